"""Pair mixing of :mod:`idml.augment`: :class:`Mixup` and :class:`CutMix` append mixed images
labelled with the set ``{l_a, l_b}`` of their two sources."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from idml.augment.batch import (
    AugmentedBatch,
    BatchAugmentation,
    MixupInfo,
    MixupMode,
    _check_fraction,
    _count,
    _rand,
    _randperm,
    sample_beta,
)
from idml.choices import EnumField
from idml.relations import LabelSets


@dataclass(frozen=True)
class _PairMixing(BatchAugmentation):
    """What :class:`Mixup` and :class:`CutMix` share: the settings of how many images to mix, the
    draw of the source pairs ``(a, b = π(a))`` and the batch with the mixed images appended.

    A subclass names itself in :attr:`name`, sets :attr:`mode` (or a field of that name) and
    makes the mixed images in :meth:`mix`.
    """

    name: ClassVar[str]
    mode: ClassVar[MixupMode] = MixupMode.SET

    alpha: float = 1.0
    fraction: float = 1.0
    num_mixed: int | None = None

    def __post_init__(self) -> None:
        _check_mixing(self.name, self.alpha, self.fraction, self.num_mixed)

    def mix(
        self, images: Tensor, index_a: Tensor, index_b: Tensor, generator: torch.Generator | None
    ) -> tuple[Tensor, Tensor]:
        """The images mixed from rows ``index_a`` and ``index_b``, and each one's weight ``λ`` of
        its ``a`` source (in the images' dtype and device)."""
        raise NotImplementedError

    def augment(
        self, images: Tensor, labels: LabelSets, generator: torch.Generator | None
    ) -> AugmentedBatch:
        """Append the mixed images; see the class docstring."""
        index_a, index_b = _draw_pairs(
            self.name, images, labels, self.fraction, self.num_mixed, generator
        )
        mixed_images, lam = self.mix(images, index_a, index_b, generator)
        return _append_mixed(images, labels, mixed_images, index_a, index_b, lam, self.mode)


@dataclass(frozen=True)
class Mixup(_PairMixing):
    """Mixup with set labels (Zhang et al. 2018; Wang et al. 2022 §III-C).

    Draws ``M`` distinct source rows ``a`` (kept in batch order), partners ``b = π(a)`` for a random
    permutation ``π`` of the batch, and ``λ ~ Beta(alpha, alpha)``; appends
    ``x_m = λ·x_a + (1 − λ)·x_b`` with label set ``{l_a, l_b}`` (a singleton when the classes agree,
    including ``a = b``).

    Args:
        alpha: Beta parameter ``a`` [1: ``λ`` uniform on [0, 1]].
        fraction: ``M = round(fraction·B)`` mixed images are added [1: as many as originals].
        num_mixed: an absolute ``M`` instead of ``fraction``; at most ``B``.
        mode: ``set`` (default) or ``interpolate`` (see :class:`MixupMode`).
        shared_lambda: one ``λ`` for the whole batch; ``None`` = only in ``interpolate`` mode,
            which requires it.
    """

    name: ClassVar[str] = "Mixup"
    # A field here where CutMix keeps the base's fixed ClassVar; the base only reads ``self.mode``.
    mode: EnumField[MixupMode] = EnumField(MixupMode.SET)  # type: ignore[misc]
    shared_lambda: bool | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mode is MixupMode.INTERPOLATE and self.shared_lambda is False:
            raise ValueError(
                "mode='interpolate' weights whole-batch losses by λ, so it needs shared_lambda=True "
                "(or None)"
            )

    def mix(
        self, images: Tensor, index_a: Tensor, index_b: Tensor, generator: torch.Generator | None
    ) -> tuple[Tensor, Tensor]:
        """``λ·x_a + (1 − λ)·x_b`` with ``λ ~ Beta(alpha, alpha)``, one draw per image or shared."""
        count = index_a.shape[0]
        shared = (
            self.mode is MixupMode.INTERPOLATE if self.shared_lambda is None else self.shared_lambda
        )
        lam = sample_beta(self.alpha, 1 if shared else count, generator).expand(count)
        lam = lam.to(device=images.device, dtype=images.dtype)
        weight = lam.view(count, 1, 1, 1)
        return weight * images[index_a] + (1 - weight) * images[index_b], lam


def _check_mixing(name: str, alpha: float, fraction: float, num_mixed: int | None) -> None:
    if not (alpha > 0 and math.isfinite(alpha)):
        raise ValueError(f"alpha ({name} Beta parameter) must be a positive number, got {alpha}")
    _check_fraction("fraction (share of the batch to mix)", fraction)
    if num_mixed is not None and num_mixed < 0:
        raise ValueError(f"num_mixed must be >= 0, got {num_mixed}")


def _draw_pairs(
    name: str,
    images: Tensor,
    labels: LabelSets,
    fraction: float,
    num_mixed: int | None,
    generator: torch.Generator | None,
) -> tuple[Tensor, Tensor]:
    """Check that a checked batch can be mixed (one label per image, at most one mixed image per
    source) and draw ``M`` sorted distinct sources ``a`` and their partners ``b = π(a)``
    (:class:`Mixup`, :class:`CutMix`)."""
    if not labels.is_single:
        raise ValueError(
            f"{name} needs one label per image, but labels already hold label sets; apply {name} "
            "once per batch"
        )
    batch = images.shape[0]
    count = num_mixed if num_mixed is not None else _count(fraction, batch)
    if count > batch:
        raise ValueError(
            f"num_mixed={count} exceeds the batch size {batch}; each image sources at most one "
            "mixed image"
        )
    index_a = _randperm(batch, generator, images.device)[:count].sort().values
    index_b = _randperm(batch, generator, images.device)[index_a]
    return index_a, index_b


def _append_mixed(
    images: Tensor,
    sets: LabelSets,
    mixed_images: Tensor,
    index_a: Tensor,
    index_b: Tensor,
    lam: Tensor,
    mode: MixupMode,
) -> AugmentedBatch:
    """The batch with ``mixed_images`` appended, labelled ``{l_a, l_b}`` and flagged as mixed."""
    batch, count = images.shape[0], mixed_images.shape[0]
    labels_a, labels_b = sets.primary[index_a], sets.primary[index_b]
    flags = torch.zeros(batch + count, dtype=torch.bool, device=images.device)
    flags[batch:] = True
    return AugmentedBatch(
        images=torch.cat([images, mixed_images]),
        labels=sets.cat(LabelSets.mixed(labels_a, labels_b)),
        mixed=flags,
        degraded=torch.zeros_like(flags),
        mixup=MixupInfo(lam.contiguous(), index_a, index_b, labels_a, labels_b, mode),
    )


# --------------------------------------------------------------------------- degradations


def cutmix_boxes(
    height: int, width: int, lam: Tensor, center_y: Tensor, center_x: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """CutMix rectangles and their exact mixing ratios (Yun et al. 2019, eq. 1–2 and their code).

    For each draw ``λ``, the cut has side ``⌊H·√(1 − λ)⌋ × ⌊W·√(1 − λ)⌋`` (area ``≈ (1 − λ)·HW``)
    centred on the integer pixel ``(center_y, center_x)``, with half-sides ``⌊side/2⌋`` on each
    side, clipped to the image. Clipping shrinks the cut, so the label weight is recomputed from
    the pixels actually kept: ``λ' = 1 − (y2 − y1)(x2 − x1)/(HW)``.

    Returns ``(y1, y2, x1, x2, λ')``: long tensors of half-open bounds and float64 ``λ'``.

    >>> y1, y2, x1, x2, lam = cutmix_boxes(10, 10, torch.tensor([0.75]), torch.tensor([5]), torch.tensor([5]))
    >>> [int(v) for v in (y1, y2, x1, x2)], float(lam)
    ([3, 7, 3, 7], 0.84)
    """
    ratio = (1.0 - lam.double()).clamp(0, 1).sqrt()
    half_h = (height * ratio).floor().long() // 2
    half_w = (width * ratio).floor().long() // 2
    center_y, center_x = center_y.long(), center_x.long()
    y1 = (center_y - half_h).clamp(0, height)
    y2 = (center_y + half_h).clamp(0, height)
    x1 = (center_x - half_w).clamp(0, width)
    x2 = (center_x + half_w).clamp(0, width)
    kept = 1.0 - ((y2 - y1) * (x2 - x1)).double() / (height * width)
    return y1, y2, x1, x2, kept


@dataclass(frozen=True)
class CutMix(_PairMixing):
    """CutMix with set labels (Yun et al. 2019), the patch-pasting counterpart of :class:`Mixup`.

    Draws ``M`` source rows ``a`` and partners ``b = π(a)`` as :class:`Mixup` does and, per mixed
    image, ``λ ~ Beta(alpha, alpha)`` and a uniform integer centre; pastes the rectangle of
    :func:`cutmix_boxes` from ``x_b`` into ``x_a``. The mixed image carries the label set
    ``{l_a, l_b}``, and :class:`MixupInfo` ``lam`` holds the exact share ``λ'`` of ``x_a``'s pixels
    (the weight CutMix gives ``l_a``). Mixed images are appended to the batch.

    Args:
        alpha: Beta parameter [1: the CutMix paper's ``λ ~ U(0, 1)``].
        fraction: ``M = round(fraction·B)`` mixed images are added [1].
        num_mixed: an absolute ``M`` instead of ``fraction``; at most ``B``.
    """

    name: ClassVar[str] = "CutMix"

    def mix(
        self, images: Tensor, index_a: Tensor, index_b: Tensor, generator: torch.Generator | None
    ) -> tuple[Tensor, Tensor]:
        """``x_a`` with the :func:`cutmix_boxes` rectangle of ``x_b`` pasted in, and ``λ'``."""
        count, (height, width) = index_a.shape[0], images.shape[-2:]
        drawn = sample_beta(self.alpha, count, generator)
        centre = _rand((count, 2), generator, torch.device("cpu")).double()
        y1, y2, x1, x2, lam = cutmix_boxes(
            height,
            width,
            drawn,
            (centre[:, 0] * height).floor().clamp_max(height - 1),
            (centre[:, 1] * width).floor().clamp_max(width - 1),
        )
        rows = torch.arange(height)
        cols = torch.arange(width)
        inside = ((rows >= y1[:, None]) & (rows < y2[:, None]))[:, :, None] & (
            (cols >= x1[:, None]) & (cols < x2[:, None])
        )[:, None, :]
        inside = inside[:, None].to(images.device)
        mixed_images = torch.where(inside, images[index_b], images[index_a])
        return mixed_images, lam.to(device=images.device, dtype=images.dtype)
