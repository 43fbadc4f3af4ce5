"""Offline real data: scikit-learn digits, Fashion-MNIST idx files, and the idx reader."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits as sklearn_digits

from idml.data import (
    FASHION_MNIST_ROOT,
    ArrayImageDataset,
    ArraySplitOptions,
    load_digits,
    load_fashion_mnist,
    load_split,
    read_idx,
)
from idml.data.offline import subsample_per_class

FASHION_FILES = [
    f"{stem}.gz"
    for stem in (
        "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte",
        "t10k-images-idx3-ubyte",
        "t10k-labels-idx1-ubyte",
    )
]
HAVE_FASHION = all((FASHION_MNIST_ROOT / name).is_file() for name in FASHION_FILES)


def test_digits_zero_shot_split_matches_sklearn() -> None:
    reference = sklearn_digits()
    split = load_digits()
    assert split.name == "digits"
    assert len(split.train) + len(split.test) == 1797
    assert len(split.train) == int((reference.target < 5).sum())
    assert split.train.classes == (0, 1, 2, 3, 4) and split.test.classes == (5, 6, 7, 8, 9)
    assert split.test.labels.tolist() == (reference.target[reference.target >= 5] - 5).tolist()

    image, label, index = split.test[3]
    assert image.shape == (3, 8, 8) and image.dtype == torch.float32
    expected = reference.images[reference.target >= 5][3] / 16.0
    # The 17 levels x/16 are quantised to uint8 (error ≤ 0.5/255, reached at x = 8) and then to
    # float32 (allclose's rtol 1e-5 covers that ε on top).
    assert torch.allclose(image[0].double(), torch.from_numpy(expected), atol=0.5 / 255)
    assert torch.equal(image[0], image[2])  # grayscale repeated to RGB
    assert label == reference.target[reference.target >= 5][3] - 5 and index == 3


def test_digits_options_subsample_resize_channels() -> None:
    split = load_digits(options=ArraySplitOptions(per_class=10, image_size=32, seed=3, channels=1))
    assert split.train.class_counts().tolist() == [10] * 5
    assert split.test.class_counts().tolist() == [10] * 5
    image, _, _ = split.train[0]
    assert image.shape == (1, 32, 32)
    assert float(image.min()) >= 0.0 and float(image.max()) <= 1.0
    again = load_digits(options=ArraySplitOptions(per_class=10, image_size=32, seed=3, channels=1))
    # The digits are held in memory.
    assert isinstance(split.train, ArrayImageDataset) and isinstance(again.train, ArrayImageDataset)
    assert torch.equal(split.train.images, again.train.images)
    other = load_digits(options=ArraySplitOptions(per_class=10, image_size=32, seed=4, channels=1))
    assert isinstance(other.train, ArrayImageDataset)
    assert not torch.equal(split.train.images, other.train.images)

    three_way = load_digits(options=ArraySplitOptions(num_train_classes=3))
    assert three_way.train.classes == (0, 1, 2) and three_way.num_test_classes == 7
    with pytest.raises(ValueError, match=r"num_train_classes must be in 1\.\.9"):
        load_digits(options=ArraySplitOptions(num_train_classes=10))
    with pytest.raises(ValueError, match=r"per_class must be >= 2"):
        load_digits(options=ArraySplitOptions(per_class=1))
    with pytest.raises(ValueError, match="do not pass root"):
        load_split("digits", "/somewhere")


def test_subsample_per_class_is_uniform_within_class() -> None:
    class_ids = np.repeat(np.arange(3), [5, 1, 8])
    keep = subsample_per_class(class_ids, per_class=4, seed=0)
    assert np.bincount(class_ids[keep]).tolist() == [4, 1, 4]
    assert len(np.unique(keep)) == len(keep)
    # Over many seeds every image of class 2 is kept about 4/8 of the time.
    hits = np.zeros(len(class_ids))
    for seed in range(400):
        hits[subsample_per_class(class_ids, 4, seed)] += 1
    # Statistical: each hit rate is Binomial(400, 1/2)/400 with standard error 0.025; atol 0.1 is 4
    # standard errors (seeds are fixed, so the test is deterministic).
    assert np.allclose(hits[class_ids == 2] / 400, 0.5, atol=0.1)


def write_idx(path: Path, array: np.ndarray, compress: bool) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + array.astype(np.uint8).tobytes()
    if compress:
        path.write_bytes(gzip.compress(payload))
    else:
        path.write_bytes(payload)


@pytest.mark.parametrize("compress", [True, False])
def test_read_idx_against_hand_written_files(tmp_path: Path, compress: bool) -> None:
    array = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    path = tmp_path / ("images.gz" if compress else "images")
    write_idx(path, array, compress)
    assert np.array_equal(read_idx(path), array)

    raw = tmp_path / "truncated"
    write_idx(raw, array, compress=False)
    raw.write_bytes(raw.read_bytes()[:-3])
    with pytest.raises(
        ValueError, match=r"truncated.*shape \(2, 3, 4\)|shape \(2, 3, 4\).*truncated"
    ):
        read_idx(raw)
    (tmp_path / "bad").write_bytes(b"\x01\x02\x08\x01abcd")
    with pytest.raises(ValueError, match="not an idx file"):
        read_idx(tmp_path / "bad")


def test_fashion_mnist_layout_on_a_fake_root(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    for prefix, count in (("train", 30), ("t10k", 10)):
        labels = np.arange(count) % 10
        images = rng.integers(0, 256, size=(count, 28, 28)).astype(np.uint8)
        write_idx(tmp_path / f"{prefix}-images-idx3-ubyte", images, compress=False)
        write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte.gz", labels, compress=True)
    split = load_fashion_mnist(tmp_path)
    assert (len(split.train), len(split.test)) == (20, 20)
    assert split.test.class_names == ("Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")

    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(FileNotFoundError, match=r"t10k-labels-idx1-ubyte.*dataset-fashion-mnist"):
        load_fashion_mnist(tmp_path)


@pytest.mark.skipif(
    not HAVE_FASHION, reason=f"Fashion-MNIST idx files not installed in {FASHION_MNIST_ROOT}"
)
def test_fashion_mnist_installed_files() -> None:
    split = load_fashion_mnist()
    assert (len(split.train), len(split.test)) == (35_000, 35_000)
    assert split.train.class_counts().tolist() == [7000] * 5
    assert split.test.classes == (5, 6, 7, 8, 9)
    image, label, _ = split.test[0]
    assert image.shape == (3, 28, 28) and 0 <= label < 5
    assert float(image.max()) <= 1.0 and float(image.max()) > 0.0

    small = load_split("fashion-mnist", per_class=6, image_size=32, channels=1)
    assert small.train.class_counts().tolist() == [6] * 5
    assert small.test[0][0].shape == (1, 32, 32)


def test_config_num_train_classes_moves_the_class_split(tmp_path: Path) -> None:
    from idml.app.build import build_data
    from idml.app.config import load_config

    base = ["data.dataset=digits", "data.image_size=8", "data.resize_size=null"]
    split = build_data(load_config(None, [*base, "data.num_train_classes=3"]))
    targets = sklearn_digits().target
    assert split.num_train_classes == 3 and split.num_test_classes == 7
    assert len(split.train) == int((targets < 3).sum()) and len(split.test) == int(
        (targets >= 3).sum()
    )
    for other in ("omniglot", "folder"):
        cfg = load_config(
            None, [f"data.dataset={other}", f"data.root={tmp_path}", "data.num_train_classes=3"]
        )
        with pytest.raises(
            ValueError, match=f"num_train_classes applies to digits.*not to '{other}'"
        ):
            build_data(cfg)
    with pytest.raises(ValueError, match=r"num_train_classes must be in 1\.\.9"):
        build_data(load_config(None, [*base, "data.num_train_classes=10"]))
