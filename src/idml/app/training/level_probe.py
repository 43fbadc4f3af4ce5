"""Is the uncertainty a model reports at test the uncertainty it trained with?

Training logs the mean uncertainty level of the untouched images of each epoch's batches
(``uncertainty/original`` in ``metrics.jsonl``), computed with the model in training mode. What
``idml embed``, ISM at test and the calibrated confidence read is the level in eval mode, where every
BatchNorm (the backbone's, and the bounded head's standardisation of the level's input) uses its
running averages instead of the batch's statistics. The two can disagree by an order of magnitude:
with the default level (``model.uncertainty.level_input=standardized``) and Mixup, test-time
``||u||`` was 8.6–24.5 times the trained one on Omniglot (``benchmarks/RESULTS.md``, "The ``||u||``
a model reports at test is not the ``||u||`` it trained with").

:class:`EvalLevelProbe` measures the eval-mode level of a fixed set of training images (evenly spaced
over the training set, with the test transform, so every epoch sees the same images and nothing
draws from a random stream): the trainer logs it as ``uncertainty/eval_train`` after each
evaluation, and :func:`level_drift` says when it differs from the trained level by more than
:data:`DRIFT_FACTOR`. Training images rather than test images, so that the comparison measures the
mode and not the novelty of unseen classes (whose higher uncertainty is what the head should say).

Example:
    >>> level_drift(trained=0.05, at_eval=0.5)
    10.0
    >>> level_drift(trained=0.04, at_eval=0.05) is None
    True
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.data import Subset

from idml.app.config import Config
from idml.data.datasets import ImageDataset, TrainTestPair
from idml.models.encode import embed_dataset
from idml.models.model import EmbeddingModel

LOG_KEY = "eval_train"
"""The probe's entry in the ``uncertainty`` group of an epoch's log (``uncertainty/eval_train``)."""

DRIFT_FACTOR = 2.0
"""The eval-mode level counts as drifted when it is this many times the trained level (or that
fraction of it). Where the level is standardised alike in training and at test, the two agree
within a factor of 1.6 in ``benchmarks/RESULTS.md``'s runs (the running-statistics level, attached
or detached from the backbone, and the ISM-only runs: the backbone's own BatchNorm, other
transforms and a level that still moves within the epoch account for that much); the default
level's drift under Mixup was 7.5–24.5-fold."""


class LevelDriftWarning(RuntimeWarning):
    """The eval-mode uncertainty level has drifted from the trained one (its own category, so that
    a caller that reports the drift itself, as ``idml demo`` does, can filter it)."""


def drift_ratio(epoch_log: dict[str, float]) -> float | None:
    """``uncertainty/eval_train / uncertainty/original`` of one epoch's log line, when it has both
    (an evaluated epoch of a run with an uncertainty head and untouched training images).

    >>> drift_ratio({"uncertainty/original": 0.04, "uncertainty/eval_train": 0.1})
    2.5
    >>> drift_ratio({"uncertainty/original": 0.04}) is None
    True
    """
    trained = epoch_log.get("uncertainty/original")
    at_eval = epoch_log.get(f"uncertainty/{LOG_KEY}")
    if trained is None or at_eval is None or trained <= 0:
        return None
    return at_eval / trained


class EvalLevelProbe:
    """The eval-mode uncertainty level of ``count`` images of ``dataset`` (all of them when it
    holds fewer), evenly spaced in dataset order; :meth:`training_images` is the trainer's.

    Args:
        dataset: yields ``(image, label, index)`` (the datasets of :mod:`idml.data`).
        count: how many images.
        batch_size: images per forward pass (``eval.batch_size``).
    """

    def __init__(self, dataset: ImageDataset, count: int, batch_size: int) -> None:
        n = min(count, len(dataset))
        index = torch.linspace(0, len(dataset) - 1, n).round().long().unique().tolist()
        self.images = Subset(dataset, index)
        self.batch_size = batch_size

    @classmethod
    def training_images(cls, data: TrainTestPair, count: int, batch_size: int) -> EvalLevelProbe:
        """The probe of a run: its training images seen through the test transform."""
        return cls(data.train.with_transform(data.test.transform), count, batch_size)

    def __len__(self) -> int:
        return len(self.images)

    @torch.no_grad()
    def levels(self, model: EmbeddingModel, device: torch.device) -> Tensor | None:
        """The level of each of the probe's images with ``model`` in eval mode (its mode is
        restored; no running statistic moves); ``None`` for a model without an uncertainty head."""
        embeddings, _ = embed_dataset(model, self.images, self.batch_size, device)
        if embeddings.uncertainty is None:
            return None
        return model.uncertainty_level(embeddings)

    def measure(self, model: EmbeddingModel, device: torch.device) -> float | None:
        """The mean of :meth:`levels` (what the trainer logs as ``uncertainty/eval_train``)."""
        levels = self.levels(model, device)
        return None if levels is None else float(levels.double().mean())


def level_drift(trained: float, at_eval: float) -> float | None:
    """How many times the eval-mode level is the trained one (or the trained one the eval-mode
    level, when that is smaller), when that exceeds :data:`DRIFT_FACTOR`; else ``None``.

    A level of 0 on one side only counts as infinite drift; 0 on both as none.
    """
    low, high = sorted((trained, at_eval))
    if high <= 0.0:
        return None
    factor = high / low if low > 0.0 else float("inf")
    return factor if factor > DRIFT_FACTOR else None


def drift_advice(cfg: Config, frozen_batchnorm: bool) -> str:
    """Where the drift comes from, for this run's config and whether the model keeps its backbone's
    BatchNorm frozen (``EmbeddingModel.freeze_bn``), and what makes the two levels one.

    >>> from idml.app.config import Config
    >>> cfg = Config.model_validate({"model": {"uncertainty": {"enabled": True}}})
    >>> print(drift_advice(cfg, frozen_batchnorm=True))  # doctest: +NORMALIZE_WHITESPACE
    The level's input is standardised by each batch's statistics in training and by their running
    averages at test (model.uncertainty.level_input=standardized); level_input=standardized_running
    standardises by the running averages in both
    """
    head = cfg.model.uncertainty
    if head.form == "bounded" and head.level_input == "standardized":
        return (
            "The level's input is standardised by each batch's statistics in training and by their "
            "running averages at test (model.uncertainty.level_input=standardized); "
            "level_input=standardized_running standardises by the running averages in both"
        )
    if not frozen_batchnorm:
        return (
            "The backbone's BatchNorm layers normalise by each batch's statistics in training and "
            "by their running averages at test; model.freeze_bn=true keeps them at the running "
            "averages in both"
        )
    return (
        "Neither the backbone's BatchNorm (frozen) nor the level reads a batch's statistics, so "
        "the difference comes from the images: the training transform and Mixup's images against "
        "the test transform, or a level still moving in the last epoch"
    )
