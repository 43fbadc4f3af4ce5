"""Image transforms: the DML paper recipe as torchvision v2 pipelines producing float ``[0, 1]``.

The default recipe (the DML convention of Kim et al. 2020, ProxyAnchor, which the IDML code builds
on): train ``RandomResizedCrop(224)`` + horizontal flip; test ``Resize(256)`` + ``CenterCrop(224)``.
The IDML and SSR papers' text (Wang et al. 2022, "Implementation details"; Fu et al. 2021,
"Implementation Details") describe the train crop as "resize to 256×256, then random crop 224"; that
variant is ``train_crop="resize_random"``. Sizes are parameters so that small data (digits at 32 px)
uses the same recipe scaled down; the resize defaults to the recipe's ratio ``256/224`` of the crop.

No normalisation happens here: the model normalises for its backbone inside ``forward``, so pixel
augmentations (Mixup, blur, SSR's graded transforms) work on ``[0, 1]`` images. Geometric steps
run on ``uint8`` (cheaper) and the conversion to float comes last.

Example:
    >>> import torch
    >>> image = torch.randint(0, 256, (3, 40, 60), dtype=torch.uint8)
    >>> out = build_transforms(train=False, image_size=32)(image)
    >>> tuple(out.shape), out.dtype, bool(out.min() >= 0 and out.max() <= 1)
    ((3, 32, 32), torch.float32, True)
    >>> eval_resize_size(224)
    256
"""

from __future__ import annotations

from typing import Literal

import torch
from torchvision.transforms import v2
from torchvision.transforms.v2 import InterpolationMode

PAPER_IMAGE_SIZE = 224
PAPER_RESIZE_SIZE = 256

TrainCrop = Literal["random_resized", "resize_random"]
"""``random_resized``: RandomResizedCrop (the default); ``resize_random``: square resize + RandomCrop."""


def eval_resize_size(image_size: int) -> int:
    """The recipe's test resize for a crop of ``image_size``: ``round(image_size · 256/224)``."""
    return round(image_size * PAPER_RESIZE_SIZE / PAPER_IMAGE_SIZE)


def to_float_transform() -> v2.Compose:
    """No geometry: PIL, array or ``uint8`` tensor in, float ``C×H×W`` in ``[0, 1]`` out."""
    return v2.Compose([v2.ToImage(), v2.ToDtype(torch.float32, scale=True)])


def build_transforms(
    train: bool,
    image_size: int = PAPER_IMAGE_SIZE,
    resize_size: int | None = None,
    *,
    train_crop: TrainCrop = "random_resized",
    crop_scale: tuple[float, float] = (0.08, 1.0),
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3),
    flip_probability: float = 0.5,
    interpolation: InterpolationMode = InterpolationMode.BILINEAR,
) -> v2.Compose:
    """The DML recipe's train or test pipeline, ending in float ``[0, 1]`` images.

    - ``train=True``: ``RandomResizedCrop(image_size, crop_scale, crop_ratio)`` — or, with
      ``train_crop="resize_random"``, ``Resize((resize_size, resize_size))`` then
      ``RandomCrop(image_size)`` — then a horizontal flip with probability ``flip_probability``;
    - ``train=False``: ``Resize(resize_size)`` of the shorter side then ``CenterCrop(image_size)``.

    ``resize_size`` defaults to :func:`eval_resize_size` and is unused by ``random_resized``.
    Input: PIL image, ``H×W×C`` array or ``C×H×W`` tensor.
    """
    if image_size < 1:
        raise ValueError(f"image_size must be a positive number of pixels, got {image_size}")
    if not 0.0 < crop_scale[0] <= crop_scale[1] <= 1.0:
        raise ValueError(f"crop_scale must satisfy 0 < low <= high <= 1, got {crop_scale}")
    if not 0.0 < crop_ratio[0] <= crop_ratio[1]:
        raise ValueError(f"crop_ratio must satisfy 0 < low <= high, got {crop_ratio}")
    if not 0.0 <= flip_probability <= 1.0:
        raise ValueError(f"flip_probability must be in [0, 1], got {flip_probability}")
    if train_crop not in ("random_resized", "resize_random"):
        raise ValueError(
            f"train_crop must be 'random_resized' or 'resize_random', got {train_crop!r}"
        )
    resize = eval_resize_size(image_size) if resize_size is None else resize_size
    if resize < image_size:
        raise ValueError(
            f"resize_size ({resize}) must be >= image_size ({image_size}) so the crop fits"
        )
    geometry: list[v2.Transform]
    if train and train_crop == "random_resized":
        geometry = [
            v2.RandomResizedCrop(
                image_size,
                scale=crop_scale,
                ratio=crop_ratio,
                interpolation=interpolation,
                antialias=True,
            ),
            v2.RandomHorizontalFlip(p=flip_probability),
        ]
    elif train:
        geometry = [
            v2.Resize((resize, resize), interpolation=interpolation, antialias=True),
            v2.RandomCrop(image_size),
            v2.RandomHorizontalFlip(p=flip_probability),
        ]
    else:
        geometry = [
            v2.Resize(resize, interpolation=interpolation, antialias=True),
            v2.CenterCrop(image_size),
        ]
    return v2.Compose([v2.ToImage(), *geometry, v2.ToDtype(torch.float32, scale=True)])


def paper_transforms(train: bool) -> v2.Compose:
    """The papers' exact recipe: 224-pixel crops, test resize 256."""
    return build_transforms(train, PAPER_IMAGE_SIZE, PAPER_RESIZE_SIZE)
