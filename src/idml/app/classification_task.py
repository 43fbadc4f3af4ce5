"""``task: classification``: the :class:`~idml.app.training.Trainer` with a classifier instead of a
metric loss (checkpoints, exact resume, logging, distributed shards and ablations are the
trainer's own).

What changes (:mod:`idml.classification` for the math):

- data: the standard split, every class in train and test (:mod:`idml.data.classification`);
- loss: :class:`~idml.classification.IntrospectiveClassifier`, ``z = s·S(x, w_c)`` with
  ``S = S_IN`` when ``metric.introspective``, trained on λ-weighted Mixup/CutMix targets;
- augmentations: degradations, then Mixup or CutMix of the whole batch (``classification.mix``);
- evaluation: top-k accuracy, ECE, NLL and the ``||u||`` of clean, mixed and degraded test images.

:func:`make_trainer` picks the trainer of a config's task.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import load_file
from torch import Tensor

from idml.app import build
from idml.app.checkpoint import (
    TRAINING_FILE,
    CheckpointError,
    load_weights,
    read_state,
    resolve_checkpoint,
)
from idml.app.config import ClassificationConfig, Config
from idml.app.preflight import check_class_count
from idml.app.trained_run import TrainedRun, load_trained_run
from idml.app.training import Trainer
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
from idml.embeddings import Embeddings


def _settings(cfg: Config) -> ClassificationConfig:
    if cfg.classification is None:  # the config validator fills it for task: classification
        raise ValueError("task: classification needs the classification section")
    return cfg.classification


def evaluation_settings(cfg: Config) -> ClassifierEvaluationSettings:
    """What a classification run's evaluation measures: ``classification.{ks, ece_bins,
    uncertainty_probes}``, the probes seeded with the run's ``seed``."""
    c = _settings(cfg)
    return ClassifierEvaluationSettings(c.ks, c.ece_bins, c.uncertainty_probes, cfg.seed)


def build_classification_data(cfg: Config) -> ClassificationSplit:
    """The standard split of ``data.dataset`` with the run's train and test pixel pipelines."""
    d, c = cfg.data, _settings(cfg)
    train_transform, test_transform = build.data_transforms(cfg)
    return load_classification_split(
        d.dataset,
        d.root,
        per_class=d.samples_per_class,
        test_per_class=c.test_samples_per_class,
        test_fraction=c.test_fraction,
        seed=cfg.seed,
        train_transform=train_transform,
        test_transform=test_transform,
    )


def build_classifier(cfg: Config, num_classes: int) -> IntrospectiveClassifier:
    """The cosine classifier on the run's metric (cosine, or ISM around it)."""
    proxy_u = None
    if cfg.metric.introspective and cfg.metric.proxy_uncertainty:
        proxy_u = cfg.model.uncertainty.dim or cfg.model.embedding_dim
    return IntrospectiveClassifier(
        num_classes,
        cfg.model.embedding_dim,
        build.build_metric(cfg),
        scale=_settings(cfg).scale,
        proxy_uncertainty_dim=proxy_u,
    )


def build_classification_augmentations(cfg: Config) -> ClassificationAugmentation:
    """Degradations of ``degradations.*``, then ``classification.mix`` of whole batches."""
    c = _settings(cfg)
    mixing = None
    if c.mix != "none":
        mixer = Mixup(alpha=c.mix_alpha) if c.mix == "mixup" else CutMix(alpha=c.mix_alpha)
        mixing = BatchMixing(mixer, probability=c.mix_prob, keep_originals=c.keep_originals)
    return ClassificationAugmentation(build.build_augmentations(cfg), mixing)


class ClassificationTrainer(Trainer):
    """:class:`~idml.app.training.Trainer` for ``task: classification`` (module docstring)."""

    loss: IntrospectiveClassifier

    def _build_data(self) -> Any:
        data = build_classification_data(self.cfg)
        check_class_count(self.cfg, data.num_classes, self.cfg.data.dataset)  # before any step
        return data

    def _build_loss(self) -> IntrospectiveClassifier:
        return build_classifier(self.cfg, self.data.num_classes)

    def _build_augmentations(self) -> Any:
        return build_classification_augmentations(self.cfg)

    def _checkpoint_extras(self) -> dict[str, Any]:
        # The classifier's column names, so `idml embed` can name the logits without the data.
        return {"class_names": list(self.data.train.class_names)}

    def _metric_loss(self, emb: Embeddings, batch: AugmentedBatch) -> Tensor:
        if not self.cfg.metric.introspective:
            emb = Embeddings(emb.semantic)  # the plain cosine classifier ignores u
        return self.loss.soft_loss(emb, mixed_targets(batch, self.loss.num_classes))

    def evaluate(self) -> dict[str, float]:
        """Top-k accuracy, ECE, NLL and ``||u||`` probes on the test side (computed on rank 0)."""
        report = None
        if self.dist.is_main:
            settings = evaluation_settings(self.cfg)
            outputs = classify_dataset(
                self.model,
                self.loss,
                self.data.test,
                self.cfg.eval.batch_size,
                self.device,
                introspective=self.cfg.metric.introspective,
                settings=settings,
                progress=self.progress,
            )
            report = outputs.metrics(settings.ks, settings.ece_bins)
        return self.dist.broadcast_object(report)


def make_trainer(cfg: Config, run_dir: Path, **options: Any) -> Trainer:
    """The trainer of ``cfg.task`` (options as :class:`~idml.app.training.Trainer` takes them)."""
    cls = ClassificationTrainer if cfg.task == "classification" else Trainer
    return cls(cfg, run_dir, **options)


@dataclass(frozen=True)
class TrainedClassifier:
    """A classification run as loaded from one checkpoint: the model and its classifier."""

    run: TrainedRun
    classifier: IntrospectiveClassifier
    """In eval mode, on the CPU (like ``run.model``)."""
    class_names: tuple[str, ...]
    """The name of each classifier column (logit)."""

    @property
    def config(self) -> Config:
        return self.run.config

    def outputs(
        self,
        dataset: torch.utils.data.Dataset,
        device: torch.device | str | None = None,
        progress: bool = False,
    ) -> ClassifierOutputs:
        """:func:`~idml.classification.classify_dataset` with the run's own evaluation settings
        (``eval.batch_size``, ``classification.uncertainty_probes``, ``seed``), so the numbers are
        those the trainer logged for this checkpoint."""
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


def load_classification_run(path: Path, which: str = "best") -> TrainedClassifier:
    """A classification run's ``which`` checkpoint: the model from ``model.safetensors``, the
    classifier's weights from ``training.safetensors``.

    Raises:
        ValueError: the run is not a classification run.
        idml.app.checkpoint.CheckpointError: the checkpoint is missing or unreadable.
    """
    run = load_trained_run(path, which)
    cfg = run.config
    if cfg.task != "classification":
        raise ValueError(f"{path} is a {cfg.task} run; evaluate it with idml evaluate --checkpoint")
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
        names = build_classification_data(cfg).train.class_names
    if len(names) != num_classes:
        raise CheckpointError(
            f"{run.checkpoint / 'state.json'}: 'class_names' has {len(names)} entries but the "
            f"classifier has {num_classes} classes"
        )
    return TrainedClassifier(run, classifier, tuple(str(n) for n in names))


def evaluate_classification_run(
    path: Path,
    which: str = "best",
    device: torch.device | str | None = None,
    progress: bool = False,
) -> dict[str, float]:
    """A trained classification run's test metrics
    (:meth:`~idml.classification.ClassifierOutputs.metrics` with its evaluation settings), from its
    ``which`` checkpoint (:func:`load_classification_run`)."""
    loaded = load_classification_run(path, which)
    settings = evaluation_settings(loaded.config)
    test = build_classification_data(loaded.config).test
    return loaded.outputs(test, device, progress).metrics(settings.ks, settings.ece_bins)


def run_task(path: Path, which: str = "best") -> str:
    """The ``task`` a run folder (or checkpoint folder) was trained for, from its ``config.yaml``
    or else its checkpoint's state."""
    written = Path(path) / "config.yaml"
    if written.is_file():
        raw = yaml.safe_load(written.read_text()) or {}
        return str(raw.get("task", "metric_learning")) if isinstance(raw, dict) else ""
    ckpt = resolve_checkpoint(Path(path), which if which != "best" else "latest")
    return str(read_state(ckpt).get("config", {}).get("task", "metric_learning"))
