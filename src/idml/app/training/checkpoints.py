"""A training run's checkpoints (:class:`Checkpointing`): one per epoch, the latest and the best
kept, and the latest restored on resume; and the best epoch so far (:class:`BestEpoch`).

A checkpoint holds the model, the run's other trainable modules (the task's objective, SSR's head)
with their optimizers (:class:`TrainingWeights`), and a ``state.json`` the trainer fills: epoch,
config, schedule, AMP scale, best epoch and whatever the task adds
(:meth:`~idml.app.tasks.Task.checkpoint_state`).
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from idml.app.checkpoint import (
    BEST,
    checkpoint_name,
    load_model_weights,
    load_training_state,
    mark_best,
    read_state,
    resolve_checkpoint,
    save_checkpoint,
)
from idml.app.config import (
    RUNTIME_KEYS,
    Config,
    config_difference,
    config_to_dict,
    stored_config_dict,
)
from idml.app.distributed import DistributedContext

RESUMABLE_CHANGES = RUNTIME_KEYS | {"optim.epochs", "optim.compile"}
"""Config keys a resumed run may change (more epochs, another machine, compiled or not); any other
change is refused."""


@dataclass
class BestEpoch:
    """The epoch (numbered from 1; 0: none evaluated yet) whose ``eval.select`` metric is the
    largest so far, and its metrics.

    >>> best = BestEpoch()
    >>> best.update(1, {"recall@1": 0.5}, "recall@1"), best.update(2, {"recall@1": 0.4}, "recall@1")
    (True, False)
    >>> best.epoch, best.to_state()["best_value"]
    (1, 0.5)
    """

    value: float = -math.inf
    epoch: int = 0
    metrics: dict[str, float] = field(default_factory=dict)

    def update(self, epoch: int, metrics: Mapping[str, float], key: str) -> bool:
        """Take ``epoch`` when its ``key`` beats the best so far; returns whether it did."""
        if key not in metrics:
            raise ValueError(f"eval.select={key!r} is not among the metrics {sorted(metrics)}")
        if metrics[key] > self.value:
            self.value, self.epoch, self.metrics = metrics[key], epoch, dict(metrics)
            return True
        return False

    def to_state(self) -> dict[str, Any]:
        """The ``state.json`` entries of the best epoch."""
        return {"best_value": self.value, "best_epoch": self.epoch, "best_metrics": self.metrics}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> BestEpoch:
        return cls(
            float(state.get("best_value", -math.inf)),
            int(state.get("best_epoch", 0)),
            dict(state.get("best_metrics", {})),
        )


@dataclass(frozen=True)
class TrainingWeights:
    """What a checkpoint stores besides ``state.json``: the model (``model.safetensors``) and the
    run's other modules and optimizers by name (``training.safetensors``)."""

    model: nn.Module
    modules: Mapping[str, nn.Module]
    optimizers: Mapping[str, torch.optim.Optimizer]


@dataclass(frozen=True)
class Restored:
    """What :meth:`Checkpointing.restore` read back: the checkpoint's ``state.json`` (its ``epoch``,
    ``scheduler``, ``scaler`` and best epoch) and whether the run's length changed since."""

    state: dict[str, Any]
    epochs_changed: bool

    @property
    def epoch(self) -> int:
        return int(self.state["epoch"])


class Checkpointing:
    """Writes a run's checkpoints (rank 0) and restores the latest (every rank)."""

    def __init__(self, run_dir: Path, dist: DistributedContext) -> None:
        self.run_dir = Path(run_dir)
        self.dist = dist

    def save(self, epoch: int, weights: TrainingWeights, state: dict[str, Any], best: int) -> None:
        """Write ``epoch``'s checkpoint, point ``best`` at it when ``best == epoch``, and delete
        every older one but the best (rank 0 only).

        Raises:
            idml.app.checkpoint.NonFiniteStateError: a weight or buffer is NaN or infinite (nothing
                is written; the previous checkpoint stays latest).
        """
        if not self.dist.is_main:
            return
        name = checkpoint_name(epoch)
        save_checkpoint(
            self.run_dir,
            name,
            weights.model,
            dict(weights.modules),
            dict(weights.optimizers),
            state,
        )  # NonFiniteStateError for NaN/inf parameters or buffers (BatchNorm statistics)
        if best == epoch:
            mark_best(self.run_dir, name)
        _prune(self.run_dir / "checkpoints", keep=name)

    def restore(self, cfg: Config, weights: TrainingWeights) -> Restored:
        """Load the latest checkpoint's weights and optimizer state into ``weights``.

        Raises:
            ValueError: the checkpoint's config differs from ``cfg`` in a key outside
                :data:`RESUMABLE_CHANGES`.
        """
        ckpt = resolve_checkpoint(self.run_dir)
        saved = read_state(ckpt)
        stored = saved.get("config", {})
        changes = config_difference(
            stored_config_dict(stored), config_to_dict(cfg), RESUMABLE_CHANGES
        )
        if changes:
            raise ValueError(
                f"cannot resume {self.run_dir}: its config differs from the one given "
                f"({'; '.join(changes[:5])}); resume with the run's own config.yaml or start a "
                "new --out folder"
            )
        load_model_weights(ckpt, weights.model)
        state = load_training_state(ckpt, dict(weights.modules), dict(weights.optimizers))
        epochs = stored.get("optim", {}).get("epochs") if isinstance(stored, dict) else None
        return Restored(state, epochs_changed=epochs != cfg.optim.epochs)


def _prune(root: Path, keep: str) -> None:
    """Keep the checkpoint ``keep`` (the latest) and the one ``best`` names (whose folder name may
    follow an older numbering, in a resumed run); older epochs would only fill the disk."""
    best = root / BEST
    kept = {keep, best.read_text().strip()} if best.is_file() else {keep}
    for path in root.glob("epoch_*"):
        if path.is_dir() and path.name not in kept:
            shutil.rmtree(path)
