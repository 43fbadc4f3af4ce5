"""Real image data that needs no network: scikit-learn's digits and Debian's Fashion-MNIST.

Both follow the zero-shot DML protocol (train and test classes disjoint): the first half of the
classes (by class id) train, the rest test. They are small enough to hold in memory as ``uint8`` arrays, so they are
:class:`~idml.data.datasets.ArrayImageDataset` s. Their options are an :class:`ArraySplitOptions`
(:class:`ArrayOptions`, which Omniglot takes too, and ``num_train_classes``).

Example:
    >>> split = load_digits(options=ArraySplitOptions(per_class=10, image_size=16))
    >>> split.num_train_classes, split.num_test_classes, len(split.train), len(split.test)
    (5, 5, 50, 50)
    >>> image, label, index = split.test[0]
    >>> tuple(image.shape), 0.0 <= float(image.min()) <= float(image.max()) <= 1.0
    ((3, 16, 16), True)
"""

from __future__ import annotations

import gzip
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from idml.data.datasets import ArrayImageDataset, Channels, DMLSplit

FASHION_MNIST_ROOT = Path("/usr/share/datasets/fashion-mnist")
"""Where Debian's ``dataset-fashion-mnist`` package installs the idx files."""

FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)

_FASHION_MNIST_FILES = (
    ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
)

_MAX_RESIZED_BYTES = 4 * 1024**3
"""Refuse load-time resizing beyond this many bytes of images (resize in the transform instead)."""

_RESIZE_CHUNK = 4096
"""Images resized per interpolation call, bounding the float intermediate's memory."""


def read_idx(path: str | Path) -> np.ndarray:
    """An ``unsigned byte`` idx array (the MNIST file format), plain or gzipped.

    Format (LeCun et al.): two zero bytes, the type code ``0x08`` (unsigned byte), the number of
    dimensions ``k``, then ``k`` big-endian ``uint32`` sizes and the data in row-major order.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"idx file {path} does not exist")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as handle:
            data = handle.read()
    except (OSError, EOFError) as err:
        raise ValueError(
            f"cannot read idx file {path} ({err}); the file is corrupt — reinstall it"
        ) from err
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise ValueError(f"{path} is not an idx file (bad magic number); is this the right file?")
    if data[2] != 0x08:
        raise ValueError(f"{path}: idx type code {data[2]:#04x} is not unsigned byte (0x08)")
    ndim = data[3]
    header_size = 4 + 4 * ndim
    shape = tuple(int(v) for v in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    expected = int(np.prod(shape)) if shape else 0
    if len(data) - header_size != expected:
        raise ValueError(
            f"{path}: header says shape {shape} ({expected} bytes) but the file holds "
            f"{len(data) - header_size} bytes; the file is truncated or corrupt — reinstall it"
        )
    return np.frombuffer(data, dtype=np.uint8, offset=header_size).reshape(shape)


def _idx_file(root: Path, stem: str) -> Path:
    for candidate in (root / f"{stem}.gz", root / stem):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"Fashion-MNIST: neither {root / stem}.gz nor {root / stem} exists; install the Debian "
        "package dataset-fashion-mnist or pass root=<folder with the idx files>"
    )


def subsample_per_class(class_ids: np.ndarray, per_class: int, seed: int) -> np.ndarray:
    """Sorted indices of at most ``per_class`` images of each class, drawn uniformly with ``seed``.

    Vectorised: a random permutation is stably sorted by class, so each image's rank within its
    class is uniform; the images of rank ``< per_class`` are kept.
    """
    if per_class < 2:
        raise ValueError(f"per_class must be >= 2 (a class needs a positive pair), got {per_class}")
    return rows_per_class(class_ids, per_class, seed)


def rows_per_class(class_ids: np.ndarray, per_class: int, seed: int) -> np.ndarray:
    """:func:`subsample_per_class` for any ``per_class >= 1`` (classification needs no pairs)."""
    if per_class < 1:
        raise ValueError(f"per_class must be >= 1, got {per_class}")
    order = np.random.default_rng(seed).permutation(len(class_ids))
    order = order[np.argsort(class_ids[order], kind="stable")]
    sorted_ids = class_ids[order]
    rank = np.arange(len(order)) - np.searchsorted(sorted_ids, sorted_ids, side="left")
    return np.sort(order[rank < per_class])


def resize_images(images: np.ndarray, size: int) -> np.ndarray:
    """``uint8`` images ``(N, H, W)`` resized to ``(N, size, size)``, bilinear with antialiasing."""
    if size < 1:
        raise ValueError(f"image_size must be a positive number of pixels, got {size}")
    if len(images) * size * size > _MAX_RESIZED_BYTES:
        raise ValueError(
            f"image_size={size} would hold {len(images) * size * size / 1024**3:.1f} GiB of images "
            "in memory; use per_class to subsample, or leave image_size unset and resize in the "
            "transform (build_transforms)"
        )
    source = torch.from_numpy(np.ascontiguousarray(images))
    resized = torch.empty((len(images), size, size), dtype=torch.uint8)
    for start in range(0, len(images), _RESIZE_CHUNK):
        chunk = source[start : start + _RESIZE_CHUNK].unsqueeze(1).float()
        out = F.interpolate(
            chunk, size=(size, size), mode="bilinear", antialias=True, align_corners=False
        )
        resized[start : start + _RESIZE_CHUNK] = (
            out.squeeze(1).round_().clamp_(0, 255).to(torch.uint8)
        )
    return resized.numpy()


@dataclass(frozen=True)
class ArrayOptions:
    """Options of the in-memory datasets (digits, Fashion-MNIST, Omniglot)."""

    per_class: int | None = None
    """Keep at most this many images of each class, drawn at random with ``seed`` (a quick, still
    class-balanced subset)."""
    image_size: int | None = None
    """Resize every image once at load time (bilinear with antialiasing): cheaper than resizing in
    the per-sample transform when the same size is used every epoch."""
    seed: int = 0
    """Seed of the ``per_class`` draw."""
    channels: Channels = 3
    """3 (grayscale repeated, what ImageNet backbones expect) or 1."""


@dataclass(frozen=True)
class ArraySplitOptions(ArrayOptions):
    """Options of the datasets split by class id (digits, Fashion-MNIST)."""

    num_train_classes: int | None = None
    """The first this many of the sorted class ids train (default ``ceil(C/2)``), the rest test."""


def array_split(
    name: str,
    images: np.ndarray,
    class_ids: np.ndarray,
    class_names: Mapping[int, str],
    options: ArrayOptions,
    num_train_classes: int | None = None,
) -> DMLSplit:
    """The zero-shot split of in-memory ``uint8`` images: the first ``num_train_classes`` of the
    sorted class ids train (default ``ceil(C/2)``), the rest test."""
    classes = np.unique(class_ids)
    num_train = (len(classes) + 1) // 2 if num_train_classes is None else num_train_classes
    if not 1 <= num_train < len(classes):
        raise ValueError(
            f"num_train_classes must be in 1..{len(classes) - 1} so both splits have classes, "
            f"got {num_train}"
        )
    if options.per_class is not None:
        keep = subsample_per_class(class_ids, options.per_class, options.seed)
        images, class_ids = images[keep], class_ids[keep]
    if options.image_size is not None:
        images = resize_images(images, options.image_size)
    in_train = np.isin(class_ids, classes[:num_train])
    return DMLSplit(
        ArrayImageDataset(
            images[in_train],
            class_ids[in_train],
            class_names,
            channels=options.channels,
            source=f"{name}/train",
        ),
        ArrayImageDataset(
            images[~in_train],
            class_ids[~in_train],
            class_names,
            channels=options.channels,
            source=f"{name}/test",
        ),
        name,
    )


def load_digits(root: None = None, options: ArraySplitOptions | None = None) -> DMLSplit:
    """scikit-learn's bundled digits (1,797 images 8×8, classes 0–9): digits 0–4 train, 5–9 test.

    Pixel values 0–16 are rescaled to ``uint8`` 0–255. ``root`` is accepted for a uniform loader
    signature but must be ``None`` (the data ships inside scikit-learn).
    """
    if root is not None:
        raise ValueError("the digits dataset ships with scikit-learn; do not pass root")
    from sklearn.datasets import load_digits as sklearn_digits

    bunch = sklearn_digits()
    images = np.rint(bunch.images * (255.0 / 16.0)).clip(0, 255).astype(np.uint8)
    class_ids = bunch.target.astype(np.int64)
    options = options or ArraySplitOptions()
    names = {i: str(i) for i in range(10)}
    return array_split("digits", images, class_ids, names, options, options.num_train_classes)


def load_fashion_mnist(
    root: str | Path | None = None, options: ArraySplitOptions | None = None
) -> DMLSplit:
    """Fashion-MNIST (Xiao et al. 2017; 70,000 images 28×28, 10 classes) from idx files.

    The official train (60,000) and test (10,000) files are merged — the DML split is by class:
    classes 0–4 (T-shirt/top … Coat) train, 5–9 (Sandal … Ankle boot) test. ``root`` defaults to
    :data:`FASHION_MNIST_ROOT`; files may be gzipped.
    """
    base = Path(root).expanduser() if root is not None else FASHION_MNIST_ROOT
    if not base.is_dir():
        raise FileNotFoundError(
            f"Fashion-MNIST folder {base} does not exist; install the Debian package "
            "dataset-fashion-mnist or pass root=<folder with the idx files>"
        )
    image_parts, label_parts = [], []
    for image_stem, label_stem in _FASHION_MNIST_FILES:
        image_file, label_file = _idx_file(base, image_stem), _idx_file(base, label_stem)
        images, labels = read_idx(image_file), read_idx(label_file)
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise ValueError(
                f"{image_file} (shape {images.shape}) and {label_file} (shape {labels.shape}) do not "
                "form an image/label pair; check the file names"
            )
        if labels.max(initial=0) >= len(FASHION_MNIST_CLASSES):
            raise ValueError(f"{label_file}: labels must be 0..9, found {int(labels.max())}")
        image_parts.append(images)
        label_parts.append(labels)
    options = options or ArraySplitOptions()
    return array_split(
        "fashion_mnist",
        np.concatenate(image_parts),
        np.concatenate(label_parts).astype(np.int64),
        dict(enumerate(FASHION_MNIST_CLASSES)),
        options,
        options.num_train_classes,
    )
