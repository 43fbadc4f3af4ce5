"""Data for image classification: the standard split, where every class is in train and test.

Unlike the zero-shot split of deep metric learning (:class:`~idml.data.datasets.DMLSplit`), a
:class:`ClassificationSplit` holds the same classes on both sides, so a label means the same class
in train and test. :func:`load_classification_split` knows:

- ``digits`` (scikit-learn, 1,797 images, no official split): a per-class hold-out of
  ``test_fraction`` of the images, drawn with ``seed``;
- ``fashion_mnist``: the official 60,000 train / 10,000 test files;
- ``folder``: ``root/train/<class>/<image>`` with ``root/test/<class>/`` or ``root/val/<class>/``
  — ImageNet's ``train/<wnid>/`` + ``val/<wnid>/`` layout, and CIFAR-10/100 converted to PNG
  folders — or ``root/<class>/<image>`` with a per-class hold-out;
- ``csv``: ``path,label,split`` rows (``train``/``val``/``test``), or ``path,label`` with a
  hold-out.

Both are read by :mod:`idml.data.reader` (labels are folder paths below the root or the split
folder, however deep); the test side is ``test``, else ``val``.

``per_class`` / ``test_per_class`` subsample each side (at most that many images per class, drawn
with ``seed``).

Example:
    >>> split = load_classification_split("digits", per_class=20, test_per_class=10)
    >>> split.num_classes, len(split.train), len(split.test), split.train.classes == split.test.classes
    (10, 200, 100, True)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from idml.data.datasets import (
    ArrayImageDataset,
    Channels,
    FileImageDataset,
    TrainTestPair,
    Transform,
)
from idml.data.offline import (
    _FASHION_MNIST_FILES,
    FASHION_MNIST_CLASSES,
    FASHION_MNIST_ROOT,
    _idx_file,
    read_idx,
    resize_images,
    rows_per_class,
)
from idml.data.reader import read_csv, read_folder
from idml.data.records import ImageRecords, format_examples
from idml.data.splits import given_split, holdout_rows, holdout_split

CLASSIFICATION_DATASETS = ("digits", "fashion_mnist", "folder", "csv")
"""The datasets with a classification split (CUB, Cars and SOP are zero-shot retrieval benchmarks)."""


@dataclass(frozen=True)
class ClassificationSplit(TrainTestPair):
    """Train and test images of the same classes (labels ``0..C−1`` mean the same on both sides)."""

    def __post_init__(self) -> None:
        self._check_sides_have_images()
        if self.train.classes != self.test.classes:
            only_train = sorted(set(self.train.classes) - set(self.test.classes))
            only_test = sorted(set(self.test.classes) - set(self.train.classes))
            names = dict(zip(self.train.classes, self.train.class_names)) | dict(
                zip(self.test.classes, self.test.class_names)
            )
            raise ValueError(
                f"{self.name}: a classification split needs every class on both sides; only in "
                f"train: {format_examples([names[c] for c in only_train]) or 'none'}, only in test: "
                f"{format_examples([names[c] for c in only_test]) or 'none'}"
            )

    @property
    def num_classes(self) -> int:
        return self.train.num_classes


_Side = Literal["train", "test"]
_SIDES: tuple[_Side, _Side] = ("train", "test")


@dataclass(frozen=True)
class _Sampling:
    """Which images of each side a split keeps (``per_class`` / ``test_per_class``, drawn with
    ``seed``), and how many channels they are read with."""

    per_class: int | None
    test_per_class: int | None
    seed: int
    channels: Channels

    def rows(self, class_ids: np.ndarray, side: _Side) -> np.ndarray:
        """Sorted rows of at most the side's per-class count of each class (all when ``None``)."""
        limit, offset = (self.per_class, 0) if side == "train" else (self.test_per_class, 1)
        if limit is None:
            return np.arange(len(class_ids))
        return rows_per_class(class_ids, limit, self.seed * 2 + offset)


def _arrays(
    name: str,
    parts: tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]],
    class_names: dict[int, str],
    sampling: _Sampling,
    image_size: int | None,
) -> ClassificationSplit:
    sides = []
    for (images, ids), side in zip(parts, _SIDES, strict=True):
        keep = sampling.rows(ids, side)
        images, ids = images[keep], ids[keep]
        if image_size is not None:
            images = resize_images(images, image_size)
        sides.append(
            ArrayImageDataset(
                images, ids, class_names, channels=sampling.channels, source=f"{name}/{side}"
            )
        )
    return ClassificationSplit(sides[0], sides[1], name)


def _digits(
    test_fraction: float, sampling: _Sampling, image_size: int | None
) -> ClassificationSplit:
    from sklearn.datasets import load_digits as sklearn_digits

    bunch = sklearn_digits()
    images = np.rint(bunch.images * (255.0 / 16.0)).clip(0, 255).astype(np.uint8)
    ids = bunch.target.astype(np.int64)
    # The hold-out is drawn with its own stream: the test images do not depend on the run's seed.
    test = holdout_rows(ids, test_fraction, 0)
    parts = ((images[~test], ids[~test]), (images[test], ids[test]))
    return _arrays("digits", parts, {i: str(i) for i in range(10)}, sampling, image_size)


def _fashion_mnist(
    root: str | Path | None, sampling: _Sampling, image_size: int | None
) -> ClassificationSplit:
    base = Path(root).expanduser() if root is not None else FASHION_MNIST_ROOT
    if not base.is_dir():
        raise FileNotFoundError(
            f"Fashion-MNIST folder {base} does not exist; install the Debian package "
            "dataset-fashion-mnist or set data.root to the folder with the idx files"
        )
    parts = []
    for image_stem, label_stem in _FASHION_MNIST_FILES:
        images = read_idx(_idx_file(base, image_stem))
        labels = read_idx(_idx_file(base, label_stem)).astype(np.int64)
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise ValueError(
                f"{base}: {image_stem} and {label_stem} do not form an image/label pair"
            )
        parts.append((images, labels))
    names = dict(enumerate(FASHION_MNIST_CLASSES))
    return _arrays("fashion_mnist", (parts[0], parts[1]), names, sampling, image_size)


def _user_images(
    name: str, records: ImageRecords, source: str, test_fraction: float, sampling: _Sampling
) -> ClassificationSplit:
    """Classification's split policy for a user's images: the split they give (the test side is
    ``test``, else ``val``), or a per-class hold-out of ``test_fraction``."""
    records.require_labels(source)
    if records.roles is not None:
        raise ValueError(
            f"{source} has a role column: query/gallery roles are for retrieval evaluation "
            "(task: metric_learning); a classification run scores every test image, so drop it"
        )
    if records.splits is None:
        train, test = holdout_split(records, test_fraction)
    else:
        sides = given_split(records)
        train, test = sides.train, sides.test if len(sides.test) else sides.val
    train = train.take(sampling.rows(train.class_ids, "train"))
    test = test.take(sampling.rows(test.class_ids, "test"))
    return ClassificationSplit(
        FileImageDataset(train, channels=sampling.channels),
        FileImageDataset(test, channels=sampling.channels),
        name,
    )


def _folder(root: Path, test_fraction: float, sampling: _Sampling) -> ClassificationSplit:
    base = Path(root).expanduser()
    if not base.is_dir():
        raise FileNotFoundError(
            f"image folder {base} is not a directory; set data.root to a folder with train/ and "
            "val/ (or test/) class folders, or with one folder per class"
        )
    return _user_images("folder", read_folder(base), str(base), test_fraction, sampling)


def _csv(root: Path, test_fraction: float, sampling: _Sampling) -> ClassificationSplit:
    path = Path(root).expanduser()
    return _user_images("csv", read_csv(path), str(path), test_fraction, sampling)


def load_classification_split(
    name: str,
    root: str | Path | None = None,
    *,
    per_class: int | None = None,
    test_per_class: int | None = None,
    test_fraction: float = 0.2,
    image_size: int | None = None,
    seed: int = 0,
    channels: Channels = 3,
    train_transform: Transform | None = None,
    test_transform: Transform | None = None,
) -> ClassificationSplit:
    """The classification split of dataset ``name`` (module docstring), transforms attached.

    ``test_fraction`` is the per-class hold-out of datasets without a test side (digits, a flat
    folder, a CSV without split column); ``image_size`` resizes in-memory datasets once at load.
    """
    if name not in CLASSIFICATION_DATASETS:
        raise ValueError(
            f"data.dataset={name!r} has no classification split; for task: classification use "
            f"one of {', '.join(CLASSIFICATION_DATASETS)} (ImageNet and CIFAR: folder)"
        )
    sampling = _Sampling(per_class, test_per_class, seed, channels)
    if name == "digits":
        if root is not None:
            raise ValueError("the digits dataset ships with scikit-learn; leave data.root unset")
        split = _digits(test_fraction, sampling, image_size)
    elif name == "fashion_mnist":
        split = _fashion_mnist(root, sampling, image_size)
    else:
        if root is None:
            raise ValueError(f"data.dataset={name!r} needs data.root")
        if image_size is not None:
            raise ValueError("image_size resizes in-memory datasets only; use the transform")
        loader = _folder if name == "folder" else _csv
        split = loader(Path(root), test_fraction, sampling)
    return split.with_transforms(train_transform, test_transform)
