"""Data for deep metric learning: class-disjoint splits, datasets, samplers and transforms.

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
from idml.data.records import IMAGE_EXTENSIONS, ImageRecords
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
    "ImageDataset",
    "ImageFailure",
    "ImageRecords",
    "RandomBatchSampler",
    "SamplerKind",
    "Transform",
    "VerificationReport",
    "build_batch_sampler",
    "build_transforms",
    "dataset_options",
    "decode_image_file",
    "epoch_generator",
    "eval_resize_size",
    "load_cars",
    "load_csv",
    "load_cub",
    "load_digits",
    "load_fashion_mnist",
    "load_folder",
    "load_sop",
    "load_split",
    "paper_transforms",
    "read_idx",
    "to_float_image",
    "to_float_transform",
]
