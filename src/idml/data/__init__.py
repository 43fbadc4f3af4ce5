"""Data for deep metric learning: class-disjoint splits, datasets, samplers and transforms.

- :func:`read_images`: the one reader of a user's folder or CSV into :class:`ImageRecords`
  (labels, splits, query/gallery roles; README, "Data layouts"); the split policies of
  :mod:`idml.data.splits` make sides of them.
- :func:`load_split` (dispatch on :class:`DatasetName` through :data:`DATASETS`, the one list of
  datasets) returns a :class:`DMLSplit` of two
  :class:`ImageDataset` s yielding ``(image float C×H×W in [0, 1], label, index)``, train and test
  classes disjoint (README, "Data layouts").
- :class:`ClassBalancedBatchSampler` (P classes × K images) and :class:`RandomBatchSampler`,
  deterministic in ``(seed, epoch)``.
- :func:`build_transforms`: the DML paper recipe with configurable sizes.
"""

from idml.data.datasets import (
    ArrayImageDataset,
    CorruptImageError,
    DMLSplit,
    FileImageDataset,
    ImageDataset,
    ImageFailure,
    Transform,
    VerificationReport,
    dataset_length,
    decode_image_file,
    to_float_image,
)
from idml.data.loaders import (
    CarsOptions,
    CsvOptions,
    FileOptions,
    FolderOptions,
    load_cars,
    load_csv,
    load_cub,
    load_folder,
    load_sop,
)
from idml.data.offline import (
    FASHION_MNIST_ROOT,
    ArrayOptions,
    ArraySplitOptions,
    load_digits,
    load_fashion_mnist,
    read_idx,
)
from idml.data.reader import read_csv, read_folder, read_images
from idml.data.records import IMAGE_EXTENSIONS, ROLES, SPLITS, ImageRecords
from idml.data.registry import (
    DATASETS,
    LOADERS,
    DatasetName,
    DatasetSpec,
    dataset_options,
    load_split,
)
from idml.data.samplers import (
    ClassBalancedBatchSampler,
    EpochBatchSampler,
    RandomBatchSampler,
    SamplerKind,
    build_batch_sampler,
    epoch_generator,
)
from idml.data.splits import GivenSplit, given_split, holdout_split, split_by_class
from idml.data.transforms import (
    build_transforms,
    eval_resize_size,
    paper_transforms,
    to_float_transform,
)

__all__ = [
    "DATASETS",
    "FASHION_MNIST_ROOT",
    "IMAGE_EXTENSIONS",
    "LOADERS",
    "ROLES",
    "SPLITS",
    "ArrayImageDataset",
    "ArrayOptions",
    "ArraySplitOptions",
    "CarsOptions",
    "ClassBalancedBatchSampler",
    "CorruptImageError",
    "CsvOptions",
    "DMLSplit",
    "DatasetName",
    "DatasetSpec",
    "EpochBatchSampler",
    "FileImageDataset",
    "FileOptions",
    "FolderOptions",
    "GivenSplit",
    "ImageDataset",
    "ImageFailure",
    "ImageRecords",
    "RandomBatchSampler",
    "SamplerKind",
    "Transform",
    "VerificationReport",
    "build_batch_sampler",
    "build_transforms",
    "dataset_length",
    "dataset_options",
    "decode_image_file",
    "epoch_generator",
    "eval_resize_size",
    "given_split",
    "holdout_split",
    "load_cars",
    "load_csv",
    "load_cub",
    "load_digits",
    "load_fashion_mnist",
    "load_folder",
    "load_sop",
    "load_split",
    "paper_transforms",
    "read_csv",
    "read_folder",
    "read_idx",
    "read_images",
    "split_by_class",
    "to_float_image",
    "to_float_transform",
]
