"""``task: classification``: the run's model as an image classifier, with ISM inside the softmax.

A cosine classifier ``z = s·S(x, w_c)`` on the semantic embedding replaces the metric loss
(:mod:`idml.classification` for the math); ``S = S_IN`` when ``metric.introspective``. What the
task owns:

- split: the standard split of ``data.dataset``, every class on both sides
  (:func:`idml.data.classification.load_classification_split`; ``task.test_fraction`` of each class
  for datasets without a test side);
- objective: :class:`~idml.classification.IntrospectiveClassifier` trained on λ-weighted targets of
  mixed images (:func:`~idml.classification.mixed_targets`);
- augmentations: degradations, then the ``mixup`` section's Mixup or CutMix of whole batches
  (``mixup.probability`` of them, replacing or, with ``mixup.keep_originals``, appended to the
  clean ones);
- evaluation: top-k accuracy for ``eval.ks``, ECE, NLL and the ``||u||`` of clean, mixed and
  degraded test images (rank 0);
- a finished run: its classifier loaded beside the model, ``idml embed`` adding logits and
  probabilities, and the report's calibration, confusion and mistakes
  (:mod:`idml.app.reports.classification`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from pydantic import Field
from safetensors.torch import load_file
from torch import Tensor

from idml.app import build
from idml.app.checkpoint import TRAINING_FILE, CheckpointError, load_weights
from idml.app.config import RUN_KEYS, Config, ConfigError, OpenUnitInterval, read_only
from idml.app.tasks._base import (
    Evaluation,
    EvaluationContext,
    EvaluationRequest,
    LoadedRun,
    MetricsTable,
    Objective,
    Task,
    TaskParams,
)
from idml.augment import AugmentedBatch, CutMix, Mixup
from idml.classification import (
    BatchMixing,
    ClassificationAugmentation,
    ClassifierEvaluationSettings,
    ClassifierOutputs,
    IntrospectiveClassifier,
    classify_dataset,
    mixed_targets,
)
from idml.data.classification import ClassificationSplit, load_classification_split
from idml.data.datasets import TrainTestPair
from idml.embeddings import Embeddings
from idml.metrics import CosineSimilarity

if TYPE_CHECKING:
    from idml.app.reports.runs import AnalysisOptions, RunLog
    from idml.app.reports.sections import PageFigures
    from idml.app.trained_run import TrainedRun


class ClassificationParams(TaskParams):
    """``task: {name: classification, ...}``: the classifier's scale, the split of datasets without
    a test side and what the evaluation measures besides ``eval.ks``'s top-k accuracies."""

    scale: float = Field(16.0, gt=0, allow_inf_nan=False, description="logit scale s = 1/T")
    test_fraction: OpenUnitInterval = Field(
        0.2, description="per-class hold-out of datasets without a test side"
    )
    test_samples_per_class: int | None = Field(
        None, gt=0, description="subsample the test side (data.samples_per_class: the train side)"
    )
    ece_bins: int = Field(15, gt=0, description="equal-width confidence bins of the ECE")
    uncertainty_probes: bool = Field(
        True, description="log ||u|| of Mixup, CutMix and low-resolution test images"
    )


def settings(cfg: Config) -> ClassificationParams:
    """The ``task`` section of a classification config."""
    params = cfg.task
    if not isinstance(params, ClassificationParams):
        raise ValueError(f"task.name={cfg.task.name}: not a classification config")
    return params


def evaluation_settings(cfg: Config) -> ClassifierEvaluationSettings:
    """What a classification run's evaluation measures: ``eval.ks``, ``task.ece_bins`` and
    ``task.uncertainty_probes``, the probes seeded with the run's ``seed``."""
    s = settings(cfg)
    return ClassifierEvaluationSettings(cfg.eval.ks, s.ece_bins, s.uncertainty_probes, cfg.seed)


def build_classifier(cfg: Config, num_classes: int) -> IntrospectiveClassifier:
    """The cosine classifier on the run's metric (cosine, or ISM around it)."""
    proxy_u = None
    if cfg.metric.introspective and cfg.metric.proxy_uncertainty:
        proxy_u = cfg.model.uncertainty.dim or cfg.model.embedding_dim
    return IntrospectiveClassifier(
        num_classes,
        cfg.model.embedding_dim,
        build.build_metric(cfg, CosineSimilarity()),
        scale=settings(cfg).scale,
        proxy_uncertainty_dim=proxy_u,
    )


class ClassifierObjective(Objective):
    """The classifier's cross-entropy against λ-weighted targets (one-hot for clean rows), ``u``
    fed to it only when it compares through ISM."""

    module: IntrospectiveClassifier

    def __init__(self, classifier: IntrospectiveClassifier, introspective: bool) -> None:
        self.module = classifier
        self.introspective = introspective

    def __call__(self, embeddings: Embeddings, batch: AugmentedBatch) -> Tensor:
        if not self.introspective:
            embeddings = Embeddings(embeddings.semantic)  # the plain cosine classifier ignores u
        return self.module.soft_loss(embeddings, mixed_targets(batch, self.module.num_classes))


@dataclass(frozen=True)
class ClassificationRun(LoadedRun):
    """A classification run as loaded from one checkpoint: the model and its classifier."""

    run: TrainedRun
    classifier: IntrospectiveClassifier
    """In eval mode, on the CPU (like ``run.model``)."""
    class_names: tuple[str, ...]
    """The name of each classifier column (logit)."""

    extra_arrays: ClassVar[tuple[str, ...]] = ("logits", "probabilities")

    def outputs(
        self,
        dataset: torch.utils.data.Dataset,
        device: torch.device | str | None = None,
        progress: bool = False,
    ) -> ClassifierOutputs:
        """:func:`~idml.classification.classify_dataset` with the run's own evaluation settings
        (``eval.batch_size``, ``task.uncertainty_probes``, ``seed``), so the numbers are those the
        trainer logged for this checkpoint."""
        cfg = self.config
        target = torch.device(device) if device is not None else torch.device("cpu")
        return classify_dataset(
            self.run.model.to(target),
            self.classifier.to(target),
            dataset,
            cfg.eval.batch_size,
            target,
            introspective=cfg.metric.introspective,
            settings=evaluation_settings(cfg),
            progress=progress,
        )

    def extra_outputs(
        self, embeddings: Embeddings
    ) -> tuple[dict[str, Tensor], dict[str, list[str]]]:
        """``logits`` ``(N, C)`` (``u`` fed to the classifier when the run trained with ISM, as in
        its evaluation), ``probabilities`` (their softmax) and ``logit_classes``, the class of each
        column (the run's classes, not necessarily those of the embedded images' labels)."""
        classifier = self.classifier
        was_training = classifier.training
        classifier.eval()
        unc = embeddings.uncertainty if self.config.metric.introspective else None
        with torch.no_grad():
            logits = classifier.to(embeddings.semantic.device).logits(
                Embeddings(embeddings.semantic, unc)
            )
        classifier.train(was_training)
        arrays = {
            "logits": logits.float(),
            "probabilities": torch.softmax(logits.double(), dim=1).float(),
        }
        return arrays, {"logit_classes": list(self.class_names)}


_OLD_KEYS = {
    "scale": "task.scale",
    "mix": "mixup.enabled and mixup.kind",
    "mix_alpha": "mixup.alpha",
    "mix_prob": "mixup.probability",
    "keep_originals": "mixup.keep_originals",
    "test_fraction": "task.test_fraction",
    "test_samples_per_class": "task.test_samples_per_class",
    "ks": "eval.ks",
    "ece_bins": "task.ece_bins",
    "uncertainty_probes": "task.uncertainty_probes",
}
"""The keys of the ``classification`` section before tasks had the ``task`` section, and where
they live now."""


def _check_class_count(cfg: Config, num_classes: int) -> None:
    """Refuse ``eval.ks`` asking for a top-k accuracy of more classes than the dataset has: that
    accuracy would be dropped from every evaluation, and an ``eval.select`` naming it would fail
    only once the first epoch is trained."""
    ks = list(cfg.eval.ks)
    too_large = [k for k in ks if k > num_classes]
    if too_large:
        fitting = [k for k in ks if k <= num_classes] or [1]
        selected = cfg.eval.select in {f"top{k}" for k in too_large}
        raise ConfigError(
            f"eval.ks={ks} asks for top-{too_large[0]} accuracy but {cfg.data.dataset} has "
            f"{num_classes} classes, so top{too_large[0]} cannot be measured"
            + (f" (and eval.select={cfg.eval.select!r} names it)" if selected else "")
            + f"; use values up to {num_classes}, e.g. eval.ks={fitting}"
        )


class Classification(Task):
    """Image classification with the introspective cosine classifier (module docstring)."""

    name = "classification"
    params = ClassificationParams
    reads: ClassVar[frozenset[str]] = RUN_KEYS | {
        "data.dataset",
        "data.root",
        "data.image_size",
        "data.resize_size",
        "data.train_crop_scale",
        "data.horizontal_flip",
        "data.samples_per_class",
        "data.num_workers",
        "data.decode",
        "data.augment_on",
        "data.cache",
        "sampler",
        "model",
        "metric",
        "mixup.enabled",
        "mixup.kind",
        "mixup.alpha",
        "mixup.probability",
        "mixup.keep_originals",
        "degradations",
        "optim",
        "eval.every",
        "eval.ks",
        "eval.select",
        "eval.batch_size",
        "eval.train_level_images",
    }
    defaults = "task/classification"

    def upgrade(self, raw: dict[str, Any], source: str) -> dict[str, Any]:
        """A config stored by a run before tasks had their section (the whole ``classification``
        section written out, beside every other key at its default) reads as ``task: {name:
        classification, ...}`` and the one ``mixup`` section; a ``classification`` section written
        by hand is refused, naming where each of its keys went (``classification: null``, which
        metric-learning runs of that version stored, is dropped)."""
        if "classification" not in raw:
            return raw
        raw = dict(raw)
        old = raw.pop("classification")
        if old is None:
            return raw
        if not (isinstance(old, dict) and set(old) == set(_OLD_KEYS)):
            moved = [
                f"classification.{key} -> {new}"
                for key, new in _OLD_KEYS.items()
                if isinstance(old, dict) and key in old
            ]
            raise ConfigError(
                "the classification section is now the task section and the one mixup section: "
                "write task: {name: classification, ...}"
                + (f" ({'; '.join(moved)})" if moved else "")
                + f"\n  in {source}"
            )
        mixed = old["mix"] != "none"
        settings = ("scale", "test_fraction", "test_samples_per_class", "ece_bins")
        upgraded = read_only(raw, self.reads)  # the old schema wrote every key, read or not
        upgraded["task"] = {"name": self.name, "uncertainty_probes": old["uncertainty_probes"]}
        upgraded["task"] |= {key: old[key] for key in settings}
        upgraded["mixup"] = {
            "enabled": mixed,
            "kind": old["mix"] if mixed else "mixup",
            "alpha": old["mix_alpha"],
            "probability": old["mix_prob"],
            "keep_originals": old["keep_originals"],
        }
        evaluation: dict[str, Any] = dict(upgraded.get("eval") or {})
        upgraded["eval"] = {**evaluation, "ks": old["ks"]}
        return upgraded

    def check_config(self, cfg: Config) -> None:
        if cfg.data.dataset in ("cub", "cars", "sop"):
            raise ValueError(
                f"data.dataset={cfg.data.dataset}: a zero-shot retrieval benchmark has no "
                "classification split; use digits, fashion_mnist, folder (ImageNet/CIFAR "
                "layouts) or csv"
            )

    def metric_names(self, cfg: Config) -> list[str]:
        """The top-k accuracies of ``eval.ks`` (ECE and NLL are logged too, but smaller is better
        for them, so ``eval.select`` cannot name them)."""
        return [f"top{k}" for k in cfg.eval.ks]

    def describe(self, cfg: Config) -> list[str]:
        return ["cosine classifier"]

    def build_data(self, cfg: Config) -> ClassificationSplit:
        """The standard split of ``data.dataset`` with the run's train and test pixel pipelines."""
        d, s = cfg.data, settings(cfg)
        train_transform, test_transform = build.data_transforms(cfg)
        split = load_classification_split(
            d.dataset,
            d.root,
            per_class=d.samples_per_class,
            test_per_class=s.test_samples_per_class,
            test_fraction=s.test_fraction,
            seed=cfg.seed,
            train_transform=train_transform,
            test_transform=test_transform,
        )
        _check_class_count(cfg, split.num_classes)  # before any step
        return build.reading_images(split, cfg)

    def build_objective(self, cfg: Config, data: TrainTestPair) -> ClassifierObjective:
        return ClassifierObjective(
            build_classifier(cfg, data.num_train_classes), cfg.metric.introspective
        )

    def build_augmentations(self, cfg: Config) -> ClassificationAugmentation:
        """Degradations of ``degradations.*``, then ``mixup``'s mixing of whole batches."""
        m = cfg.mixup
        mixing = None
        if m.enabled:
            mixer = Mixup(alpha=m.alpha) if m.kind == "mixup" else CutMix(alpha=m.alpha)
            mixing = BatchMixing(mixer, probability=m.probability, keep_originals=m.keep_originals)
        return ClassificationAugmentation(build.build_degradations(cfg), mixing)

    def checkpoint_state(self, data: TrainTestPair) -> dict[str, Any]:
        # The classifier's column names, so `idml embed` can name the logits without the data.
        return {"class_names": list(data.train.class_names)}

    def evaluate(self, context: EvaluationContext) -> Evaluation:
        """Top-k accuracy, ECE, NLL and ``||u||`` probes on the test side (computed on rank 0)."""
        report = None
        if context.dist.is_main:
            cfg = context.cfg
            evaluation = evaluation_settings(cfg)
            classifier = context.objective.module
            assert isinstance(classifier, IntrospectiveClassifier)
            outputs = classify_dataset(
                context.model,
                classifier,
                context.data.test,
                cfg.eval.batch_size,
                context.device,
                introspective=cfg.metric.introspective,
                settings=evaluation,
                progress=context.progress,
            )
            report = Evaluation(outputs.metrics(evaluation.ks, evaluation.ece_bins))
        found = context.dist.broadcast_object(report)
        assert found is not None  # rank 0 evaluated
        return found

    def load_run(self, path: Path, which: str = "best") -> ClassificationRun:
        """A classification run's ``which`` checkpoint: the model from ``model.safetensors``, the
        classifier's weights from ``training.safetensors``.

        Raises:
            idml.app.checkpoint.CheckpointError: the checkpoint is missing or unreadable.
        """
        from idml.app.trained_run import load_trained_run

        run = load_trained_run(path, which)
        cfg = run.config
        if not isinstance(run.state.get("num_train_classes"), int):
            raise CheckpointError(
                f"{run.checkpoint / 'state.json'} has no integer 'num_train_classes', so the "
                "classifier cannot be rebuilt; use a checkpoint written by `idml train`"
            )
        num_classes = int(run.state["num_train_classes"])
        classifier = build_classifier(cfg, num_classes)
        file = run.checkpoint / TRAINING_FILE
        try:
            tensors = load_file(str(file))
        except Exception as err:  # safetensors raises its own error types for corrupt files
            raise CheckpointError(f"cannot read {file}: {err}") from err
        own = {k[len("loss.") :]: v for k, v in tensors.items() if k.startswith("loss.")}
        load_weights(
            classifier, {k: v for k, v in own.items() if not k.startswith("optimizer.")}, str(file)
        )
        classifier.eval()
        names = run.state.get("class_names")
        if names is None:
            # Checkpoints written before the names were stored: the training split has them.
            names = self.build_data(cfg).train.class_names
        if len(names) != num_classes:
            raise CheckpointError(
                f"{run.checkpoint / 'state.json'}: 'class_names' has {len(names)} entries but the "
                f"classifier has {num_classes} classes"
            )
        return ClassificationRun(run, classifier, tuple(str(n) for n in names))

    def evaluate_run(
        self,
        path: Path,
        which: str,
        request: EvaluationRequest,
        device: torch.device | str | None = None,
        progress: bool = False,
    ) -> MetricsTable:
        """The test metrics (:meth:`~idml.classification.ClassifierOutputs.metrics` with the run's
        evaluation settings) of its ``which`` checkpoint."""
        loaded = self.load_run(path, which)
        evaluation = evaluation_settings(loaded.config)
        test = self.build_data(loaded.config).test
        outputs = loaded.outputs(test, device, progress)
        return MetricsTable(str(path), outputs.metrics(evaluation.ks, evaluation.ece_bins))

    def analyse(
        self, log: RunLog, options: AnalysisOptions, device: torch.device, progress: bool
    ) -> Any:
        from idml.app.reports.classification import analyse_classification_run

        return analyse_classification_run(
            self.load_run(log.run_dir, options.which), options, device, progress
        )

    def report_section(self, analysis: Any, slug: str, page: PageFigures) -> str:
        from idml.app.reports.sections import classification_section

        return classification_section(analysis, slug, page)

    def without_analysis(self) -> str:
        return "no confusion matrix, reliability diagram or mistakes"
