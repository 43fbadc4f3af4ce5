"""Checkpoints of a training run: writing one per epoch, keeping the latest and the best, and
resuming a run from its latest one."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

from idml.app.checkpoint import (
    BEST,
    EPOCH_BASE,
    NonFiniteStateError,
    checkpoint_name,
    load_model_weights,
    load_training_state,
    mark_best,
    read_state,
    resolve_checkpoint,
    save_checkpoint,
)
from idml.app.config import RUNTIME_KEYS, config_difference, config_to_dict, stored_config_dict
from idml.app.training.records import read_log

RESUMABLE_CHANGES = RUNTIME_KEYS | {"optim.epochs"}
"""Config keys a resumed run may change (more epochs, another machine); any other change is refused."""


class Checkpointing:
    """The :class:`~idml.app.training.Trainer`'s checkpoints, best epoch and resume (uses the trainer's
    modules, optimizers, scheduler, scaler, ``history`` and best-epoch fields)."""

    def resume(self) -> None:
        """Continue from the run folder's latest checkpoint (exactly, for a fixed seed on CPU)."""
        ckpt = resolve_checkpoint(self.run_dir)
        saved = read_state(ckpt)
        changes = config_difference(
            stored_config_dict(saved.get("config", {})), config_to_dict(self.cfg), RESUMABLE_CHANGES
        )
        diff = "; ".join(changes[:5])
        if diff:
            raise ValueError(
                f"cannot resume {self.run_dir}: its config differs from the one given ({diff}); "
                "resume with the run's own config.yaml or start a new --out folder"
            )
        load_model_weights(ckpt, self.model)
        state = load_training_state(ckpt, self._training_modules(), self._optimizer_map())
        if self.scheduler is not None and state.get("scheduler") is not None:
            if saved.get("config", {}).get("optim", {}).get("epochs") == self.cfg.optim.epochs:
                self.scheduler.load_state_dict(state["scheduler"])
            else:  # more (or fewer) epochs: the schedule of a fresh run of the new length
                self._replay_schedule(int(saved["epoch"]))
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.start_epoch = int(saved["epoch"])  # epochs done (read_state numbers them from 1)
        self.best_value = float(state.get("best_value", -math.inf))
        self.best_epoch = int(saved.get("best_epoch", 0))
        self.best_metrics = dict(state.get("best_metrics", {}))
        self.history = read_log(self._log_path, self.start_epoch)
        self.dist.barrier()  # every rank has read the log before rank 0 truncates it
        if self.dist.is_main:
            self._log_path.write_text("".join(json.dumps(h) + "\n" for h in self.history))

    def _replay_schedule(self, epochs_done: int) -> None:
        """Rebuild the learning-rate schedule for ``optim.epochs`` and advance it by
        ``epochs_done`` steps from the base rates, as an uninterrupted run of that length steps it
        (cosine's ``T_max`` is the run length, so the saved schedule cannot be reused)."""
        assert self.scheduler is not None
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs, strict=True):
            group["lr"] = group["initial_lr"] = base
        self.scheduler = self._scheduler(self.optimizer)
        # Stepping the schedule without optimizer steps is the point: silence torch's warning.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(epochs_done):
                self.scheduler.step()  # type: ignore[union-attr]

    def _track_best(self, epoch: int, metrics: dict[str, float]) -> None:
        key = self.cfg.eval.select
        if key not in metrics:
            raise ValueError(f"eval.select={key!r} is not among the metrics {sorted(metrics)}")
        if metrics[key] > self.best_value:
            self.best_value = metrics[key]
            self.best_epoch = epoch
            self.best_metrics = dict(metrics)

    def _checkpoint_extras(self) -> dict[str, Any]:
        """Task-specific entries of a checkpoint's ``state.json`` (none for metric learning)."""
        return {}

    def _checkpoint(self, epoch: int) -> None:
        """The checkpoint after epoch ``epoch`` (numbered from 1)."""
        if not self.dist.is_main:
            return
        name = checkpoint_name(epoch)
        state = {
            "epoch": epoch,
            EPOCH_BASE: 1,
            "config": config_to_dict(self.cfg),
            "num_train_classes": self.data.num_train_classes,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.amp else None,
            "best_value": self.best_value,
            "best_epoch": self.best_epoch,
            "best_metrics": self.best_metrics,
            "metrics": self.history[-1] if self.history else {},
            **self._checkpoint_extras(),
        }
        try:
            save_checkpoint(
                self.run_dir,
                name,
                self.model,
                self._training_modules(),
                self._optimizer_map(),
                state,
            )
        except NonFiniteStateError as err:  # parameters or buffers (BatchNorm statistics)
            raise self._non_finite(str(err), after_epoch=True) from None
        if self.best_epoch == epoch:
            mark_best(self.run_dir, name)
        _prune(self.run_dir / "checkpoints", keep=name)


def _prune(root: Path, keep: str) -> None:
    """Keep the checkpoint ``keep`` (the latest) and the one ``best`` names (whose folder name may
    follow an older numbering, in a resumed run); older epochs would only fill the disk."""
    import shutil

    best = root / BEST
    kept = {keep, best.read_text().strip()} if best.is_file() else {keep}
    for path in root.glob("epoch_*"):
        if path.is_dir() and path.name not in kept:
            shutil.rmtree(path)
