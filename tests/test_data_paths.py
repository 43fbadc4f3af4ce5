"""The faster data paths give the reference's images: torchvision's JPEG decoder (the same bytes),
the batched crop and flip on the device (within one grey level of the per-image ``uint8`` pipeline,
1e-5 of its float computation), the ``uint8`` cache (the same bytes for images within its size,
and the same test crops at ``short_side = resize_size``); the loader that wires them draws its
crops from the run's seed, so a resumed run repeats them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader
from torchvision.transforms.v2 import functional as TF

from idml.app import build
from idml.app.cli import main
from idml.app.config import ConfigError, load_config
from idml.app.training import Trainer
from idml.data import FileImageDataset, ImageRecords, build_transforms
from idml.data.batches import (
    BatchCrops,
    DeviceBatches,
    UncroppedImages,
    collate_uncropped,
    decode_on,
)
from idml.data.cache import CacheError, CacheSettings, open_cache, stored_size, write_cache
from idml.data.datasets import TrainTestPair
from idml.data.decoding import (
    Channels,
    Decoder,
    decode_image_file,
    jpeg_components,
    jpeg_decodable,
)
from tiny_run import CLASSIFICATION, TINY

ONE_LEVEL = 1 / 255
"""The per-image pipeline resizes ``uint8`` in two separable passes, rounding after each: at most
0.5 from the first (carried unchanged at most through the second pass's convex weights) and 0.5
from the second."""
FLOAT32_RESAMPLING = 1e-5
"""Two float32 weighted sums of ≤ ~10 terms of values ≤ 1 each: relative ~1e-6, with margin."""


def _natural(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """A smooth colour field with sharp-edged shapes and grain: what a photograph's JPEG holds."""
    low = rng.uniform(0, 255, (height // 16 + 2, width // 16 + 2, 3)).astype(np.uint8)
    image = np.asarray(
        Image.fromarray(low).resize((width, height), Image.Resampling.BICUBIC)
    ).copy()
    for _ in range(4):
        y, x = rng.integers(0, height - 4), rng.integers(0, width - 4)
        image[y : y + rng.integers(3, height // 2), x : x + rng.integers(3, width // 2)] = (
            rng.integers(0, 255, 3)
        )
    noisy = image.astype(np.int16) + rng.normal(0, 6, image.shape).astype(np.int16)
    return np.clip(noisy, 0, 255).astype(np.uint8)


def _files(folder: Path) -> dict[str, Path]:
    """One file of every kind the decoders must agree on (and the ones that go to Pillow)."""
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    rgb = Image.fromarray(_natural(rng, 75, 100))
    files: dict[str, tuple[Image.Image, dict[str, Any]]] = {  # Image.save's keyword params
        "jpeg420": (rgb, {"quality": 90}),
        "jpeg444": (rgb, {"quality": 90, "subsampling": 0}),
        "progressive": (rgb, {"quality": 85, "progressive": True}),
        "grey": (rgb.convert("L"), {"quality": 90}),
        "odd": (Image.fromarray(_natural(rng, 37, 53)), {"quality": 70}),
        "cmyk": (rgb.convert("CMYK"), {"quality": 90}),
    }
    out = {}
    for name, (image, options) in files.items():
        out[name] = folder / f"{name}.jpg"
        image.save(out[name], **options)
    out["png"] = folder / "png.png"
    rgb.save(out["png"])
    return out


@pytest.mark.parametrize("channels", [3, 1])
def test_torchvision_decoder_gives_pillows_bytes(tmp_path: Path, channels: Channels) -> None:
    files = _files(tmp_path)
    for name, path in files.items():
        for box in (None, (5, 7, 60, 50), (-3, 10, 104, 80)):  # the last leaves the image
            reference = decode_image_file(str(path), channels, box, decoder="pil")
            fast = decode_image_file(str(path), channels, box, decoder="torchvision")
            assert torch.equal(fast, reference), (name, box)


def test_which_jpegs_torchvision_decodes(tmp_path: Path) -> None:
    files = _files(tmp_path)
    components = {name: jpeg_components(p.read_bytes()) for name, p in files.items()}
    assert components == {
        "jpeg420": 3,
        "jpeg444": 3,
        "progressive": 3,
        "grey": 1,
        "odd": 3,
        "cmyk": 4,
        "png": None,
    }
    assert jpeg_decodable(files["jpeg420"].read_bytes(), 3)
    assert not jpeg_decodable(files["jpeg420"].read_bytes(), 1)  # Pillow's luma is the reference
    assert jpeg_decodable(files["grey"].read_bytes(), 3)
    assert not jpeg_decodable(files["cmyk"].read_bytes(), 3)


# ----------------------------------------------------------------------------- batched crops
def _images(seed: int, sizes: list[tuple[int, int]]) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(_natural(rng, h, w)).permute(2, 0, 1).contiguous() for h, w in sizes]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batched_crops_are_the_per_image_crops(seed: int) -> None:
    images = _images(seed, [(75, 100), (120, 64), (50, 50), (33, 140), (90, 91)])
    crops = BatchCrops(24, scale=(0.16, 1.0))
    heights = torch.tensor([i.shape[1] for i in images])
    widths = torch.tensor([i.shape[2] for i in images])
    draws = crops.draw(heights, widths, torch.Generator().manual_seed(seed))
    out = crops.apply(images, draws)
    assert out.shape == (5, 3, 24, 24) and out.dtype == torch.float32
    for b, image in enumerate(images):
        top, left, h, w = draws.boxes[b].tolist()
        per_image = TF.resized_crop(image, top, left, h, w, [24, 24], antialias=True)
        in_float = F.interpolate(
            image[None, :, top : top + h, left : left + w].float(),
            size=(24, 24),
            mode="bilinear",
            antialias=True,
            align_corners=False,
        )[0]
        if draws.flips[b]:
            per_image, in_float = TF.horizontal_flip(per_image), in_float.flip(-1)
        torch.testing.assert_close(
            out[b], per_image.float() / 255, atol=ONE_LEVEL + FLOAT32_RESAMPLING, rtol=0
        )
        torch.testing.assert_close(out[b], in_float / 255, atol=FLOAT32_RESAMPLING, rtol=0)


def test_crop_draws_follow_torchvisions_rule() -> None:
    crops = BatchCrops(8, scale=(0.16, 1.0), ratio=(3 / 4, 4 / 3))
    n = 4000
    heights = torch.randint(20, 200, (n,), generator=torch.Generator().manual_seed(0))
    widths = torch.randint(20, 200, (n,), generator=torch.Generator().manual_seed(1))
    draws = crops.draw(heights, widths, torch.Generator().manual_seed(2))
    top, left, h, w = draws.boxes.T
    assert bool(((top >= 0) & (left >= 0) & (top + h <= heights) & (left + w <= widths)).all())
    assert bool(((h > 0) & (w > 0)).all())
    # Boxes from an attempt: area and aspect within the ranges, up to the rounding of the sides.
    area = (h * w).double() / (heights * widths).double()
    assert float(area.max()) <= 1.0
    ratio = w.double() / h.double()
    slack = 1.0 / h.double() + 1.0 / w.double()  # one pixel of rounding on either side
    inside = (ratio >= 3 / 4 - 2 * slack) & (ratio <= 4 / 3 + 2 * slack)
    central = (top == (heights - h) // 2) & (left == (widths - w) // 2)
    assert bool((inside | central).all())
    # About half flipped: 4000 fair coins stay within 6 standard deviations (±190) of 2000.
    assert abs(int(draws.flips.sum()) - n // 2) < 190
    # The same generator state gives the same draws (what exact resume rests on).
    again = crops.draw(heights, widths, torch.Generator().manual_seed(2))
    assert torch.equal(again.boxes, draws.boxes) and torch.equal(again.flips, draws.flips)


def test_crop_fallback_is_torchvisions_central_box() -> None:
    # A 1-pixel-high strip: no box of area ≥ 90 % with aspect in [3/4, 4/3] fits, so the
    # fallback is the central box of height 1 and width round(1 · 4/3) = 1 (torchvision's rule).
    crops = BatchCrops(4, scale=(0.9, 1.0))
    draws = crops.draw(torch.tensor([1, 100]), torch.tensor([100, 1]), torch.Generator())
    assert draws.boxes.tolist() == [[0, 49, 1, 1], [49, 0, 1, 1]]


# ----------------------------------------------------------------------------- the cache
def _dataset(tmp_path: Path, count: int = 6, size: tuple[int, int] = (60, 80)) -> FileImageDataset:
    rng = np.random.default_rng(5)
    paths = []
    for i in range(count):
        path = tmp_path / "images" / f"{i}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(_natural(rng, *size)).save(path, quality=90)
        paths.append(str(path))
    records = ImageRecords(paths=np.array(paths, dtype=object), class_ids=np.arange(count) % 3)
    return FileImageDataset(records)


def _write(dataset: FileImageDataset, folder: Path, short_side: int | None) -> Path:
    settings = CacheSettings(3, False, short_side)
    paths = [str(p) for p in dataset.paths]
    return write_cache(folder, paths, dataset.load_image, settings, workers=2)


def test_cache_holds_the_decoded_bytes_and_is_checked(tmp_path: Path) -> None:
    dataset = _dataset(tmp_path)
    cache = open_cache(_write(dataset, tmp_path / "cache", short_side=None))
    cached = dataset.reading(cache=cache)
    for i in range(len(dataset)):
        assert torch.equal(cached.load_image(i), dataset.load_image(i))
    # Train transforms draw the same crops from the same torch seed: the same tensors.
    train = build_transforms(True, 32)
    torch.manual_seed(0)
    reference = [train(dataset.load_image(i)) for i in range(len(dataset))]
    torch.manual_seed(0)
    assert all(torch.equal(train(cached.load_image(i)), r) for i, r in enumerate(reference))
    # A changed source file, a missing image, other loader settings, damaged pixels: refused.
    with open(dataset.paths[2], "ab") as fh:
        fh.write(b"\0")
    with pytest.raises(CacheError, match=r"1 source file\(s\) changed.*2\.jpg.*idml cache"):
        dataset.reading(cache=cache)
    with pytest.raises(CacheError, match="not in the cache"):
        cache.image(str(tmp_path / "other.jpg"))
    with pytest.raises(CacheError, match=r"channels=3.*channels=1"):
        cache.check_sources([], channels=1, crop_to_box=False)
    pixels = tmp_path / "cache" / "pixels.u8"
    data = bytearray(pixels.read_bytes())
    data[10] ^= 0xFF
    pixels.write_bytes(bytes(data))
    with pytest.raises(CacheError, match="checksum mismatch"):
        open_cache(tmp_path / "cache")


def test_resized_cache_gives_the_reference_test_crops(tmp_path: Path) -> None:
    # Stored at short side 48 = the test transform's resize: Resize(48) + CentreCrop(42) of the
    # cached image is the reference's, byte for byte (the same resize, done once ahead).
    dataset = _dataset(tmp_path, size=(60, 85))
    cache = open_cache(_write(dataset, tmp_path / "cache", short_side=48))
    test = build_transforms(False, 42, 48)
    for i in range(len(dataset)):
        stored = cache.image(str(dataset.paths[i]))
        assert tuple(stored.shape[1:]) == stored_size(60, 85, 48) == (48, 68)
        assert torch.equal(test(stored), test(dataset.load_image(i)))


# ----------------------------------------------------------------------------- the loader
def test_device_batches_decode_and_crop_the_loaders_images(tmp_path: Path) -> None:
    dataset = _dataset(tmp_path)
    loader = DataLoader(
        UncroppedImages(dataset, encoded=True), batch_size=4, collate_fn=collate_uncropped
    )
    crops = BatchCrops(16)
    batches = DeviceBatches(loader, crops, torch.Generator().manual_seed(3), torch.device("cpu"))
    images, labels, indices = next(iter(batches))
    payloads, encoded, boxes, _, _ = next(iter(loader))
    assert all(encoded)  # JPEG bytes travel, not pixels
    decoded = decode_on(payloads, encoded, boxes, 3, torch.device("cpu"))
    assert all(torch.equal(d, dataset.load_image(i)) for i, d in enumerate(decoded))
    expected = crops(decoded, torch.Generator().manual_seed(3))
    assert torch.equal(images, expected)
    assert labels.tolist() == dataset.labels[:4].tolist() and indices.tolist() == [0, 1, 2, 3]


def _folder_config(tmp_path: Path, *extra: str) -> list[str]:
    root = tmp_path / "folder"
    rng = np.random.default_rng(0)
    for c in range(6):
        for i in range(5):
            path = root / f"class{c}" / f"{i}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(_natural(rng, 20 + 3 * c, 24 + 2 * i)).save(path, quality=90)
    return [
        *TINY,
        "data.dataset=folder",
        f"data.root={root}",
        "data.image_size=12",
        "data.horizontal_flip=true",
        "data.samples_per_class=null",
        "sampler.classes_per_batch=3",
        "sampler.images_per_class=2",
        *extra,
    ]


def _decoders(split: TrainTestPair) -> dict[str, Decoder]:
    """The decoder of each side of a split read from image files."""
    decoders: dict[str, Decoder] = {}
    for name, side in split.sides:
        assert isinstance(side, FileImageDataset)
        decoders[name] = side.decoder
    return decoders


def test_config_keys_choose_the_path(tmp_path: Path) -> None:
    cfg = load_config(None, _folder_config(tmp_path, "data.decode=torchvision"))
    split = build.build_data(cfg)
    assert set(_decoders(split).values()) == {"torchvision"}
    with pytest.raises(ConfigError, match=r"data\.cache apply to datasets of image files"):
        build.build_data(load_config(None, [*TINY, f"data.cache={tmp_path}"]))
    with pytest.raises(ConfigError, match=r"data\.augment_on=device"):
        load_config(None, ["data.decode=device"])
    cfg = load_config(None, _folder_config(tmp_path, "data.augment_on=device"))
    data = build.build_data(cfg)
    gen = torch.Generator().manual_seed(11)
    first = build.train_loader(cfg, data, 0, gen, device=torch.device("cpu"))
    assert isinstance(first, DeviceBatches)
    again = build.train_loader(
        cfg, data, 0, torch.Generator().manual_seed(11), device=torch.device("cpu")
    )
    for (a, la, _), (b, lb, _) in zip(first, again, strict=True):
        assert torch.equal(a, b) and torch.equal(la, lb)


def test_every_task_reads_its_images_by_the_data_keys(tmp_path: Path) -> None:
    # The classification task builds its own split: data.decode and data.augment_on reach it too.
    root = next(item for item in _folder_config(tmp_path) if item.startswith("data.root="))
    folder = [*CLASSIFICATION, "data.dataset=folder", root, "sampler.batch_size=8"]
    cfg = load_config(None, [*folder, "data.decode=torchvision"])
    split = cfg.task.spec.build_data(cfg)
    assert _decoders(split) == {
        "train": "torchvision",
        "test": "torchvision",
    }
    cfg = load_config(None, [*folder, "data.augment_on=device"])
    data = cfg.task.spec.build_data(cfg)
    generator = torch.Generator().manual_seed(1)
    loader = build.train_loader(cfg, data, 0, generator, device=torch.device("cpu"))
    assert isinstance(loader, DeviceBatches)
    images, labels, _ = next(iter(loader))
    assert images.shape == (8, 3, 16, 16) and labels.shape == (8,)


def test_cache_of_an_in_memory_dataset_is_refused(tmp_path: Path) -> None:
    from idml.app.config import ConfigError
    from idml.app.image_cache import cache_dataset

    with pytest.raises(ConfigError, match="'digits' is held in memory; a cache is for datasets"):
        cache_dataset(load_config(None, ["data.dataset=digits"]), tmp_path / "c", None, False)
    assert not (tmp_path / "c").exists()


@pytest.mark.slow
@pytest.mark.numerics
def test_cache_and_device_crops_train_and_resume_exactly(tmp_path: Path) -> None:
    overrides = _folder_config(tmp_path, "optim.epochs=2", "data.augment_on=device")
    cfg_file = tmp_path / "tiny.yaml"
    cfg_file.write_text("# a tiny run on JPEGs\n")
    args = ["cache", str(cfg_file), "--out", str(tmp_path / "cache"), "--no-progress"]
    for item in overrides:
        args += ["--set", item]
    assert main(args) == 0
    overrides.append(f"data.cache={tmp_path / 'cache'}")
    full = Trainer(load_config(None, overrides), tmp_path / "full", progress=False).fit()
    part = Trainer(load_config(None, overrides), tmp_path / "part", progress=False)
    part.cfg.optim.epochs = 1
    part.fit()
    resumed = Trainer(load_config(None, overrides), tmp_path / "part", progress=False)
    assert resumed.fit(resume=True).final_metrics == full.final_metrics
