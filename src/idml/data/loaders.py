"""Loaders of the file-based DML benchmarks and of generic image collections (README, "Data layouts").

Each loader parses its annotation files into :class:`~idml.data.records.ImageRecords`, validates
them (missing files, malformed or mismatched label files and classes with too few images are errors
that name the file and the fix) and returns a class-disjoint :class:`~idml.data.datasets.DMLSplit`:

- **CUB-200-2011** (Wah et al. 2011): classes 1–100 train, 101–200 test. ``train_test_split.txt`` is
  the *classification* split and is never read.
- **Cars196** (Krause et al. 2013): classes 1–98 train, 99–196 test, from ``cars_annos.mat`` or
  from the devkit layout (``cars_train/``, ``cars_test/``), whose two halves are merged first. The
  annotation's ``test`` flag (a classification split) is ignored.
- **Stanford Online Products** (Oh Song et al. 2016): the split of ``Ebay_train.txt`` /
  ``Ebay_test.txt``.
- **a user's folder** or **CSV** ``path,label[,split[,role]]``, read by :mod:`idml.data.reader`:
  the split they give, or by class, the first half of the sorted classes (``ceil(C/2)``) train
  unless told otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from idml.data.cars import CARS_LAST_TRAIN_CLASS, CARS_NUM_CLASSES, CarsOptions, load_cars
from idml.data.datasets import DMLSplit, FileImageDataset
from idml.data.loading import (
    FileOptions,
    build_split,
    check_class_range,
    check_unique,
    locate_root,
)
from idml.data.reader import read_csv, read_folder
from idml.data.records import (
    IMAGE_EXTENSIONS,
    ImageRecords,
    format_examples,
    parse_ints,
    read_table,
)
from idml.data.splits import given_split, split_by_class

__all__ = [
    "CARS_LAST_TRAIN_CLASS",
    "CARS_NUM_CLASSES",
    "CUB_LAST_TRAIN_CLASS",
    "CUB_NUM_CLASSES",
    "SOP_HEADER",
    "CarsOptions",
    "CsvOptions",
    "FileOptions",
    "FolderOptions",
    "load_cars",
    "load_csv",
    "load_cub",
    "load_folder",
    "load_sop",
]

CUB_NUM_CLASSES = 200
CUB_LAST_TRAIN_CLASS = 100
SOP_HEADER = ("image_id", "class_id", "super_class_id", "path")


# --------------------------------------------------------------------------- CUB-200-2011
def load_cub(root: str | Path, options: FileOptions | None = None) -> DMLSplit:
    """CUB-200-2011 as a DML split: classes 1–100 train (5,864 images), 101–200 test (5,924).

    Reads ``images.txt`` (``image_id path``) and ``image_class_labels.txt`` (``image_id class_id``)
    from ``root`` or ``root/CUB_200_2011``; images are ``images/<NNN.name>/*.jpg``. The label file
    is cross-checked against the images: every image id must have exactly one label, and the
    ``NNN`` prefix of an image's folder must equal its class id.
    """
    base = locate_root(root, "images.txt", ("CUB_200_2011",), "CUB-200-2011")
    images_file, labels_file = base / "images.txt", base / "image_class_labels.txt"
    image_rows = read_table(images_file, 2)
    label_rows = read_table(labels_file, 2)
    image_ids = parse_ints([row[0] for row in image_rows], images_file, "image_id")
    label_ids = parse_ints([row[0] for row in label_rows], labels_file, "image_id")
    labels = parse_ints([row[1] for row in label_rows], labels_file, "class_id")
    check_unique(image_ids, images_file, "image ids")
    check_unique(label_ids, labels_file, "image ids")
    unlabelled = np.setdiff1d(image_ids, label_ids)
    unknown = np.setdiff1d(label_ids, image_ids)
    if len(unlabelled) or len(unknown):
        raise ValueError(
            f"{labels_file} does not match {images_file}: "
            f"{len(unlabelled)} image ids have no label ({format_examples(unlabelled.tolist())}) and "
            f"{len(unknown)} labels name unknown image ids ({format_examples(unknown.tolist())}); "
            "use the two files from the same CUB_200_2011 archive"
        )
    by_id = np.argsort(label_ids)
    class_ids = labels[by_id][np.searchsorted(label_ids[by_id], image_ids)]
    check_class_range(class_ids, labels_file, CUB_NUM_CLASSES, "CUB-200-2011")

    relative = [row[1] for row in image_rows]
    folders = [path.split("/", 1)[0] for path in relative]
    prefixes = np.array([_leading_int(folder) for folder in folders], dtype=np.int64)
    mismatched = np.flatnonzero((prefixes >= 0) & (prefixes != class_ids))
    if len(mismatched):
        examples = [f"{relative[i]} labelled {class_ids[i]}" for i in mismatched]
        raise ValueError(
            f"{labels_file}: {len(mismatched)} labels disagree with the class folder of the image "
            f"({format_examples(examples)}); is this the right label file?"
        )
    class_names = {int(c): folder.split(".", 1)[-1] for c, folder in zip(class_ids, folders)}
    records = ImageRecords(
        paths=np.array([str(base / "images" / path) for path in relative], dtype=object),
        class_ids=class_ids,
        class_names=class_names,
    )
    train, test = records.split_by_class(np.arange(1, CUB_LAST_TRAIN_CLASS + 1))
    return build_split("cub", train, test, str(images_file), options or FileOptions())


def _leading_int(folder: str) -> int:
    """The ``NNN`` of ``NNN.name``, or ``-1`` when the folder has no numeric prefix."""
    prefix = folder.split(".", 1)[0]
    return int(prefix) if prefix.isdigit() else -1


# --------------------------------------------------------------------------- Stanford Online Products
def load_sop(root: str | Path, options: FileOptions | None = None) -> DMLSplit:
    """Stanford Online Products: ``Ebay_train.txt`` (59,551 images, 11,318 classes) and
    ``Ebay_test.txt`` (60,502 images, 11,316 classes), in ``root`` or
    ``root/Stanford_Online_Products``.

    Each file has the header ``image_id class_id super_class_id path``; paths are relative to the
    folder holding the files. Class ids are global, so the split must already be class-disjoint
    (checked).
    """
    base = locate_root(
        root, "Ebay_train.txt", ("Stanford_Online_Products",), "Stanford Online Products"
    )
    halves = []
    for file_name in ("Ebay_train.txt", "Ebay_test.txt"):
        path = base / file_name
        rows = read_table(path, len(SOP_HEADER), header=SOP_HEADER)
        class_ids = parse_ints([row[1] for row in rows], path, "class_id")
        parse_ints([row[2] for row in rows], path, "super_class_id")
        relative = [row[3] for row in rows]
        names = {int(c): f"{Path(p).parent.name}/{c}" for c, p in zip(class_ids, relative)}
        halves.append(
            ImageRecords(
                paths=np.array([str(base / p) for p in relative], dtype=object),
                class_ids=class_ids,
                class_names=names,
            )
        )
    source = str(base / "Ebay_{train,test}.txt")
    return build_split("sop", halves[0], halves[1], source, options or FileOptions())


# --------------------------------------------------------------------------- a user's folder or CSV
@dataclass(frozen=True)
class FolderOptions(FileOptions):
    """Options of :func:`load_folder`."""

    check_files: bool = False
    """Off by default: the images were just listed."""
    train_classes: Sequence[str] | None = None
    """Labels of the train classes (default: the first half of the sorted labels); not with
    ``train/``, ``test/`` folders, which give the split."""
    extensions: Sequence[str] = tuple(sorted(IMAGE_EXTENSIONS))
    """File suffixes that count as images."""


def load_folder(root: str | Path, options: FolderOptions | None = None) -> DMLSplit:
    """The images below ``root``, labelled by the path of their folder below it
    (:mod:`idml.data.reader`: ``root/<class>/<image>``, or deeper such as
    ``root/<alphabet>/<character>/<image>``), split by class.

    Train classes are ``options.train_classes`` or the first ``ceil(C/2)`` of the sorted labels;
    the rest are test. A root of ``train/``, ``val/`` and ``test/`` folders gives the split
    instead (``val``: the side :meth:`~idml.data.DMLSplit.validation` evaluates).
    """
    options = options or FolderOptions()
    base = Path(root).expanduser()
    if not base.is_dir():
        raise FileNotFoundError(
            f"image folder {base} is not a directory; pass root=<folder of class folders>"
        )
    records = read_folder(base, options.extensions)
    return _split_records("folder", records, str(base), options, options.train_classes)


@dataclass(frozen=True)
class CsvOptions(FileOptions):
    """Options of :func:`load_csv`."""

    image_root: str | Path | None = None
    """The folder relative paths start from (default: the CSV's folder)."""
    train_classes: Sequence[str] | None = None
    """Names of the train classes when there is no split column (default: the first half)."""


def load_csv(root: str | Path, options: CsvOptions | None = None) -> DMLSplit:
    """A CSV file of ``path,label[,split[,role]]`` rows (:mod:`idml.data.reader`: header, comments,
    encoding, path policy).

    With a ``split`` column (``train``/``val``/``test``) the split is taken from it and checked
    to be class-disjoint; without one, the train classes are ``options.train_classes`` or the
    first half of the sorted classes. Roles (``query``/``gallery``) of the test images make
    evaluation search the queries against the gallery.
    """
    options = options or CsvOptions()
    path = Path(root).expanduser()
    if path.is_dir():
        raise FileNotFoundError(
            f"data.root {path} is a folder; dataset csv needs the CSV file itself (root=<file.csv>)"
        )
    records = read_csv(path, image_root=options.image_root, check_files=options.check_files)
    # The reader checked the files already, naming the CSV lines.
    checked = replace(options, check_files=False)
    return _split_records("csv", records, str(path), checked, options.train_classes)


def _split_records(
    name: str,
    records: ImageRecords,
    source: str,
    options: FileOptions,
    train_classes: Sequence[str] | None,
) -> DMLSplit:
    """Metric learning's split policy for a user's images: given, or class-disjoint."""
    records.require_labels(source)
    if records.splits is None:
        train, test = split_by_class(records, train_classes, source)
        return build_split(name, train, test, source, options)
    if train_classes is not None:
        raise ValueError(f"{source} gives the split (train/test); do not also pass train_classes")
    sides = given_split(records)
    split = build_split(name, sides.train, sides.test, source, options)
    if not len(sides.val):
        return split
    sides.val.check_min_images_per_class(options.min_images_per_class, f"{source} (val split)")
    val = FileImageDataset(sides.val, channels=options.channels)
    return replace(split, val=val)
