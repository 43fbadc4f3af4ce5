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
- **Folder-per-class** and **CSV** ``path,label[,split]``: split by class, the first half of the
  sorted classes (``ceil(C/2)``) train unless told otherwise.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from idml.data.cars import CARS_LAST_TRAIN_CLASS, CARS_NUM_CLASSES, CarsOptions, load_cars
from idml.data.datasets import DMLSplit
from idml.data.loading import (
    FileOptions,
    build_split,
    check_class_range,
    check_unique,
    locate_root,
)
from idml.data.records import (
    IMAGE_EXTENSIONS,
    ImageRecords,
    first_half,
    format_examples,
    is_int,
    parse_ints,
    read_table,
)

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


# --------------------------------------------------------------------------- generic
def _train_ids_from_names(
    train_classes: Sequence[str] | None,
    ids_by_name: dict[str, int],
    class_ids: np.ndarray,
    source: str,
) -> np.ndarray:
    if train_classes is None:
        return first_half(class_ids)
    if isinstance(train_classes, str):
        raise ValueError("train_classes must be a list of class names, not a single string")
    unknown = [str(c) for c in train_classes if str(c) not in ids_by_name]
    if unknown:
        raise ValueError(
            f"train_classes names classes that are not in {source}: {format_examples(unknown)}; "
            f"known classes include {format_examples(sorted(ids_by_name))}"
        )
    return np.array([ids_by_name[str(c)] for c in train_classes], dtype=np.int64)


@dataclass(frozen=True)
class FolderOptions(FileOptions):
    """Options of :func:`load_folder`."""

    check_files: bool = False
    """Off by default: the images were just listed."""
    train_classes: Sequence[str] | None = None
    """Folder names of the train classes (default: the first half of the sorted names)."""
    extensions: Sequence[str] = tuple(sorted(IMAGE_EXTENSIONS))
    """File suffixes that count as images."""


def load_folder(root: str | Path, options: FolderOptions | None = None) -> DMLSplit:
    """A folder per class, ``root/<class name>/<image>``, split by class.

    Train classes are ``options.train_classes`` (folder names) or the first ``ceil(C/2)`` of the
    sorted folder names; the rest are test. Original class ids are the positions in that sorted
    list. Only files directly in a class folder whose suffix is in ``options.extensions`` count as
    images; hidden folders are ignored; an empty class folder is an error.
    """
    options = options or FolderOptions()
    base = Path(root).expanduser()
    if not base.is_dir():
        raise FileNotFoundError(
            f"image folder {base} is not a directory; pass root=<folder of class folders>"
        )
    class_dirs = sorted(d for d in base.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not class_dirs:
        raise ValueError(f"{base} has no class folders; expected {base}/<class name>/<image files>")
    suffixes = {s.lower() if s.startswith(".") else f".{s.lower()}" for s in options.extensions}
    files_per_class = [
        sorted(p for p in d.iterdir() if p.is_file() and p.suffix.lower() in suffixes)
        for d in class_dirs
    ]
    empty = [d.name for d, files in zip(class_dirs, files_per_class) if not files]
    if empty:
        raise ValueError(
            f"{base}: class folder(s) {format_examples(empty)} contain no images with suffix "
            f"{sorted(suffixes)}; add images or remove the folders"
        )
    counts = [len(files) for files in files_per_class]
    records = ImageRecords(
        paths=np.array([str(p) for files in files_per_class for p in files], dtype=object),
        class_ids=np.repeat(np.arange(len(class_dirs)), counts),
        class_names={i: d.name for i, d in enumerate(class_dirs)},
    )
    ids_by_name = {d.name: i for i, d in enumerate(class_dirs)}
    train_ids = _train_ids_from_names(
        options.train_classes, ids_by_name, records.class_ids, str(base)
    )
    train, test = records.split_by_class(train_ids)
    return build_split("folder", train, test, str(base), options)


@dataclass(frozen=True)
class CsvOptions(FileOptions):
    """Options of :func:`load_csv`."""

    image_root: str | Path | None = None
    """The folder relative paths start from (default: the CSV's folder)."""
    train_classes: Sequence[str] | None = None
    """Names of the train classes when there is no split column (default: the first half)."""


def load_csv(root: str | Path, options: CsvOptions | None = None) -> DMLSplit:
    """A CSV file of ``path,label[,split]`` rows (an optional header row names those columns).

    Paths are relative to ``options.image_root`` (default: the CSV's folder) unless absolute.
    Absolute paths and ``..`` are allowed on purpose: a CSV is a local dataset index its author
    controls. Code that builds a CSV from untrusted requests (a service) must check the paths
    itself, e.g. that ``Path(p).resolve()`` lies under the allowed folder. Labels are class names;
    when all are integers they are the original class ids, otherwise the ids are the positions in
    the sorted names. With a ``split`` column (``train``/``test``) the split is taken from it and
    checked to be class-disjoint; without one, the train classes are ``options.train_classes`` or
    the first half of the sorted classes.
    """
    options = options or CsvOptions()
    path = Path(root).expanduser()
    if path.is_dir():
        raise FileNotFoundError(
            f"data.root {path} is a folder; dataset csv needs the CSV file itself (root=<file.csv>)"
        )
    if not path.is_file():
        raise FileNotFoundError(f"CSV file {path} does not exist; pass root=<file.csv>")
    # utf-8-sig: a byte-order mark (spreadsheet exports) must not become part of the header.
    with path.open(newline="", encoding="utf-8-sig") as handle:
        rows = [
            (n, [c.strip() for c in row]) for n, row in enumerate(csv.reader(handle), 1) if any(row)
        ]
    if not rows:
        raise ValueError(f"{path} is empty; expected rows path,label[,split]")
    first = [c.lower() for c in rows[0][1]]
    if first[:1] == ["path"]:
        if first not in (["path", "label"], ["path", "label", "split"]):
            raise ValueError(
                f"{path}:{rows[0][0]}: header must be path,label[,split], got {','.join(first)}"
            )
        rows = rows[1:]
    num_columns = len(first)
    if num_columns not in (2, 3):
        raise ValueError(
            f"{path}:{rows[0][0]}: expected 2 or 3 columns path,label[,split], got {num_columns}"
        )
    bad_row = next(
        ((n, row) for n, row in rows if len(row) != num_columns or not all(row[:2])), None
    )
    if bad_row is not None:
        raise ValueError(
            f"{path}:{bad_row[0]}: expected {num_columns} non-empty columns, got {bad_row[1]}"
        )
    if not rows:
        raise ValueError(f"{path} has a header but no rows")
    image_root = options.image_root
    image_base = Path(image_root).expanduser() if image_root is not None else path.parent
    labels = [row[1] for _, row in rows]
    numeric = all(is_int(label) for label in labels)
    names = sorted(set(labels), key=int) if numeric else sorted(set(labels))
    ids_by_name = {name: (int(name) if numeric else i) for i, name in enumerate(names)}
    records = ImageRecords(
        paths=np.array([str(image_base / row[0]) for _, row in rows], dtype=object),
        class_ids=np.array([ids_by_name[label] for label in labels], dtype=np.int64),
        class_names={i: name for name, i in ids_by_name.items()},
    )
    if num_columns == 3:
        if options.train_classes is not None:
            raise ValueError(f"{path} has a split column; do not also pass train_classes")
        split = np.array([row[2].lower() for _, row in rows])
        bad = [n for (n, _), s in zip(rows, split) if s not in ("train", "test")]
        if bad:
            raise ValueError(
                f"{path}: split must be 'train' or 'test' (line(s) {format_examples(bad)})"
            )
        train, test = records.take(split == "train"), records.take(split == "test")
    else:
        train_ids = _train_ids_from_names(
            options.train_classes, ids_by_name, records.class_ids, str(path)
        )
        train, test = records.split_by_class(train_ids)
    return build_split("csv", train, test, str(path), options)
