"""The DML transform recipe: output sizes, value range, and the geometry of each step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from idml.data import build_transforms, eval_resize_size, paper_transforms, to_float_transform


def horizontal_ramp(height: int, width: int) -> torch.Tensor:
    """uint8 image whose value increases strictly from left to right, same in all channels."""
    row = torch.linspace(0, 255, width).round().to(torch.uint8)
    return row.expand(3, height, width).clone()


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize(
    ("size", "shape"), [(32, (3, 8, 8)), (32, (3, 50, 70)), (224, (3, 300, 400))]
)
def test_output_size_dtype_and_range(train: bool, size: int, shape: tuple[int, int, int]) -> None:
    torch.manual_seed(0)
    image = torch.randint(0, 256, shape, dtype=torch.uint8)
    out = build_transforms(train, image_size=size)(image)
    assert out.shape == (3, size, size) and out.dtype == torch.float32
    assert float(out.min()) >= 0.0 and float(out.max()) <= 1.0


def test_recipe_resize_sizes() -> None:
    assert eval_resize_size(224) == 256
    assert eval_resize_size(32) == 37
    names = [type(t).__name__ for t in paper_transforms(train=False).transforms]
    assert names == ["ToImage", "Resize", "CenterCrop", "ToDtype"]
    resize, crop = paper_transforms(train=False).transforms[1:3]
    assert resize.size == [256] and crop.size == (224, 224)
    train_names = [type(t).__name__ for t in paper_transforms(train=True).transforms]
    assert train_names == ["ToImage", "RandomResizedCrop", "RandomHorizontalFlip", "ToDtype"]


def test_test_pipeline_resizes_shorter_side_then_centre_crops() -> None:
    # 40×80 ramp → Resize(40) keeps it (shorter side already 40) → CenterCrop(20) keeps columns 30..49.
    image = horizontal_ramp(40, 80)
    out = build_transforms(False, image_size=20, resize_size=40)(image)
    expected = image[:, 10:30, 30:50].float() / 255
    # Resize and crop leave the uint8 pixels as they are; ToDtype multiplies by fl(1/255) where this
    # divides by 255: ≤ 1 ulp apart, inside allclose's rtol 1e-5.
    assert torch.allclose(out, expected)
    # Constant colour survives any resize exactly: the uint8 filter's fixed-point weights sum to one
    # (a level off would be 1/255 ≈ 0.004 ≫ 1e-5); 51·fl(1/255) vs fl(0.2) is ≤ 1 ulp.
    flat = torch.full((3, 33, 47), 51, dtype=torch.uint8)
    assert torch.allclose(
        build_transforms(False, image_size=16)(flat), torch.full((3, 16, 16), 0.2)
    )


def test_train_pipeline_flips_and_crops() -> None:
    image = horizontal_ramp(30, 30)
    always_flip = build_transforms(
        True, image_size=30, crop_scale=(1.0, 1.0), crop_ratio=(1.0, 1.0), flip_probability=1.0
    )
    out = always_flip(image)
    # Full crop + flip = mirror image: the same uint8 pixels, ·fl(1/255) vs /255 (≤ 1 ulp).
    assert torch.allclose(out, image.flip(-1).float() / 255)
    never_flip = build_transforms(True, image_size=10, crop_scale=(0.2, 0.5), flip_probability=0.0)
    crops = [never_flip(image) for _ in range(8)]
    for crop in crops:
        assert bool((crop[0, :, 1:] >= crop[0, :, :-1]).all())  # ramp direction kept
    assert any(not torch.equal(crops[0], c) for c in crops[1:])  # crops are random


def test_paper_text_variant_resizes_square_then_crops() -> None:
    image = horizontal_ramp(20, 40)  # 20×40 → Resize((40, 40)) → RandomCrop(32)
    pipeline = build_transforms(
        True, image_size=32, resize_size=40, train_crop="resize_random", flip_probability=0.0
    )
    names = [type(t).__name__ for t in pipeline.transforms]
    assert names == ["ToImage", "Resize", "RandomCrop", "RandomHorizontalFlip", "ToDtype"]
    resized = torch.nn.functional.interpolate(
        image[None].float(), size=(40, 40), mode="bilinear", antialias=True
    )[0]
    out = pipeline(image) * 255
    # The crop is one of the 9×9 windows of the resized image. Not float rounding: torchvision
    # resizes the uint8 image with its own fixed-point weights and rounds to integer levels (±0.5),
    # against float interpolation here: ≤ 1 of 255 levels.
    windows = [resized[:, y : y + 32, x : x + 32] for y in range(9) for x in range(9)]
    assert min(float((out - w).abs().max()) for w in windows) <= 1.0
    with pytest.raises(ValueError, match="train_crop must be"):
        build_transforms(True, train_crop="center")  # type: ignore[arg-type]


def test_accepts_pil_and_arrays() -> None:
    pil = Image.new("RGB", (40, 30), (255, 0, 0))
    out = build_transforms(False, image_size=24)(pil)
    # A constant 255 stays 255 through the uint8 resize; 255·fl(1/255) is 1 within 1 ulp.
    assert out.shape == (3, 24, 24) and torch.allclose(out[0], torch.ones(24, 24))
    array = np.zeros((5, 6, 3), dtype=np.uint8)
    assert to_float_transform()(array).shape == (3, 5, 6)


def test_bad_parameters() -> None:
    with pytest.raises(ValueError, match=r"resize_size \(20\) must be >= image_size \(32\)"):
        build_transforms(False, image_size=32, resize_size=20)
    with pytest.raises(ValueError, match="crop_scale"):
        build_transforms(True, crop_scale=(0.5, 1.5))
    with pytest.raises(ValueError, match="flip_probability"):
        build_transforms(True, flip_probability=2.0)
    with pytest.raises(ValueError, match="image_size must be a positive"):
        build_transforms(True, image_size=0)
