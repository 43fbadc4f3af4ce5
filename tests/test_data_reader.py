"""The one reader of a user's images (idml.data.reader): folder labels, CSV header, comments,
encoding, splits, roles and the errors that name the file, the line and the value."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from idml.data import load_csv, load_folder, read_csv, read_folder, read_images
from idml.data.classification import load_classification_split
from idml.data.loaders import FolderOptions


def _touch(root: Path, *names: str) -> None:
    """Empty files (the reader lists images, it does not decode them)."""
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"")


def _write_png(root: Path, *names: str) -> None:
    from PIL import Image

    for i, name in enumerate(names):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((6, 6, 3), 20 * i, np.uint8)).save(root / name)


# --------------------------------------------------------------------------- folders
def test_a_folder_label_is_the_path_below_the_root(tmp_path: Path) -> None:
    _touch(tmp_path, "Greek/character01/1.png", "Greek/character01/2.png")
    _touch(tmp_path, "Latin/character01/1.png", "Latin/character02/1.PNG", "Latin/notes.txt")
    _touch(tmp_path, ".cache/x.png", "Greek/.hidden.png")
    records = read_folder(tmp_path)
    names = [records.class_names[int(c)] for c in records.class_ids]
    assert names == ["Greek/character01"] * 2 + ["Latin/character01", "Latin/character02"]
    assert records.labelled and records.splits is None and records.roles is None


def test_images_at_several_depths_are_an_error_that_names_the_rule(tmp_path: Path) -> None:
    _touch(tmp_path, "Greek/character01/1.png", "Latin/1.png")
    with pytest.raises(ValueError) as caught:
        read_folder(tmp_path)
    message = str(caught.value)
    assert "1 at depth 1 (e.g. Latin/1.png); 1 at depth 2 (e.g. Greek/character01/1.png)" in message
    assert "path of its folder below the root" in message and "equally deep" in message


def test_a_flat_folder_is_unlabelled_and_split_folders_give_the_split(tmp_path: Path) -> None:
    _touch(tmp_path / "flat", "a.png", "b.jpg")
    flat = read_folder(tmp_path / "flat")
    assert not flat.labelled and len(flat) == 2
    with pytest.raises(ValueError, match="gives no class labels"):
        load_folder(tmp_path / "flat")
    _touch(tmp_path / "split", "train/cat/1.png", "val/dog/1.png", "test/eel/1.png")
    given = read_folder(tmp_path / "split")
    assert given.splits is not None
    assert given.splits.tolist() == ["train", "val", "test"]
    assert sorted(given.class_names.values()) == ["cat", "dog", "eel"]  # below the split folder


def test_folder_dataset_nested_classes_and_val_split(tmp_path: Path) -> None:
    names = [f"{g}/c{c}/{i}.png" for g in ("A", "B") for c in (1, 2) for i in range(2)]
    _write_png(tmp_path / "nested", *names)
    split = load_folder(tmp_path / "nested")
    assert split.train.class_names == ("A/c1", "A/c2") and split.num_test_classes == 2
    chosen = load_folder(tmp_path / "nested", FolderOptions(train_classes=["B/c2", "A/c1"]))
    assert chosen.train.class_names == ("A/c1", "B/c2")
    for side, c in (("train", "a"), ("train", "d"), ("val", "b"), ("test", "c")):
        _write_png(tmp_path / "sides", f"{side}/{c}/0.png", f"{side}/{c}/1.png")
    given = load_folder(tmp_path / "sides")
    assert given.train.class_names == ("a", "d") and given.test.class_names == ("c",)
    assert given.val is not None and given.val.class_names == ("b",)
    assert given.validation().test.class_names == ("b",)  # the source's val side


# --------------------------------------------------------------------------- CSV files
@pytest.mark.parametrize(
    "header", ["path,label", "file,class", "PATH,Label", "label,path", "Class,File,split"]
)
def test_a_header_is_detected_by_its_names(tmp_path: Path, header: str) -> None:
    _touch(tmp_path, "x.png", "y.png")
    columns = [c.strip().lower() for c in header.split(",")]
    values = {"path": "x.png", "file": "x.png", "label": "cat", "class": "cat", "split": "test"}
    row = ",".join(values[c] for c in columns)
    (tmp_path / "list.csv").write_text(f"{header}\n{row}\n{row.replace('x.png', 'y.png')}\n")
    records = read_csv(tmp_path / "list.csv")
    assert [Path(p).name for p in records.paths] == ["x.png", "y.png"]
    assert records.class_names == {0: "cat"}
    assert (records.splits is not None) == ("split" in columns)


def test_byte_order_mark_comments_and_blank_lines(tmp_path: Path) -> None:
    _touch(tmp_path, "img/a.png", "img/b.png")
    text = "\ufeff# exported from a spreadsheet\n\npath,label,split\n  # a note\nimg/a.png,1,train\n\nimg/b.png,2,val\n"
    (tmp_path / "list.csv").write_text(text, encoding="utf-8")
    records = read_csv(tmp_path / "list.csv")
    assert records.class_ids.tolist() == [1, 2]  # integer labels are the class ids
    assert records.splits is not None
    assert records.splits.tolist() == ["train", "val"]


def test_without_a_header_columns_are_positional_and_paths_relative_to_the_csv(
    tmp_path: Path,
) -> None:
    _touch(tmp_path, "images/a.png", "elsewhere/b.png")
    (tmp_path / "sub").mkdir()
    absolute = tmp_path / "elsewhere" / "b.png"
    (tmp_path / "sub" / "list.csv").write_text(f"../images/a.png,owl,test\n{absolute},cat,train,\n")
    records = read_images(tmp_path / "sub" / "list.csv")
    assert records.paths.tolist() == [str(tmp_path / "sub" / "../images/a.png"), str(absolute)]
    assert records.class_names == {0: "cat", 1: "owl"} and records.class_ids.tolist() == [1, 0]


def test_bad_split_value_names_file_line_and_value(tmp_path: Path) -> None:
    _touch(tmp_path, "a.png", "b.png", "c.png")
    (tmp_path / "l.csv").write_text("path,label,split\na.png,x,train\nb.png,x,valid\nc.png,y,Tst\n")
    with pytest.raises(ValueError) as caught:
        read_csv(tmp_path / "l.csv")
    assert str(caught.value) == (
        f"{tmp_path / 'l.csv'}:3: split must be train, val, test, got 'valid' (also line(s) 4)"
    )


def test_a_missing_image_names_the_csv_and_its_line(tmp_path: Path) -> None:
    _touch(tmp_path, "a.png")
    (tmp_path / "l.csv").write_text("# header next\npath,label\na.png,x\nb.png,x\nc.png,y\n")
    with pytest.raises(FileNotFoundError) as caught:
        read_csv(tmp_path / "l.csv")
    message = str(caught.value)
    assert message.startswith(f"{tmp_path / 'l.csv'}:4: image {tmp_path / 'b.png'} does not exist")
    assert "2 of 3 listed images are missing, also line(s) 5" in message
    assert f"relative paths are taken from {tmp_path}" in message
    with pytest.raises(FileNotFoundError, match=r"l\.csv:4: image .*b\.png does not exist"):
        load_csv(tmp_path / "l.csv")  # the dataset loader reads through the same reader


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("path,label,colour\na.png,x,red\n", r":1: unknown column 'colour'"),
        ("path,file\na.png,a.png\n", r":1: the header path,file names column 'path' twice"),
        ("label,split\nx,train\n", r":1: the header label,split has no path \(or file\) column"),
        ("path,label\na.png\n", r":2: expected 2 columns \(path,label\), got 1"),
        ("path,label\na.png,\n", r":2: the label is empty, got ''"),
        ("a.png,x,train,query,extra\n", r":1: 5 columns, but a CSV without a header has at most 4"),
        ("# only a comment\n", r"lists no images"),
    ],
)
def test_malformed_csv_lines_are_named(tmp_path: Path, text: str, message: str) -> None:
    _touch(tmp_path, "a.png")
    (tmp_path / "l.csv").write_text(text)
    with pytest.raises(ValueError, match=message):
        read_csv(tmp_path / "l.csv")


# --------------------------------------------------------------------------- roles
def test_roles_mark_the_evaluation_images(tmp_path: Path) -> None:
    _touch(tmp_path, *[f"{c}{i}.png" for c in "abc" for i in range(3)])
    rows = ["path,label,split,role"]
    rows += [f"a{i}.png,a,train," for i in range(3)]
    rows += [
        f"{c}{i}.png,{c},test,{'query' if i == 0 else 'gallery'}" for c in "bc" for i in range(3)
    ]
    (tmp_path / "l.csv").write_text("\n".join(rows) + "\n")
    records = read_csv(tmp_path / "l.csv")
    assert records.roles is not None and records.splits is not None
    assert records.roles.tolist() == [""] * 3 + ["query", "gallery", "gallery"] * 2
    test = records.take(records.splits == "test")
    assert test.roles is not None
    assert test.roles.tolist() == ["query", "gallery", "gallery"] * 2


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (["a0.png,a,train,query"], r":2: a training image has no role .*got 'query'"),
        (["b0.png,b,test,query", "b1.png,b,test,"], r":3: no role, but other images of the test"),
        (
            ["b0.png,b,test,query", "b1.png,b,test,query"],
            r"the test split has roles but no gallery",
        ),
        (["b0.png,b,test,probe"], r":2: role must be query, gallery, got 'probe'"),
    ],
)
def test_role_errors_name_the_lines(tmp_path: Path, rows: list[str], message: str) -> None:
    _touch(tmp_path, "a0.png", "b0.png", "b1.png")
    (tmp_path / "l.csv").write_text("path,label,split,role\n" + "\n".join(rows) + "\n")
    with pytest.raises(ValueError, match=message):
        read_csv(tmp_path / "l.csv")


def test_classification_reads_the_same_way(tmp_path: Path) -> None:
    # A val split serves as the test side when there is no test split (ImageNet's train/ + val/).
    names = [
        f"{side}/{g}/c/{i}.png" for side in ("train", "val") for g in ("A", "B") for i in (0, 1)
    ]
    _write_png(tmp_path, *names)
    split = load_classification_split("folder", tmp_path)
    assert split.train.class_names == split.test.class_names == ("A/c", "B/c")
    assert (len(split.train), len(split.test)) == (4, 4)
    rows = ["\ufefffile,class,split"] + [f"{n},{n.split('/')[1]},{n.split('/')[0]}" for n in names]
    (tmp_path / "l.csv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    table = load_classification_split("csv", tmp_path / "l.csv")  # a BOM fails here no more
    assert table.train.class_names == ("A", "B") and len(table.test) == 4


def test_roles_reach_the_test_side_only(tmp_path: Path) -> None:
    names = [f"{c}{i}.png" for c in "abcd" for i in range(3)]
    _write_png(tmp_path, *names)
    rows = ["path,label,split,role"]
    for name in names:
        test = name[0] in "cd"
        role = ("query" if name[1] == "0" else "gallery") if test else ""
        rows.append(f"{name},{name[0]},{'test' if test else 'train'},{role}")
    (tmp_path / "l.csv").write_text("\n".join(rows) + "\n")
    split = load_csv(tmp_path / "l.csv")
    assert split.test.roles is not None
    assert split.test.roles.tolist() == ["query", "gallery", "gallery"] * 2
    # Training images have none, nor has a validation side held out of the train classes.
    assert split.train.roles is None and split.validation(0.5).test.roles is None
    with pytest.raises(
        ValueError, match="has a role column: query/gallery roles are for retrieval"
    ):
        load_classification_split("csv", tmp_path / "l.csv")
