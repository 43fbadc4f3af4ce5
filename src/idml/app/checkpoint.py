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
A full disk is reported with the folder and the bytes needed (:mod:`idml.app.storage`), and a model
whose parameters or buffers hold NaN or inf is never written (:class:`NonFiniteStateError`).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes
from torch import nn

from idml.app.storage import (
    atomic_write_text,
    fsync_folder,
    remove_quietly,
    write_failure,
    write_new_files,
)

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


class NonFiniteStateError(ArithmeticError):
    """Parameters or buffers holding NaN or inf: such a model is never saved as a checkpoint.

    ``names`` lists the tensors (``model.…``, ``loss.…``), the first ones first."""

    def __init__(self, names: list[str]) -> None:
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        super().__init__(f"NaN or inf in {shown}")
        self.names = names


def check_finite_state(modules: dict[str, nn.Module]) -> None:
    """Raise :class:`NonFiniteStateError` when a floating parameter *or buffer* of ``modules``
    (prefix → module) is NaN or infinite: a BatchNorm running variance can overflow while the loss
    and every weight stay finite, and such a checkpoint embeds every image as NaN."""
    named = [
        (f"{prefix}.{name}", value)
        for prefix, module in modules.items()
        for name, value in module.state_dict().items()
        if value.is_floating_point() or value.is_complex()
    ]
    if not named:
        return
    # One device sync per device holding state, not one per tensor.
    by_device: dict[torch.device, list[int]] = {}
    for i, (_, value) in enumerate(named):
        by_device.setdefault(value.device, []).append(i)
    ok = [True] * len(named)
    for positions in by_device.values():
        flags = torch.stack([torch.isfinite(named[i][1]).all() for i in positions]).tolist()
        for i, flag in zip(positions, flags):
            ok[i] = flag
    if not all(ok):
        raise NonFiniteStateError([name for (name, _), good in zip(named, ok) if not good])


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

    Refused with :class:`NonFiniteStateError` (nothing written) when a parameter or buffer of
    ``model`` or ``training_modules`` is NaN or inf. A failed write (disk full, permissions)
    removes the partial folder and raises :class:`CheckpointWriteError` naming the folder and the
    bytes needed; the previous checkpoint stays ``latest``.
    """
    check_finite_state({"model": model, **training_modules})
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
    payload = {**state, "optimizers": opt_structures}
    root = run_dir / "checkpoints"
    final, tmp = root / name, root / f"{name}.tmp"
    files: dict[str, bytes] = {}
    try:
        # In memory first: the size is known, and no serializer fails half-way through a file.
        files[MODEL_FILE] = safetensors_bytes(_contiguous(model.state_dict()))
        files[TRAINING_FILE] = safetensors_bytes(_contiguous(extra))
    except SafetensorError as err:
        raise CheckpointWriteError(f"cannot serialize checkpoint {name}: {err}") from err
    files[STATE_FILE] = json.dumps(payload, indent=1, default=str).encode()
    needed = sum(len(b) for b in files.values())
    try:
        root.mkdir(parents=True, exist_ok=True)
        remove_quietly(tmp)
        tmp.mkdir()
        write_new_files(tmp, files)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_folder(root)
        atomic_write_text(root / LATEST, name + "\n")
    except OSError as err:
        remove_quietly(tmp)
        previous = root / LATEST
        kept = (
            f"the previous checkpoint {previous.read_text().strip()} stays latest"
            if previous.is_file()
            else "no earlier checkpoint exists"
        )
        failure = write_failure(
            err, root, f"checkpoint {name}", needed, kept, "continue with --resume"
        )
        raise CheckpointWriteError(str(failure)) from err
    return final


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
