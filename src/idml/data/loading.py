"""What the dataset loaders of :mod:`idml.data.loaders` and :mod:`idml.data.cars` share: their
options, finding the dataset folder, checking annotation ids and wrapping the validated halves as
a split."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from idml.data.datasets import Channels, DMLSplit, FileImageDataset
from idml.data.records import ImageRecords, format_examples


@dataclass(frozen=True)
class FileOptions:
    """Options of the file-based loaders (CUB-200-2011, Stanford Online Products; extended for
    Cars196, CSV files and class folders): how the images are read and the split is checked."""

    channels: Channels = 3
    """3 (RGB) or 1 (grayscale)."""
    check_files: bool = True
    """Check that every listed image file exists before training starts."""
    min_images_per_class: int = 2
    """Fewest images a class may have on its side of the split."""


def build_split(
    name: str,
    train: ImageRecords,
    test: ImageRecords,
    source: str,
    options: FileOptions,
    crop_to_box: bool = False,
) -> DMLSplit:
    """Validate both halves (files exist, classes big enough) and wrap them as datasets."""
    if options.check_files:
        ImageRecords.concat([train, test]).check_files_exist(source)
    for side, records in (("train", train), ("test", test)):
        records.check_min_images_per_class(options.min_images_per_class, f"{source} ({side} split)")
    channels = options.channels
    return DMLSplit(
        FileImageDataset(train, channels=channels, crop_to_box=crop_to_box),
        FileImageDataset(test, channels=channels, crop_to_box=crop_to_box),
        name,
    )


def locate_root(root: str | Path, marker: str, subfolders: Sequence[str], dataset: str) -> Path:
    """The directory holding ``marker``: ``root`` itself or one of its usual ``subfolders``."""
    base = Path(root).expanduser()
    if not base.is_dir():
        raise FileNotFoundError(
            f"{dataset} root {base} is not a directory; pass the dataset folder"
        )
    for candidate in (base, *(base / sub for sub in subfolders)):
        if (candidate / marker).exists():
            return candidate
    raise FileNotFoundError(
        f"{dataset}: no {marker} in {base}"
        + (f" or its subfolder(s) {', '.join(subfolders)}" if subfolders else "")
        + "; pass root= the extracted dataset directory"
    )


def check_unique(ids: np.ndarray, path: Path, what: str) -> None:
    """Raise a ``ValueError`` naming ``path`` if any of ``ids`` (the file's ``what``) repeats."""
    values, counts = np.unique(ids, return_counts=True)
    if (counts > 1).any():
        raise ValueError(
            f"{path}: {what} {format_examples(values[counts > 1].tolist())} appear more than once; "
            "is the annotation file corrupted?"
        )


def check_class_range(class_ids: np.ndarray, path: Path, num_classes: int, dataset: str) -> None:
    """Raise a ``ValueError`` naming ``path`` unless every class id lies in ``1..num_classes``."""
    bad = np.unique(class_ids[(class_ids < 1) | (class_ids > num_classes)])
    if len(bad):
        raise ValueError(
            f"{path}: class ids must lie in 1..{num_classes} for {dataset}, found "
            f"{format_examples(bad.tolist())}; is this the right label file?"
        )
