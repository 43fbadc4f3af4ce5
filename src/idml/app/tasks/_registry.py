"""The registry of tasks: one :class:`~idml.app.tasks.Task` per ``task.name``, the one list a run
config reads (``idml.app.config`` validates ``task:`` against it at validation time, so a task
registered after the config module was imported is a valid ``task.name`` too).

Example:
    >>> from idml.app.config import load_config
    >>> from idml.app.tasks import TASKS
    >>> list(TASKS)
    ['metric_learning', 'classification']
    >>> TASKS["classification"].metric_names(load_config(None, ["task=classification"]))
    ['top1', 'top5']
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, TypeVar

from idml.app.tasks._base import Task, TaskParams

if TYPE_CHECKING:
    from idml.app.config import Config

_TASKS: dict[str, Task] = {}
TASKS: Mapping[str, Task] = MappingProxyType(_TASKS)
"""Every registered task by name, in registration order (read-only; see :func:`register_task`)."""

TaskT = TypeVar("TaskT", bound=Task)


def register_task(task: TaskT) -> TaskT:
    """Register ``task`` under ``task.name``; returns it, as the type it was given.

    Raises:
        ValueError: the name is not an identifier or is taken by another class, its ``params``
            is not a :class:`~idml.app.tasks.TaskParams` model or has a ``name`` field, or it
            reads a key the config does not have.
    """
    from idml.app.config import config_keys

    name = getattr(task, "name", "")
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"task name {name!r} must be an identifier (letters, digits, _)")
    params = task.params
    if not (isinstance(params, type) and issubclass(params, TaskParams)):
        raise ValueError(
            f"{type(task).__name__}: params must be a TaskParams model, got {params!r}"
        )
    if "name" in params.model_fields:
        raise ValueError(f"{params.__name__}: 'name' is reserved for the task's name")
    known = config_keys()
    unknown = sorted(key for key in task.reads if key not in known)
    if unknown:
        raise ValueError(
            f"{type(task).__name__}.reads names keys the config does not have: {unknown}"
        )
    old = _TASKS.get(name)
    if old is not None and type(old) is not type(task):
        raise ValueError(f"task name {name!r} is taken by {type(old).__name__}")
    _TASKS[name] = task
    return task


def unregister_task(name: str) -> None:
    """Remove a registered task (for tests that register one of their own)."""
    _TASKS.pop(name, None)


def task_of(cfg: Config) -> Task:
    """The registered task of a validated config."""
    return TASKS[cfg.task.name]


def task_of_run(path: Path, which: str = "best") -> Task:
    """The task of a run folder (or checkpoint folder), from its ``config.yaml`` or else its
    checkpoint's ``state.json``.

    Raises:
        ValueError: the run names a task that is not registered (listing those that are).
    """
    import yaml

    from idml.app.checkpoint import read_state, resolve_checkpoint

    written = Path(path) / "config.yaml"
    if written.is_file():
        raw = yaml.safe_load(written.read_text(encoding="utf-8-sig"))
    else:
        ckpt = resolve_checkpoint(Path(path), which if which != "best" else "latest")
        raw = read_state(ckpt).get("config", {})
    entry = raw.get("task", "metric_learning") if isinstance(raw, dict) else None
    name = entry.get("name") if isinstance(entry, dict) else entry
    if name not in TASKS:
        raise ValueError(
            f"{path} is a run of task {name!r}, which is not registered; registered tasks: "
            f"{', '.join(TASKS)}"
        )
    return TASKS[str(name)]
