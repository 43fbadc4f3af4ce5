"""``idml train --data``: what is derived from a user's images (:mod:`idml.app.own_data`), the
one-line errors of bad input, and a run through the CLI whose ``config.yaml`` holds the choices."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from idml.app import build, own_data
from idml.app.cli import build_parser, main
from idml.app.cli.training import resume_command
from idml.app.config import config_to_dict, fragment_names, fragment_overrides, load_config
from idml.app.fragments import method_names
from idml.app.own_data import inspect_images, plan_own_data
from idml.app.paper import config_value
from idml.models.backbones import MissingWeightsError
from tiny_run import write_images

SMALL_CNN = "model.backbone=small_cnn"
"""Fast, and the same on a machine with or without EfficientNet-Lite0."""


def _decision(plan: own_data.OwnDataPlan, key: str) -> own_data.Decision:
    (found,) = [d for d in plan.decisions if d.key == key]
    return found


@pytest.fixture
def no_lite0(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine without EfficientNet-Lite0 or any ImageNet weights."""

    def missing(name: object, pretrained: object, download: bool) -> Path:
        raise MissingWeightsError(f"no weights for {name}", f"no weights for {name}")

    monkeypatch.setattr(own_data, "locate_weights", missing)


# --------------------------------------------------------------------------- derivation
def test_few_classes_bound_the_batch_layout(tmp_path: Path) -> None:
    root = write_images(tmp_path / "pets", classes=6, per_class=5)
    for extra in (3, 4):  # class 'a' (a training class) is the smallest: 3 images
        (root / "a" / f"{extra}.png").unlink()
    plan = plan_own_data(root, "baseline", [SMALL_CNN])
    assert plan.data.train_classes == ("a", "b", "c")
    assert plan.data.test_classes == ("d", "e", "f")
    assert plan.data.smallest_train_class == ("a", 3)
    cfg = plan.config()
    assert (cfg.sampler.classes_per_batch, cfg.sampler.images_per_class) == (3, 3)
    assert "at most the 3 training classes" in _decision(plan, "sampler.classes_per_batch").reason


def test_many_classes_keep_the_recipes_batch_layout(tmp_path: Path) -> None:
    recipe = load_config(None, fragment_overrides(own_data.RECIPE_LOSS)).sampler
    root = write_images(tmp_path / "many", classes=2 * recipe.classes_per_batch + 2, per_class=5)
    cfg = plan_own_data(root, "idml", [SMALL_CNN]).config()
    assert cfg.sampler.classes_per_batch == recipe.classes_per_batch
    assert cfg.sampler.images_per_class == recipe.images_per_class


def test_image_size_follows_the_images_within_the_backbones_range(
    tmp_path: Path, no_lite0: None
) -> None:
    tiny = write_images(tmp_path / "tiny", classes=4, per_class=2, shape=(10, 10))
    plan = plan_own_data(tiny, "baseline")
    cfg = plan.config()
    # Without Lite0 the default is the small CNN, from scratch, at its smallest useful size.
    assert (cfg.model.backbone, cfg.model.pretrained) == ("small_cnn", False)
    assert (cfg.data.image_size, cfg.data.resize_size) == (16, 18)
    assert "raised to 16 px" in _decision(plan, "data.image_size").reason
    wide = write_images(tmp_path / "wide", classes=4, per_class=2, shape=(40, 30))  # 30×40 px
    assert plan_own_data(wide, "baseline").config().data.image_size == 30
    large = write_images(tmp_path / "large", classes=4, per_class=2, shape=(90, 120))
    assert plan_own_data(large, "baseline").config().data.image_size == 64  # the CNN's largest
    # An ImageNet backbone (here without weights: trained from scratch) starts at 64 px.
    plan = plan_own_data(tiny, "baseline", ["model.backbone=resnet18"])
    assert plan.config().data.image_size == 64
    assert plan.config().model.pretrained is False
    assert "no weights for" in _decision(plan, "model.pretrained").reason


def test_pretrained_backbone_warms_up_within_the_epochs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(own_data, "locate_weights", lambda *_, **__: tmp_path / "weights.pth")
    root = write_images(tmp_path / "imgs", classes=4, per_class=2)
    overrides = ["model.backbone=resnet18"]
    cfg = plan_own_data(root, "idml", overrides).config()
    assert (cfg.model.pretrained, cfg.optim.warmup_epochs) == (True, 1)
    short = plan_own_data(root, "idml", [*overrides, "optim.epochs=1"])
    assert short.config().optim.warmup_epochs == 0
    assert "whole run" in _decision(short, "optim.warmup_epochs").reason


def test_flat_and_nested_folders_and_a_csv(tmp_path: Path) -> None:
    flat = inspect_images(write_images(tmp_path / "flat", classes=4, per_class=2))
    assert (flat.images, flat.classes, flat.layout) == (8, 4, "a folder of class folders")
    nested = tmp_path / "omniglot"
    for alphabet in ("Greek", "Latin"):
        for character in ("character01", "character02"):
            write_images(nested / alphabet / character, classes=1, per_class=3)
    found = inspect_images(nested)
    assert found.classes == 4  # Greek/character01 and Latin/character01 stay apart
    assert found.train_classes == ("Greek/character01/a", "Greek/character02/a")
    assert "3 levels deep" in found.layout
    assert plan_own_data(nested, "idml", [SMALL_CNN]).config().name == "omniglot-idml"

    rows = ["file,class,split"]
    for c in "abcd":
        rows += [f"flat/{c}/{i},{c},{'train' if c in 'ab' else 'test'}" for i in ("0.png", "1.png")]
    (tmp_path / "my list.csv").write_text("\n".join(rows) + "\n")
    plan = plan_own_data(tmp_path / "my list.csv", "baseline", [SMALL_CNN])
    assert plan.data.split_given and plan.data.test_classes == ("c", "d")
    cfg = plan.config()
    assert (cfg.data.dataset, cfg.name) == ("csv", "my-list-baseline")
    assert cfg.data.root == (tmp_path / "my list.csv").resolve()
    assert any(line.startswith("split   given by the data") for line in plan.report())


def test_a_user_setting_wins_and_later_choices_follow_it(tmp_path: Path) -> None:
    root = write_images(tmp_path / "imgs", classes=4, per_class=4, shape=(20, 20))
    plan = plan_own_data(root, "idml", [SMALL_CNN, "data.image_size=32", "name=mine"])
    cfg = plan.config()
    assert (cfg.name, cfg.data.image_size) == ("mine", 32)
    assert cfg.data.resize_size == 37  # follows the user's size, not the derived 20
    size = _decision(plan, "data.image_size")
    assert size.user_set and (size.value, size.derived) == (32, 20)
    assert "data.image_size=32  (your --set, which wins over the derived 20:" in size.line()


def test_the_methods_are_the_packaged_fragments(tmp_path: Path) -> None:
    assert {"baseline", "idml"} <= set(method_names())
    assert {f"method/{m}" for m in method_names()} <= set(fragment_names())
    root = write_images(tmp_path / "imgs", classes=4, per_class=2)
    for method in method_names():
        cfg = plan_own_data(root, method, [SMALL_CNN]).config()
        assert cfg.name == f"imgs-{method}"
        stored = config_to_dict(cfg)
        for override in fragment_overrides(f"method/{method}"):
            key, _, value = override.partition("=")
            assert config_value(stored, key) == yaml.safe_load(value), (method, key)


def test_a_preset_keeps_its_backbone_and_missing_weights_name_the_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setattr(torch.hub, "_hub_dir", None)  # an earlier set_dir would win
    preset = Path(__file__).resolve().parents[1] / "configs/idml/cub_multi_similarity_idml.yaml"
    cfg = load_config(preset)
    assert (cfg.model.backbone, cfg.model.pretrained) == ("resnet50", True)
    with pytest.raises(MissingWeightsError) as info:
        build.build_model(cfg)
    message = str(info.value)
    assert "model.pretrained=" in message and "model.backbone=" in message
    assert "resnet50-0676ba61.pth" in message and "download=True" not in message


# --------------------------------------------------------------------------- bad input
def _bad_input(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    one_class = write_images(tmp_path / "one", classes=1, per_class=3)
    lonely = write_images(tmp_path / "lonely", classes=5, per_class=2)
    (lonely / "c" / "1.png").unlink()
    binary = tmp_path / "binary.csv"
    binary.write_bytes(b"\xff\xfe\x00\x81path")
    missing = tmp_path / "list.csv"
    missing.write_text("path,label\nnope.png,a\n")
    return {
        "missing folder": (tmp_path / "absent", "does not exist"),
        "one class": (one_class, "needs at least 4"),
        "a class with one image": (lonely, "single image (c)"),
        "unreadable CSV": (binary, "is not UTF-8 text"),
        "a CSV of missing files": (missing, "does not exist"),
    }


def test_bad_input_is_one_line_naming_the_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for case, (path, problem) in _bad_input(tmp_path).items():
        assert main(["train", "--data", str(path)]) == 2, case
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("idml train: error: "), (case, err)
        assert path.name in err and problem in err, (case, err)


def test_wrong_flags_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = write_images(tmp_path / "imgs", classes=4, per_class=2)
    refused = {
        ("--data", str(root), "--method", "fancy"): "--method takes baseline, idml",
        ("--data", str(root), "--set", f"data.root={root}"): "--set data.root: --data sets it",
        ("--data", str(root), "configs/x.yaml"): "not both",
        ("configs/x.yaml", "--method", "idml"): "--method applies to --data",
        (): "give a YAML config",
        ("--data", str(root), "--set", "optim.nope=1"): "unknown key 'optim.nope'",
        ("--data", str(root), "--set", "task=classification"): "--data trains metric learning",
    }
    for flags, message in refused.items():
        assert main(["train", *flags]) == 2, flags
        assert message in capsys.readouterr().err, flags


def test_the_resume_command_repeats_data_and_method() -> None:
    args = build_parser().parse_args(
        ["train", "--data", "my images", "--method", "baseline", "--set", "optim.epochs=3"]
    )
    assert resume_command(args, Path("runs/x")) == (
        "idml train --data 'my images' --method baseline --out runs/x --resume --set optim.epochs=3"
    )


# --------------------------------------------------------------------------- the CLI
DERIVED = (
    "name",
    "model.backbone",
    "model.pretrained",
    "sampler.classes_per_batch",
    "sampler.images_per_class",
    "data.image_size",
    "data.resize_size",
    "optim.warmup_epochs",
)


@pytest.mark.slow
def test_train_on_a_folder_prints_and_stores_its_choices(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = write_images(tmp_path / "shapes", classes=6, per_class=6, shape=(16, 16))
    out = tmp_path / "run"
    fast = ["optim.epochs=1", "optim.max_steps_per_epoch=1", "data.num_workers=0"]
    flags = [
        f
        for key in (*fast, "sampler.images_per_class=3", "tensorboard=false")
        for f in ("--set", key)
    ]
    assert main(["train", "--data", str(root), "--out", str(out), "--no-progress", *flags]) == 0
    printed = capsys.readouterr().out
    lines = {line.split("=")[0].strip(): line for line in printed.splitlines() if "=" in line}
    for key in DERIVED:
        assert key in lines, (key, printed)
    assert "6 classes" in printed and "train 3: a, b, c; test 3: d, e, f" in printed
    assert "your --set, which wins over the derived 4" in lines["sampler.images_per_class"]
    stored = yaml.safe_load((out / "config.yaml").read_text())
    chosen = load_config(out / "config.yaml")
    assert stored["name"] == "shapes-idml" and chosen.name == "shapes-idml"
    assert chosen.sampler.images_per_class == 3  # the user's
    assert chosen.sampler.classes_per_batch == 3  # derived: 3 training classes
    assert chosen.data.dataset == "folder" and chosen.data.root == root.resolve()
    for key in DERIVED[1:]:
        section, field = key.split(".")
        assert f"{key}={stored[section][field]}".lower() in lines[key].lower(), key
