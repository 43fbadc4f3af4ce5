"""IDML for image classification: the introspective similarity inside the softmax classifier.

The softmax loss is a proxy-based metric loss whose proxies are the rows ``w_c`` of the linear
classifier (IDML, Wang et al., TPAMI version: "can be naturally adopted to the image classification
task by involving the proposed introspective similarity in the corresponding softmax loss"). With
L2-normalised semantic embeddings ``ŝ_i`` and weights ``ŵ_c`` and a scale ``s``, the logits are::

    z_ic = s · S(x_i, w_c)        S = cosine C (baseline) or S_IN (ISM, IDML eq. 5–7)

with the image's uncertainty ``β_ic = ||u_i||`` (class weights carry none). With ``γ = 0`` and
``u = 0``, ``S_IN = C`` bit for bit, so the ISM classifier is exactly the normalised-softmax
(cosine) classifier (Zhai & Wu 2019). An uncertain image is "close to every class": its logits
flatten, which is what a mixed image should look like.

Mixed images (Mixup, Zhang et al. 2018; CutMix, Yun et al. 2019) carry the *set* label
``{l_a, l_b}`` — positive to both classes — weighted as those methods do: the target is
``t = λ·e_{l_a} + (1 − λ)·e_{l_b}`` and the loss ``−Σ_c t_c log softmax(z)_c``
(``= λ·CE(z, l_a) + (1 − λ)·CE(z, l_b)``). By default a mixed batch *replaces* the clean one with
probability ``probability`` (the CutMix paper's recipe); ``keep_originals`` appends it instead, as
IDML does for metric learning.

Example:
    >>> import torch
    >>> from idml.metrics import CosineSimilarity, IntrospectiveMetric
    >>> emb = Embeddings(torch.randn(4, 8), torch.zeros(4, 8))
    >>> plain = IntrospectiveClassifier(3, 8, CosineSimilarity(), scale=16.0)
    >>> ism = IntrospectiveClassifier(3, 8, IntrospectiveMetric(CosineSimilarity()), scale=16.0)
    >>> _ = ism.load_state_dict(plain.state_dict())
    >>> torch.equal(ism.logits(emb), plain.logits(Embeddings(emb.semantic)))
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import Dataset

from idml.augment import (
    AugmentationPipeline,
    AugmentedBatch,
    BatchAugmentation,
    CutMix,
    LowResolution,
    Mixup,
)
from idml.augment.batch import _rand
from idml.embeddings import Embeddings
from idml.evaluation.classification import classification_metrics
from idml.losses.base import check_positive
from idml.losses.softmax import NormalizedSoftmaxLoss
from idml.metrics import Metric
from idml.models import EmbeddingModel, embed_dataset
from idml.relations import LabelSets


class IntrospectiveClassifier(NormalizedSoftmaxLoss):
    """Cosine classifier ``z_ic = s·S(x_i, w_c)`` whose weights are the proxies of the normalised
    softmax loss (module docstring); ``S`` is ISM's ``S_IN`` when ``metric`` is an
    :class:`~idml.metrics.IntrospectiveMetric`.

    Args:
        num_classes: ``C``.
        embedding_dim: size ``d`` of the semantic embedding.
        metric: :class:`~idml.metrics.CosineSimilarity` (default) or ISM around it.
        scale: ``s = 1/T > 0`` [16].
        proxy_uncertainty_dim: learnable uncertainty per class weight (default: none, ``β = ||u_i||``).

    ``forward(embeddings, labels)`` is the normalised-softmax loss on (set) labels; training with
    λ-weighted targets uses :meth:`soft_loss`. The weights are :attr:`proxies` ``(C, d)``.
    """

    def __init__(
        self,
        num_classes: int,
        embedding_dim: int,
        metric: Metric | None = None,
        scale: float = 16.0,
        proxy_uncertainty_dim: int | None = None,
    ) -> None:
        check_positive("scale", scale)
        super().__init__(
            num_classes,
            embedding_dim,
            metric,
            temperature=1.0 / float(scale),
            proxy_uncertainty_dim=proxy_uncertainty_dim,
        )
        if not self.metric.is_similarity:
            raise ValueError(
                "IntrospectiveClassifier needs a similarity metric (cosine, or ISM around it)"
            )
        self.scale = float(scale)

    def soft_loss(self, embeddings: Embeddings, targets: Tensor) -> Tensor:
        """Mean ``−Σ_c t_ic log softmax(z_i)_c`` against ``(B, C)`` target distributions."""
        if targets.shape != (len(embeddings), self.num_classes):
            raise ValueError(
                f"targets must have shape ({len(embeddings)}, {self.num_classes}), got "
                f"{tuple(targets.shape)}"
            )
        logits = self.logits(embeddings)
        loss = -(targets.to(logits.dtype) * torch.log_softmax(logits, dim=1)).sum(dim=1).mean()
        if not bool(torch.isfinite(loss)):
            raise FloatingPointError(
                f"classifier produced a non-finite loss ({loss.item()}); lower the learning rate "
                "or check the inputs"
            )
        return loss


def mixed_targets(batch: AugmentedBatch, num_classes: int) -> Tensor:
    """``(N, C)`` λ-weighted targets of a batch: one-hot for clean rows, ``λ·e_a + (1 − λ)·e_b``
    for its mixed rows (row ``k`` of ``batch.mixup`` describes the ``k``-th mixed row).

    >>> from idml.augment import MixupInfo, MixupMode
    >>> info = MixupInfo(torch.tensor([0.25]), torch.tensor([0]), torch.tensor([1]),
    ...                  torch.tensor([0]), torch.tensor([2]), MixupMode.SET)
    >>> batch = AugmentedBatch(torch.zeros(2, 1, 2, 2), LabelSets(torch.tensor([[1, -1], [0, 2]])),
    ...                        torch.tensor([False, True]), torch.tensor([False, False]), info)
    >>> mixed_targets(batch, 3).tolist()
    [[0.0, 1.0, 0.0], [0.25, 0.0, 0.75]]
    """
    targets = F.one_hot(batch.labels.primary, num_classes).float()
    rows = batch.mixed.nonzero().flatten()
    if rows.numel() == 0:
        return targets
    info = batch.mixup
    if info is None or info.lam.shape[0] != rows.numel():
        raise ValueError(
            f"the batch has {rows.numel()} mixed rows but its Mixup details describe "
            f"{0 if info is None else info.lam.shape[0]}"
        )
    lam = info.lam.to(targets.dtype)[:, None]
    pair = lam * F.one_hot(info.labels_a, num_classes).float()
    pair = pair + (1 - lam) * F.one_hot(info.labels_b, num_classes).float()
    targets[rows] = pair
    return targets


@dataclass(frozen=True)
class BatchMixing(BatchAugmentation):
    """Mix a whole batch with probability ``probability`` (Mixup or CutMix, set labels).

    One uniform draw per batch decides (the CutMix paper's ``cutmix_prob``). The mixer runs with
    ``fraction = 1`` (every image gets a partner); without ``keep_originals`` the mixed images
    replace the clean ones (the Mixup/CutMix recipe, same batch size), with it they are appended.
    """

    mixer: Mixup | CutMix
    probability: float = 1.0
    keep_originals: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError(f"probability must lie in [0, 1], got {self.probability}")

    def augment(
        self, images: Tensor, labels: LabelSets, generator: torch.Generator | None
    ) -> AugmentedBatch:
        draw = float(_rand((1,), generator, torch.device("cpu")))
        if draw >= self.probability:
            return AugmentedBatch.unchanged(images, labels)
        out = self.mixer.augment(images, labels, generator)  # the batch is checked already
        if self.keep_originals:
            return out
        keep = out.mixed
        return AugmentedBatch(
            out.images[keep], out.labels[keep], out.mixed[keep], out.degraded[keep], out.mixup
        )


@dataclass(frozen=True)
class ClassificationAugmentation(BatchAugmentation):
    """Degradations (labels unchanged) on the clean images, then :class:`BatchMixing`.

    Mixed rows built from degraded sources count as mixed (their ``degraded`` flag is dropped).
    """

    degradations: AugmentationPipeline = field(default_factory=AugmentationPipeline)
    mixing: BatchMixing | None = None

    def augment(
        self, images: Tensor, labels: LabelSets, generator: torch.Generator | None
    ) -> AugmentedBatch:
        batch = self.degradations.augment(images, labels, generator)  # checked already
        if self.mixing is None:
            return batch
        mixed = self.mixing.augment(batch.images, batch.labels, generator)
        if mixed.mixup is None:
            return batch
        clean = ~mixed.mixed
        degraded = torch.zeros_like(mixed.mixed)
        degraded[clean] = batch.degraded[: int(clean.sum())]
        return AugmentedBatch(mixed.images, mixed.labels, mixed.mixed, degraded, mixed.mixup)


@dataclass
class ClassifierOutputs:
    """One pass of a classifier over a test set (CPU tensors, in dataset order)."""

    logits: Tensor
    """``(N, C)`` float32 logits ``z_i`` of the clean images."""
    labels: Tensor
    """``(N,)`` true classes."""
    uncertainty: Tensor | None
    """``(N,)`` ``||u_i||`` of the clean images (``None`` without an uncertainty head)."""
    probe_levels: dict[str, Tensor] = field(default_factory=dict)
    """``||u||`` of the probes' altered images by probe (``mixup``, ``cutmix``, ``lowres``); empty
    without an uncertainty head or with the probes off."""

    def metrics(self, ks: Sequence[int] = (1, 5), ece_bins: int = 15) -> dict[str, float]:
        """``top{k}``, ``ece``, ``nll`` and, with probes, the mean ``||u||`` per condition
        (``u_clean``, ``u_mixup``, ``u_cutmix``, ``u_lowres``)."""
        metrics = classification_metrics(self.logits, self.labels, ks, ece_bins)
        if self.probe_levels and self.uncertainty is not None:
            metrics["u_clean"] = float(self.uncertainty.double().mean())
        for name, levels in self.probe_levels.items():
            metrics[f"u_{name}"] = float(levels.double().mean())
        return metrics


@dataclass(frozen=True)
class ClassifierEvaluationSettings:
    """What a classifier's evaluation measures: the probes of :func:`classify_dataset` and the
    metrics of :meth:`ClassifierOutputs.metrics` (a run's ``classification.{ks, ece_bins,
    uncertainty_probes}`` and its ``seed``)."""

    ks: Sequence[int] = (1, 5)
    """The top-k accuracies reported (``top1``, ``top5``)."""
    ece_bins: int = 15
    """Equal-width confidence bins of the ECE."""
    uncertainty_probes: bool = True
    """With an uncertainty head, also the mean ``||u||`` of Mixup, CutMix and low-resolution (×4)
    versions of the test images (see :func:`classify_dataset`)."""
    seed: int = 0
    """Seeds the probes' partners and ``λ``, which then repeat for the same batch size."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "ks", tuple(self.ks))  # immutable, compared by value


@torch.no_grad()
def classify_dataset(
    model: EmbeddingModel,
    classifier: IntrospectiveClassifier,
    dataset: Dataset,
    batch_size: int,
    device: torch.device,
    *,
    introspective: bool,
    settings: ClassifierEvaluationSettings | None = None,
    progress: bool = False,
) -> ClassifierOutputs:
    """Logits and ``||u||`` of every test image, and ``||u||`` of Mixup, CutMix and
    low-resolution (×4) versions of them (with ``settings.uncertainty_probes`` and an uncertainty
    head); ``settings`` defaults to ``ClassifierEvaluationSettings()``.

    ``introspective`` feeds ``u`` to the classifier's metric (a run trained with ISM). The probes
    draw partners and ``λ ~ U(0, 1)`` from a generator seeded with ``settings.seed``, batch by
    batch, so they repeat for the same ``batch_size``. The test metrics the settings ask for are
    ``classify_dataset(...).metrics(settings.ks, settings.ece_bins)``
    (:meth:`ClassifierOutputs.metrics`).
    """
    s = settings if settings is not None else ClassifierEvaluationSettings()
    generator = torch.Generator().manual_seed(s.seed)
    probes = {"mixup": Mixup(), "cutmix": CutMix(), "lowres": LowResolution(fraction=1.0)}
    logits, clean = [], []
    levels: dict[str, list[Tensor]] = {k: [] for k in probes}

    def classify(images: Tensor, batch_labels: Tensor, out: Embeddings) -> None:
        semantic = out.semantic.float()
        unc = None if out.uncertainty is None else out.uncertainty.float()
        logits.append(classifier.logits(Embeddings(semantic, unc if introspective else None)).cpu())
        if unc is None:
            return
        clean.append(model.uncertainty_level(Embeddings(semantic, unc)).cpu())
        if not s.uncertainty_probes:
            return
        for name, probe in probes.items():
            probed = probe(images, batch_labels, generator)
            altered = probed.images[probed.altered]
            emb = model(altered)
            levels[name].append(model.uncertainty_level(emb.to(torch.float32)).cpu())

    was_training = classifier.training
    classifier.eval()
    try:
        _, labels = embed_dataset(
            model, dataset, batch_size, device, progress=progress, on_batch=classify
        )
    finally:
        classifier.train(was_training)
    return ClassifierOutputs(
        torch.cat(logits),
        labels,
        torch.cat(clean) if clean else None,
        {name: torch.cat(parts) for name, parts in levels.items() if parts},
    )
