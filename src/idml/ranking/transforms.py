"""Graded transforms ``T_n`` of SSR: views of an image whose distortion grows with the level ``n``.

Fu et al. 2021 ("Deep Metric Learning with Self-Supervised Ranking", AAAI) simulate intra-class
variation with a transform whose strength is indexed by ``n`` (eq. 5–6: ``i < j ⇒
d(x, T_i(x)) < d(x, T_j(x))``), composed of a random crop resized back to the input size (eq. 7,
scale), a perspective distortion (eq. 8, viewpoint) and a colour jitter of brightness, contrast and
saturation (eq. 9, colour), cascaded as ``T_n = T^crop_n ∘ T^pt_n ∘ T^color_n`` (eq. 10), with
``T_0(x) = x``. The paper gives no magnitudes; our configurable defaults at level ``n`` with
strength ``t_n = n``:

* crop: kept area ``a_n = 1 − 0.15·t_n`` (the aspect ratio of the input is kept, so the crop's side is
  ``√a_n`` of the image's), at a uniformly random position, resized back to ``H × W``;
* perspective: each corner of the (cropped) image moves inward by ``U(0, p_n)·(W/2, H/2)`` with
  ``p_n = 0.1·t_n`` (the ``distortion_scale`` convention of torchvision's ``RandomPerspective``);
  the area it uncovers is filled with ``fill``;
* colour: brightness, contrast and saturation factors ``1 ± j_n`` with ``j_n = 0.1·t_n`` and an
  independent random sign each, applied in that order (torchvision's ``adjust_*`` definitions:
  brightness scales, contrast blends with the mean grey level, saturation with the grey image).

Everything happens on float images in ``[0, 1]`` *before* the model's normalisation, batched: the colour
jitter is a handful of broadcast tensor ops, and crop + perspective are fused into one homography per
view, sampled with a single :func:`torch.nn.functional.grid_sample` call for all ``M·N`` views (one
interpolation, so the crop does not blur the image twice).

Example:
    >>> import torch
    >>> transforms = GradedTransforms(GradedTransformConfig(num_levels=3))
    >>> images = torch.rand(2, 3, 16, 16)
    >>> views = transforms(images, generator=torch.Generator().manual_seed(0))
    >>> tuple(views.shape), torch.equal(views[:, 0], images)
    ((2, 4, 3, 16, 16), True)
    >>> GradedTransformConfig().levels().crop_area
    (0.85, 0.7, 0.55, 0.4)
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise
from typing import Annotated, Any, Literal, NamedTuple

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor, nn

from idml.images import check_images
from idml.ranking.warps import CORNERS, color_jitter, corner_homographies, warp_grid

Interpolation = Literal["bilinear", "nearest", "bicubic"]

MAX_CORNER_DISPLACEMENT = 0.5
"""Largest corner displacement (fraction of the half-size): keeps the warped quadrilateral convex."""


_PER_LEVEL_FIELDS = (
    "level_strengths",
    "crop_areas",
    "perspective_scales",
    "brightness_magnitudes",
    "contrast_magnitudes",
    "saturation_magnitudes",
)


class GradedLevels(NamedTuple):
    """Resolved magnitudes of levels ``n = 1..N`` (index ``n − 1``); level 0 is the identity."""

    crop_area: tuple[float, ...]
    """Kept area ``a_n`` of the crop, as a fraction of the image, in ``(0, 1]``."""
    perspective: tuple[float, ...]
    """Largest inward corner displacement ``p_n`` as a fraction of the half-size, in ``[0, 0.5]``."""
    brightness: tuple[float, ...]
    """Brightness factor magnitude ``j_n``: the factor is ``1 ± j_n``."""
    contrast: tuple[float, ...]
    """Contrast factor magnitude: the factor is ``1 ± j_n``."""
    saturation: tuple[float, ...]
    """Saturation factor magnitude: the factor is ``1 ± j_n``."""


FiniteNumber = Annotated[float, Field(strict=True, allow_inf_nan=False)]
"""A finite int or float (``true`` is not a number here)."""
StrictPositiveInt = Annotated[int, Field(strict=True, ge=1)]
"""An integer >= 1 (``true`` and ``20.0`` are not integers here)."""
PerLevel = tuple[FiniteNumber, ...] | None
"""One value per level ``n = 1..N`` (a YAML list becomes a tuple, so the config stays hashable)."""


def _step(default: float, magnitude: str) -> Any:
    """The field of a component's step: how much ``magnitude`` grows per unit of strength (``>= 0``;
    0 removes the component)."""
    return Field(default, ge=0, description=f"{magnitude} per unit of strength")


def _per_level(values: str) -> Any:
    """The field of explicit per-level ``values`` that replace their formula (``None``: the formula)."""
    return Field(None, description=f"explicit {values}")


class GradedTransformConfig(BaseModel):
    """Magnitudes and schedule of the graded transforms (Fu et al. 2021, eq. 5–10).

    Level ``n`` has strength ``t_n = strength · n`` (or ``strength · level_strengths[n − 1]``) and the
    magnitudes ``a_n = 1 − crop_area_step·t_n``, ``p_n = perspective_step·t_n`` and
    ``j_n = {brightness,contrast,saturation}_step·t_n``. An explicit per-level tuple (``crop_areas``,
    ``perspective_scales``, ``*_magnitudes``; ``N`` values for ``n = 1..N``) replaces the formula of
    its component and is not scaled by ``strength``. A step of 0 removes a component (the paper's
    Fig. 7 ablation). Every component must be monotone in ``n`` and every level strictly stronger
    than the previous one in at least one component, with ``T_0`` the identity.

    A frozen pydantic model: unknown keys are errors, bounds are field constraints, and the checks
    that involve several fields (per-level lengths, monotone levels) run after them.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_levels: StrictPositiveInt = Field(
        4, description="N, the number of transformed views per image (T_1..T_N)"
    )
    strength: FiniteNumber = Field(
        1.0, gt=0, description="multiplier of every step (a global strength schedule knob)"
    )
    level_strengths: PerLevel = _per_level(
        "t_1..t_N (strictly increasing, positive) instead of 1..N"
    )
    crop_area_step: FiniteNumber = _step(0.15, "kept-area decrease")
    perspective_step: FiniteNumber = _step(0.1, "corner-displacement increase")
    brightness_step: FiniteNumber = _step(0.1, "brightness factor magnitude")
    contrast_step: FiniteNumber = _step(0.1, "contrast factor magnitude")
    saturation_step: FiniteNumber = _step(0.1, "saturation factor magnitude")
    crop_areas: PerLevel = _per_level("kept areas a_1..a_N (non-increasing, in (0, 1])")
    perspective_scales: PerLevel = _per_level("p_1..p_N (non-decreasing, in [0, 0.5])")
    brightness_magnitudes: PerLevel = _per_level(
        "brightness magnitudes (non-decreasing, in [0, 1))"
    )
    contrast_magnitudes: PerLevel = _per_level("contrast magnitudes (non-decreasing, in [0, 1))")
    saturation_magnitudes: PerLevel = _per_level(
        "saturation magnitudes (non-decreasing, in [0, 1))"
    )
    nested_crops: bool = Field(
        False, description="all crops of an image share one centre: crop n contains crop n + 1"
    )
    shared_draws: bool = Field(
        False,
        description="one perspective draw and one set of jitter signs per image, scaled by each "
        "level's magnitude, so each image's views lie on one path of growing distortion "
        "(independent draws per level otherwise, as with separate torchvision transforms)",
    )
    fill: FiniteNumber = Field(
        0.0, ge=0, le=1, description="value of the pixels the perspective distortion uncovers"
    )
    interpolation: Interpolation = Field(
        "bilinear", description="resampling of crop and perspective (grid_sample mode)"
    )

    @model_validator(mode="after")
    def _consistent_levels(self) -> GradedTransformConfig:
        for name in _PER_LEVEL_FIELDS:
            value = getattr(self, name)
            if value is not None and len(value) != self.num_levels:
                raise ValueError(
                    f"{name} must have one value per level n = 1..{self.num_levels} "
                    f"(num_levels={self.num_levels}), got {len(value)}"
                )
        if self.level_strengths is not None:
            ts = self.level_strengths
            if ts[0] <= 0 or any(b <= a for a, b in pairwise(ts)):
                raise ValueError(
                    f"level_strengths must be positive and strictly increasing, got {list(ts)}"
                )
        self._check_levels(self.levels())
        return self

    def level_strength(self, n: int) -> float:
        """``t_n`` for ``n = 1..N`` (``t_0 = 0``)."""
        if n == 0:
            return 0.0
        base = float(n) if self.level_strengths is None else self.level_strengths[n - 1]
        return self.strength * base

    def levels(self) -> GradedLevels:
        """The magnitudes of levels ``1..N`` after applying steps, strength and explicit lists."""
        ts = [self.level_strength(n) for n in range(1, self.num_levels + 1)]

        def resolve(
            explicit: tuple[float, ...] | None, step: float, area: bool = False
        ) -> tuple[float, ...]:
            if explicit is not None:
                return explicit
            # Rounded so that e.g. 3 × 0.1 reads 0.3, not 0.30000000000000004.
            return tuple(round((1.0 - step * t) if area else step * t, 12) for t in ts)

        return GradedLevels(
            crop_area=resolve(self.crop_areas, self.crop_area_step, area=True),
            perspective=resolve(self.perspective_scales, self.perspective_step),
            brightness=resolve(self.brightness_magnitudes, self.brightness_step),
            contrast=resolve(self.contrast_magnitudes, self.contrast_step),
            saturation=resolve(self.saturation_magnitudes, self.saturation_step),
        )

    def _check_levels(self, levels: GradedLevels) -> None:
        hint = "lower `strength` or the step, or pass explicit per-level values"

        def check(component: str, source: str, valid: str, ok: Callable[[float], bool]) -> None:
            for n, v in enumerate(getattr(levels, component), start=1):
                if not ok(v):
                    raise ValueError(
                        f"{source}: level {n} gives {component} {v:.4g}, which must be {valid}; {hint}"
                    )

        check("crop_area", "crop_areas / crop_area_step", "in (0, 1]", lambda v: 0.0 < v <= 1.0)
        check(
            "perspective",
            "perspective_scales / perspective_step",
            f"in [0, {MAX_CORNER_DISPLACEMENT}] (larger displacements can fold the image)",
            lambda v: 0.0 <= v <= MAX_CORNER_DISPLACEMENT,
        )
        for colour in ("brightness", "contrast", "saturation"):
            # A factor 1 − j must stay positive, or the view loses the image entirely.
            check(
                colour,
                f"{colour}_magnitudes / {colour}_step",
                "in [0, 1)",
                lambda v: 0.0 <= v < 1.0,
            )
        # Strength must grow with n: each component monotone, and each level stronger somewhere.
        identity = GradedLevels((1.0,), (0.0,), (0.0,), (0.0,), (0.0,))
        full = GradedLevels(*(first + rest for first, rest in zip(identity, levels)))
        for n in range(1, self.num_levels + 1):
            weaker = full.crop_area[n] > full.crop_area[n - 1] or any(
                getattr(full, c)[n] < getattr(full, c)[n - 1]
                for c in ("perspective", "brightness", "contrast", "saturation")
            )
            if weaker:
                raise ValueError(
                    f"level {n} is weaker than level {n - 1} in some component ({_describe(full, n)} vs "
                    f"{_describe(full, n - 1)}); kept crop areas must not grow and the other "
                    "magnitudes must not shrink with n"
                )
            if all(getattr(full, c)[n] == getattr(full, c)[n - 1] for c in full._fields):
                raise ValueError(
                    f"level {n} is no stronger than level {n - 1} ({_describe(full, n)}); the "
                    "transform strength must increase strictly with n — make some step non-zero"
                )


class GradedViewParams(NamedTuple):
    """The random draws of one call, for ``M`` images and levels ``1..N`` (normalised coordinates).

    Normalised coordinates are ``grid_sample``'s (``align_corners=False``): ``x, y ∈ [−1, 1]`` span the
    image from its left/top edge to its right/bottom edge.
    """

    crop_centres: Tensor
    """``(M, N, 2)`` centre ``(x, y)`` of each crop."""
    crop_half_sizes: Tensor
    """``(M, N, 2)`` half-extent ``(x, y)`` of each crop (1 = the whole image)."""
    corner_offsets: Tensor
    """``(M, N, 4, 2)`` displacement of the corners (TL, TR, BR, BL) of the cropped image in the view."""
    jitter_factors: Tensor
    """``(M, N, 3)`` brightness, contrast and saturation factors."""


class GradedTransforms(nn.Module):
    """Produce the views ``T_0(x), …, T_N(x)`` of a batch (Fu et al. 2021, eq. 5–10).

    ``forward(images (M, C, H, W) in [0, 1]) → (M, N + 1, C, H, W)`` with ``[:, 0]`` the input itself
    (``T_0`` is the identity exactly) and ``[:, n]`` the view at level ``n``. ``C`` is 1 or 3 (grey
    images have no saturation to jitter). Randomness comes from ``generator`` (CPU or the images'
    device); :meth:`sample_params` and :meth:`apply_params` split drawing from applying (``apply`` would
    shadow :meth:`torch.nn.Module.apply`), for replay and tests.
    """

    def __init__(self, config: GradedTransformConfig | None = None) -> None:
        super().__init__()
        self.config = config if config is not None else GradedTransformConfig()
        self.levels = self.config.levels()

    @property
    def num_levels(self) -> int:
        """``N``: views ``T_1..T_N`` besides the original."""
        return self.config.num_levels

    def extra_repr(self) -> str:
        return f"num_levels={self.num_levels}, levels={self.levels}"

    def forward(self, images: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Views ``(M, N + 1, C, H, W)`` of ``images`` ``(M, C, H, W)``, ``[:, 0]`` = ``images``."""
        check_ranking_images(images)
        return self._render(images, self.sample_params(images.shape[0], generator))

    def sample_params(
        self, num_images: int, generator: torch.Generator | None = None
    ) -> GradedViewParams:
        """Draw crops, perspective corners and jitter signs for ``num_images`` images (float64).

        Non-nested crops are uniform over the positions where they fit; nested crops share a centre
        uniform over the positions where the largest one fits, so every smaller crop fits too.
        """
        if num_images < 1:
            raise ValueError(f"num_images must be >= 1, got {num_images}")
        m, n, cfg, lv = num_images, self.num_levels, self.config, self.levels
        device = generator.device if generator is not None else torch.device("cpu")
        f64: dict[str, Any] = {"dtype": torch.float64, "device": device}

        def uniform(*shape: int) -> Tensor:
            return torch.rand(*shape, generator=generator, **f64)

        # The crop keeps the aspect ratio, so its side is √a_n of the image's: that is also its
        # half-extent in normalised coordinates, where the image spans [−1, 1].
        half = torch.tensor(lv.crop_area, **f64).sqrt()
        half_sizes = half.view(1, n, 1).expand(m, n, 2)
        if cfg.nested_crops:
            slack = 1.0 - half.max()
            centres = ((2.0 * uniform(m, 1, 2) - 1.0) * slack).expand(m, n, 2)
        else:
            centres = (2.0 * uniform(m, n, 2) - 1.0) * (1.0 - half).view(1, n, 1)

        draws = n if not cfg.shared_draws else 1
        inward = -torch.tensor(CORNERS, **f64)  # each corner moves toward the centre
        scales = torch.tensor(lv.perspective, **f64).view(1, n, 1, 1)
        offsets = uniform(m, draws, 4, 2).expand(m, n, 4, 2) * scales * inward

        signs = torch.where(uniform(m, draws, 3) < 0.5, -1.0, 1.0).expand(m, n, 3)
        magnitudes = torch.tensor(list(zip(lv.brightness, lv.contrast, lv.saturation)), **f64)
        factors = 1.0 + signs * magnitudes.view(1, n, 3)
        return GradedViewParams(
            centres.contiguous(),
            half_sizes.contiguous(),
            offsets.contiguous(),
            factors.contiguous(),
        )

    def apply_params(self, images: Tensor, params: GradedViewParams) -> Tensor:
        """Apply given draws: colour jitter, then crop and perspective fused in one resampling.

        Jittering first keeps the filled border at exactly ``fill``; the order hardly matters otherwise
        (the jitter is pointwise except contrast's mean grey level, taken over the whole image).
        """
        check_ranking_images(images)
        m, n = images.shape[0], self.num_levels
        expected = {
            "crop_centres": (m, n, 2),
            "crop_half_sizes": (m, n, 2),
            "corner_offsets": (m, n, 4, 2),
            "jitter_factors": (m, n, 3),
        }
        for name, shape in expected.items():
            got = tuple(getattr(params, name).shape)
            if got != shape:
                raise ValueError(f"params.{name} must have shape {shape} for {m} images, got {got}")
        return self._render(images, params)

    def _render(self, images: Tensor, params: GradedViewParams) -> Tensor:
        m, c, h, w = images.shape
        n = self.num_levels

        factors = params.jitter_factors.to(images.device, images.dtype)
        views = images.unsqueeze(1).expand(m, n, c, h, w)
        if bool((params.jitter_factors != 1.0).any()):
            views = color_jitter(views, factors)
        needs_warp = bool(
            (params.crop_half_sizes != 1.0).any() or (params.corner_offsets != 0.0).any()
        )
        if needs_warp:
            homographies = corner_homographies(params.corner_offsets.reshape(m * n, 4, 2))
            grid, inside = warp_grid(
                homographies,
                params.crop_centres.reshape(m * n, 2),
                params.crop_half_sizes.reshape(m * n, 2),
                height=h,
                width=w,
                device=images.device,
            )
            # Border padding: a crop touching the image edge samples up to half a pixel outside it.
            warped = F.grid_sample(
                views.reshape(m * n, c, h, w),
                grid.to(images.dtype),
                mode=self.config.interpolation,
                padding_mode="border",
                align_corners=False,
            )
            if self.config.interpolation == "bicubic":
                warped.clamp_(0.0, 1.0)  # cubic kernels overshoot
            # fill + inside · (warped − fill): the uncovered area fades to the fill value.
            inside = inside.to(images.dtype).unsqueeze(1)
            views = (
                warped.sub_(self.config.fill)
                .mul_(inside)
                .add_(self.config.fill)
                .view(m, n, c, h, w)
            )
        out = torch.empty((m, n + 1, c, h, w), dtype=images.dtype, device=images.device)
        out[:, 0] = images
        out[:, 1:] = views
        return out


def check_ranking_images(images: Tensor) -> None:
    """:func:`idml.images.check_images`, and what the graded transforms need besides: at least one
    image, and 1 or 3 channels (the colour jitter's grey level)."""
    check_images(images)
    if images.shape[0] < 1:
        raise ValueError("images must hold at least one image to rank, got an empty batch")
    if images.shape[1] not in (1, 3):
        raise ValueError(
            f"images must have 1 or 3 channels for the colour jitter, got {images.shape[1]}"
        )


def _describe(levels: GradedLevels, n: int) -> str:
    return ", ".join(f"{c}={getattr(levels, c)[n]:.3g}" for c in levels._fields)
