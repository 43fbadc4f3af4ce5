"""Degradations of :mod:`idml.augment` (the IDML paper's Table 3 alternatives to Mixup): a fraction
of the batch is degraded in place, labels unchanged."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from idml.augment.batch import (
    AugmentedBatch,
    BatchAugmentation,
    _check_fraction,
    _count,
    _rand,
    _randperm,
)
from idml.relations import LabelSets


@dataclass(frozen=True)
class Degradation(BatchAugmentation, ABC):
    """Degrade a random ``round(fraction·B)`` rows of a batch in place of the originals; labels kept.

    The degraded rows are clamped to ``[0, 1]``; the others are returned bit-for-bit unchanged.
    """

    fraction: float = 0.5

    def __post_init__(self) -> None:
        _check_fraction(f"{type(self).__name__}.fraction", self.fraction)

    @abstractmethod
    def degrade(self, images: Tensor, generator: torch.Generator | None) -> Tensor:
        """Degrade every image of ``images`` (the selected rows)."""

    def augment(
        self, images: Tensor, labels: LabelSets, generator: torch.Generator | None
    ) -> AugmentedBatch:
        """Pick the rows, degrade them, report them in ``degraded``."""
        batch = images.shape[0]
        rows = _randperm(batch, generator, images.device)[: _count(self.fraction, batch)]
        out = images.clone()
        if rows.numel():
            out[rows] = self.degrade(images[rows], generator).clamp(0, 1).to(images.dtype)
        degraded = torch.zeros(batch, dtype=torch.bool, device=images.device)
        degraded[rows] = True
        return AugmentedBatch(out, labels, torch.zeros_like(degraded), degraded)


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
