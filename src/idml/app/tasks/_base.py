"""What a task is: the :class:`Task` interface every entry of :data:`idml.app.tasks.TASKS` implements.

A task decides what a run learns and how it is judged; everything else (the model, the optimiser,
the loop, AMP, several processes, checkpoints, exact resume, the epoch log, the CLI) is the same
for every task. A task owns, for its runs:

- its config: the keys of its ``task:`` section (:attr:`Task.params`), the other keys it reads
  (:attr:`Task.reads`: a key it does not read is an error when a config sets it) and its defaults
  (:attr:`Task.defaults`, a fragment merged under the config like any ``include:``);
- the split policy (:meth:`Task.build_data`), the objective, i.e. the trainable modules beside the
  model and the loss of an augmented batch (:meth:`Task.build_objective`), and the batch
  augmentations (:meth:`Task.build_augmentations`);
- evaluation during training (:meth:`Task.evaluate`) and the names of its metrics;
- work on the finished run once the last checkpoint is written (:meth:`Task.after_training`);
- a finished run: loading it (:meth:`Task.load_run`), evaluating it (:meth:`Task.evaluate_run`),
  the extra arrays ``idml embed`` writes (:meth:`LoadedRun.extra_outputs`) and its report section
  (:meth:`Task.analyse`, :meth:`Task.report_section`).

Adding a task is one module with a :class:`Task` subclass and one :func:`~idml.app.tasks.register_task`
line (README, "Adding a task").
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import torch
from pydantic import BaseModel, ConfigDict
from torch import Tensor, nn

from idml.augment import AugmentedBatch, BatchAugmentation
from idml.data.datasets import TrainTestPair
from idml.embeddings import Embeddings
from idml.metrics import IntrospectiveMetric

if TYPE_CHECKING:
    from idml.app.config import Config
    from idml.app.distributed import DistributedContext
    from idml.app.reports.runs import AnalysisOptions, RunLog
    from idml.app.reports.sections import PageFigures
    from idml.app.trained_run import TrainedRun
    from idml.evaluation.reranking import Reranker


class TaskParams(BaseModel):
    """A task's own settings as a config writes them under ``task:`` (besides ``task.name``):
    typed, bounded, unknown keys rejected. Subclass it next to the task and set the task's
    ``params`` to it; a task without settings keeps this empty model."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class Objective(ABC):
    """What a run minimises: the trainable modules beside the model (proxies, a classifier's
    weights; :attr:`module`, trained and checkpointed as ``loss``) and the loss of one augmented
    batch (:meth:`__call__`)."""

    module: nn.Module

    @abstractmethod
    def __call__(self, embeddings: Embeddings, batch: AugmentedBatch) -> Tensor:
        """The scalar loss of ``batch``'s ``embeddings`` (the gathered global batch)."""

    @property
    def introspective_metric(self) -> IntrospectiveMetric | None:
        """The ISM the loss compares through, if any: the trainer ramps its strength in
        (``metric.warmup_epochs``) and records its weakening factors."""
        metric = getattr(self.module, "metric", None)
        return metric if isinstance(metric, IntrospectiveMetric) else None


@dataclass(frozen=True)
class EvaluationContext:
    """What evaluation during training may use (every rank calls :meth:`Task.evaluate`)."""

    cfg: Config
    model: Any
    """The :class:`~idml.models.EmbeddingModel` being trained."""
    objective: Objective
    data: TrainTestPair
    device: torch.device
    dist: DistributedContext
    progress: bool


@dataclass
class Evaluation:
    """Test metrics (larger is better for the one ``eval.select`` names) and notes on how they
    were computed (logged as ``eval/<key>``)."""

    metrics: dict[str, float]
    notes: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class EvaluationRequest:
    """Changes to a finished run's own evaluation settings that ``idml evaluate --checkpoint``
    may ask for; ``None``: the run's config decides. A task names the fields it can honour
    (:attr:`Task.evaluation_options`); the CLI refuses the others, naming their flags."""

    ks: tuple[int, ...] | None = None
    introspective: bool | None = None
    nmi: bool | None = None
    nmi_backend: str | None = None
    full_ranking: bool | None = None
    """``False``: metrics from each query's neighbour list only (Recall@K, R-Precision, MAP@R)."""
    block_size: int | None = None
    seed: int | None = None
    reranking: Reranker | None = None
    """Re-order each query's shortlist before the metrics and the confidence."""
    calibration: Path | None = None
    """A ``calibration.json`` whose calibrated confidence to judge (default: the run's own,
    when it applies; :func:`idml.app.calibration.find_calibration`)."""

    def given(self) -> list[str]:
        """The fields set, in declaration order."""
        return [name for name in self.__dataclass_fields__ if getattr(self, name) is not None]


@runtime_checkable
class RunEvaluation(Protocol):
    """A finished run's evaluation as ``idml evaluate`` prints it (e.g. an
    :class:`~idml.evaluation.EvaluationReport`, or a :class:`MetricsTable`)."""

    @property
    def metrics(self) -> dict[str, float]:
        """Metric name → value."""
        ...

    def to_json(self, per_class: bool = False) -> str:
        """One JSON object (with every class's numbers when ``per_class`` and the task has any)."""
        ...

    def format_table(self, per_class: int = 0) -> str:
        """A table for the terminal (the ``per_class`` worst classes when the task has them)."""
        ...


@dataclass(frozen=True)
class MetricsTable:
    """A run's metrics as a two-column table (the evaluation of a task without per-class results)."""

    title: str
    values: Mapping[str, float]

    @property
    def metrics(self) -> dict[str, float]:
        return dict(self.values)

    def to_json(self, per_class: bool = False) -> str:
        import json

        return json.dumps(self.metrics)

    def format_table(self, per_class: int = 0) -> str:
        from idml.app.metric_display import format_metrics

        return format_metrics(self.title, self.metrics)


class LoadedRun:
    """A finished run loaded from one checkpoint: its :class:`~idml.app.trained_run.TrainedRun`
    (config and embedding model) and what its task adds to ``idml embed``'s output."""

    extra_arrays: ClassVar[tuple[str, ...]] = ()
    """The names of the arrays :meth:`extra_outputs` adds."""

    def __init__(self, run: TrainedRun) -> None:
        self.run = run

    @property
    def config(self) -> Config:
        return self.run.config

    @property
    def model(self) -> Any:
        return self.run.model

    def extra_outputs(
        self, embeddings: Embeddings
    ) -> tuple[dict[str, Tensor], dict[str, list[str]]]:
        """Arrays (one row per image) and name lists that ``idml embed`` writes beside the
        embeddings and ``||u||``; none by default."""
        return {}, {}


class Task(ABC):
    """One kind of run: what it learns and how it is judged. Subclass it, then
    :func:`~idml.app.tasks.register_task` an instance.

    A task owns its config (:attr:`params`, :attr:`reads`, :attr:`defaults`, :meth:`upgrade`,
    :meth:`check_config`), the split (:meth:`build_data`), the objective (:meth:`build_objective`),
    the batch augmentations (:meth:`build_augmentations`), evaluation during training
    (:meth:`evaluate`, :meth:`metric_names`) and finished runs (:meth:`load_run`,
    :meth:`evaluate_run`, :meth:`analyse`, :meth:`report_section`). The trainer, the CLI and the
    report call these and never compare task names.
    """

    name: ClassVar[str]
    """The ``task.name`` a config selects this task with (an identifier)."""
    params: ClassVar[type[TaskParams]] = TaskParams
    """The keys of the ``task:`` section besides ``name``."""
    reads: ClassVar[frozenset[str]]
    """Config keys the task reads besides ``task``, dotted (a section name stands for all its
    keys; :data:`idml.app.config.RUN_KEYS` every run reads). A config that sets another key is an
    error naming it."""
    defaults: ClassVar[str | Path | None] = None
    """A fragment (a packaged name such as ``task/classification``, or a ``.yaml`` path) merged
    under every config of this task, as its first ``include:``."""
    evaluation_options: ClassVar[frozenset[str]] = frozenset()
    """The :class:`EvaluationRequest` fields :meth:`evaluate_run` honours."""

    def upgrade(self, raw: dict[str, Any], source: str) -> dict[str, Any]:
        """A raw config (a file, or one a run stored) with this task's keys of older versions of
        idml spelled as today's, or a ``ConfigError`` naming an old key's new place; called for
        every config before it is validated. Unchanged by default."""
        return raw

    def check_config(self, cfg: Config) -> None:
        """Refuse (``ValueError`` naming the keys) settings of the keys it reads that this task
        cannot run with; called when a config is validated. Nothing by default."""
        return None

    @abstractmethod
    def metric_names(self, cfg: Config) -> list[str]:
        """The test metrics a training run logs and ``eval.select`` may name, in report order
        (larger is better for each)."""

    def describe(self, cfg: Config) -> list[str]:
        """The parts of a short description of a run's method (the report's "method" column)."""
        return [self.name]

    # ------------------------------------------------------------------ training
    @abstractmethod
    def build_data(self, cfg: Config) -> TrainTestPair:
        """The train and test sides of ``data.*`` under this task's split policy, with the
        run's pixel pipelines."""

    @abstractmethod
    def build_objective(self, cfg: Config, data: TrainTestPair) -> Objective:
        """The objective of a run on ``data`` (its module is moved to the device by the trainer)."""

    @abstractmethod
    def build_augmentations(self, cfg: Config) -> BatchAugmentation:
        """The batch augmentations each training step applies (one stream per shard)."""

    def checkpoint_state(self, data: TrainTestPair) -> dict[str, Any]:
        """Entries the task adds to every checkpoint's ``state.json`` (JSON values)."""
        return {}

    @abstractmethod
    def evaluate(self, context: EvaluationContext) -> Evaluation:
        """Test metrics of the model being trained, known to every rank."""

    def after_training(
        self,
        run_dir: Path,
        data: TrainTestPair,
        device: torch.device,
        log: Callable[[str], object] | None = None,
    ) -> None:
        """Work on the finished run, called by rank 0 once the last checkpoint is written (e.g.
        what its answers need beside the weights); lines for the user go to ``log``. Nothing by
        default."""
        return None

    # ------------------------------------------------------------------ finished runs
    def load_run(self, path: Path, which: str = "best") -> LoadedRun:
        """A run folder's ``which`` checkpoint, loaded (:func:`~idml.app.trained_run.load_trained_run`)."""
        from idml.app.trained_run import load_trained_run

        return LoadedRun(load_trained_run(path, which))

    @abstractmethod
    def evaluate_run(
        self,
        path: Path,
        which: str,
        request: EvaluationRequest,
        device: torch.device | str | None = None,
        progress: bool = False,
    ) -> RunEvaluation:
        """A finished run's test metrics from its ``which`` checkpoint, with the run's own settings
        changed as ``request`` asks (only :attr:`evaluation_options` are ever set)."""

    @abstractmethod
    def analyse(
        self, log: RunLog, options: AnalysisOptions, device: torch.device, progress: bool
    ) -> Any:
        """The report's test-set analysis of a run's checkpoint (an object with ``metrics``,
        ``checkpoint`` and ``epoch``, which :meth:`report_section` draws).

        Raises:
            idml.app.checkpoint.CheckpointError: the run folder holds no readable checkpoint.
        """

    @abstractmethod
    def report_section(self, analysis: Any, slug: str, page: PageFigures) -> str:
        """The HTML of a run's test-set analysis (figures written through ``page``)."""

    def without_analysis(self) -> str:
        """What a report without the test-set analysis (``--no-test``) lacks, in words."""
        return "no test-set figures"


def known_names(items: Sequence[str]) -> str:
    """``a, b, c`` (for messages that list valid names)."""
    return ", ".join(items)
