"""Image records: the parsed, validated table of a dataset before it becomes a torch ``Dataset``.

Every file-based loader (CUB, Cars196, SOP, and a user's folder or CSV through
:mod:`idml.data.reader`) parses its annotation files into one :class:`ImageRecords` table — a
path, an *original* class id and optionally a bounding box, a split and an evaluation role per
image — and then a split policy (:mod:`idml.data.splits`) makes its train and test sides. The
checks of bad input live here so that every loader applies them the same way, each an error that
names the file and the fix rather than a silently wrong split: missing files, classes with too few
images, malformed annotation lines.

Example:
    >>> import numpy as np
    >>> records = ImageRecords(
    ...     paths=np.array(["a/1.jpg", "a/2.jpg", "b/1.jpg", "b/2.jpg"], dtype=object),
    ...     class_ids=np.array([7, 7, 9, 9]),
    ...     class_names={7: "a", 9: "b"},
    ... )
    >>> train, test = records.split_by_class(np.array([7]))
    >>> len(train), len(test), test.class_ids.tolist()
    (2, 2, [9, 9])
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

IMAGE_EXTENSIONS: frozenset[str] = frozenset(
    {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm"}
)
"""File suffixes (lower case) recognised as images by the folder loader."""

_MAX_LISTED = 5
"""How many offending items an error message lists before summarising the rest as a count."""


def format_examples(items: Sequence[object], total: int | None = None) -> str:
    """``a, b, c (and 7 more)``: a short list of offending items for an error message."""
    total = len(items) if total is None else total
    shown = ", ".join(str(item) for item in items[:_MAX_LISTED])
    return shown if total <= _MAX_LISTED else f"{shown} (and {total - _MAX_LISTED} more)"


SPLITS: tuple[str, ...] = ("train", "val", "test")
"""The values of a split column (or the names of split folders)."""

ROLES: tuple[str, ...] = ("query", "gallery")
"""The evaluation roles of an image: searched with, or searched in (open-metric-learning's
``is_query`` / ``is_gallery``)."""


@dataclass(frozen=True)
class ImageRecords:
    """A columnar table with one row per image: file path, original class id, optional box,
    split and evaluation role.

    ``class_ids`` keep the numbering of the source (CUB and Cars classes start at 1, SOP class ids
    are global across its two files); the datasets built from these records remap them to
    ``0..C−1`` and keep the originals. ``boxes`` are ``(x1, y1, x2, y2)`` pixel boxes (Cars196).
    ``splits`` (one of :data:`SPLITS` per row) and ``roles`` (one of :data:`ROLES`, or ``""`` for
    none) are given by the source when it has them. ``labelled=False``: the source names no
    classes (a flat folder of images, a CSV without a label column); ``class_ids`` are then all 0.
    """

    paths: np.ndarray
    class_ids: np.ndarray
    class_names: Mapping[int, str] = field(default_factory=dict)
    boxes: np.ndarray | None = None
    splits: np.ndarray | None = None
    roles: np.ndarray | None = None
    labelled: bool = True

    def __post_init__(self) -> None:
        paths = np.asarray(self.paths, dtype=object).reshape(-1)
        class_ids = np.asarray(self.class_ids)
        if class_ids.ndim != 1 or len(class_ids) != len(paths):
            raise ValueError(
                f"class_ids must be a vector with one entry per path ({len(paths)} paths), "
                f"got shape {class_ids.shape}"
            )
        if len(class_ids) and not np.issubdtype(class_ids.dtype, np.integer):
            raise ValueError(f"class_ids must be integers, got dtype {class_ids.dtype}")
        if self.boxes is not None and np.asarray(self.boxes).shape != (len(paths), 4):
            raise ValueError(
                f"boxes must have shape ({len(paths)}, 4) (x1, y1, x2, y2 per image), "
                f"got {np.asarray(self.boxes).shape}"
            )
        for name, allowed in (("splits", SPLITS), ("roles", (*ROLES, ""))):
            column = getattr(self, name)
            if column is None:
                continue
            column = np.asarray(column, dtype=object).reshape(-1)
            if len(column) != len(paths):
                raise ValueError(f"{name} must have one entry per path ({len(paths)} paths)")
            unknown = sorted({str(v) for v in column} - set(allowed))
            if unknown:
                raise ValueError(f"{name} must be among {list(allowed)}, got {unknown}")
            object.__setattr__(self, name, column)
        object.__setattr__(self, "paths", paths)
        object.__setattr__(self, "class_ids", class_ids.astype(np.int64, copy=False))
        if self.boxes is not None:
            object.__setattr__(self, "boxes", np.asarray(self.boxes, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.paths)

    def take(self, rows: np.ndarray) -> ImageRecords:
        """The sub-table of the given rows (a boolean mask or integer indices)."""
        return ImageRecords(
            paths=self.paths[rows],
            class_ids=self.class_ids[rows],
            class_names=self.class_names,
            boxes=None if self.boxes is None else self.boxes[rows],
            splits=None if self.splits is None else self.splits[rows],
            roles=None if self.roles is None else self.roles[rows],
            labelled=self.labelled,
        )

    @staticmethod
    def concat(tables: Sequence[ImageRecords]) -> ImageRecords:
        """The rows of ``tables`` one after the other (class names merged; boxes, splits and roles
        kept if all have them)."""
        if not tables:
            raise ValueError("concat needs at least one table")
        names: dict[int, str] = {}
        for table in tables:
            names.update(table.class_names)

        def column(name: str) -> np.ndarray | None:
            parts = [getattr(table, name) for table in tables]
            return None if any(p is None for p in parts) else np.concatenate(parts)

        return ImageRecords(
            paths=np.concatenate([table.paths for table in tables]),
            class_ids=np.concatenate([table.class_ids for table in tables]),
            class_names=names,
            boxes=column("boxes"),
            splits=column("splits"),
            roles=column("roles"),
            labelled=all(table.labelled for table in tables),
        )

    def require_labels(self, source: str) -> None:
        """Raise a ``ValueError`` naming ``source`` when its images carry no class labels."""
        if not self.labelled:
            raise ValueError(
                f"{source} gives no class labels: put the images in one folder per class "
                "(root/<class>/<image>), or give the CSV a label column (path,label[,split])"
            )

    def split_by_class(self, train_class_ids: np.ndarray) -> tuple[ImageRecords, ImageRecords]:
        """``(train, test)``: images whose original class is in ``train_class_ids``, and the rest.

        A DML split is by class, never by image (the benchmarks' zero-shot protocol), so the two
        halves share no class.
        """
        in_train = np.isin(self.class_ids, np.asarray(train_class_ids, dtype=np.int64))
        return self.take(in_train), self.take(~in_train)

    def check_files_exist(self, source: str) -> None:
        """Raise ``FileNotFoundError`` listing the image files that do not exist.

        ``source`` names the annotation file or folder the paths came from, so the message says
        where the dangling entries are.
        """
        missing = [path for path in self.paths if not os.path.isfile(path)]
        if missing:
            raise FileNotFoundError(
                f"{len(missing)} of {len(self)} images listed in {source} do not exist: "
                f"{format_examples(missing)}. Check that the dataset was fully extracted and that "
                "root points at the dataset directory"
            )

    def check_min_images_per_class(self, minimum: int, source: str) -> None:
        """Raise ``ValueError`` naming the classes with fewer than ``minimum`` images.

        A class with a single image has no positive pair: it cannot train a metric and, in a test
        set, cannot be queried; this check names such classes instead of keeping them silently.
        """
        if minimum < 1:
            raise ValueError(f"min_images_per_class must be >= 1, got {minimum}")
        classes, counts = np.unique(self.class_ids, return_counts=True)
        small = classes[counts < minimum]
        if len(small):
            described = [
                f"{self.class_names.get(int(c), c)!s} ({int(n)} image{'s' if n != 1 else ''})"
                for c, n in zip(small, counts[counts < minimum])
            ]
            raise ValueError(
                f"{source}: {len(small)} class(es) have fewer than {minimum} images: "
                f"{format_examples(described)}. Add images to them, remove them, or pass "
                f"min_images_per_class={max(1, int(counts.min()))} to accept them"
            )


def read_table(
    path: Path, num_fields: int, *, header: Sequence[str] | None = None
) -> list[list[str]]:
    """Rows of a whitespace-separated text file with exactly ``num_fields`` fields per line.

    The last field may contain spaces (it is taken as the remainder of the line). Blank lines are
    skipped. With ``header``, the first non-blank line must match it (case-insensitive); the
    error names the file, the line and what was expected.
    """
    if not path.is_file():
        raise FileNotFoundError(f"annotation file {path} does not exist; check the dataset root")
    rows: list[list[str]] = []
    header_pending = header is not None
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            text = line.strip()
            if not text:
                continue
            fields = text.split(maxsplit=num_fields - 1)
            if header_pending and header is not None:
                if [f.lower() for f in text.split()] != [h.lower() for h in header]:
                    raise ValueError(
                        f"{path}:{line_number}: expected the header {' '.join(header)!r}, "
                        f"got {text!r}; is this the right annotation file?"
                    )
                header_pending = False
                continue
            if len(fields) != num_fields:
                raise ValueError(
                    f"{path}:{line_number}: expected {num_fields} fields, got {len(fields)} "
                    f"in {text!r}; is this the right annotation file?"
                )
            rows.append(fields)
    if not rows:
        raise ValueError(f"{path} has no entries; the annotation file is empty or truncated")
    return rows


def parse_ints(values: Sequence[str], path: Path, column: str) -> np.ndarray:
    """The column ``values`` as int64, or a ``ValueError`` naming the file, column and bad value."""
    try:
        return np.array([int(value) for value in values], dtype=np.int64)
    except ValueError:
        bad = next(v for v in values if not is_int(v))
        raise ValueError(
            f"{path}: column {column!r} must hold integers, found {bad!r}; "
            "is this the right annotation file?"
        ) from None


def is_int(text: str) -> bool:
    """Whether ``text`` parses as a Python ``int``."""
    try:
        int(text)
    except ValueError:
        return False
    return True
