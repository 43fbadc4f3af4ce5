"""What a run records each epoch: :class:`EpochRecord` lines of ``metrics.jsonl``, the
:class:`TrainResult` of a run, and the writing of both to the log and the run's loggers."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from idml.app.config import config_to_dict
from idml.app.loggers import MLflowLogger, TensorBoardLogger, tensorboard_available
from idml.app.run_folder import log_epochs_from_one
from idml.app.training.console import epoch_line


@dataclass
class EpochRecord:
    """What one epoch logs (one line of ``metrics.jsonl``)."""

    epoch: int
    """The epoch's number, from 1 (as the terminal and the checkpoint folders name it)."""
    losses: dict[str, float]
    lr: dict[str, float]
    uncertainty: dict[str, float]
    metrics: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    steps: int = 0
    ism: dict[str, float] = field(default_factory=dict)
    """ISM's weakening factors over the epoch (:class:`~idml.app.training.monitoring.WeakeningMonitor`), the
    warm-up strength at the epoch's end, and the mean gradient norm of the model."""
    notes: dict[str, str] = field(default_factory=dict)
    eval_seconds: float = 0.0
    """Seconds the test-set evaluation took (0 on epochs not evaluated); ``seconds`` is training."""

    def to_json(self) -> dict[str, Any]:
        timing = {"eval_seconds": round(self.eval_seconds, 3)} if self.eval_seconds else {}
        return {
            "epoch": self.epoch,
            "steps": self.steps,
            "seconds": round(self.seconds, 3),
            **timing,
            **{f"loss/{k}": v for k, v in self.losses.items()},
            **{f"lr/{k}": v for k, v in self.lr.items()},
            **{f"uncertainty/{k}": v for k, v in self.uncertainty.items()},
            **{f"ism/{k}": v for k, v in self.ism.items()},
            **{f"test/{k}": v for k, v in self.metrics.items()},
            **{f"eval/{k}": v for k, v in self.notes.items()},
        }


@dataclass
class TrainResult:
    """Outcome of :meth:`Trainer.fit`."""

    run_dir: Path
    final_metrics: dict[str, float]
    best_metrics: dict[str, float]
    best_epoch: int
    """The number (from 1) of the epoch whose metrics are ``best_metrics``; 0 when never evaluated."""
    history: list[dict[str, Any]]


class NonFiniteError(FloatingPointError):
    """Training produced a NaN or infinite loss or weight; the message names the epoch and step."""


class EpochLogging:
    """The :class:`~idml.app.training.Trainer`'s epoch log: ``metrics.jsonl``, the loggers and the
    per-epoch line (uses the trainer's ``cfg``, ``run_dir``, ``dist``, ``history``, ``best_epoch``,
    ``echo`` and ``_loggers``)."""

    @property
    def _log_path(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    def _log(self, record: EpochRecord) -> None:
        line = record.to_json()
        self.history.append(line)
        if self.echo is not None and self.dist.is_main:
            best = self.cfg.eval.select if self.best_epoch == record.epoch else None
            self.echo(epoch_line(record, self.cfg.optim.epochs, best))
        if not self.dist.is_main:
            return
        with open(self._log_path, "a") as fh:
            fh.write(json.dumps(line) + "\n")
        for logger in self._loggers:
            logger.log(line, record.epoch)

    def _open_loggers(self, resume: bool) -> None:
        """TensorBoard when installed and ``tensorboard``; MLflow when ``mlflow.enabled``."""
        if not self.dist.is_main:
            return
        if self.cfg.tensorboard and tensorboard_available():  # tensorboard is optional
            self._loggers.append(TensorBoardLogger(self.run_dir / "tensorboard"))
        m = self.cfg.mlflow
        if m.enabled:
            self._loggers.append(
                MLflowLogger(
                    self.run_dir,
                    self.cfg.name,
                    config_to_dict(self.cfg),
                    tracking_uri=m.tracking_uri,
                    experiment=m.experiment,
                    resume=resume,
                )
            )


def read_log(path: Path, epochs: int) -> list[dict[str, Any]]:
    """The first ``epochs`` lines of ``metrics.jsonl``, epochs numbered from 1
    (:func:`~idml.app.run_folder.log_epochs_from_one`). Lines after them belong to epochs whose
    checkpoint was never written (a line cut by a crash among them) and are dropped."""
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        raise ValueError(
            f"cannot resume: {path} is missing; the run folder is incomplete"
        ) from None
    if len(lines) < epochs:
        raise ValueError(
            f"cannot resume: {path} has {len(lines)} epoch lines but the checkpoint is of epoch "
            f"{epochs}; the log was truncated or replaced"
        )
    history = []
    for number, line in enumerate(lines[:epochs], start=1):
        try:
            history.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise ValueError(
                f"cannot resume: line {number} of {path} is not JSON ({err.msg}); restore the "
                "line or start again with --overwrite"
            ) from None
    return log_epochs_from_one(history)
