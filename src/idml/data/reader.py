"""The one reader of a user's images: a folder or a CSV file becomes
:class:`~idml.data.records.ImageRecords`, for every task, dataset kind and command (training on
``data.dataset: folder`` or ``csv``, ``idml embed``, ``idml index``, ``idml search``; ``idml
evaluate`` reads what ``idml embed`` wrote). It returns records and applies no split policy: the
task does (:mod:`idml.data.splits`).

**Folders.** The label of an image is the path of its folder below the root, ``/``-separated:
``root/cat/1.jpg`` is ``cat``, and Omniglot's ``root/Greek/character01/1.png`` is
``Greek/character01`` (not ``character01``, which every alphabet has). Every image must lie at the
same depth below the root; images at several depths are an error that names both depths, since
either labelling would be a guess. Images directly in the root have no label (a flat gallery). A
root whose only sub-folders are ``train``, ``val`` and ``test`` gives the split, and labels are the
paths below the split folder. Hidden files and folders and files of other suffixes are ignored; a
folder with no image anywhere below it is an error.

**CSV files.** Read as ``utf-8-sig`` (a spreadsheet's byte-order mark is dropped). Blank lines and
lines whose first non-blank character is ``#`` are skipped. The first row is a header when it holds
a column name: ``path`` (or ``file``), ``label`` (or ``class``), ``split``, ``role``, in any order,
in any case; without a header the columns are ``path[,label[,split[,role]]]``. Splits are
``train``, ``val`` and ``test``; roles, for evaluation images, ``query`` and ``gallery`` (queries
are searched against the gallery only, as in open-metric-learning's retrieval format): within a
split (or the whole file, without a split column) every image has a role or none has, and a
training image has none. Relative paths are taken from the CSV's folder (or ``image_root``);
absolute paths and ``..`` are accepted, since a CSV is a local index its author controls — code that
builds a CSV from untrusted input must check that each resolved path lies under its allowed folder.
Every error names the file, the line and the value.

**Class ids.** When every label is an integer, the integers are the class ids; otherwise the ids are
the positions of the names in sorted order (folder labels always are names).

Example:
    >>> import tempfile
    >>> root = Path(tempfile.mkdtemp())
    >>> for name in ("Greek/character01/a.png", "Greek/character02/b.png", "Latin/character01/c.png"):
    ...     (root / name).parent.mkdir(parents=True, exist_ok=True)
    ...     _ = (root / name).write_bytes(b"")
    >>> records = read_images(root)
    >>> sorted(records.class_names.values())
    ['Greek/character01', 'Greek/character02', 'Latin/character01']
    >>> _ = (root / "list.csv").write_text("# my images\\nfile,class,split\\nGreek/character01/a.png,1,test\\n")
    >>> table = read_images(root / "list.csv")
    >>> table.class_ids.tolist(), table.splits.tolist(), table.roles
    ([1], ['test'], None)
"""

from __future__ import annotations

import csv
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from idml.data.records import (
    IMAGE_EXTENSIONS,
    ROLES,
    SPLITS,
    ImageRecords,
    format_examples,
    is_int,
)

COLUMN_NAMES: dict[str, str] = {
    "path": "path",
    "file": "path",
    "label": "label",
    "class": "label",
    "split": "split",
    "role": "role",
}
"""Header names a CSV may use (case-insensitive) → the column they name."""

_POSITIONAL = ("path", "label", "split", "role")
"""The columns of a CSV without a header, in order."""


def read_images(
    source: str | Path,
    *,
    image_root: str | Path | None = None,
    extensions: Iterable[str] = IMAGE_EXTENSIONS,
    check_files: bool = True,
) -> ImageRecords:
    """The records of an image folder (:func:`read_folder`) or a ``.csv`` file (:func:`read_csv`)."""
    path = Path(source).expanduser()
    if path.is_dir():
        if image_root is not None:
            raise ValueError(f"image_root applies to a CSV file, but {path} is a folder")
        return read_folder(path, extensions)
    if path.is_file() and path.suffix.lower() == ".csv":
        return read_csv(path, image_root=image_root, check_files=check_files)
    if path.is_file():
        raise ValueError(f"{path} is neither an image folder nor a .csv file")
    raise FileNotFoundError(f"{path} does not exist; give an image folder or a .csv file")


# --------------------------------------------------------------------------- folders
def _suffixes(extensions: Iterable[str]) -> frozenset[str]:
    return frozenset(s.lower() if s.startswith(".") else f".{s.lower()}" for s in extensions)


@dataclass(frozen=True)
class _Image:
    """An image file found below a folder: its path and its folder's parts below that folder."""

    path: str
    folder: tuple[str, ...]


def _walk(top: Path, suffixes: frozenset[str]) -> list[_Image]:
    """The images below ``top`` in sorted depth-first order; an error names the folders below it
    that hold no image at all."""
    images: list[_Image] = []
    folders: list[tuple[str, ...]] = []
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        parts = Path(dirpath).relative_to(top).parts
        if parts:
            folders.append(parts)
        images += [
            _Image(os.path.join(dirpath, name), parts)
            for name in sorted(filenames)
            if not name.startswith(".") and Path(name).suffix.lower() in suffixes
        ]
    holding = {image.folder[:n] for image in images for n in range(1, len(image.folder) + 1)}
    # Name the outermost empty folders only (their empty sub-folders follow from them).
    empty = [f for f in folders if f not in holding and (len(f) == 1 or f[:-1] in holding)]
    if empty:
        raise ValueError(
            f"{top}: folder(s) {format_examples(['/'.join(f) for f in empty])} contain no images "
            f"with suffix {sorted(suffixes)}; add images or remove the folders"
        )
    return images


def _check_one_depth(root: Path, images: Sequence[_Image], where: str) -> None:
    """Raise unless every image lies at the same depth below ``root`` (module docstring)."""
    by_depth: dict[int, list[_Image]] = {}
    for image in images:
        by_depth.setdefault(len(image.folder), []).append(image)
    if len(by_depth) < 2:
        return
    described = [
        f"{len(found)} at depth {depth} (e.g. {os.path.relpath(found[0].path, root)})"
        for depth, found in sorted(by_depth.items())
    ]
    raise ValueError(
        f"{root}: images lie at different depths {where}: {'; '.join(described)}. An image's "
        "label is the path of its folder below the root (Greek/character01 for "
        "root/Greek/character01/1.png), so every image must be equally deep: move the images "
        "that are not into class folders of the same depth, or point at a sub-folder"
    )


def _split_folders(base: Path, suffixes: frozenset[str]) -> list[str] | None:
    """The split folders of ``base`` when its only sub-folders are among :data:`SPLITS` and it
    holds no image itself, else ``None``."""
    entries = [e for e in base.iterdir() if not e.name.startswith(".")]
    folders = sorted(e.name for e in entries if e.is_dir())
    if not folders or not set(folders) <= set(SPLITS):
        return None
    if any(e.is_file() and e.suffix.lower() in suffixes for e in entries):
        return None
    return [name for name in SPLITS if name in folders]


def read_folder(root: str | Path, extensions: Iterable[str] = IMAGE_EXTENSIONS) -> ImageRecords:
    """The images below ``root``, labelled by the path of their folder below it (module docstring).

    Returns unlabelled records for a flat folder (images directly in ``root``) and records with
    ``splits`` for a root of ``train``/``val``/``test`` folders.
    """
    base = Path(root).expanduser()
    if not base.is_dir():
        raise FileNotFoundError(f"image folder {base} is not a directory")
    suffixes = _suffixes(extensions)
    splits = _split_folders(base, suffixes)
    parts: list[tuple[str | None, list[_Image]]] = [(None, _walk(base, suffixes))]
    if splits is not None:
        parts = [(split, _walk(base / split, suffixes)) for split in splits]
    images = [image for _, found in parts for image in found]
    if not images:
        raise ValueError(f"{base} contains no images with suffix {sorted(suffixes)}")
    where = "below the split folders" if splits else "below it"
    _check_one_depth(base, images, where)
    labelled = len(images[0].folder) > 0
    labels = ["/".join(image.folder) for image in images]
    names = sorted(set(labels)) if labelled else []
    ids = {name: i for i, name in enumerate(names)}
    return ImageRecords(
        paths=np.array([image.path for image in images], dtype=object),
        class_ids=np.array([ids[label] if labelled else 0 for label in labels], dtype=np.int64),
        class_names=dict(enumerate(names)),
        splits=(
            np.array([split for split, found in parts for _ in found], dtype=object)
            if splits
            else None
        ),
        labelled=labelled,
    )


# --------------------------------------------------------------------------- CSV files
@dataclass(frozen=True)
class _Row:
    line: int
    cells: dict[str, str]


def _bad_lines(path: Path, bad: Sequence[tuple[int, str]], problem: str) -> ValueError:
    """``list.csv:3: <problem>, got 'x' (also line(s) 7, 9)``: the first offending line and value,
    then where else."""
    line, value = bad[0]
    more = ""
    if len(bad) > 1:
        more = f" (also line(s) {format_examples([n for n, _ in bad[1:]])})"
    return ValueError(f"{path}:{line}: {problem}, got {value!r}{more}")


def _header(path: Path, line: int, cells: list[str]) -> list[str] | None:
    """The columns a header row names, ``None`` when ``cells`` is a data row."""
    lowered = [c.lower() for c in cells]
    if not any(c in COLUMN_NAMES for c in lowered):
        return None
    unknown = [c for c in cells if c.lower() not in COLUMN_NAMES]
    if unknown:
        raise ValueError(
            f"{path}:{line}: unknown column {unknown[0]!r} in the header {','.join(cells)}; "
            f"columns are {', '.join(COLUMN_NAMES)} (path and file, label and class are synonyms)"
        )
    columns = [COLUMN_NAMES[c] for c in lowered]
    repeated = sorted({c for c in columns if columns.count(c) > 1})
    if repeated:
        raise ValueError(
            f"{path}:{line}: the header {','.join(cells)} names column {repeated[0]!r} twice"
        )
    if "path" not in columns:
        raise ValueError(
            f"{path}:{line}: the header {','.join(cells)} has no path (or file) column"
        )
    return columns


def _read_rows(path: Path) -> list[_Row]:
    """The data rows of a CSV (module docstring: encoding, comments, header, column count)."""
    try:
        return _parse_rows(path)
    except UnicodeDecodeError:
        raise ValueError(
            f"{path} is not UTF-8 text (a binary file, or a CSV saved in another encoding); "
            "save it as UTF-8"
        ) from None


def _parse_rows(path: Path) -> list[_Row]:
    columns: list[str] | None = None
    rows: list[_Row] = []
    with path.open(newline="", encoding="utf-8-sig") as handle:
        for line, text in enumerate(handle, start=1):
            if not text.strip() or text.lstrip().startswith("#"):
                continue
            cells = [c.strip() for c in next(csv.reader([text]))]
            if columns is None:
                columns = _header(path, line, cells)
                if columns is not None:
                    continue
                if len(cells) > len(_POSITIONAL):
                    raise ValueError(
                        f"{path}:{line}: {len(cells)} columns, but a CSV without a header has at "
                        f"most {len(_POSITIONAL)}: {','.join(_POSITIONAL)}"
                    )
                columns = list(_POSITIONAL[: len(cells)])
            while len(cells) > len(columns) and not cells[-1]:
                cells.pop()  # trailing empty cells a spreadsheet adds
            if len(cells) != len(columns):
                raise ValueError(
                    f"{path}:{line}: expected {len(columns)} columns ({','.join(columns)}), got "
                    f"{len(cells)}: {text.strip()!r}"
                )
            rows.append(_Row(line, dict(zip(columns, cells))))
    if not rows:
        raise ValueError(f"{path} lists no images; expected rows of path[,label[,split]]")
    return rows


def _checked_column(
    path: Path, rows: Sequence[_Row], column: str, allowed: Sequence[str], optional: bool
) -> np.ndarray | None:
    """The column's values in lower case, each among ``allowed`` (or empty when ``optional``)."""
    if column not in rows[0].cells:
        return None
    values = [row.cells[column].lower() for row in rows]
    accepted = set(allowed) | ({""} if optional else set())
    bad = [(row.line, row.cells[column]) for row, v in zip(rows, values) if v not in accepted]
    if bad:
        raise _bad_lines(path, bad, f"{column} must be {', '.join(allowed)}")
    return np.array(values, dtype=object)


def _check_roles(
    path: Path, rows: Sequence[_Row], splits: np.ndarray | None, roles: np.ndarray
) -> None:
    """A training image has no role; within a split (or the file) every image has one or none."""
    lines = np.array([row.line for row in rows])
    groups = splits if splits is not None else np.full(len(rows), "", dtype=object)
    if splits is not None:
        trained = (splits == "train") & (roles != "")
        if trained.any():
            bad = [(int(n), str(r)) for n, r in zip(lines[trained], roles[trained])]
            raise _bad_lines(
                path, bad, "a training image has no role (roles mark evaluation images)"
            )
    for group in np.unique(groups):
        member = groups == group
        given = roles[member] != ""
        if not given.any():
            continue
        where = f"the {group} split" if group else "the file"
        if not given.all():
            missing = lines[member][~given].tolist()
            raise ValueError(
                f"{path}:{missing[0]}: no role, but other images of {where} have one; give every "
                f"evaluation image a role (query or gallery), or none "
                f"(lines without one: {format_examples(missing)})"
            )
        absent = [role for role in ROLES if not (roles[member] == role).any()]
        if absent:
            raise ValueError(
                f"{path}: {where} has roles but no {absent[0]} image; queries are searched "
                "against the gallery, so both are needed"
            )


def read_csv(
    path: str | Path, *, image_root: str | Path | None = None, check_files: bool = True
) -> ImageRecords:
    """The records of a CSV file (module docstring); ``check_files`` checks that every image
    exists, naming the lines that list missing ones."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise FileNotFoundError(f"{path} is a folder, not a CSV file")
    if not path.is_file():
        raise FileNotFoundError(f"CSV file {path} does not exist")
    rows = _read_rows(path)
    empty = [(row.line, "") for row in rows if not row.cells["path"]]
    if empty:
        raise _bad_lines(path, empty, "the path is empty")
    base = Path(image_root).expanduser() if image_root is not None else path.parent
    paths = [str(base / row.cells["path"]) for row in rows]  # an absolute path replaces base
    if check_files:
        missing = [(row.line, p) for row, p in zip(rows, paths) if not os.path.isfile(p)]
        if missing:
            line, first = missing[0]
            also = f", also line(s) {format_examples([n for n, _ in missing[1:]])}"
            raise FileNotFoundError(
                f"{path}:{line}: image {first} does not exist ({len(missing)} of {len(rows)} "
                f"listed images are missing{also if len(missing) > 1 else ''}); relative paths "
                f"are taken from {base}"
            )
    labelled = "label" in rows[0].cells
    labels = [row.cells.get("label", "") for row in rows]
    if labelled:
        unlabelled = [(row.line, "") for row, label in zip(rows, labels) if not label]
        if unlabelled:
            raise _bad_lines(path, unlabelled, "the label is empty")
    numeric = labelled and all(is_int(label) for label in labels)
    names = sorted(set(labels), key=int) if numeric else sorted(set(labels))
    ids = {name: (int(name) if numeric else i) for i, name in enumerate(names)}
    splits = _checked_column(path, rows, "split", SPLITS, optional=False)
    roles = _checked_column(path, rows, "role", ROLES, optional=True)
    if roles is not None:
        _check_roles(path, rows, splits, roles)
    return ImageRecords(
        paths=np.array(paths, dtype=object),
        class_ids=np.array([ids[label] if labelled else 0 for label in labels], dtype=np.int64),
        class_names={i: name for name, i in ids.items()} if labelled else {},
        splits=splits,
        roles=roles,
        labelled=labelled,
    )
