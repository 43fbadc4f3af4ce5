"""The Cars196 loader (Krause et al. 2013): classes 1–98 train, 99–196 test, from ``cars_annos.mat``
or from the devkit layout (see :mod:`idml.data.loaders`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from idml.data.datasets import DMLSplit
from idml.data.loading import FileOptions, build_split, check_class_range
from idml.data.records import ImageRecords

CARS_NUM_CLASSES = 196
CARS_LAST_TRAIN_CLASS = 98


def _load_mat(path: Path) -> dict[str, Any]:
    import scipy.io

    if not path.is_file():
        raise FileNotFoundError(f"annotation file {path} does not exist; check the dataset root")
    try:
        return scipy.io.loadmat(str(path), squeeze_me=True)
    except Exception as err:  # scipy's parser fails on garbage with assorted exception types
        raise ValueError(
            f"{path} is not a readable MATLAB .mat file ({err}); re-download it"
        ) from err


def _struct_columns(
    mat: dict[str, Any], key: str, fields: Sequence[str], path: Path
) -> dict[str, np.ndarray]:
    """The named fields of MATLAB struct ``key`` as flat columns.

    Accepts both the ``1×N`` struct array of the official files and a ``1×1`` struct whose fields
    are arrays.
    """
    if key not in mat:
        found = sorted(k for k in mat if not k.startswith("__"))
        raise ValueError(f"{path} has no variable {key!r} (found {found}); is this the right file?")
    struct = np.atleast_1d(mat[key])
    names = struct.dtype.names or ()
    missing = [f for f in fields if f not in names]
    if missing:
        raise ValueError(
            f"{path}: struct {key!r} lacks field(s) {missing} (has {list(names)}); "
            "is this the right annotation file?"
        )
    columns = {
        f: np.concatenate([np.atleast_1d(value).reshape(-1) for value in struct[f]]) for f in fields
    }
    lengths = {len(column) for column in columns.values()}
    if len(lengths) != 1:
        raise ValueError(f"{path}: fields of {key!r} have different lengths {sorted(lengths)}")
    return columns


def _int_column(column: np.ndarray, path: Path, field: str) -> np.ndarray:
    try:
        return column.astype(np.int64)
    except (TypeError, ValueError):
        raise ValueError(
            f"{path}: field {field!r} must hold integers; is this the right file?"
        ) from None


def _cars_class_names(mat: dict[str, Any]) -> dict[int, str]:
    names = np.atleast_1d(mat.get("class_names", np.array([], dtype=object))).reshape(-1)
    return {i + 1: str(name) for i, name in enumerate(names)}


_BOX_FIELDS = ("bbox_x1", "bbox_y1", "bbox_x2", "bbox_y2")


def _cars_records(
    columns: dict[str, np.ndarray], paths: np.ndarray, path: Path, names: dict[int, str]
) -> ImageRecords:
    class_ids = _int_column(columns["class"], path, "class")
    check_class_range(class_ids, path, CARS_NUM_CLASSES, "Cars196")
    boxes = np.stack([_int_column(columns[f], path, f) for f in _BOX_FIELDS], axis=1)
    return ImageRecords(paths=paths, class_ids=class_ids, class_names=names, boxes=boxes)


@dataclass(frozen=True)
class CarsOptions(FileOptions):
    """Options of :func:`load_cars`."""

    crop_to_box: bool = False
    """Crop every image to its annotated box (off by default, as in the DML literature)."""


def load_cars(root: str | Path, options: CarsOptions | None = None) -> DMLSplit:
    """Cars196 as a DML split: classes 1–98 train (8,054 images), 99–196 test (8,131).

    Two layouts are accepted (in ``root`` or ``root/stanford_cars``):

    - original: ``cars_annos.mat`` (struct ``annotations`` with ``relative_im_path``,
      ``bbox_x1..bbox_y2``, ``class``, ``test``) and ``car_ims/``;
    - devkit: ``cars_train/``, ``cars_test/``, ``devkit/cars_train_annos.mat``,
      ``cars_test_annos_withlabels.mat`` (in ``devkit/`` or the root; the devkit's own
      ``cars_test_annos.mat`` has no labels) and optionally ``devkit/cars_meta.mat`` for names.
      Both halves are merged, then split by class.

    ``options.crop_to_box`` crops every image to its annotated box (off by default, as in the DML
    literature).
    """
    options = options or CarsOptions()
    base = Path(root).expanduser()
    candidates = [base, base / "stanford_cars"]
    original = next((c for c in candidates if (c / "cars_annos.mat").is_file()), None)
    devkit = next(
        (
            c
            for c in candidates
            if _first_file(c, "devkit/cars_train_annos.mat", "cars_train_annos.mat")
        ),
        None,
    )
    if original is not None:
        annos = original / "cars_annos.mat"
        mat = _load_mat(annos)
        columns = _struct_columns(
            mat, "annotations", ("relative_im_path", "class", *_BOX_FIELDS), annos
        )
        paths = np.array(
            [str(original / str(p)) for p in columns["relative_im_path"]], dtype=object
        )
        records = _cars_records(columns, paths, annos, _cars_class_names(mat))
        source = str(annos)
    elif devkit is not None:
        records, source = _cars_devkit_records(devkit)
    else:
        raise FileNotFoundError(
            f"Cars196: found neither cars_annos.mat nor devkit/cars_train_annos.mat in {base}; "
            "pass root= the folder with cars_annos.mat + car_ims/, or with cars_train/, "
            "cars_test/ and devkit/"
        )
    train, test = records.split_by_class(np.arange(1, CARS_LAST_TRAIN_CLASS + 1))
    return build_split("cars", train, test, source, options, crop_to_box=options.crop_to_box)


def _first_file(base: Path, *relative: str) -> Path | None:
    return next((base / r for r in relative if (base / r).is_file()), None)


def _image_dir(base: Path, name: str) -> Path:
    """``base/name``, or ``base/name/name`` as some archives nest it."""
    nested = base / name / name
    return nested if nested.is_dir() else base / name


def _cars_devkit_records(base: Path) -> tuple[ImageRecords, str]:
    train_annos = _first_file(base, "devkit/cars_train_annos.mat", "cars_train_annos.mat")
    test_annos = _first_file(
        base, "devkit/cars_test_annos_withlabels.mat", "cars_test_annos_withlabels.mat"
    )
    if train_annos is None:
        raise FileNotFoundError(
            f"Cars196 devkit layout: devkit/cars_train_annos.mat missing in {base}"
        )
    if test_annos is None:
        raise FileNotFoundError(
            f"Cars196 devkit layout: cars_test_annos_withlabels.mat missing in {base} and "
            f"{base / 'devkit'}; the devkit's cars_test_annos.mat has no class labels — download "
            "cars_test_annos_withlabels.mat, or use the cars_annos.mat + car_ims/ layout"
        )
    meta = _first_file(base, "devkit/cars_meta.mat", "cars_meta.mat")
    names = _cars_class_names(_load_mat(meta)) if meta is not None else {}
    halves = []
    for annos, folder in ((train_annos, "cars_train"), (test_annos, "cars_test")):
        columns = _struct_columns(
            _load_mat(annos), "annotations", ("fname", "class", *_BOX_FIELDS), annos
        )
        image_dir = _image_dir(base, folder)
        paths = np.array([str(image_dir / str(f)) for f in columns["fname"]], dtype=object)
        halves.append(_cars_records(columns, paths, annos, names))
    return ImageRecords.concat(halves), f"{train_annos} + {test_annos}"
