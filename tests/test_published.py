"""Published numbers: presets equal the parsed source tables; "paper vs this run" after training."""

from __future__ import annotations

import glob
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import yaml

from idml.app.cli import main
from idml.app.config import (
    ConfigError,
    config_difference,
    config_to_dict,
    load_config,
    validate_config,
)
from idml.app.paper import compare_with_paper, format_paper_table, paper_table_markdown
from tiny_run import TINY

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
ROWS = json.loads((REPO / "configs" / "published.json").read_text())["rows"]
# The retrieval presets; configs/classification/ takes its numbers from the authors' README table
# in scripts/make_classification_presets.py (tests/test_classification.py checks them).
PRESETS = sorted(
    p for p in glob.glob(str(REPO / "configs" / "*" / "*.yaml")) if "/classification/" not in p
)


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _label(row: dict) -> str:
    setting = f", {row['setting']}" if row["setting"] else ""
    return f"{row['paper']}, {row['table']}, row '{row['row']}'{setting}"


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: Path(p).name)
def test_preset_numbers_equal_the_source_rows_they_name(path: str) -> None:
    published = yaml.safe_load(Path(path).read_text())["published"]
    if published is None:
        return
    dataset = load_config(path).data.dataset  # from the preset's dataset fragment
    # The source names one or more rows ("; "-separated); the first row holding a metric gives it.
    rows = []
    for part in published["source"].split("; "):
        found = [r for r in ROWS if _label(r) == part and r["dataset"] == dataset]
        assert len(found) == 1, f"{path}: source {part!r} names {len(found)} rows"
        rows.append(found[0])
    expected: dict[str, float] = {}
    for row in rows:
        for key, value in row["metrics"].items():
            expected.setdefault(key, value)
    assert published["metrics"] == expected  # exact: both are the printed decimals
    load_config(path)  # and the preset still validates


def test_presets_cover_every_stated_row() -> None:
    with_numbers = {
        Path(p).name for p in PRESETS if yaml.safe_load(Path(p).read_text())["published"]
    }
    # 6 IDML/ProxyAnchor (paper text), 3 official code (README), 12 SSR + 9 of their baselines
    # (the 512-d Margin row has no baseline in the SSR paper).
    assert len(with_numbers) == 30
    assert "cub_margin_128_baseline.yaml" in with_numbers
    assert "cub_margin_512_baseline.yaml" not in with_numbers


def test_generator_output_is_committed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    presets = _script("make_presets")
    monkeypatch.setattr(presets, "ROOT", tmp_path / "configs")
    (tmp_path / "configs").mkdir()
    presets.main()
    written = sorted((tmp_path / "configs").rglob("*.yaml"))
    for path in written:
        committed = REPO / "configs" / path.relative_to(tmp_path / "configs")
        assert committed.read_text() == path.read_text(), f"re-run make_presets: {committed}"
    # No committed preset that the generator no longer writes.
    assert {str(p.relative_to(tmp_path / "configs")) for p in written} == {
        str(Path(p).relative_to(REPO / "configs")) for p in PRESETS
    }


def test_every_preset_resolves_to_its_full_recipe() -> None:
    """A preset and its fragments agree: the committed file, with its includes merged, is the
    recipe the generator spells out in full (a fragment edited alone makes this fail)."""
    presets = _script("make_presets")
    recipes = presets.presets()
    assert len(recipes) == len(PRESETS) == 69
    for path, preset in recipes.items():
        file = REPO / "configs" / path
        assert yaml.safe_load(file.read_text())["include"] == list(preset.include)
        resolved = config_to_dict(load_config(file))
        wanted = config_to_dict(validate_config(preset.recipe))
        assert config_difference(resolved, wanted, ignore=()) == [], f"{file} vs its recipe"


def test_presets_and_fragments_that_disagree_are_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    from idml.app.config import _io as config_io

    presets = _script("make_presets")
    preset = presets.presets()[Path("idml") / "cub_triplet_idml.yaml"]
    wanted = config_to_dict(validate_config(preset.recipe))
    # A fragment edited without regenerating: the committed preset no longer resolves to its recipe.
    fragments = tmp_path / "fragments"
    shutil.copytree(config_io.FRAGMENTS, fragments)
    cub = fragments / "dataset" / "cub.yaml"
    cub.write_text(cub.read_text().replace("image_size: 224", "image_size: 256"))
    monkeypatch.setattr(config_io, "FRAGMENTS", fragments)  # where include: reads them
    resolved = config_to_dict(load_config(REPO / "configs" / "idml" / "cub_triplet_idml.yaml"))
    assert config_difference(resolved, wanted, ignore=()) == ["data.image_size: 256 -> 224"]
    # Regenerating writes the recipe's value into the preset rather than trusting the fragment,
    assert preset.body()["data"] == {"image_size": 224}
    # and refuses a fragment that changes a key the recipe leaves at its default.
    cub.write_text(
        cub.read_text().replace("resize_size: 256", "resize_size: 256\n  horizontal_flip: false")
    )
    with pytest.raises(SystemExit, match=r"data\.horizontal_flip"):
        preset.body()


@pytest.mark.skipif(
    not (SHARED / "seeds").is_dir(), reason="the papers' text is not beside the repo"
)
def test_committed_numbers_equal_a_fresh_parse_of_the_papers() -> None:
    parser = _script("parse_published")
    assert parser.parse_all(SHARED) == ROWS


def test_parser_reads_flattened_rows_with_missing_cells() -> None:
    parser = _script("parse_published")
    body = "Foo (Bar et al. 2019) R128 1.0 2.0 3.0 - 5.0 6.0 7.0 8.0 9.0 10.0 11.0 12.0 13.0 - 15.0"
    text = f"Method Setting R@1 R@10 R@100 R@1000 NMI {body} Table 2: caption"
    rows = parser.parse_ssr_table(text, 2)
    assert [r["dataset"] for r in rows] == ["cub", "cars", "sop"]
    assert rows[0]["row"] == "Foo (Bar et al. 2019)" and rows[0]["setting"] == "R128"
    assert rows[0]["metrics"] == {"recall@1": 1.0, "recall@2": 2.0, "recall@4": 3.0, "nmi": 5.0}
    assert rows[2]["metrics"] == {
        "recall@1": 11.0,
        "recall@10": 12.0,
        "recall@100": 13.0,
        "nmi": 15.0,
    }


def test_published_block_is_validated() -> None:
    with pytest.raises(ConfigError, match="unknown metric 'recal@1'"):
        validate_config({"published": {"source": "x", "metrics": {"recal@1": 3.0}}})
    with pytest.raises(ConfigError, match="percentage"):
        validate_config({"published": {"source": "x", "metrics": {"recall@1": 170.0}}})
    # Run folders written before the source was recorded hold the bare metrics.
    old = validate_config({"published": {"recall@1": 70.7}})
    assert old.published is not None and old.published.metrics == {"recall@1": 70.7}


def test_comparison_rows_put_the_run_in_percent() -> None:
    rows = compare_with_paper({"recall@1": 66.5, "nmi": 69.7}, {"recall@1": 0.6725})
    # float64 100·0.6725 (one rounding, ≤ ε/2·67 ≈ 7e-15) and its difference from 66.5: abs 1e-12.
    assert rows[0].run == pytest.approx(67.25, abs=1e-12)
    assert rows[0].delta == pytest.approx(0.75, abs=1e-12)
    assert rows[1].run is None and rows[1].delta is None  # NMI not computed: shown, not dropped
    text = format_paper_table("SSR Table 1", rows)
    assert re.search(r"recall@1 +66\.5 +67\.2 +\+0\.8", text) and re.search(
        r"nmi +69\.7 +n/a", text
    )
    assert "| recall@1 | 66.5 | 67.2 | +0.8 |" in paper_table_markdown("SSR Table 1", rows)


# The recipe keys of the TINY run: digits, the small CNN from scratch, 16-d, one epoch, step.
TINY_RECIPE = (
    "{data.dataset: digits, model.backbone: small_cnn, model.pretrained: false, "
    "model.embedding_dim: 16, optim.epochs: 1, optim.scheduler: step, optim.step_size: 10, "
    "optim.step_gamma: 0.5}"
)


def _train_with(tmp_path: Path, published: str) -> None:
    (tmp_path / "run.yaml").write_text("name: tiny\n")
    args = ["train", str(tmp_path / "run.yaml"), "--no-progress", "--out", str(tmp_path / "run")]
    for override in [*TINY, "eval.ks=[1, 2]", f"published={published}"]:
        args += ["--set", override]
    assert main(args) == 0


def test_train_ends_with_paper_vs_this_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    metrics = "{recall@1: 50.0, recall@2: 60.0, nmi: 40.0}"
    _train_with(tmp_path, f"{{source: Test table, metrics: {metrics}, recipe: {TINY_RECIPE}}}")
    out = capsys.readouterr().out
    log = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    r1 = 100 * log[-1]["test/recall@1"]
    assert "paper vs this run (final epoch) (Test table; %)" in out
    assert re.search(rf"recall@1 +50\.0 +{r1:.1f} +{re.escape(f'{r1 - 50:+.1f}')}\n", out)
    assert re.search(r"nmi +40\.0 +n/a +n/a", out)  # TINY switches NMI off


def test_train_on_another_recipe_names_what_differs_and_prints_no_delta(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A preset's numbers next to a run on other data would be a meaningless Δ (a Table I preset
    on another folder of images printed Δ −23.7): the keys that differ are named instead."""
    recipe = TINY_RECIPE.replace("digits", "cub").replace("optim.epochs: 1", "optim.epochs: 60")
    published = (
        f"{{source: Test table, metrics: {{recall@1: 50.0}}, recipe: {recipe}, classes: 100}}"
    )
    _train_with(tmp_path, published)
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("paper vs this run")]
    assert line.startswith("paper vs this run (final epoch): not compared; this run is not the ")
    assert "data.dataset: digits (source: cub)" in line and "optim.epochs: 1 (source: 60)" in line
    assert "training classes: 5 (source: 100)" in line  # digits 0-4 train, TINY
    assert "Δ" not in out and "50.0" not in out


def test_a_published_block_without_recipe_is_compared_but_says_it_was_not_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    _train_with(tmp_path, "{source: Test table, metrics: {recall@1: 50.0}}")
    out = capsys.readouterr().out
    assert "paper vs this run (final epoch) (the source's recipe is not recorded: not " in out
    assert re.search(r"recall@1 +50\.0 +\d+\.\d +[+-]\d+\.\d", out)


def test_preset_recipes_are_the_presets_own_values() -> None:
    """Every preset with numbers records its recipe (classification ones their class count too),
    and the preset resolves to it: the preset run itself is compared."""
    from idml.app.paper import recipe_differences, recipe_of

    presets = sorted(glob.glob(str(REPO / "configs" / "*" / "*.yaml")))
    checked = 0
    for path in presets:
        cfg = load_config(path)
        if cfg.published is None:
            continue
        config = config_to_dict(cfg)
        assert cfg.published.recipe == recipe_of(config), path
        assert recipe_differences(cfg.published.recipe, config, cfg.published.classes) == []
        assert (cfg.published.classes is not None) == (cfg.task.name == "classification"), path
        checked += 1
    assert checked == 30 + 18
    # The two cases: a Table I preset on a folder, a CIFAR-10 preset on another folder.
    table1 = load_config(REPO / "configs/idml/cub_proxy_anchor_idml.yaml", ["data.dataset=folder"])
    assert table1.published is not None
    assert recipe_differences(table1.published.recipe, config_to_dict(table1)) == [
        "data.dataset: folder (source: cub)"
    ]
    cifar = load_config(REPO / "configs/classification/cifar10_baseline.yaml", ["optim.epochs=3"])
    assert cifar.published is not None
    assert recipe_differences(cifar.published.recipe, config_to_dict(cifar), 10, 964) == [
        "optim.epochs: 3 (source: 300)",
        "training classes: 964 (source: 10)",
    ]


def test_a_recipe_naming_no_config_key_is_refused_before_training() -> None:
    from idml.app.preflight import check_run_config

    cfg = load_config(
        None, [*TINY, "published={source: x, metrics: {recall@1: 1.0}, recipe: {data.datset: cub}}"]
    )
    with pytest.raises(ConfigError, match=r"published.recipe names 'data.datset'"):
        check_run_config(cfg)
