"""Uncertainty-generating augmentations on batches of ``[0, 1]`` images.

- :class:`Mixup` (Zhang et al. 2018, with IDML's *set labels*, Wang et al. 2022 §III-C): for a mixed
  image ``x_m = λ·x_a + (1 − λ)·x_b`` with ``λ ~ Beta(a, a)`` and the partner ``b`` given by a random
  permutation of the batch, the label is the set ``{l_a, l_b}``. Mixed images are *added* to the
  batch, so they serve as anchors, positives and negatives alike. The official code's alternative,
  loss interpolation ``L(orig) + λ·L(mixed, l_a) + (1 − λ)·L(mixed, l_b)``, is ``mode="interpolate"``
  (one ``λ`` shared by the batch, as that formula needs).
- The IDML paper's Table 3 alternatives, each applied to a fraction of the batch with labels
  unchanged: :class:`LowResolution` (down-scale by a factor, up-scale back), :class:`GaussianBlur`
  and :class:`Occlusion` (one random erased rectangle, Zhong et al. 2020).

Every augmentation takes a ``torch.Generator`` for reproducibility (draws happen on the generator's
device, then move to the images' device, so a CPU generator drives CUDA batches too) and returns an
:class:`AugmentedBatch` that says which rows were mixed or degraded (to log ``||u||`` of altered vs
original images). They compose with :func:`apply_augmentations`.

Example:
    >>> import torch
    >>> g = torch.Generator().manual_seed(0)
    >>> images, labels = torch.rand(4, 3, 8, 8), torch.tensor([0, 0, 1, 2])
    >>> batch = apply_augmentations(images, labels, [Mixup(fraction=0.5), GaussianBlur(fraction=0.5)], g)
    >>> batch.images.shape, int(batch.mixed.sum()), int(batch.degraded.sum())
    (torch.Size([6, 3, 8, 8]), 2, 3)
    >>> bool((batch.images >= 0).all() and (batch.images <= 1).all())
    True
"""

from __future__ import annotations

import enum
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from idml.embeddings import Embeddings
from idml.relations import LabelSets

RANGE_TOLERANCE = 1e-4
"""Slack on the ``[0, 1]`` check: ``λ·x + (1 − λ)·y`` may exceed 1 by a rounding error."""


def check_images(name: str, images: Tensor) -> None:
    """Raise a ``ValueError`` naming ``name`` unless ``images`` is a float ``(B, C, H, W)`` batch in ``[0, 1]``.

    NaN fails the range test too. Costs one min/max reduction.
    """
    if not isinstance(images, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(images).__name__}")
    if images.dim() != 4:
        raise ValueError(
            f"{name} must have shape (batch, channels, height, width), got {tuple(images.shape)}"
        )
    if not images.dtype.is_floating_point:
        raise ValueError(
            f"{name} must be floating point in [0, 1], got dtype {images.dtype}; convert with "
            "images.float() / 255"
        )
    if images.numel() == 0:
        return
    low, high = (float(v) for v in torch.aminmax(images.detach()))
    if not (low >= -RANGE_TOLERANCE and high <= 1 + RANGE_TOLERANCE):
        raise ValueError(
            f"{name} must be un-normalised floats in [0, 1], got values in [{low:.4g}, {high:.4g}]; "
            "remove Normalize from the transform (the model normalises internally) and check for NaN"
        )


# --------------------------------------------------------------------------- random draws
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


# --------------------------------------------------------------------------- results
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


# --------------------------------------------------------------------------- Mixup
@dataclass(frozen=True)
class Mixup:
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

    alpha: float = 1.0
    fraction: float = 1.0
    num_mixed: int | None = None
    mode: MixupMode = MixupMode.SET
    shared_lambda: bool | None = None

    def __post_init__(self) -> None:
        _check_mixing("Mixup", self.alpha, self.fraction, self.num_mixed)
        object.__setattr__(self, "mode", MixupMode(self.mode))
        if self.mode is MixupMode.INTERPOLATE and self.shared_lambda is False:
            raise ValueError(
                "mode='interpolate' weights whole-batch losses by λ, so it needs shared_lambda=True "
                "(or None)"
            )

    def __call__(
        self,
        images: Tensor,
        labels: Tensor | LabelSets,
        generator: torch.Generator | None = None,
    ) -> AugmentedBatch:
        """Append the mixed images; see the class docstring."""
        sets, index_a, index_b = _draw_pairs(
            "Mixup", images, labels, self.fraction, self.num_mixed, generator
        )
        count = index_a.shape[0]
        shared = (
            self.mode is MixupMode.INTERPOLATE if self.shared_lambda is None else self.shared_lambda
        )
        lam = sample_beta(self.alpha, 1 if shared else count, generator).expand(count)
        lam = lam.to(device=images.device, dtype=images.dtype)
        weight = lam.view(count, 1, 1, 1)
        mixed_images = weight * images[index_a] + (1 - weight) * images[index_b]
        return _append_mixed(images, sets, mixed_images, index_a, index_b, lam, self.mode)


def _check_mixing(name: str, alpha: float, fraction: float, num_mixed: int | None) -> None:
    if not (alpha > 0 and math.isfinite(alpha)):
        raise ValueError(f"alpha ({name} Beta parameter) must be a positive number, got {alpha}")
    _check_fraction("fraction (share of the batch to mix)", fraction)
    if num_mixed is not None and num_mixed < 0:
        raise ValueError(f"num_mixed must be >= 0, got {num_mixed}")


def _draw_pairs(
    name: str,
    images: Tensor,
    labels: Tensor | LabelSets,
    fraction: float,
    num_mixed: int | None,
    generator: torch.Generator | None,
) -> tuple[LabelSets, Tensor, Tensor]:
    """Validate a batch for mixing and draw ``M`` sorted distinct sources ``a`` and their partners
    ``b = π(a)`` (:class:`Mixup`, :class:`CutMix`)."""
    check_images("images", images)
    sets = _coerce_labels(labels, images)
    if not sets.is_single:
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
    return sets, index_a, index_b


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
@dataclass(frozen=True)
class Degradation(ABC):
    """Degrade a random ``round(fraction·B)`` rows of a batch in place of the originals; labels kept.

    The degraded rows are clamped to ``[0, 1]``; the others are returned bit-for-bit unchanged.
    """

    fraction: float = 0.5

    def __post_init__(self) -> None:
        _check_fraction(f"{type(self).__name__}.fraction", self.fraction)

    @abstractmethod
    def degrade(self, images: Tensor, generator: torch.Generator | None) -> Tensor:
        """Degrade every image of ``images`` (the selected rows)."""

    def __call__(
        self,
        images: Tensor,
        labels: Tensor | LabelSets,
        generator: torch.Generator | None = None,
    ) -> AugmentedBatch:
        """Pick the rows, degrade them, report them in ``degraded``."""
        check_images("images", images)
        sets = _coerce_labels(labels, images)
        batch = images.shape[0]
        rows = _randperm(batch, generator, images.device)[: _count(self.fraction, batch)]
        out = images.clone()
        if rows.numel():
            out[rows] = self.degrade(images[rows], generator).clamp(0, 1).to(images.dtype)
        degraded = torch.zeros(batch, dtype=torch.bool, device=images.device)
        degraded[rows] = True
        return AugmentedBatch(out, sets, torch.zeros_like(degraded), degraded)


@dataclass(frozen=True)
class LowResolution(Degradation):
    """Down-scale by ``factor`` (bilinear, anti-aliased) and up-scale back (bilinear); IDML Table 3.

    Both steps are convex combinations of pixels, so the range is kept.
    """

    factor: float = 4.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (self.factor > 1 and math.isfinite(self.factor)):
            raise ValueError(f"LowResolution.factor must be > 1, got {self.factor}")

    def degrade(self, images: Tensor, generator: torch.Generator | None) -> Tensor:
        height, width = images.shape[-2:]
        small = (max(1, round(height / self.factor)), max(1, round(width / self.factor)))
        low = F.interpolate(
            images, size=small, mode="bilinear", antialias=True, align_corners=False
        )
        return F.interpolate(low, size=(height, width), mode="bilinear", align_corners=False)


def _as_range(name: str, value: float | tuple[float, float]) -> tuple[float, float]:
    low, high = (value, value) if isinstance(value, int | float) else value
    if not (0 < low <= high and math.isfinite(high)):
        raise ValueError(f"{name} must be a positive number or a (low, high) range, got {value}")
    return float(low), float(high)


@dataclass(frozen=True)
class GaussianBlur(Degradation):
    """Separable Gaussian blur, ``G_σ(t) ∝ exp(−t² / 2σ²)`` truncated at ``3σ``; IDML Table 3.

    ``sigma`` (pixels) is a number or a ``(low, high)`` range drawn uniformly per image. Borders are
    replicated; the kernel is normalised, so the range is kept.
    """

    sigma: float | tuple[float, float] = 2.0

    def __post_init__(self) -> None:
        super().__post_init__()
        _as_range("GaussianBlur.sigma", self.sigma)

    def degrade(self, images: Tensor, generator: torch.Generator | None) -> Tensor:
        n, c, h, w = images.shape
        low, high = _as_range("GaussianBlur.sigma", self.sigma)
        sigma = low + (high - low) * _rand((n,), generator, images.device).to(images.dtype)
        radius = max(1, math.ceil(3 * high))
        offsets = torch.arange(-radius, radius + 1, device=images.device, dtype=images.dtype)
        kernel = torch.exp(-(offsets**2) / (2 * sigma[:, None] ** 2))
        kernel = (kernel / kernel.sum(dim=1, keepdim=True)).repeat_interleave(c, dim=0)
        # One depthwise group per (image, channel) applies each image's own σ in a single conv call.
        x = images.reshape(1, n * c, h, w)
        x = F.conv2d(
            F.pad(x, (radius, radius, 0, 0), mode="replicate"),
            kernel[:, None, None, :],
            groups=n * c,
        )
        x = F.conv2d(
            F.pad(x, (0, 0, radius, radius), mode="replicate"),
            kernel[:, None, :, None],
            groups=n * c,
        )
        return x.reshape(n, c, h, w)


@dataclass(frozen=True)
class Occlusion(Degradation):
    """Erase one random rectangle per image (Random Erasing, Zhong et al. 2020); IDML Table 3.

    The rectangle covers ``area`` of the image (a number or a ``(low, high)`` range) with aspect
    ratio ``h/w`` log-uniform in ``ratio``, clipped to the image, at a uniform position. It is filled
    with the constant ``fill`` or, with ``fill="noise"``, uniform noise.
    """

    area: float | tuple[float, float] = 0.25
    ratio: tuple[float, float] = (0.3, 3.3)
    fill: float | Literal["noise"] = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if _as_range("Occlusion.area", self.area)[1] > 1:
            raise ValueError(f"Occlusion.area must lie in (0, 1], got {self.area}")
        _as_range("Occlusion.ratio", self.ratio)
        if self.fill != "noise" and not (
            isinstance(self.fill, int | float) and 0 <= self.fill <= 1
        ):
            raise ValueError(
                f"Occlusion.fill must be a value in [0, 1] or 'noise', got {self.fill!r}"
            )

    def degrade(self, images: Tensor, generator: torch.Generator | None) -> Tensor:
        n, c, h, w = images.shape
        device = images.device
        area_low, area_high = _as_range("Occlusion.area", self.area)
        ratio_low, ratio_high = _as_range("Occlusion.ratio", self.ratio)
        u = _rand((n, 4), generator, device)
        area = (area_low + (area_high - area_low) * u[:, 0]) * (h * w)
        ratio = torch.exp(math.log(ratio_low) + (math.log(ratio_high / ratio_low)) * u[:, 1])
        patch_h = (area * ratio).sqrt().round().clamp(1, h)
        patch_w = (area / ratio).sqrt().round().clamp(1, w)
        top = (u[:, 2] * (h - patch_h + 1)).floor()
        left = (u[:, 3] * (w - patch_w + 1)).floor()
        rows = torch.arange(h, device=device)
        cols = torch.arange(w, device=device)
        in_rows = (rows >= top[:, None]) & (rows < (top + patch_h)[:, None])
        in_cols = (cols >= left[:, None]) & (cols < (left + patch_w)[:, None])
        inside = (in_rows[:, :, None] & in_cols[:, None, :])[:, None]
        if self.fill == "noise":
            fill = _rand((n, c, h, w), generator, device).to(images.dtype)
        else:
            fill = torch.full_like(images, float(self.fill))
        return torch.where(inside, fill, images)


# --------------------------------------------------------------------------- composition
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
    batch = AugmentedBatch.unchanged(images, labels)
    for augmentation in augmentations:
        out = augmentation(batch.images, batch.labels, generator)
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
class AugmentationPipeline:
    """A fixed sequence of augmentations, itself an :class:`UncertaintyAugmentation`."""

    augmentations: tuple[UncertaintyAugmentation, ...] = ()

    def __call__(
        self,
        images: Tensor,
        labels: Tensor | LabelSets,
        generator: torch.Generator | None = None,
    ) -> AugmentedBatch:
        """See :func:`apply_augmentations`."""
        return apply_augmentations(images, labels, self.augmentations, generator)


# --------------------------------------------------------------------------- CutMix
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
class CutMix:
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

    alpha: float = 1.0
    fraction: float = 1.0
    num_mixed: int | None = None

    def __post_init__(self) -> None:
        _check_mixing("CutMix", self.alpha, self.fraction, self.num_mixed)

    def __call__(
        self,
        images: Tensor,
        labels: Tensor | LabelSets,
        generator: torch.Generator | None = None,
    ) -> AugmentedBatch:
        """Append the CutMix images; see the class docstring."""
        sets, index_a, index_b = _draw_pairs(
            "CutMix", images, labels, self.fraction, self.num_mixed, generator
        )
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
        lam = lam.to(device=images.device, dtype=images.dtype)
        return _append_mixed(images, sets, mixed_images, index_a, index_b, lam, MixupMode.SET)
