"""Atomic, self-describing checkpoints: weights in safetensors, everything else in JSON.

A checkpoint is a folder::

    epoch_0007/
        model.safetensors       # EmbeddingModel weights only: what retrieval needs
        training.safetensors    # loss (proxies...), SSR head, optimizer tensors
        state.json              # epoch, metrics, best, config, optimizer/scheduler structure

Epochs are numbered from 1 in every file and on screen: ``epoch_0007`` holds the model after the
7th epoch, its ``state.json`` says ``"epoch": 7`` and the terminal said ``epoch 7/60``.
Checkpoints written before (``epoch_0006`` for that same epoch, numbered from 0) carry no
:data:`EPOCH_BASE` entry; :func:`read_state` renumbers them, so every reader sees one convention.

It is written into ``epoch_0007.tmp`` and renamed into place, then ``latest`` (a one-line text file)
is replaced atomically, so an interrupted write never leaves a half checkpoint where a good one was.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

MODEL_FILE = "model.safetensors"
TRAINING_FILE = "training.safetensors"
STATE_FILE = "state.json"
LATEST = "latest"
BEST = "best"
EPOCH_BASE = "epoch_base"
"""``state.json`` entry saying what the first epoch is called (1); absent in checkpoints written when
epochs were numbered from 0."""


def checkpoint_name(epoch: int) -> str:
    """The folder of the checkpoint after epoch ``epoch`` (numbered from 1): ``epoch_0007``."""
    return f"epoch_{epoch:04d}"


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt, or belongs to another model."""


class CheckpointPointerError(CheckpointError):
    """A ``latest``/``best`` pointer that names something other than a checkpoint of its run."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint that could not be written (disk full, permissions); the previous one stays."""


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and an atomic rename."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def flatten_optimizer(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split an optimizer ``state_dict`` into safetensors-able tensors and a JSON structure."""
    tensors: dict[str, torch.Tensor] = {}
    structure: dict[str, Any] = {"param_groups": state["param_groups"], "state": {}}
    for pid, slots in state["state"].items():
        entry: dict[str, Any] = {}
        for key, value in slots.items():
            if isinstance(value, torch.Tensor):
                name = f"optimizer.{pid}.{key}"
                tensors[name] = value.detach().cpu().contiguous()
                entry[key] = {"tensor": name}
            else:
                entry[key] = value
        structure["state"][str(pid)] = entry
    return tensors, structure


def unflatten_optimizer(tensors: dict[str, torch.Tensor], structure: dict[str, Any]) -> dict:
    state: dict[int, dict[str, Any]] = {}
    for pid, slots in structure["state"].items():
        state[int(pid)] = {
            k: tensors[v["tensor"]] if isinstance(v, dict) and "tensor" in v else v
            for k, v in slots.items()
        }
    return {"state": state, "param_groups": structure["param_groups"]}


def save_checkpoint(
    run_dir: Path,
    name: str,
    model: nn.Module,
    training_modules: dict[str, nn.Module],
    optimizers: dict[str, torch.optim.Optimizer],
    state: dict[str, Any],
) -> Path:
    """Write checkpoint ``run_dir/checkpoints/<name>`` atomically and point ``latest`` at it.

    A failed write (disk full, permissions) removes the partial folder and raises
    :class:`CheckpointWriteError`; the previous checkpoint stays ``latest``.
    """
    root = run_dir / "checkpoints"
    with _reported_write(root, name):
        root.mkdir(parents=True, exist_ok=True)
        final = root / name
        tmp = root / f"{name}.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        save_file(_contiguous(model.state_dict()), str(tmp / MODEL_FILE))
        extra: dict[str, torch.Tensor] = {}
        for prefix, module in training_modules.items():
            for key, value in module.state_dict().items():
                extra[f"{prefix}.{key}"] = value
        opt_structures = {}
        for prefix, opt in optimizers.items():
            tensors, structure = flatten_optimizer(opt.state_dict())
            extra.update({f"{prefix}.{k}": v for k, v in tensors.items()})
            opt_structures[prefix] = structure
            for entry in structure["state"].values():
                for value in entry.values():
                    if isinstance(value, dict) and "tensor" in value:
                        value["tensor"] = f"{prefix}.{value['tensor']}"
        save_file(_contiguous(extra), str(tmp / TRAINING_FILE))
        payload = {**state, "optimizers": opt_structures}
        atomic_write_text(tmp / STATE_FILE, json.dumps(payload, indent=1, default=str))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        atomic_write_text(root / LATEST, name + "\n")
        return final


@contextmanager
def _reported_write(root: Path, name: str) -> Iterator[None]:
    try:
        yield
    except (OSError, RuntimeError, ValueError, SafetensorError) as err:
        # safetensors reports I/O failures (ENOSPC included) as its own SafetensorError.
        shutil.rmtree(root / f"{name}.tmp", ignore_errors=True)
        previous = root / LATEST
        kept = (
            f"the previous checkpoint {previous.read_text().strip()} stays latest"
            if previous.is_file()
            else "no earlier checkpoint exists"
        )
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise CheckpointWriteError(
            f"cannot write checkpoint {name} into {root}: {reason}; {kept}. Free disk space (or "
            "fix the folder's permissions) and continue with --resume"
        ) from err


def mark_best(run_dir: Path, name: str) -> None:
    atomic_write_text(run_dir / "checkpoints" / BEST, name + "\n")


def resolve_checkpoint(path: Path, which: str = LATEST) -> Path:
    """A checkpoint folder from a run folder (its ``latest``/``best``) or a checkpoint folder."""
    path = Path(path)
    if (path / MODEL_FILE).is_file():
        return path
    pointer = path / "checkpoints" / which
    if not pointer.is_file():
        raise CheckpointError(
            f"{path} holds no checkpoint (no {pointer}); pass a run folder written by `idml train` "
            "or a checkpoint folder containing model.safetensors"
        )
    target = _pointer_target(pointer)
    if not (target / MODEL_FILE).is_file():
        raise CheckpointError(f"checkpoint {target} named by {pointer} is missing {MODEL_FILE}")
    return target


def _pointer_target(pointer: Path) -> Path:
    """The checkpoint folder a pointer names: a plain folder name inside the same
    ``checkpoints/`` folder, never a path (or a link) leading out of the run."""
    try:
        name = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"cannot read checkpoint pointer {pointer}: {err}") from err
    root = pointer.parent
    target = root / name
    inside = (
        name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and target.resolve().parent == root.resolve()
    )
    if not inside:
        raise CheckpointPointerError(
            f"checkpoint pointer {pointer} names {name!r}, which is not a checkpoint folder of this "
            f"run; it must hold the name of a folder in {root} (e.g. epoch_0003). Fix or delete it"
        )
    return target


def read_state(ckpt: Path) -> dict[str, Any]:
    """A checkpoint's ``state.json``, its epochs numbered from 1 (``epoch``, ``best_epoch``, whose
    0 means "never evaluated", and the log line under ``metrics``) whenever it was written."""
    try:
        state = json.loads((ckpt / STATE_FILE).read_text())
    except FileNotFoundError as err:
        raise CheckpointError(f"checkpoint {ckpt} has no {STATE_FILE}") from err
    except json.JSONDecodeError as err:
        raise CheckpointError(f"checkpoint {ckpt}/{STATE_FILE} is corrupt: {err}") from err
    if isinstance(state, dict) and EPOCH_BASE not in state:  # numbered from 0: renumber
        for key in ("epoch", "best_epoch"):
            if isinstance(state.get(key), int):
                state[key] = max(0, state[key] + 1)  # best_epoch −1 (none) becomes 0
        line = state.get("metrics")
        if isinstance(line, dict) and isinstance(line.get("epoch"), int):
            line["epoch"] += 1
        state[EPOCH_BASE] = 1
    return state


def load_weights(module: nn.Module, tensors: dict[str, torch.Tensor], what: str) -> None:
    """Load a state dict, turning key/shape mismatches into an error that lists them."""
    own = module.state_dict()
    missing = sorted(set(own) - set(tensors))
    unexpected = sorted(set(tensors) - set(own))
    wrong = sorted(k for k in set(own) & set(tensors) if own[k].shape != tensors[k].shape)
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"missing {missing[:5]}")
        if unexpected:
            parts.append(f"unexpected {unexpected[:5]}")
        if wrong:
            parts.append(
                "shape mismatch "
                + ", ".join(
                    f"{k}: {tuple(tensors[k].shape)} vs {tuple(own[k].shape)}" for k in wrong[:5]
                )
            )
        raise CheckpointError(
            f"{what} does not fit this model ({'; '.join(parts)}); it was written by a run with a "
            "different config (backbone, embedding size, loss or number of classes). Use that run's "
            "config or start a new run"
        )
    module.load_state_dict(tensors)


def load_model_weights(ckpt: Path, model: nn.Module) -> None:
    try:
        tensors = load_file(str(ckpt / MODEL_FILE))
    except Exception as err:  # safetensors raises its own error types for corrupt files
        raise CheckpointError(f"cannot read {ckpt / MODEL_FILE}: {err}") from err
    load_weights(model, tensors, str(ckpt / MODEL_FILE))


def load_training_state(
    ckpt: Path,
    training_modules: dict[str, nn.Module],
    optimizers: dict[str, torch.optim.Optimizer],
) -> dict[str, Any]:
    """Restore loss/SSR modules and optimizers; returns the JSON state."""
    state = read_state(ckpt)
    try:
        tensors = load_file(str(ckpt / TRAINING_FILE))
    except Exception as err:
        raise CheckpointError(f"cannot read {ckpt / TRAINING_FILE}: {err}") from err
    for prefix, module in training_modules.items():
        own = {k[len(prefix) + 1 :]: v for k, v in tensors.items() if k.startswith(prefix + ".")}
        own = {k: v for k, v in own.items() if not k.startswith("optimizer.")}
        load_weights(module, own, f"{ckpt / TRAINING_FILE} [{prefix}]")
    for prefix, opt in optimizers.items():
        structure = state["optimizers"].get(prefix)
        if structure is None:
            raise CheckpointError(f"{ckpt / STATE_FILE} has no optimizer state {prefix!r}")
        opt.load_state_dict(unflatten_optimizer(tensors, structure))
    return state


def _contiguous(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # safetensors refuses shared storage and non-contiguous views; clone where needed.
    return {k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}
