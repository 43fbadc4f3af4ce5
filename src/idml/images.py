"""The one check of an image batch that every stage taking pixels applies: the model's input
normalisation, the batch augmentations (Mixup, CutMix, degradations) and SSR's graded transforms.

Images travel through idml as float ``(B, C, H, W)`` batches of *un-normalised* pixels in ``[0, 1]``:
the model normalises inside ``forward`` (:mod:`idml.data.datasets`), so pixel augmentations act on
the images as they look. A batch normalised by a transform (values around ``[−2, 2.6]``), a ``uint8``
batch or one holding NaN is refused here with the fix, not trained on.

Example:
    >>> import torch
    >>> check_images(torch.rand(2, 3, 4, 4))
    >>> try:
    ...     check_images(torch.rand(2, 3, 4, 4) * 255, "query")
    ... except ValueError as err:
    ...     print(str(err)[:44])
    query must be un-normalised floats in [0, 1]
"""

from __future__ import annotations

import torch
from torch import Tensor

from idml.checks import value_checks_enabled

RANGE_TOLERANCE = 1e-4
"""Slack on the ``[0, 1]`` check: ``λ·x + (1 − λ)·y`` may exceed 1 by a rounding error."""


def check_images(images: Tensor, name: str = "images") -> None:
    """Raise naming ``name`` unless ``images`` is a float ``(B, C, H, W)`` batch in ``[0, 1]``.

    NaN fails the range test too. An empty batch passes (the caller decides whether it may be
    empty). Costs one min/max reduction (a host sync on a GPU), so a batch is checked once per step;
    skipped where :func:`idml.checks.value_checks` turned the value checks off.
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
    if images.numel() == 0 or not value_checks_enabled():
        return
    low, high = (float(v) for v in torch.aminmax(images.detach()))
    if not (low >= -RANGE_TOLERANCE and high <= 1 + RANGE_TOLERANCE):
        raise ValueError(
            f"{name} must be un-normalised floats in [0, 1], got values in [{low:.4g}, {high:.4g}]; "
            "remove Normalize from the transform (the model normalises internally) and check for NaN"
        )
