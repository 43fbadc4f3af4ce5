"""Composed configs: ``include:`` of packaged fragments and files, and its errors."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest
import yaml

import idml
from idml.app import ablation, demo
from idml.app.config import (
    FRAGMENTS,
    ConfigError,
    config_to_dict,
    fragment_names,
    fragment_overrides,
    load_config,
    read_fragment,
)
from idml.losses import MarginParams
from tiny_run import IDML, TINY, train_tiny

REPO = Path(__file__).resolve().parents[1]


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_fragments_merge_in_order_with_the_files_own_keys_last(tmp_path: Path) -> None:
    _write(tmp_path / "parts" / "lr.yaml", "optim: {lr: 0.01, epochs: 7}\n")
    config = _write(
        tmp_path / "run.yaml",
        "include: [method/idml, dataset/cub, loss/multi_similarity, parts/lr.yaml]\n"
        "optim: {epochs: 3}\nmixup: {alpha: 0.5}\n",
    )
    cfg = load_config(config)
    assert cfg.model.uncertainty.enabled and cfg.metric.introspective and cfg.mixup.enabled
    assert cfg.data.dataset == "cub" and cfg.eval.ks == [1, 2, 4, 8]
    assert cfg.loss.name == "multi_similarity" and cfg.sampler.classes_per_batch == 30
    assert (cfg.optim.lr, cfg.optim.epochs, cfg.mixup.alpha) == (0.01, 3, 0.5)
    # --set applies after the includes and the file.
    assert load_config(config, ["optim.epochs=1", "mixup.enabled=false"]).optim.epochs == 1


def test_a_single_include_and_a_later_loss_replaces_the_section(tmp_path: Path) -> None:
    config = _write(tmp_path / "a.yaml", "include: loss/margin\nloss: {name: triplet}\n")
    assert load_config(config).loss.name == "triplet"  # margin's keys would be unknown here
    config = _write(tmp_path / "b.yaml", "include: loss/margin\nloss: {margin: 0.3}\n")
    loss = load_config(config).loss
    assert isinstance(loss, MarginParams)  # the section is margin's settings model
    assert loss.margin == 0.3


@pytest.mark.parametrize(
    ("files", "match"),
    [
        ({"a.yaml": "include: b.yaml\n", "b.yaml": "include: a.yaml\n"}, r"cycle: .*a\.yaml -> "),
        ({"a.yaml": "include: a.yaml\n"}, "cycle"),
        ({"a.yaml": "include: missing.yaml\n"}, r"missing\.yaml does not exist"),
        (
            {"a.yaml": "include: method/idmll\n"},
            r"no packaged fragment 'method/idmll'.*method/idml",
        ),
        (
            {"a.yaml": "include: b.yaml\n", "b.yaml": "[1, 2]\n"},
            r"b\.yaml, included from .*a\.yaml",
        ),
        ({"a.yaml": "include: {x: 1}\n"}, "give a fragment name or a .yaml path"),
        (
            {"a.yaml": "include: b.yaml\n", "b.yaml": "optim: {learning_rate: 0.1}\n"},
            r"unknown key 'optim.learning_rate'[\s\S]*fragment .*b\.yaml \(include chain: .*a\.yaml -> ",
        ),
        (
            {"a.yaml": "include: b.yaml\n", "b.yaml": "include: method/idml\nmodle: {}\n"},
            r"unknown key 'modle' \(did you mean 'model'\?\)",
        ),
    ],
)
def test_include_errors_name_the_file_and_the_chain(
    tmp_path: Path, files: dict[str, str], match: str
) -> None:
    for name, text in files.items():
        _write(tmp_path / name, text)
    with pytest.raises(ConfigError, match=match):
        load_config(tmp_path / "a.yaml")


def test_checks_across_keys_run_on_the_merged_config(tmp_path: Path) -> None:
    # The fragment alone would fail (ISM without a head); the file supplies the head.
    _write(tmp_path / "ism.yaml", "metric: {introspective: true}\n")
    config = _write(
        tmp_path / "a.yaml", "include: ism.yaml\nmodel: {uncertainty: {enabled: true}}\n"
    )
    assert load_config(config).metric.introspective
    alone = _write(tmp_path / "b.yaml", "include: ism.yaml\n")
    with pytest.raises(ConfigError, match=r"needs an uncertainty head[\s\S]*includes .*ism\.yaml"):
        load_config(alone)


def test_a_run_stores_the_merged_config(tmp_path: Path) -> None:
    run = train_tiny(tmp_path, [])
    assert "include" not in yaml.safe_load((run / "config.yaml").read_text())
    composed = _write(tmp_path / "composed.yaml", "include: [method/idml]\n")
    cfg = load_config(composed, TINY)
    stored = tmp_path / "stored.yaml"
    stored.write_text(yaml.safe_dump(config_to_dict(cfg)))
    assert "include" not in stored.read_text()
    assert config_to_dict(load_config(stored)) == config_to_dict(cfg)


def test_every_fragment_is_packaged_and_valid() -> None:
    # package-data patterns are relative to the idml package folder.
    package = Path(idml.__file__).parent
    # pyproject's [tool.setuptools.package-data] line (tomllib is Python 3.11+).
    line = re.search(r"^idml = \[(.*)\]$", (REPO / "pyproject.toml").read_text(), re.M)
    assert line is not None
    patterns = re.findall(r'"([^"]+)"', line.group(1))
    for path in FRAGMENTS.rglob("*"):
        if path.is_file():
            relative = path.relative_to(package).as_posix()
            assert any(fnmatch.fnmatch(relative, p) for p in patterns), f"not installed: {path}"
    assert {"method/idml", "method/baseline", "method/ssr", "dataset/digits_demo"} <= set(
        fragment_names()
    )
    for name in fragment_names():
        assert read_fragment(name), name
        load_config(_fragment_file(name))  # each validates on its own merged with the defaults


def _fragment_file(name: str) -> Path:
    return FRAGMENTS / f"{name}.yaml"


def test_idml_means_one_thing_everywhere() -> None:
    idml = fragment_overrides("method/idml")
    assert idml == [
        "model.uncertainty.enabled=true",
        "metric.introspective=true",
        "mixup.enabled=true",
    ]
    assert idml == IDML
    assert demo.DEMO_IDML[: len(idml)] == idml
    # A grid's method value switches every other component off and pins the ISM variant.
    cell = ablation.PRESETS["method"].overrides("idml", None)
    assert set(idml) <= set(cell)
    assert set(cell) - set(idml) == {"metric.variant=soft", "ssr.enabled=false"}
    assert ablation.PRESETS["method"].overrides("baseline", None) == tuple(
        fragment_overrides("method/baseline")
    )
    assert set(fragment_overrides("method/ssr")) <= set(
        ablation.PRESETS["method"].overrides("ssr", None)
    )
    assert ablation.PRESETS["metric"].overrides("ism", None) == (
        *fragment_overrides("method/ism"),
        "metric.variant=soft",
    )
    assert ablation.PRESETS["mixup"].overrides("on", None) == tuple(
        fragment_overrides("method/mixup")
    )
