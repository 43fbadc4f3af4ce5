"""Loaders of CUB, Cars196, SOP, folder and CSV datasets on tiny real trees written under tmp_path.

Every image is a uniform colour that encodes its original class id, so a decoded image proves
that the path ↔ label mapping is right, independently of the loader's bookkeeping.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import scipy.io
import torch
from PIL import Image

from idml.data import (
    CarsOptions,
    CorruptImageError,
    CsvOptions,
    DatasetName,
    DMLSplit,
    FileImageDataset,
    FileOptions,
    FolderOptions,
    build_transforms,
    load_cars,
    load_csv,
    load_cub,
    load_folder,
    load_sop,
    load_split,
)


def colour_of(class_id: int) -> tuple[int, int, int]:
    """A colour that identifies a class id (distinct for ids < 256, far apart in red)."""
    return ((class_id * 37) % 256, (class_id * 11) % 256, 200)


def write_jpeg(path: Path, class_id: int, size: tuple[int, int] = (20, 16)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour_of(class_id)).save(path, format="JPEG", quality=95)


def assert_colour(image: torch.Tensor, class_id: int) -> None:
    """The decoded image is the uniform colour of ``class_id`` (JPEG error of a few levels)."""
    expected = torch.tensor(colour_of(class_id), dtype=torch.float32) / 255.0
    mean = image.mean(dim=(1, 2))
    # Not rounding: JPEG (quality 95) of a uniform colour is off by a few of the 255 levels; 4/255
    # bounds that, far below the distance between two class colours.
    assert torch.allclose(mean, expected, atol=4 / 255), (mean * 255, class_id)


def assert_labels_match_images(split: DMLSplit) -> None:
    for dataset in (split.train, split.test):
        assert dataset.labels.tolist() == [dataset.classes.index(int(c)) for c in dataset.class_ids]
        assert sorted(set(dataset.labels.tolist())) == list(range(dataset.num_classes))
        for index in range(len(dataset)):
            image, label, returned_index = dataset[index]
            assert returned_index == index
            assert image.dtype == torch.float32 and image.shape[0] == 3
            assert float(image.min()) >= 0.0 and float(image.max()) <= 1.0
            assert_colour(image, dataset.classes[label])


# --------------------------------------------------------------------------- CUB
CUB_CLASSES = {1: 3, 2: 2, 100: 2, 101: 3, 200: 2}
"""Original class id → number of images of the tiny CUB tree."""


def make_cub(root: Path, classes: dict[int, int] = CUB_CLASSES) -> Path:
    base = root / "CUB_200_2011"
    image_lines, label_lines, split_lines, class_lines = [], [], [], []
    image_id = 0
    for class_id, count in classes.items():
        folder = f"{class_id:03d}.Bird_{class_id}"
        class_lines.append(f"{class_id} {folder}")
        for k in range(count):
            image_id += 1
            relative = f"{folder}/Bird_{class_id}_{k:04d}.jpg"
            write_jpeg(base / "images" / relative, class_id, size=(20 + k, 16))
            image_lines.append(f"{image_id} {relative}")
            label_lines.append(f"{image_id} {class_id}")
            # The classification split: deliberately all "train" — a DML loader must ignore it.
            split_lines.append(f"{image_id} 1")
    (base / "images.txt").write_text("\n".join(image_lines) + "\n")
    (base / "image_class_labels.txt").write_text("\n".join(label_lines) + "\n")
    (base / "train_test_split.txt").write_text("\n".join(split_lines) + "\n")
    (base / "classes.txt").write_text("\n".join(class_lines) + "\n")
    return base


def test_cub_split_counts_labels_and_pixels(tmp_path: Path) -> None:
    make_cub(tmp_path)
    split = load_cub(tmp_path)  # the parent of CUB_200_2011 is accepted too
    assert split.name == "cub"
    assert len(split.train) == 3 + 2 + 2 and len(split.test) == 3 + 2
    assert split.train.classes == (1, 2, 100) and split.test.classes == (101, 200)
    assert split.num_train_classes == 3 and split.num_test_classes == 2
    assert split.train.labels.tolist() == [0, 0, 0, 1, 1, 2, 2]
    assert split.test.labels.tolist() == [0, 0, 0, 1, 1]
    assert split.test.class_names == ("Bird_101", "Bird_200")
    assert_labels_match_images(split)
    assert split.train[1][0].shape == (3, 16, 21)  # H×W of the second image of class 1


def test_cub_missing_image_names_the_file(tmp_path: Path) -> None:
    base = make_cub(tmp_path)
    missing = base / "images" / "101.Bird_101" / "Bird_101_0001.jpg"
    missing.unlink()
    with pytest.raises(FileNotFoundError, match=r"1 of 12 images.*Bird_101_0001\.jpg"):
        load_cub(base)


def test_cub_label_file_that_disagrees_with_folders(tmp_path: Path) -> None:
    base = make_cub(tmp_path)
    labels = base / "image_class_labels.txt"
    lines = labels.read_text().splitlines()
    lines[0] = "1 2"  # image 1 lives in 001.Bird_1 but is labelled 2
    labels.write_text("\n".join(lines))
    with pytest.raises(
        ValueError, match=r"image_class_labels\.txt.*disagree.*Bird_1_0000\.jpg labelled 2"
    ):
        load_cub(base)


def test_cub_label_file_for_other_images(tmp_path: Path) -> None:
    base = make_cub(tmp_path)
    labels = base / "image_class_labels.txt"
    labels.write_text(labels.read_text().replace("12 200", "99 200"))
    with pytest.raises(
        ValueError, match=r"does not match .*images\.txt.*no label \(12\).*unknown image ids \(99\)"
    ):
        load_cub(base)


def test_cub_non_integer_labels_and_wrong_field_count(tmp_path: Path) -> None:
    base = make_cub(tmp_path)
    labels = base / "image_class_labels.txt"
    original = labels.read_text()
    labels.write_text(original.replace("3 1\n", "3 one\n"))
    with pytest.raises(ValueError, match=r"image_class_labels\.txt: column 'class_id'.*'one'"):
        load_cub(base)
    labels.write_text(original.replace("3 1\n", "3\n"))
    with pytest.raises(ValueError, match=r"image_class_labels\.txt:3: expected 2 fields"):
        load_cub(base)


def test_cub_class_ids_out_of_range(tmp_path: Path) -> None:
    base = make_cub(tmp_path, {1: 2, 201: 2})
    with pytest.raises(ValueError, match=r"1\.\.200.*201"):
        load_cub(base)


def test_cub_class_with_one_image(tmp_path: Path) -> None:
    base = make_cub(tmp_path, {1: 2, 2: 1, 150: 2})
    with pytest.raises(
        ValueError, match=r"train split.*Bird_2 \(1 image\).*min_images_per_class=1"
    ):
        load_cub(base)
    split = load_cub(base, FileOptions(min_images_per_class=1))
    assert split.train.class_counts().tolist() == [2, 1]


def test_cub_missing_annotation_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no images\.txt"):
        load_cub(tmp_path)
    base = make_cub(tmp_path)
    (base / "image_class_labels.txt").unlink()
    with pytest.raises(FileNotFoundError, match=r"image_class_labels\.txt does not exist"):
        load_cub(base)


def test_corrupt_and_truncated_images(tmp_path: Path) -> None:
    base = make_cub(tmp_path)
    garbage = base / "images" / "002.Bird_2" / "Bird_2_0000.jpg"
    garbage.write_bytes(b"this is not a jpeg")
    truncated = base / "images" / "200.Bird_200" / "Bird_200_0001.jpg"
    truncated.write_bytes(truncated.read_bytes()[:200])

    split = load_cub(base)  # files exist, so loading succeeds; decoding is what fails
    assert isinstance(split.train, FileImageDataset)  # CUB is read from image files
    bad_index = split.train.paths.tolist().index(str(garbage))
    with pytest.raises(CorruptImageError, match=r"cannot decode image .*Bird_2_0000\.jpg"):
        split.train[bad_index]

    report = split.test.verify(workers=2)
    assert report.checked == 5 and not report.ok
    assert [f.source for f in report.failures] == [str(truncated)]

    with pytest.raises(CorruptImageError, match=r"1 of 7 images cannot be read.*Bird_2_0000\.jpg"):
        load_split("cub", base, verify="raise")

    # Skipping drops both files, but class 2 would keep one image: still an error.
    with pytest.raises(ValueError, match=r"after dropping unreadable images.*Bird_2"):
        load_split("cub", base, verify="skip")
    skipped = load_split("cub", base, verify="skip", min_images_per_class=1)
    assert len(skipped.train) == 6 and len(skipped.test) == 4
    assert [f.source for f in skipped.train.skipped] == [str(garbage)]
    assert skipped.summary()["skipped_images"] == 2
    assert_labels_match_images(skipped)


# --------------------------------------------------------------------------- Cars196
CARS_CLASSES = {1: 2, 2: 3, 98: 2, 99: 2, 150: 3, 196: 2}


def car_class_names() -> np.ndarray:
    return np.array([f"Car model {i}" for i in range(1, 197)], dtype=object)


def annotation_struct(rows: list[dict[str, object]]) -> np.ndarray:
    """A MATLAB 1×N struct array (as in the official .mat files) from dict rows."""
    fields = list(rows[0])
    struct = np.empty(len(rows), dtype=[(f, object) for f in fields])
    for i, row in enumerate(rows):
        struct[i] = tuple(row[f] for f in fields)
    return struct


def box(k: int) -> dict[str, object]:
    return {"bbox_x1": 2, "bbox_y1": 3, "bbox_x2": 12 + k, "bbox_y2": 10}


def make_cars_original(root: Path, classes: dict[int, int] = CARS_CLASSES) -> Path:
    rows: list[dict[str, object]] = []
    for class_id, count in classes.items():
        for k in range(count):
            relative = f"car_ims/{len(rows) + 1:06d}.jpg"
            write_jpeg(root / relative, class_id)
            # The "test" flag is the classification split; make it contradict the DML split.
            rows.append({"relative_im_path": relative, **box(k), "class": class_id, "test": k % 2})
    scipy.io.savemat(
        root / "cars_annos.mat",
        {"annotations": annotation_struct(rows), "class_names": car_class_names()},
    )
    return root


def test_cars_original_layout(tmp_path: Path) -> None:
    make_cars_original(tmp_path)
    split = load_cars(tmp_path)
    assert split.train.classes == (1, 2, 98) and split.test.classes == (99, 150, 196)
    assert len(split.train) == 7 and len(split.test) == 7
    assert split.test.labels.tolist() == [0, 0, 1, 1, 1, 2, 2]
    assert split.train.class_names[2] == "Car model 98"
    assert_labels_match_images(split)
    cropped = load_cars(tmp_path, CarsOptions(crop_to_box=True))
    image, _, _ = cropped.train[1]  # second image of class 1: box (2, 3, 13, 10)
    assert image.shape == (3, 7, 11)


def test_cars_devkit_layout_merges_then_splits_by_class(tmp_path: Path) -> None:
    halves = {"cars_train": {1: 2, 5: 1, 120: 2}, "cars_test": {5: 2, 120: 1, 196: 2}}
    rows_by_half: dict[str, list[dict[str, object]]] = {}
    for folder, classes in halves.items():
        rows: list[dict[str, object]] = []
        for class_id, count in classes.items():
            for k in range(count):
                name = f"{len(rows) + 1:05d}.jpg"
                write_jpeg(tmp_path / folder / name, class_id)
                rows.append({**box(k), "class": class_id, "fname": name})
        rows_by_half[folder] = rows
    (tmp_path / "devkit").mkdir()
    scipy.io.savemat(
        tmp_path / "devkit" / "cars_train_annos.mat",
        {"annotations": annotation_struct(rows_by_half["cars_train"])},
    )
    scipy.io.savemat(
        tmp_path / "cars_test_annos_withlabels.mat",
        {"annotations": annotation_struct(rows_by_half["cars_test"])},
    )
    scipy.io.savemat(tmp_path / "devkit" / "cars_meta.mat", {"class_names": car_class_names()})

    split = load_cars(tmp_path)
    assert split.train.classes == (1, 5) and split.test.classes == (120, 196)
    assert split.train.class_counts().tolist() == [2, 3]
    assert split.test.class_counts().tolist() == [3, 2]
    assert split.test.class_names == ("Car model 120", "Car model 196")
    assert_labels_match_images(split)


def test_cars_devkit_without_test_labels(tmp_path: Path) -> None:
    (tmp_path / "devkit").mkdir()
    rows = [{**box(0), "class": 1, "fname": "00001.jpg"}]
    scipy.io.savemat(
        tmp_path / "devkit" / "cars_train_annos.mat", {"annotations": annotation_struct(rows)}
    )
    with pytest.raises(
        FileNotFoundError, match=r"cars_test_annos_withlabels\.mat missing.*no class labels"
    ):
        load_cars(tmp_path)


def test_cars_wrong_annotation_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"neither cars_annos\.mat nor devkit"):
        load_cars(tmp_path)
    rows = [{"relative_im_path": "car_ims/000001.jpg", **box(0), "test": 0}]
    scipy.io.savemat(tmp_path / "cars_annos.mat", {"annotations": annotation_struct(rows)})
    with pytest.raises(
        ValueError, match=r"cars_annos\.mat: struct 'annotations' lacks field\(s\) \['class'\]"
    ):
        load_cars(tmp_path)
    (tmp_path / "cars_annos.mat").write_bytes(b"not a mat file at all")
    with pytest.raises(ValueError, match=r"not a readable MATLAB"):
        load_cars(tmp_path)


def test_cars_class_out_of_range(tmp_path: Path) -> None:
    make_cars_original(tmp_path, {1: 2, 197: 2})
    with pytest.raises(ValueError, match=r"1\.\.196.*197"):
        load_cars(tmp_path)


# --------------------------------------------------------------------------- Stanford Online Products
def make_sop(root: Path, train: dict[int, int], test: dict[int, int]) -> Path:
    base = root / "Stanford_Online_Products"
    image_id = 0
    for file_name, classes in (("Ebay_train.txt", train), ("Ebay_test.txt", test)):
        lines = ["image_id class_id super_class_id path"]
        for class_id, count in classes.items():
            super_id = 1 + class_id % 2
            folder = ("bicycle_final", "cabinet_final")[super_id - 1]
            for k in range(count):
                image_id += 1
                relative = f"{folder}/{1000 + class_id}_{k}.JPG"
                write_jpeg(base / relative, class_id)
                lines.append(f"{image_id} {class_id} {super_id} {relative}")
        (base / file_name).write_text("\n".join(lines) + "\n")
    return base


def test_sop_split_from_files(tmp_path: Path) -> None:
    make_sop(tmp_path, train={1: 2, 2: 4, 3: 2}, test={4: 3, 5: 2})
    split = load_sop(tmp_path)
    assert (len(split.train), len(split.test)) == (8, 5)
    assert split.train.classes == (1, 2, 3) and split.test.classes == (4, 5)
    assert split.test.class_names == ("bicycle_final/4", "cabinet_final/5")
    assert_labels_match_images(split)


def test_sop_overlapping_classes_and_bad_header(tmp_path: Path) -> None:
    base = make_sop(tmp_path, train={1: 2, 2: 2}, test={2: 2, 3: 2})
    with pytest.raises(
        ValueError, match=r"sop: train and test share 1 class\(es\) \(original ids 2\)"
    ):
        load_sop(base)
    test_file = base / "Ebay_test.txt"
    test_file.write_text(test_file.read_text().replace("super_class_id", "superclass"))
    with pytest.raises(ValueError, match=r"Ebay_test\.txt:1: expected the header"):
        load_sop(base)


# --------------------------------------------------------------------------- folder and CSV
def make_folder(root: Path, classes: dict[str, int]) -> Path:
    for index, (name, count) in enumerate(classes.items()):
        (root / name).mkdir(parents=True)
        for k in range(count):
            write_jpeg(root / name / f"img{k}.jpg", index)
        (root / name / "notes.txt").write_text("not an image")
    return root


def test_folder_first_half_of_sorted_classes(tmp_path: Path) -> None:
    make_folder(tmp_path / "data", {"ant": 2, "bee": 3, "cat": 2, "dog": 2, "eel": 2})
    (tmp_path / "data" / ".cache").mkdir()
    split = load_folder(tmp_path / "data")
    assert split.train.class_names == ("ant", "bee", "cat")
    assert split.test.class_names == ("dog", "eel")
    assert (len(split.train), len(split.test)) == (7, 4)
    assert_labels_match_images(split)

    chosen = load_folder(tmp_path / "data", FolderOptions(train_classes=["eel", "ant"]))
    assert chosen.train.class_names == ("ant", "eel")
    assert chosen.test.class_names == ("bee", "cat", "dog")
    with pytest.raises(ValueError, match=r"not in .*: zebra"):
        load_folder(tmp_path / "data", FolderOptions(train_classes=["zebra"]))


def test_folder_empty_class_is_an_error(tmp_path: Path) -> None:
    make_folder(tmp_path, {"ant": 2, "bee": 0, "cat": 2})
    with pytest.raises(ValueError, match=r"folder\(s\) bee contain no images"):
        load_folder(tmp_path)


def test_csv_with_split_column(tmp_path: Path) -> None:
    for class_id in (3, 7, 12):
        for k in range(2):
            write_jpeg(tmp_path / "img" / f"{class_id}_{k}.jpg", class_id)
    rows = ["path,label,split"]
    rows += [
        f"img/{c}_{k}.jpg,{c},{'train' if c == 12 else 'TEST'}"
        for c in (3, 7, 12)
        for k in range(2)
    ]
    (tmp_path / "list.csv").write_text("\n".join(rows) + "\n")
    split = load_csv(tmp_path / "list.csv")
    assert split.train.classes == (12,) and split.test.classes == (3, 7)
    assert_labels_match_images(split)

    (tmp_path / "bad.csv").write_text("path,label,split\nimg/3_0.jpg,3,train\nimg/3_1.jpg,3,test\n")
    with pytest.raises(ValueError, match=r"share 1 class.*class-disjoint"):
        load_csv(tmp_path / "bad.csv", CsvOptions(min_images_per_class=1))
    (tmp_path / "val.csv").write_text("img/3_0.jpg,3,valid\n")
    with pytest.raises(
        ValueError, match=r"val\.csv:1: split must be train, val, test, got 'valid'"
    ):
        load_csv(tmp_path / "val.csv")


def test_csv_without_split_uses_class_names(tmp_path: Path) -> None:
    names = ["owl", "cat", "fox", "ant"]
    for index, name in enumerate(names):
        for k in range(2):
            write_jpeg(tmp_path / "images" / f"{name}{k}.png", index)
    (tmp_path / "sub").mkdir()
    text = "\n".join(f"{name}{k}.png,{name}" for name in names for k in range(2))
    (tmp_path / "sub" / "list.csv").write_text(text + "\n")
    split = load_csv(tmp_path / "sub" / "list.csv", CsvOptions(image_root=tmp_path / "images"))
    assert split.train.class_names == ("ant", "cat") and split.test.class_names == ("fox", "owl")
    for dataset in (split.train, split.test):
        for index in range(len(dataset)):
            image, label, _ = dataset[index]
            assert_colour(image, names.index(dataset.class_names[label]))
    (tmp_path / "short.csv").write_text("a.png,owl\nb.png\n")
    with pytest.raises(ValueError, match=r"short\.csv:2: expected 2 columns \(path,label\), got 1"):
        load_csv(tmp_path / "short.csv")


# --------------------------------------------------------------------------- registry
def test_load_split_dispatch_transforms_and_option_errors(tmp_path: Path) -> None:
    make_sop(tmp_path, train={1: 2, 2: 2}, test={3: 2})
    split = load_split(
        "Stanford-Online-Products",
        tmp_path,
        train_transform=build_transforms(train=True, image_size=12),
        test_transform=build_transforms(train=False, image_size=8),
    )
    assert split.name == DatasetName.SOP.value
    assert split.train[0][0].shape == (3, 12, 12) and split.test[0][0].shape == (3, 8, 8)

    with pytest.raises(ValueError, match=r"unknown dataset 'imagenet'; choose one of \['cub'"):
        load_split("imagenet", tmp_path)
    with pytest.raises(
        ValueError, match=r"unknown option\(s\) \['crop_to_box'\] for dataset 'sop'"
    ):
        load_split(DatasetName.SOP, tmp_path, crop_to_box=True)
    with pytest.raises(ValueError, match=r"dataset 'cub' needs root="):
        load_split("cub")
