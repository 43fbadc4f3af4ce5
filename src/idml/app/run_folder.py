"""Claiming a run folder: one writer at a time, and an existing run is never silently replaced.

A folder *holds a run* once it has a non-empty ``metrics.jsonl`` or anything under
``checkpoints/``. Training into such a folder needs an explicit decision:

* ``resume``: continue it (:meth:`idml.app.training.Trainer.resume`);
* ``overwrite``: start afresh; the old run is moved, whole, into a sibling folder
  ``<name>.replaced-<UTC time>`` (nothing is deleted, the caller is told where it went);
* neither: :class:`RunFolderError`, naming the folder and both options.

While a trainer writes, ``<run>/.lock`` holds its PID, host and start time. A second writer is
refused with :class:`RunLockedError` naming that process; a lock left behind by a process that no
longer exists (same host) is taken over, so a ``kill -9`` never blocks the folder for good. A lock
from another host cannot be checked: it is reported with the command that removes it. The same
lock (:func:`folder_lock`) guards an index folder while ``idml index`` writes it.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK_FILE = ".lock"
LOG_FILE = "metrics.jsonl"
CHECKPOINTS = "checkpoints"


def log_epochs_from_one(history: list[dict]) -> list[dict]:
    """``metrics.jsonl`` lines with their ``epoch`` numbered from 1, as the terminal and the
    checkpoints number them. A log always starts with its run's first epoch, so one whose first
    line says ``"epoch": 0`` was written when epochs were numbered from 0: each of its lines is
    renumbered (in place; the lines are returned)."""
    if history and history[0].get("epoch") == 0:
        for line in history:
            if isinstance(line.get("epoch"), int):
                line["epoch"] += 1
    return history


class RunFolderError(ValueError):
    """A run folder that cannot be used as asked (holds a run, is a file, is not writable)."""


class RunLockedError(RunFolderError):
    """Another live process is writing into the run folder."""


def holds_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds the log or checkpoints of a run (an empty log is no run)."""
    log = run_dir / LOG_FILE
    if log.is_file() and log.stat().st_size > 0:
        return True
    ckpts = run_dir / CHECKPOINTS
    return ckpts.is_dir() and any(ckpts.iterdir())


def make_folder(folder: Path, what: str = "run folder") -> None:
    """Create ``folder`` (and its parents), with an error that names the path in the way."""
    folder = Path(folder)
    for parent in (folder, *folder.parents):
        if parent.exists() and not parent.is_dir():
            raise RunFolderError(
                f"{what} {folder}: {parent} is a file, not a folder; choose another --out"
            )
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunFolderError(
            f"cannot create {what} {folder}: {err.strerror or err}; choose another --out"
        ) from err


@contextmanager
def claim_run_folder(
    run_dir: Path,
    *,
    resume: bool,
    overwrite: bool,
) -> Iterator[Path | None]:
    """Lock ``run_dir`` for this process and apply the resume/overwrite decision.

    Yields the folder the old run was moved to (``overwrite`` of a folder that held a run), else
    ``None``; the caller says so in its own words (the trainer names ``--overwrite``, an ablation
    the changed config). The lock is released on exit, also when training fails.
    """
    if resume and overwrite:
        raise RunFolderError("give either --resume or --overwrite, not both")
    make_folder(run_dir)
    lock = acquire_lock(run_dir)
    try:
        moved = None
        if not resume and holds_run(run_dir):
            if not overwrite:
                raise RunFolderError(
                    f"{run_dir} already holds a run ({_describe(run_dir)}); continue it with "
                    "--resume, start afresh with --overwrite (the old run is moved aside, not "
                    "deleted), or choose another --out"
                )
            moved = move_run_aside(run_dir)
        yield moved
    finally:
        _release(lock)


def move_run_aside(run_dir: Path) -> Path:
    """Move everything in ``run_dir`` except the lock into a new sibling folder; return it."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    aside = run_dir.with_name(f"{run_dir.name}.replaced-{stamp}")
    n = 1
    while aside.exists():
        n += 1
        aside = run_dir.with_name(f"{run_dir.name}.replaced-{stamp}-{n}")
    aside.mkdir()
    for entry in run_dir.iterdir():
        if entry.name != LOCK_FILE:
            os.replace(entry, aside / entry.name)
    return aside


def _describe(run_dir: Path) -> str:
    parts = []
    log = run_dir / LOG_FILE
    if log.is_file():
        epochs = sum(1 for line in log.read_text(errors="replace").splitlines() if line.strip())
        parts.append(f"{epochs} logged epoch{'s' if epochs != 1 else ''}")
    ckpts = run_dir / CHECKPOINTS
    if ckpts.is_dir():
        names = sorted(p.name for p in ckpts.glob("epoch_*") if p.is_dir())
        parts.append(f"checkpoints {', '.join(names)}" if names else "a checkpoints folder")
    return "; ".join(parts)


_HELD: set[Path] = set()
"""The locks this process holds (so that one writer may take its own lock again)."""


@contextmanager
def folder_lock(
    folder: Path,
    what: str = "run folder",
    alternative: str = "choose another --out",
    on_stale: Callable[[str], object] = lambda _: None,
) -> Iterator[Path]:
    """Hold ``folder/.lock`` for this process while the block runs (re-entrant in one process);
    ``on_stale`` hears of a dead writer's lock that was taken over."""
    path = (Path(folder) / LOCK_FILE).absolute()
    if path in _HELD:
        yield path
        return
    acquire_lock(folder, what, alternative, on_stale)
    _HELD.add(path)
    try:
        yield path
    finally:
        _HELD.discard(path)
        _release(path)


def acquire_lock(
    folder: Path,
    what: str = "run folder",
    alternative: str = "choose another --out",
    on_stale: Callable[[str], object] = lambda _: None,
) -> Path:
    """Create ``folder/.lock`` for this process, or raise :class:`RunLockedError` naming the
    process that holds it (its PID, host and start time, and the command that removes the lock
    should that process be gone). A lock whose process no longer runs on this host is taken over."""
    path = Path(folder) / LOCK_FILE
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
    for _ in range(2):  # a second try after removing a stale lock
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            holder = _read_lock(path)
            if holder is not None and _alive(holder):
                started = time.strftime(
                    "%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(holder.get("started", 0)))
                )
                raise RunLockedError(
                    f"{folder} is being written by process {holder.get('pid')} on "
                    f"{holder.get('host')} (since {started}); wait for it to finish, stop it, or "
                    f"{alternative}. If no such process runs, remove the lock: rm {path}"
                ) from None
            path.unlink(missing_ok=True)  # its writer is gone (or the file is unreadable debris)
            on_stale(
                f"took over the lock of {what} {folder} from process "
                f"{(holder or {}).get('pid', '?')}, which no longer runs"
            )
            continue
        except OSError as err:
            raise RunFolderError(
                f"cannot write into {what} {folder}: {err.strerror or err}"
            ) from err
        with os.fdopen(fd, "w") as fh:
            json.dump(record, fh)
        return path
    raise RunLockedError(f"{path} keeps reappearing; another process is claiming {folder}")


def _release(path: Path) -> None:
    holder = _read_lock(path)
    if holder is not None and holder.get("pid") == os.getpid():
        path.unlink(missing_ok=True)


def _read_lock(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _alive(holder: dict) -> bool:
    """Whether the lock's process still runs; a lock from another host is assumed live."""
    if holder.get("host") != socket.gethostname():
        return True
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    if pid == os.getpid():
        return True  # this very process (e.g. a second Trainer in one script) is writing
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    except OSError as err:
        return err.errno != errno.ESRCH
    return True
