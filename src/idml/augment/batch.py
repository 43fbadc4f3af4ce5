"""The batch types of :mod:`idml.augment` and what every augmentation shares: the image check
(:func:`idml.images.check_images`), the seeded random draws, :class:`AugmentedBatch`, the checked
:class:`BatchAugmentation` and their composition."""

from __future__ import annotations

import enum
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor

from idml.embeddings import Embeddings
from idml.images import check_images
from idml.relations import LabelSets


def _generator_device(generator: torch.Generator | None) -> torch.device:
    return generator.device if generator is not None else torch.device("cpu")


def _randperm(n: int, generator: torch.Generator | None, device: torch.device) -> Tensor:
    return torch.randperm(n, generator=generator, device=_generator_device(generator)).to(device)


def _rand(
    shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device
) -> Tensor:
    return torch.rand(shape, generator=generator, device=_generator_device(generator)).to(device)


def sample_beta(alpha: float, n: int, generator: torch.Generator | None = None) -> Tensor:
    """``n`` draws of ``Beta(alpha, alpha)`` as a float64 CPU tensor, reproducible from ``generator``.

    torch's Beta sampler cannot take a generator, so a seed drawn from ``generator`` drives NumPy's.
    """
    if not (alpha > 0 and math.isfinite(alpha)):
        raise ValueError(f"alpha (Mixup Beta parameter) must be a positive number, got {alpha}")
    seed = torch.randint(
        0, 2**62, (1,), generator=generator, device=_generator_device(generator)
    ).item()
    return torch.from_numpy(np.random.default_rng(int(seed)).beta(alpha, alpha, size=n))


def _count(fraction: float, batch_size: int) -> int:
    """``round(fraction·B)``, halves rounded up (Python's ``round`` would round half to even)."""
    return math.floor(fraction * batch_size + 0.5)


def _check_fraction(name: str, fraction: float) -> None:
    if not (0.0 <= fraction <= 1.0):
        raise ValueError(f"{name} must lie in [0, 1], got {fraction}")


def _coerce_labels(labels: Tensor | LabelSets, images: Tensor) -> LabelSets:
    sets = LabelSets.coerce(labels).to(images.device)
    if len(sets) != images.shape[0]:
        raise ValueError(
            f"labels has {len(sets)} entries but images has {images.shape[0]}; pass one label per image"
        )
    return sets


class MixupMode(str, enum.Enum):
    """How mixed images enter the loss: extra rows with set labels (default), or interpolation."""

    SET = "set"
    """Set labels ``{l_a, l_b}`` in one batch with the originals (the paper; default)."""
    INTERPOLATE = "interpolate"
    """Official code: ``L(orig) + λ·L(mixed, l_a) + (1 − λ)·L(mixed, l_b)`` with one shared ``λ``."""

    @classmethod
    def _missing_(cls, value: object) -> MixupMode | None:
        raise ValueError(f"Mixup mode {value!r} is not known; choose 'set' or 'interpolate'")


@dataclass(frozen=True)
class MixupInfo:
    """What :class:`Mixup` did; row ``k`` describes the ``k``-th mixed row of the batch.

    ``x_mixed[k] = lam[k]·x[index_a[k]] + (1 − lam[k])·x[index_b[k]]`` where ``x`` is the batch that
    went in; ``labels_a``/``labels_b`` are the source labels (equal for a same-class pair).
    """

    lam: Tensor
    index_a: Tensor
    index_b: Tensor
    labels_a: Tensor
    labels_b: Tensor
    mode: MixupMode


LossFn = Callable[[Embeddings, LabelSets], Tensor]


@dataclass(frozen=True)
class AugmentedBatch:
    """Images and label sets after augmentation, with masks of the rows that were changed.

    Attributes:
        images: ``(N, C, H, W)`` in ``[0, 1]``; mixed images (if any) follow the originals.
        labels: ``(N, K)`` label sets (mixed rows carry ``{l_a, l_b}``).
        mixed: ``(N,)`` bool, rows that are Mixup images.
        degraded: ``(N,)`` bool, rows changed by a degradation (low resolution, blur, occlusion).
        mixup: details of the Mixup step, if one ran.
    """

    images: Tensor
    labels: LabelSets
    mixed: Tensor
    degraded: Tensor
    mixup: MixupInfo | None = field(default=None)

    @classmethod
    def unchanged(cls, images: Tensor, labels: Tensor | LabelSets) -> AugmentedBatch:
        """A batch no augmentation has touched."""
        none = torch.zeros(images.shape[0], dtype=torch.bool, device=images.device)
        return cls(images, _coerce_labels(labels, images), none, none.clone())

    @property
    def altered(self) -> Tensor:
        """``(N,)`` bool: mixed or degraded rows (the images expected to be more uncertain)."""
        return self.mixed | self.degraded

    @property
    def ambiguity(self) -> Tensor:
        """``(N,)`` how ambiguous each row's class is by construction: ``1 − |2λ − 1|`` for a row
        mixed from two *different* classes (1 for a 50/50 mix, → 0 as one source dominates; ``λ``
        the pixel share of CutMix), 0 for an original row and for a mix of two images of one class.

        The target of the Mixup-supervised uncertainty extension
        (:func:`idml.losses.ambiguity.mixup_uncertainty_loss`); the paper's IDML never uses it.
        """
        out = torch.zeros(self.mixed.shape[0], device=self.mixed.device)
        info = self.mixup
        if info is None or not bool(self.mixed.any()):
            return out
        lam = info.lam.to(out.device, out.dtype)
        two_classes = (info.labels_a != info.labels_b).to(out.device, out.dtype)
        out[self.mixed] = (1 - (2 * lam - 1).abs()) * two_classes
        return out

    @property
    def interpolate(self) -> MixupInfo | None:
        """The Mixup details when the loss must be interpolated, else ``None``."""
        if self.mixup is not None and self.mixup.mode is MixupMode.INTERPOLATE:
            return self.mixup
        return None

    def loss(self, loss_fn: LossFn, embeddings: Embeddings) -> Tensor:
        """The metric loss of this batch according to the Mixup mode.

        ``set`` (or no Mixup): ``L(all rows, label sets)``. ``interpolate``:
        ``L(originals) + λ·L(mixed, l_a) + (1 − λ)·L(mixed, l_b)`` (official IDML code).
        """
        info = self.interpolate
        if info is None or not bool(self.mixed.any()):
            return loss_fn(embeddings, self.labels)
        lam = float(info.lam[0])
        originals = loss_fn(embeddings[~self.mixed], self.labels[~self.mixed])
        mixed = embeddings[self.mixed]
        as_a = loss_fn(mixed, LabelSets.from_labels(info.labels_a))
        as_b = loss_fn(mixed, LabelSets.from_labels(info.labels_b))
        return originals + lam * as_a + (1 - lam) * as_b


@runtime_checkable
class UncertaintyAugmentation(Protocol):
    """A batch transform: ``(images, labels, generator) -> AugmentedBatch``."""

    def __call__(
        self,
        images: Tensor,
        labels: Tensor | LabelSets,
        generator: torch.Generator | None = None,
    ) -> AugmentedBatch: ...


class BatchAugmentation(ABC):
    """An augmentation that changes the batch itself (:class:`~idml.augment.Degradation`,
    :class:`~idml.augment.Mixup`, :class:`~idml.augment.CutMix`) or composes others
    (:class:`AugmentationPipeline`), after checking it: the images must pass :func:`check_images`
    and the labels give one label (set) per image.

    Subclasses implement :meth:`augment` on the checked batch.
    """

    def __call__(
        self,
        images: Tensor,
        labels: Tensor | LabelSets,
        generator: torch.Generator | None = None,
    ) -> AugmentedBatch:
        """Check the batch, then :meth:`augment` it."""
        check_images(images)
        return self.augment(images, _coerce_labels(labels, images), generator)

    @abstractmethod
    def augment(
        self, images: Tensor, labels: LabelSets, generator: torch.Generator | None
    ) -> AugmentedBatch:
        """The augmented batch of checked ``images`` and their label sets ``labels`` (on the images'
        device)."""


def apply_augmentations(
    images: Tensor,
    labels: Tensor | LabelSets,
    augmentations: Sequence[UncertaintyAugmentation],
    generator: torch.Generator | None = None,
) -> AugmentedBatch:
    """Apply ``augmentations`` in order, accumulating the ``mixed``/``degraded`` masks.

    At most one :class:`Mixup` may appear (its row indices refer to the batch it received, which
    later degradations keep in place). An empty sequence returns the batch unchanged.
    """
    return _apply_in_order(images, labels, augmentations, generator, checked=False)


def _apply_in_order(
    images: Tensor,
    labels: Tensor | LabelSets,
    augmentations: Sequence[UncertaintyAugmentation],
    generator: torch.Generator | None,
    checked: bool,
) -> AugmentedBatch:
    """:func:`apply_augmentations`; ``checked``: the batch already passed :func:`check_images`.

    The batch is checked once: what a :class:`BatchAugmentation` returns (convex mixes, blur,
    antialiased resizing, constant occlusion) stays in ``[0, 1]``, so the next one runs its
    :meth:`~BatchAugmentation.augment` directly; any other callable is trusted with the check.
    """
    batch = AugmentedBatch.unchanged(images, labels)
    for augmentation in augmentations:
        if checked and isinstance(augmentation, BatchAugmentation):
            out = augmentation.augment(batch.images, batch.labels, generator)
        else:
            out = augmentation(batch.images, batch.labels, generator)
        checked = isinstance(augmentation, BatchAugmentation)
        if out.mixup is not None and batch.mixup is not None:
            raise ValueError("augmentations: apply Mixup at most once per batch")
        added = out.images.shape[0] - batch.images.shape[0]
        pad = torch.zeros(added, dtype=torch.bool, device=batch.mixed.device)
        batch = AugmentedBatch(
            images=out.images,
            labels=out.labels,
            mixed=torch.cat([batch.mixed, pad]) | out.mixed,
            degraded=torch.cat([batch.degraded, pad]) | out.degraded,
            mixup=out.mixup if out.mixup is not None else batch.mixup,
        )
    return batch


@dataclass(frozen=True)
class AugmentationPipeline(BatchAugmentation):
    """A fixed sequence of augmentations, itself a (checked) :class:`UncertaintyAugmentation`."""

    augmentations: tuple[UncertaintyAugmentation, ...] = ()

    def augment(
        self, images: Tensor, labels: LabelSets, generator: torch.Generator | None
    ) -> AugmentedBatch:
        """See :func:`apply_augmentations` (the batch was checked by :meth:`__call__`)."""
        return _apply_in_order(images, labels, self.augmentations, generator, checked=True)
