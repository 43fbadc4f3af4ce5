"""The image operations of :class:`~idml.ranking.transforms.GradedTransforms`: colour jitter and
the perspective warp (corner homographies and their sampling grid), Fu et al. 2021 eq. 8–9."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

CORNERS = ((-1.0, -1.0), (1.0, -1.0), (1.0, 1.0), (-1.0, 1.0))
"""Image corners in ``grid_sample``'s normalised coordinates: top-left, top-right, bottom-right, bottom-left."""

_LUMA = (0.2989, 0.587, 0.114)
"""ITU-R 601-2 luma weights of R, G, B (the grey level torchvision's colour ops use)."""


def color_jitter(images: Tensor, factors: Tensor) -> Tensor:
    """Brightness, contrast then saturation adjustment with per-image factors (Fu et al. 2021, eq. 9).

    With grey level ``g(x) = 0.2989 R + 0.587 G + 0.114 B`` (``x`` itself for one channel) and
    ``clip`` to ``[0, 1]``::

        x₁ = clip(b · x)
        x₂ = clip(c · x₁ + (1 − c) · mean(g(x₁)))
        x₃ = clip(s · x₂ + (1 − s) · g(x₂))

    Args:
        images: ``(..., C, H, W)`` in ``[0, 1]``, ``C`` 1 or 3.
        factors: ``(..., 3)`` factors ``(b, c, s)`` broadcastable against the leading dimensions.
    """
    b, c, s = (factors[..., k, None, None, None] for k in range(3))
    out = (images * b).clamp_(0.0, 1.0)
    # mean(g(x)) = Σ_c w_c · mean(x_c): reduce first, no full grey image needed.
    mean = _grey(out.mean(dim=(-2, -1), keepdim=True))
    out = torch.lerp(mean, out, c).clamp_(0.0, 1.0)  # c·x + (1 − c)·mean
    return torch.lerp(_grey(out), out, s).clamp_(0.0, 1.0)


def _grey(images: Tensor) -> Tensor:
    if images.shape[-3] == 1:
        return images
    r, g, b = images.unbind(dim=-3)
    return (_LUMA[0] * r + _LUMA[1] * g + _LUMA[2] * b).unsqueeze(-3)


def corner_homographies(corner_offsets: Tensor) -> Tensor:
    """Homographies mapping view coordinates back to the undistorted frame (Fu et al. 2021, eq. 8).

    The perspective distortion moves corner ``c_k`` of the frame to ``e_k = c_k + δ_k``. Resampling
    needs the inverse map ``H`` with ``H(e_k) = c_k``: writing ``H = [[h1 h2 h3] [h4 h5 h6] [h7 h8 1]]``,
    each correspondence ``(x, y) → (u, v)`` gives two linear equations
    ``h1 x + h2 y + h3 − h7 x u − h8 y u = u`` and ``h4 x + h5 y + h6 − h7 x v − h8 y v = v``; the
    four corners give an 8×8 system, solved for all views at once in float64.

    Args:
        corner_offsets: ``(B, 4, 2)`` displacements ``δ_k`` of TL, TR, BR, BL in normalised coordinates.

    Returns:
        ``(B, 3, 3)`` float64 homographies (identity for zero offsets).
    """
    offsets = corner_offsets.to(torch.float64)
    corners = torch.tensor(CORNERS, dtype=torch.float64, device=offsets.device).expand_as(offsets)
    ends = corners + offsets
    x, y = ends[..., 0], ends[..., 1]
    u, v = corners[..., 0], corners[..., 1]
    one, zero = torch.ones_like(x), torch.zeros_like(x)
    rows_u = torch.stack([x, y, one, zero, zero, zero, -x * u, -y * u], dim=-1)
    rows_v = torch.stack([zero, zero, zero, x, y, one, -x * v, -y * v], dim=-1)
    system = torch.stack([rows_u, rows_v], dim=2).reshape(-1, 8, 8)
    targets = torch.stack([u, v], dim=2).reshape(-1, 8)
    solution = torch.linalg.solve(system, targets)
    return torch.cat([solution, torch.ones_like(solution[:, :1])], dim=1).view(-1, 3, 3)


def warp_grid(
    homographies: Tensor,
    crop_centres: Tensor,
    crop_half_sizes: Tensor,
    *,
    height: int,
    width: int,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor]:
    """Sampling grid of crop-then-perspective, and how much of each output pixel lies in the frame.

    An output pixel at normalised ``p`` comes from ``q = H(p)`` in the cropped-and-resized frame
    (:func:`corner_homographies`), which is the source point ``centre + half · q`` of the image
    (Fu et al. 2021, eq. 7–8 composed). Pixels with ``q`` outside ``[−1, 1]²`` are uncovered by the
    distortion; ``inside`` fades them out across the edge over one output pixel, as bilinear sampling
    with zero padding would (so with ``fill = 0`` the result equals torchvision's ``perspective``), and
    the caller blends in the fill value. Points beyond the homography's vanishing line count as outside.

    Returns:
        ``grid (B, H, W, 2)`` and ``inside (B, H, W)`` in ``[0, 1]``, float32 on ``device``.
    """
    dev = torch.device(device) if device is not None else homographies.device
    f32: dict[str, Any] = {"dtype": torch.float32, "device": dev}
    # Pixel centres; kept separable, (1, 1, W) and (1, H, 1), so that every affine combination
    # a·x + b·y + c costs a single full-size addition.
    xs = ((2.0 * torch.arange(width, **f32) + 1.0) / width - 1.0).view(1, 1, width)
    ys = ((2.0 * torch.arange(height, **f32) + 1.0) / height - 1.0).view(1, height, 1)
    h = homographies.to(**f32).view(-1, 3, 3, 1, 1).unbind(dim=1)
    depth = h[2][:, 0] * xs + (h[2][:, 1] * ys + h[2][:, 2])
    behind = depth <= 1e-6  # beyond the vanishing line: no point of the frame lands here
    depth.clamp_(min=1e-6)
    centres = crop_centres.to(**f32).view(-1, 2, 1, 1)
    halves = crop_half_sizes.to(**f32).view(-1, 2, 1, 1)
    grid = torch.empty((*depth.shape, 2), **f32)
    inside = torch.ones_like(depth)
    for axis, extent in ((0, width), (1, height)):
        frame = (h[axis][:, 0] * xs + (h[axis][:, 1] * ys + h[axis][:, 2])).div_(depth)
        frame.clamp_(-4.0, 4.0)  # far outside but finite
        # Fade from 1 to 0 across the frame's edge, between half a pixel inside and half a pixel
        # outside it: what bilinear sampling with zero padding does at an image border.
        fade = frame.abs().mul_(-extent / 2.0).add_(0.5 + extent / 2.0).clamp_(0.0, 1.0)
        inside.mul_(fade)
        torch.addcmul(centres[:, axis], halves[:, axis], frame, out=grid[..., axis])
    inside.masked_fill_(behind, 0.0)
    return grid, inside
