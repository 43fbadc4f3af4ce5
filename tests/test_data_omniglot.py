"""The Omniglot loader on small archives built here (the real zips are a benchmark's business)."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from idml.app.config import load_config
from idml.data import DMLSplit
from idml.data.omniglot import OmniglotOptions, load_omniglot
from idml.data.registry import load_split

SMALL1 = {"Balinese": 3, "Greek": 2, "Latin": 2}
SMALL2 = {"Greek": 2, "Latin": 2, "Tagalog": 2, "Sanskrit": 3}
DRAWERS = 4


def _png(value: int, size: int = 12) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.full((size, size), value, np.uint8)).convert("1").save(out, "PNG")
    return out.getvalue()


def _archive(root: Path, name: str, alphabets: dict[str, int], unzipped: bool = False) -> None:
    files = {
        f"{name}/{alphabet}/character{c + 1:02d}/{c:04d}_{d + 1:02d}.png": _png(255 * (d % 2))
        for alphabet, count in alphabets.items()
        for c in range(count)
        for d in range(DRAWERS)
    }
    if unzipped:
        for path, data in files.items():
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_bytes(data)
        return
    with zipfile.ZipFile(root / f"{name}.zip", "w") as archive:
        for path, data in files.items():
            archive.writestr(path, data)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    _archive(tmp_path, "images_background_small1", SMALL1)
    _archive(tmp_path, "images_background_small2", SMALL2)
    return tmp_path


def test_split_by_alphabet_drops_shared_alphabets_from_test(root: Path) -> None:
    split = load_omniglot(root)
    assert split.num_train_classes == sum(SMALL1.values())
    assert split.num_test_classes == SMALL2["Tagalog"] + SMALL2["Sanskrit"]
    assert len(split.train) == DRAWERS * sum(SMALL1.values())
    assert len(split.test) == DRAWERS * split.num_test_classes
    test_alphabets = {name.split("/")[0] for name in split.test.class_names}
    assert test_alphabets == {"Sanskrit", "Tagalog"}  # Greek and Latin are in both zips
    train_names = set(split.train.class_names)
    assert {"Greek/character01", "Latin/character02"} <= train_names
    assert not train_names & set(split.test.class_names)
    image, label, _ = split.train[0]
    assert tuple(image.shape) == (3, 12, 12) and 0 <= label < split.num_train_classes
    assert {float(image.min()), float(image.max())} <= {0.0, 1.0}  # one-bit strokes kept as is


def test_unzipped_folders_and_resizing(tmp_path: Path) -> None:
    _archive(tmp_path, "images_background_small1", SMALL1, unzipped=True)
    _archive(tmp_path, "images_background_small2", SMALL2)
    split = load_omniglot(tmp_path, OmniglotOptions(image_size=8, channels=1))
    assert tuple(split.test[0][0].shape) == (1, 8, 8)
    assert split.num_test_classes == 5


def test_full_pair_is_found(tmp_path: Path) -> None:
    _archive(tmp_path, "images_background", {"Korean": 2})
    _archive(tmp_path, "images_evaluation", {"Mongolian": 3})
    split = load_omniglot(tmp_path)
    assert (split.num_train_classes, split.num_test_classes) == (2, 3)


def test_missing_or_broken_archives_are_named(tmp_path: Path) -> None:
    _archive(tmp_path, "images_background_small1", SMALL1)
    with pytest.raises(FileNotFoundError, match=r"images_background_small2\.zip"):
        load_omniglot(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"images_background_small2\.zip"):
        load_omniglot(
            tmp_path,
            OmniglotOptions(
                train_archives=["images_background_small1"],
                test_archives=["images_background_small2"],
            ),
        )
    (tmp_path / "images_background_small2.zip").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match=r"images_background_small2\.zip is not a readable zip"):
        load_omniglot(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_omniglot(tmp_path / "nowhere")


def test_only_shared_alphabets_leave_no_test_class(tmp_path: Path) -> None:
    _archive(tmp_path, "images_background_small1", {"Greek": 2})
    _archive(tmp_path, "images_background_small2", {"Greek": 2})
    with pytest.raises(ValueError, match="no test class is left"):
        load_omniglot(tmp_path)


def _split(root: Path, *overrides: str) -> DMLSplit:
    """The app's Omniglot split of ``root`` at 8 px, with ``overrides``."""
    from idml.app import build

    settings = [f"data.root={root}", "data.image_size=8", "data.resize_size=null"]
    return build.build_data(load_config(None, ["data.dataset=omniglot", *settings, *overrides]))


def test_config_and_validation_protocol(root: Path) -> None:
    split = _split(root, "data.num_workers=0")
    assert split.num_test_classes == 5
    held = _split(root, "data.protocol=validation", "data.validation_classes=0.25")
    # 7 train classes: the last ceil(0.25·7) = 2 by class id are held out; no test class is used.
    assert (held.num_train_classes, held.num_test_classes) == (5, 2)
    assert set(held.test.class_names) <= set(split.train.class_names)
    assert not set(held.train.class_names) & set(held.test.class_names)
    with pytest.raises(ValueError, match="needs root"):
        load_split("omniglot")


@pytest.mark.parametrize(
    ("order", "validated", "trained"),
    [
        # 'last' takes ceil(0.4·7) = 3 classes: Latin's two and one of Greek's, whose other
        # character trains, so the validation side is not all unseen alphabets.
        ("last", {"Greek", "Latin"}, {"Balinese", "Greek"}),
        # Whole alphabets: Latin (2 of 7 classes, 0.29) is closer to 0.4 than Latin + Greek (0.57).
        ("last_groups", {"Latin"}, {"Balinese", "Greek"}),
    ],
)
def test_validation_can_hold_out_whole_alphabets(
    root: Path, order: str, validated: set[str], trained: set[str]
) -> None:
    held = _split(
        root,
        "data.protocol=validation",
        "data.validation_classes=0.4",
        f"data.validation_order={order}",
    )
    alphabets = lambda names: {name.split("/")[0] for name in names}  # noqa: E731
    assert alphabets(held.test.class_names) == validated
    assert alphabets(held.train.class_names) == trained
    assert not set(held.train.class_names) & set(held.test.class_names)
