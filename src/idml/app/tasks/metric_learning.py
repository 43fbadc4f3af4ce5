"""``task: metric_learning``: deep metric learning on a class-disjoint split, judged by retrieval.

The IDML and SSR papers' protocol: train on some classes, embed the images of classes never seen in
training, and rank each test image's neighbours (Recall@K, R-Precision, MAP@R, MAP, MRR, NMI;
:func:`idml.evaluation.evaluate_embeddings`). What the task owns:

- split: the dataset's class-disjoint train/test split, or with ``data.protocol=validation`` a
  held-out share of the *training* classes; with ``calibration.held_out_classes`` a share of the
  training classes on a ``val`` side never trained on (:func:`idml.app.build.build_data`);
- objective: the ``loss`` section's metric loss (:data:`idml.losses.LOSSES`) on the run's metric,
  ISM when ``metric.introspective``, on the gathered global batch (Mixup rows with set labels);
- augmentations: degradations, then Mixup or CutMix with set labels appended to the batch;
- evaluation: the test side embedded in shards (one per process), gathered and scored on rank 0;
- after training: the calibrated confidence of its answers, fitted on the held-out training
  classes and written to ``calibration.json`` (:func:`idml.app.calibration.calibrate_run`);
- report: the retrieval analysis of :func:`idml.app.reports.runs.analyse_retrieval_run`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from idml.app import build
from idml.app.config import RUN_KEYS, Config
from idml.app.distributed import contiguous_shard, gather_embeddings
from idml.app.tasks._base import (
    Evaluation,
    EvaluationContext,
    EvaluationRequest,
    Objective,
    RunEvaluation,
    Task,
)
from idml.augment import AugmentationPipeline, AugmentedBatch
from idml.data.datasets import DMLSplit, TrainTestPair
from idml.embeddings import Embeddings, NonFiniteEmbeddingsError
from idml.losses import MetricLoss
from idml.losses.ambiguity import mixup_uncertainty_loss
from idml.models import embed_dataset

if TYPE_CHECKING:
    from idml.app.reports.runs import AnalysisOptions, RunLog
    from idml.app.reports.sections import PageFigures


class MetricLossObjective(Objective):
    """A metric loss on the (gathered) augmented batch: ``batch.loss(loss, embeddings)`` (set labels
    for Mixup rows, or ``mixup.mode=interpolate``'s λ-weighted losses), the uncertainty embedding
    passed on only when the loss compares through ISM or models uncertainty itself (PEL)."""

    def __init__(
        self,
        loss: MetricLoss,
        uses_uncertainty: bool,
        ambiguity: AmbiguityTerm | None = None,
    ) -> None:
        self.module = loss
        self.uses_uncertainty = uses_uncertainty
        self.ambiguity = ambiguity

    def __call__(self, embeddings: Embeddings, batch: AugmentedBatch) -> Tensor:
        extra = None
        if self.ambiguity is not None and embeddings.uncertainty is not None:
            extra = self.ambiguity(embeddings.uncertainty, batch.ambiguity)
        if not self.uses_uncertainty:
            # The uncertainty head may exist (e.g. for logging) but the plain metric ignores it.
            embeddings = Embeddings(embeddings.semantic)
        loss = batch.loss(self.module, embeddings)
        return loss if extra is None else loss + extra


class AmbiguityTerm:
    """The Mixup-supervised uncertainty extension (``mixup.uncertainty_weight`` η > 0; off by
    default, not the paper's IDML): ``η · BCE(||u||/u_max, κ·t)`` with ``t = 1 − |2λ − 1|`` the
    ambiguity of each row (0 for an original image), :func:`idml.losses.ambiguity.mixup_uncertainty_loss`."""

    def __init__(self, weight: float, max_norm: float, level: float) -> None:
        self.weight = weight
        self.max_norm = max_norm
        self.level = level

    def __call__(self, uncertainty: Tensor, ambiguity: Tensor) -> Tensor:
        rho = uncertainty.norm(dim=1) / self.max_norm
        return self.weight * mixup_uncertainty_loss(rho, ambiguity, self.level)


class MetricLearning(Task):
    """Class-disjoint retrieval with a metric loss (module docstring)."""

    name = "metric_learning"
    reads: ClassVar[frozenset[str]] = RUN_KEYS | {
        "data",
        "sampler",
        "model",
        "metric",
        "loss",
        "mixup.enabled",
        "mixup.kind",
        "mixup.alpha",
        "mixup.fraction",
        "mixup.mode",
        "mixup.uncertainty_weight",
        "mixup.uncertainty_level",
        "degradations",
        "ssr",
        "optim",
        "eval",
        "calibration",
    }
    evaluation_options: ClassVar[frozenset[str]] = frozenset(
        {
            "ks",
            "introspective",
            "nmi",
            "nmi_backend",
            "full_ranking",
            "block_size",
            "seed",
            "reranking",
            "calibration",
        }
    )

    def metric_names(self, cfg: Config) -> list[str]:
        """Recall@K for ``eval.ks``, R-Precision, MAP@R, MAP, MRR, and NMI with ``eval.nmi``
        (training evaluates with the exact search, so the full-ranking MAP and MRR are there)."""
        names = [f"recall@{k}" for k in cfg.eval.ks] + ["r_precision", "map@r", "map", "mrr"]
        if cfg.eval.nmi:
            names.append("nmi")
        return names

    def describe(self, cfg: Config) -> list[str]:
        return [cfg.loss.name]

    def build_data(self, cfg: Config) -> TrainTestPair:
        return build.build_data(cfg)

    def build_objective(self, cfg: Config, data: TrainTestPair) -> MetricLossObjective:
        loss = build.build_loss(cfg, data.num_train_classes)
        ambiguity = None
        if cfg.mixup.uncertainty_weight > 0:
            ambiguity = AmbiguityTerm(
                cfg.mixup.uncertainty_weight,
                cfg.model.uncertainty.max_norm,
                cfg.mixup.uncertainty_level,
            )
        return MetricLossObjective(
            loss, cfg.metric.introspective or cfg.loss.probabilistic, ambiguity
        )

    def build_augmentations(self, cfg: Config) -> AugmentationPipeline:
        return build.build_augmentations(cfg)

    def evaluate(self, context: EvaluationContext) -> Evaluation:
        """Retrieval metrics of the gathered test embeddings, computed once (by rank 0); how NMI
        was computed is a note (``eval/nmi_method``)."""
        emb, labels = embed_test_set(context)
        report = None
        if context.dist.is_main:
            # A test set with query/gallery roles searches its queries against its gallery.
            roles = context.data.test.roles
            evaluation = build.evaluate(
                context.cfg, emb, labels, context.device, context.progress, roles
            )
            report = Evaluation(
                dict(evaluation.metrics), {"nmi_method": evaluation.settings["nmi_method"]}
            )
        found = context.dist.broadcast_object(report)
        assert found is not None  # rank 0 evaluated
        return found

    def after_training(
        self,
        run_dir: Path,
        data: TrainTestPair,
        device: torch.device,
        log: Callable[[str], object] | None = None,
    ) -> None:
        """The run's calibrated confidence, fitted on its held-out training classes (the
        ``calibration`` section) and written to ``run_dir/calibration.json``; without held-out
        classes ``log`` says the answers carry the top-1 similarity
        (:func:`idml.app.calibration.calibrate_run`)."""
        from idml.app.calibration import calibrate_run

        split = data if isinstance(data, DMLSplit) else None  # else rebuilt from the config
        calibrate_run(run_dir, split, device=device, log=log)

    def evaluate_run(
        self,
        path: Path,
        which: str,
        request: EvaluationRequest,
        device: torch.device | str | None = None,
        progress: bool = False,
    ) -> RunEvaluation:
        from idml.app.trained_run import evaluate_checkpoint

        options: dict[str, Any] = {
            "ks": request.ks,
            "introspective": request.introspective,
            "nmi": request.nmi,
            "nmi_backend": request.nmi_backend,
            "full_ranking": request.full_ranking,
            "block_size": request.block_size,
            "reranking": request.reranking,
            "calibration": request.calibration,
        }
        if request.seed is not None:
            options["seed"] = request.seed
        return evaluate_checkpoint(path, which, device=device, progress=progress, **options)

    def analyse(
        self, log: RunLog, options: AnalysisOptions, device: torch.device, progress: bool
    ) -> Any:
        from idml.app.reports.runs import analyse_retrieval_run

        return analyse_retrieval_run(log, options, device, progress)

    def report_section(self, analysis: Any, slug: str, page: PageFigures) -> str:
        from idml.app.reports.sections import retrieval_section

        return retrieval_section(analysis, slug, page)

    def without_analysis(self) -> str:
        return "no retrieval grid, test uncertainty or t-SNE"


@torch.no_grad()
def embed_test_set(context: EvaluationContext) -> tuple[Embeddings, Tensor]:
    """Test-set embeddings in dataset order; each process embeds a contiguous shard.

    Raises:
        NonFiniteEmbeddingsError: on every rank, when any rank's embeddings hold NaN or inf.
    """
    dist = context.dist
    shard = contiguous_shard(context.data.test, dist)
    error: NonFiniteEmbeddingsError | None = None
    try:
        emb, labels = embed_dataset(
            context.model,
            shard,
            context.cfg.eval.batch_size,
            context.device,
            progress=context.progress,
        )
    except NonFiniteEmbeddingsError as err:
        error = err
    failed = error is not None
    if dist.is_distributed:
        # Agree before the gather: a rank stopping alone would leave the others waiting in it.
        failed = dist.mean({"failed": float(failed)})["failed"] > 0
    if failed:
        raise NonFiniteEmbeddingsError(str(error or "of another process")) from error
    return gather_embeddings(emb, labels, dist)
