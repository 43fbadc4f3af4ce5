"""A training run's epoch log (:class:`EpochLog`): one :class:`EpochRecord` per epoch in
``metrics.jsonl``, mirrored to the run's loggers and summarised in one printed line; and the
:class:`TrainResult` of a run. Epochs are numbered from 1, in the file as on the screen."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from idml.app.config import Config, config_to_dict
from idml.app.distributed import DistributedContext
from idml.app.loggers import MLflowLogger, RunLogger, TensorBoardLogger, tensorboard_available
from idml.app.run_folder import log_epochs_from_one

LOG_FILE = "metrics.jsonl"


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
    """Outcome of :meth:`~idml.app.training.Trainer.fit`."""

    run_dir: Path
    final_metrics: dict[str, float]
    best_metrics: dict[str, float]
    best_epoch: int
    """The number (from 1) of the epoch whose metrics are ``best_metrics``; 0 when never evaluated."""
    history: list[dict[str, Any]]


class EpochLog:
    """``metrics.jsonl`` of a run folder and the loggers that mirror it (files: rank 0 only).

    ``history`` holds every logged line (on every rank); ``echo`` receives one line per epoch
    (rank 0; :func:`~idml.app.training.console.epoch_line`): kept above the progress bars on a
    terminal and printed in a pipe.
    """

    def __init__(
        self,
        run_dir: Path,
        dist: DistributedContext,
        echo: Callable[[str], None] | None = None,
    ) -> None:
        self.path = Path(run_dir) / LOG_FILE
        self.dist = dist
        self.echo = echo
        self.history: list[dict[str, Any]] = []
        self.loggers: list[RunLogger] = []

    def start(self) -> None:
        """A new run: an empty log."""
        if self.dist.is_main:
            self.path.write_text("")

    def restore(self, epochs: int) -> None:
        """A resumed run: keep the first ``epochs`` lines (those with a checkpoint), drop the rest."""
        self.history = read_log(self.path, epochs)
        self.dist.barrier()  # every rank has read the log before rank 0 truncates it
        if self.dist.is_main:
            self.path.write_text("".join(json.dumps(h) + "\n" for h in self.history))

    def open_loggers(self, cfg: Config, resume: bool) -> None:
        """TensorBoard when installed and ``tensorboard``; MLflow when ``mlflow.enabled``."""
        if not self.dist.is_main:
            return
        if cfg.tensorboard and tensorboard_available():  # tensorboard is optional
            self.loggers.append(TensorBoardLogger(self.path.parent / "tensorboard"))
        m = cfg.mlflow
        if m.enabled:
            self.loggers.append(
                MLflowLogger(
                    self.path.parent,
                    cfg.name,
                    config_to_dict(cfg),
                    tracking_uri=m.tracking_uri,
                    experiment=m.experiment,
                    resume=resume,
                )
            )

    def write(self, record: EpochRecord, epochs: int, best: str | None = None) -> None:
        """Log one finished epoch of a run of ``epochs`` epochs; ``best`` names the selection
        metric when this epoch is the best so far (the printed line says so)."""
        from idml.app.training.console import epoch_line

        line = record.to_json()
        self.history.append(line)
        if not self.dist.is_main:
            return
        if self.echo is not None:
            self.echo(epoch_line(record, epochs, best))
        with open(self.path, "a") as fh:
            fh.write(json.dumps(line) + "\n")
        for logger in self.loggers:
            logger.log(line, record.epoch)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()

    def last_test_metrics(self) -> dict[str, float]:
        """The ``test/*`` metrics of the last logged line (without the prefix)."""
        if not self.history:
            return {}
        return {k[5:]: v for k, v in self.history[-1].items() if k.startswith("test/")}


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
