"""One entry point for every dataset: :func:`load_split` dispatches on a typed :class:`DatasetName`.

Example:
    >>> split = load_split("digits", per_class=4)
    >>> split.name, split.num_train_classes, split.num_test_classes
    ('digits', 5, 5)
    >>> DatasetName.parse("CUB-200-2011") is DatasetName.CUB
    True
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal

from idml.data import loaders, offline, omniglot
from idml.data.datasets import DMLSplit, Transform

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


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

VerifyMode = Literal["none", "raise", "skip"]
"""What :func:`load_split` does with unreadable images: nothing, fail listing them, or drop them."""
_VERIFY_MODES: tuple[str, ...] = typing.get_args(VerifyMode)

Loader = Callable[..., DMLSplit]


@dataclass(frozen=True)
class DatasetSpec:
    """A registered dataset: its loader and what a run must know about it."""

    loader: Loader
    """Takes ``root`` and an instance of :attr:`options`."""
    options: type[DataclassInstance]
    """The loader's options, a frozen dataclass: its fields are the keywords :func:`load_split`
    takes for the dataset (:func:`dataset_options`)."""
    root: str | None = None
    """What ``root`` must point at; ``None``: the dataset needs no root (it ships with a package or
    has a default location)."""
    in_memory: bool = False
    """Decoded into memory at load time; takes ``channels``, ``seed`` and ``per_class``."""
    resize_on_load: bool = False
    """Resized once at load time (``image_size``) instead of in every sample's transform."""
    takes_root: bool = True
    """``False``: ``root`` must stay ``None`` (the data ships with a package)."""


DATASETS: Mapping[DatasetName, DatasetSpec] = MappingProxyType(
    {
        DatasetName.CUB: DatasetSpec(
            loaders.load_cub, loaders.FileOptions, "the CUB_200_2011 folder (with images.txt)"
        ),
        DatasetName.CARS: DatasetSpec(
            loaders.load_cars,
            loaders.CarsOptions,
            "the folder with cars_annos.mat + car_ims/ (or cars_train/, cars_test/, devkit/)",
        ),
        DatasetName.SOP: DatasetSpec(
            loaders.load_sop,
            loaders.FileOptions,
            "the Stanford_Online_Products folder (with Ebay_train.txt)",
        ),
        DatasetName.FOLDER: DatasetSpec(
            loaders.load_folder,
            loaders.FolderOptions,
            "a folder of class folders (the label is the folder path below it)",
        ),
        DatasetName.CSV: DatasetSpec(
            loaders.load_csv, loaders.CsvOptions, "a CSV file of path,label[,split[,role]] rows"
        ),
        DatasetName.DIGITS: DatasetSpec(
            offline.load_digits, offline.ArraySplitOptions, in_memory=True, takes_root=False
        ),
        DatasetName.FASHION_MNIST: DatasetSpec(
            offline.load_fashion_mnist, offline.ArraySplitOptions, in_memory=True
        ),
        DatasetName.OMNIGLOT: DatasetSpec(
            omniglot.load_omniglot,
            omniglot.OmniglotOptions,
            "the folder with images_background_small1.zip and _small2.zip",
            in_memory=True,
            resize_on_load=True,  # 105 px originals
        ),
    }
)
"""Every dataset :func:`load_split` knows, by name: the one list of datasets."""

LOADERS: Mapping[DatasetName, Loader] = MappingProxyType(
    {name: spec.loader for name, spec in DATASETS.items()}
)
"""The loader of each dataset; each takes ``root`` and its options (:attr:`DatasetSpec.options`)."""

_ROOT_HINTS: Mapping[DatasetName, str] = MappingProxyType(
    {name: spec.root for name, spec in DATASETS.items() if spec.root is not None}
)
"""Datasets that need ``root``, and what it must point at."""


def dataset_options(name: DatasetName | str) -> tuple[str, ...]:
    """The keyword options :func:`load_split` accepts for ``name`` (its options' fields)."""
    options = DATASETS[DatasetName.parse(name)].options
    return tuple(field.name for field in dataclasses.fields(options))


def load_split(
    name: DatasetName | str,
    root: str | Path | None = None,
    *,
    train_transform: Transform | None = None,
    test_transform: Transform | None = None,
    verify: VerifyMode = "none",
    verify_workers: int = 4,
    **options: Any,
) -> DMLSplit:
    """Load dataset ``name`` as a class-disjoint DML split, with transforms attached.

    ``options`` are the fields of the dataset's options (see :func:`dataset_options`); unknown
    ones are an error. ``verify`` decodes every image once after loading: ``"raise"`` fails listing the
    unreadable files, ``"skip"`` drops them (counted in the log and in each side's ``skipped``).
    """
    dataset = DatasetName.parse(name)
    spec = DATASETS[dataset]
    accepted = dataset_options(dataset)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(
            f"unknown option(s) {unknown} for dataset {dataset.value!r}; accepted: {list(accepted)}"
        )
    if root is None and dataset in _ROOT_HINTS:
        raise ValueError(f"dataset {dataset.value!r} needs root= {_ROOT_HINTS[dataset]}")
    if verify not in _VERIFY_MODES:
        raise ValueError(f"verify must be 'none', 'raise' or 'skip', got {verify!r}")
    loader_options = spec.options(**options)
    split = spec.loader(root, loader_options)
    if verify != "none":
        split = split.verified(
            verify,
            workers=verify_workers,
            min_images_per_class=getattr(loader_options, "min_images_per_class", 2),
        )
    return split.with_transforms(train_transform, test_transform)
