"""Dataset contract: (float image in [0, 1], label, index), relabelling, subsets, transforms, splits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision.transforms import v2

from idml.data import (
    ArrayImageDataset,
    ClassBalancedBatchSampler,
    DMLSplit,
    FileImageDataset,
    ImageRecords,
    decode_image_file,
)
from idml.data.datasets import last_whole_groups


def toy_images(count: int, height: int = 6, width: int = 5) -> np.ndarray:
    return (np.arange(count * height * width) % 256).astype(np.uint8).reshape(count, height, width)


def test_array_dataset_labels_are_sorted_original_ids() -> None:
    dataset = ArrayImageDataset(
        toy_images(5), class_ids=[40, 7, 40, 12, 7], class_names={7: "seven"}
    )
    assert dataset.classes == (7, 12, 40)
    assert dataset.labels.tolist() == [2, 0, 2, 1, 0]
    assert dataset.class_ids.tolist() == [40, 7, 40, 12, 7]
    assert dataset.class_names == ("seven", "12", "40")
    assert dataset.class_counts().tolist() == [2, 1, 2]
    image, label, index = dataset[-1]
    assert (label, index) == (0, 4)
    expected = torch.from_numpy(toy_images(5)[4]).float() / 255
    assert image.shape == (3, 6, 5) and torch.equal(image[1], expected)
    with pytest.raises(IndexError, match="out of range"):
        dataset[5]


def test_array_dataset_channels_and_validation() -> None:
    rgb = np.zeros((2, 4, 4, 3), dtype=np.uint8)
    rgb[..., 0] = 255  # pure red
    gray = ArrayImageDataset(rgb, class_ids=[0, 1], channels=1)[0][0]
    assert gray.shape == (1, 4, 4)
    assert torch.allclose(gray, torch.full((1, 4, 4), 0.299), atol=1 / 255)  # ITU-R 601 luma of red
    with pytest.raises(ValueError, match="must be uint8"):
        ArrayImageDataset(rgb.astype(np.float32), class_ids=[0, 1])
    with pytest.raises(ValueError, match="one class id per image"):
        ArrayImageDataset(rgb, class_ids=[0])
    with pytest.raises(ValueError, match=r"channels must be 1 \(grayscale\) or 3"):
        ArrayImageDataset(rgb, class_ids=[0, 1], channels=2)  # type: ignore[arg-type]


def test_subset_relabels_and_transform_outputs_are_normalised_to_float() -> None:
    dataset = ArrayImageDataset(toy_images(6), class_ids=[1, 1, 5, 5, 9, 9])
    subset = dataset.subset([2, 3, 4, 5])
    assert subset.classes == (5, 9) and subset.labels.tolist() == [0, 0, 1, 1]
    assert torch.equal(subset[0][0], dataset[2][0])

    # A transform that stays uint8 (no ToDtype) still yields float [0, 1].
    cropped = dataset.with_transform(v2.CenterCrop(4))
    image, _, _ = cropped[0]
    assert image.dtype == torch.float32 and image.shape == (3, 4, 4) and float(image.max()) <= 1.0
    assert dataset.transform is None and cropped.images is dataset.images  # data shared
    to_pil = dataset.with_transform(v2.ToPILImage())
    # Exact: PIL holds the uint8 pixels losslessly and both go through the same uint8 → float division.
    assert torch.equal(to_pil[0][0], dataset[0][0])


def test_split_checks_disjoint_and_non_empty() -> None:
    train = ArrayImageDataset(toy_images(2), class_ids=[1, 2])
    with pytest.raises(
        ValueError, match=r"toy: train and test share 1 class\(es\) \(original ids 2\)"
    ):
        DMLSplit(train, ArrayImageDataset(toy_images(2), class_ids=[2, 3]), "toy")
    with pytest.raises(ValueError, match="toy: the test split has no images"):
        DMLSplit(train, train.subset([]), "toy")
    split = DMLSplit(train, ArrayImageDataset(toy_images(3), class_ids=[4, 4, 8]), "toy")
    assert split.summary() == {
        "name": "toy",
        "train_images": 2,
        "train_classes": 2,
        "test_images": 3,
        "test_classes": 2,
        "skipped_images": 0,
    }


def test_held_out_groups_are_whole_and_named_errors_say_what_to_use() -> None:
    # Ids 0-1 are group a, 2-5 group b, 6 group c: whole groups come off the end of the ids.
    names = {0: "a/0", 1: "a/1", 2: "b/0", 3: "b/1", 4: "b/2", 5: "b/3", 6: "c/0"}
    train = ArrayImageDataset(
        toy_images(14), class_ids=[c for c in names for _ in (0, 1)], class_names=names
    )
    split = DMLSplit(train, ArrayImageDataset(toy_images(2), class_ids=[9, 9]), "toy")
    # 0.5 of 7 classes: c alone (1/7) or b + c (5/7, the closer).
    held = split.held_out(0.5, "last_groups")
    assert held.val is not None and held.val.class_names == ("b/0", "b/1", "b/2", "b/3", "c/0")
    assert held.train.class_names == ("a/0", "a/1") and held.test is split.test
    # The same share by 'last' cuts group b (ceil(3.5) = 4 classes: b/1 to c/0).
    assert split.validation(0.5).test.class_names == ("b/1", "b/2", "b/3", "c/0")
    assert split.validation(0.1, "last_groups").test.class_names == ("c/0",)

    flat = DMLSplit(ArrayImageDataset(toy_images(4), class_ids=[0, 0, 1, 1]), split.test, "flat")
    with pytest.raises(
        ValueError,
        match=r"^key: holding out whole groups needs class names of "
        r"the form group/class .*; the class names 0, 1 have no group; hold out classes with",
    ):
        last_whole_groups(flat.train.class_names, 0.5, "key")
    # The error names the order setting that asked for groups, not the share.
    with pytest.raises(
        ValueError, match=r"^data\.validation_order=last_groups: holding out whole groups"
    ):
        flat.validation(0.5, "last_groups")
    one = ArrayImageDataset(toy_images(4), class_ids=[0, 0, 1, 1], class_names={0: "g/x", 1: "g/y"})
    with pytest.raises(ValueError, match=r"all 2 classes are in the one group 'g'"):
        DMLSplit(one, split.test, "one").held_out(0.5, "last_groups")
    with pytest.raises(ValueError, match=r"^calibration\.held_out_order=last_groups: all 2"):
        DMLSplit(one, split.test, "one").held_out(0.5, "last_groups")


def test_file_dataset_grayscale_decoding_and_errors(tmp_path: Path) -> None:
    Image.new("L", (7, 5), 128).save(tmp_path / "gray.png")
    Image.new("RGB", (7, 5), (255, 0, 0)).save(tmp_path / "red.png")
    records = ImageRecords(
        paths=np.array([str(tmp_path / "gray.png"), str(tmp_path / "red.png")], dtype=object),
        class_ids=np.array([0, 1]),
    )
    rgb = FileImageDataset(records)
    # float32 128/255 vs the double 128/255 rounded to float32: at most 1 ulp apart, inside
    # allclose's rtol 1e-5.
    assert torch.allclose(rgb[0][0], torch.full((3, 5, 7), 128 / 255))
    one = FileImageDataset(records, channels=1)
    assert one[1][0].shape == (1, 5, 7)
    # PIL's integer luma (0.299·255 = 76.245) may round to 76 or 77 depending on its implementation:
    # one level, 1/255.
    assert torch.allclose(one[1][0], torch.full((1, 5, 7), 76 / 255), atol=1 / 255)
    with pytest.raises(FileNotFoundError, match=r"image .*nowhere\.png does not exist"):
        decode_image_file(str(tmp_path / "nowhere.png"), 3)
    with pytest.raises(ValueError, match="crop_to_box=True needs records with bounding boxes"):
        FileImageDataset(records, crop_to_box=True)


def test_dataloader_with_class_balanced_batches() -> None:
    class_ids = np.repeat(np.arange(4), 3)
    dataset = ArrayImageDataset(toy_images(12, 8, 8), class_ids=class_ids)
    sampler = ClassBalancedBatchSampler(dataset.labels, classes_per_batch=2, images_per_class=3)
    loader = DataLoader(dataset, batch_sampler=sampler)
    batches = list(loader)
    assert len(batches) == len(sampler) == 2
    images, labels, indices = batches[0]
    assert images.shape == (6, 3, 8, 8) and images.dtype == torch.float32
    assert torch.equal(labels, dataset.labels[indices])
    assert labels.view(2, 3).unique(dim=1).shape == (2, 1)
