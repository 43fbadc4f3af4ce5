"""One entry point for every dataset: :func:`load_split` dispatches on a typed :class:`DatasetName`.

Example:
    >>> split = load_split("digits", per_class=4)
    >>> split.name, split.num_train_classes, split.num_test_classes
    ('digits', 5, 5)
    >>> DatasetName.parse("CUB-200-2011") is DatasetName.CUB
    True
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from enum import Enum
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from idml.data.datasets import DMLSplit, Transform
from idml.data.loaders import load_cars, load_csv, load_cub, load_folder, load_sop
from idml.data.offline import load_digits, load_fashion_mnist
from idml.data.omniglot import load_omniglot


class DatasetName(str, Enum):
    """The datasets :func:`load_split` knows (layouts: README, "Data layouts")."""

    CUB = "cub"
    CARS = "cars"
    SOP = "sop"
    FOLDER = "folder"
    CSV = "csv"
    DIGITS = "digits"
    FASHION_MNIST = "fashion_mnist"
    OMNIGLOT = "omniglot"

    @classmethod
    def parse(cls, name: DatasetName | str) -> DatasetName:
        """The member for ``name`` or a common alias (case, ``-`` and spaces ignored)."""
        if isinstance(name, DatasetName):
            return name
        key = str(name).strip().lower().replace("-", "_").replace(" ", "_")
        key = _ALIASES.get(key, key)
        try:
            return cls(key)
        except ValueError:
            raise ValueError(
                f"unknown dataset {name!r}; choose one of {[member.value for member in cls]}"
            ) from None


_ALIASES: dict[str, str] = {
    "cub200": "cub",
    "cub_200": "cub",
    "cub_200_2011": "cub",
    "cars196": "cars",
    "stanford_cars": "cars",
    "stanford_online_products": "sop",
    "fmnist": "fashion_mnist",
    "fashionmnist": "fashion_mnist",
}

Loader = Callable[..., DMLSplit]

LOADERS: Mapping[DatasetName, Loader] = MappingProxyType(
    {
        DatasetName.CUB: load_cub,
        DatasetName.CARS: load_cars,
        DatasetName.SOP: load_sop,
        DatasetName.FOLDER: load_folder,
        DatasetName.CSV: load_csv,
        DatasetName.DIGITS: load_digits,
        DatasetName.FASHION_MNIST: load_fashion_mnist,
        DatasetName.OMNIGLOT: load_omniglot,
    }
)
"""The loader of each dataset; each takes ``root`` first and its options as keywords."""

_ROOT_HINTS: Mapping[DatasetName, str] = MappingProxyType(
    {
        DatasetName.CUB: "the CUB_200_2011 folder (with images.txt)",
        DatasetName.CARS: "the folder with cars_annos.mat + car_ims/ (or cars_train/, cars_test/, devkit/)",
        DatasetName.SOP: "the Stanford_Online_Products folder (with Ebay_train.txt)",
        DatasetName.FOLDER: "a folder with one sub-folder of images per class",
        DatasetName.CSV: "a CSV file of path,label[,split] rows",
        DatasetName.OMNIGLOT: "the folder with images_background_small1.zip and _small2.zip",
    }
)
"""Datasets that need ``root``, and what it must point at."""


def dataset_options(name: DatasetName | str) -> tuple[str, ...]:
    """The keyword options the loader of ``name`` accepts."""
    loader = LOADERS[DatasetName.parse(name)]
    parameters = inspect.signature(loader).parameters.values()
    return tuple(p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY)


def load_split(
    name: DatasetName | str,
    root: str | Path | None = None,
    *,
    train_transform: Transform | None = None,
    test_transform: Transform | None = None,
    verify: Literal["none", "raise", "skip"] = "none",
    verify_workers: int = 4,
    **options: Any,
) -> DMLSplit:
    """Load dataset ``name`` as a class-disjoint DML split, with transforms attached.

    ``options`` go to the dataset's loader (see :func:`dataset_options`); unknown ones are an
    error. ``verify`` decodes every image once after loading: ``"raise"`` fails listing the
    unreadable files, ``"skip"`` drops them (counted in the log and in each side's ``skipped``).
    """
    dataset = DatasetName.parse(name)
    loader = LOADERS[dataset]
    accepted = dataset_options(dataset)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(
            f"unknown option(s) {unknown} for dataset {dataset.value!r}; accepted: {list(accepted)}"
        )
    if root is None and dataset in _ROOT_HINTS:
        raise ValueError(f"dataset {dataset.value!r} needs root= {_ROOT_HINTS[dataset]}")
    if verify not in ("none", "raise", "skip"):
        raise ValueError(f"verify must be 'none', 'raise' or 'skip', got {verify!r}")
    split = loader(root, **options)
    if verify != "none":
        split = split.verified(
            verify,
            workers=verify_workers,
            min_images_per_class=int(options.get("min_images_per_class", 2)),
        )
    return split.with_transforms(train_transform, test_transform)
