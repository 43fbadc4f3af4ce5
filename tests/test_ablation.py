"""`idml ablate`: grid parsing and presets, the mean ± std table, and a real 2×2×2-seed grid whose
finished cells are reused on the second run."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import socket
from pathlib import Path
from typing import Any

import pytest

from idml.app.ablation import (
    PRESETS,
    AblationResult,
    Cell,
    CellResult,
    ChoicePreset,
    GridAxis,
    SeedResult,
    expand_grid,
    parse_grid,
    run_ablation,
    split_values,
)
from idml.app.cli import main
from idml.app.config import config_difference, dump_config, load_config
from idml.app.reports.seeds import expand_run_dirs
from idml.app.run_folder import RunLockedError
from idml.app.training import Trainer
from idml.app.training.epoch_log import TrainResult
from tiny_run import TINY


# --------------------------------------------------------------------------- grid parsing
def test_parse_grid_canonicalises_values_and_splits_at_top_level_commas() -> None:
    axes = parse_grid(
        [
            "mixup=true,OFF",
            "metric=baseline,ism-dis",
            "metric.gamma=0.10,2",
            "data.train_crop_scale=[0.8, 1.0],[0.5,1]",
        ]
    )
    assert [a.key for a in axes] == ["mixup", "metric", "metric.gamma", "data.train_crop_scale"]
    assert axes[0].values == ("on", "off")
    assert axes[1].values == ("plain", "ism_dis")
    assert axes[2].values == ("0.1", "2")
    assert axes[3].values == ("[0.8,1.0]", "[0.5,1]")
    assert split_values("a,'b,c',{x: [1, 2]}") == ["a", "'b,c'", "{x: [1, 2]}"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (["metric"], "must look like key=v1,v2"),
        (["metric="], "must look like key=v1,v2"),
        (["seed=0,1"], "use --seeds"),
        (["gama=0,1"], "not a preset and not a config key"),
        (["name=a,b"], "cannot be an axis"),
        (["device=cpu,cuda"], "cannot be an axis"),
        (["data.num_workers=0,2"], "cannot be an axis"),
        (["metric=plain,isn"], "choose from plain, ism, ism_dis, ism_strict"),
        (["metric.gamma=0.1,0.10"], "twice"),
        (["metric.gamma=0,,1"], "empty value"),
        (["mixup=on", "mixup=off"], "given twice"),
        (["batch_size=0"], "positive integers"),
    ],
)
def test_parse_grid_rejects_bad_specs_with_a_clear_message(spec: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_grid(spec)


def test_expand_grid_is_the_product_in_axis_order_with_preset_overrides() -> None:
    cells = expand_grid(parse_grid(["metric=plain,ism,ism_dis", "mixup=on,off"]))
    assert [c.name for c in cells] == [
        "metric=plain mixup=on",
        "metric=plain mixup=off",
        "metric=ism mixup=on",
        "metric=ism mixup=off",
        "metric=ism_dis mixup=on",
        "metric=ism_dis mixup=off",
    ]
    assert cells[4].overrides == (
        "model.uncertainty.enabled=true",
        "metric.introspective=true",
        "metric.variant=dissimilar",
        "mixup.enabled=true",
    )
    assert cells[1].overrides == (
        "model.uncertainty.enabled=false",
        "metric.introspective=false",
        "mixup.enabled=false",
    )
    assert len({c.id for c in cells}) == len(cells)


def test_every_preset_value_gives_a_valid_config_that_does_what_it_says() -> None:
    base = load_config(None, TINY)
    for name, preset in PRESETS.items():
        if not isinstance(preset, ChoicePreset):
            continue
        for value in preset.choices:
            cfg = load_config(None, [*TINY, *preset.overrides(value, base)])
            if name == "metric":
                assert cfg.metric.introspective == (value != "plain")
                assert cfg.model.uncertainty.enabled == (value != "plain")
                if value != "plain":
                    expected = {"ism": "soft", "ism_dis": "dissimilar", "ism_strict": "strict"}
                    assert cfg.metric.variant == expected[value]
            elif name == "method":
                assert cfg.metric.introspective == cfg.mixup.enabled == ("idml" in value)
                assert cfg.ssr.enabled == ("ssr" in value)
            elif preset.switch:
                key = {"mixup": "mixup", "ssr": "ssr", "test_ism": "eval"}[name]
                section = getattr(cfg, key)
                flag = section.introspective if key == "eval" else section.enabled
                assert flag == (value == "on")


def test_alias_presets_set_their_config_key() -> None:
    (cell,) = expand_grid(parse_grid(["gamma=2.5", "tau=3", "embedding_dim=32", "ssr_weight=0.4"]))
    cfg = load_config(None, [*TINY, *cell.overrides])
    assert (cfg.metric.gamma, cfg.metric.tau, cfg.model.embedding_dim) == (2.5, 3.0, 32)
    assert cfg.ssr.task.weight == 0.4


def test_batch_size_preset_divides_by_images_per_class_and_refuses_remainders() -> None:
    base = load_config(None, TINY)  # balanced sampler, 4 images per class
    cells = expand_grid(parse_grid(["batch_size=40,120"]), base)
    sizes = [load_config(None, [*TINY, *c.overrides]).sampler for c in cells]
    assert [(s.classes_per_batch, s.effective_batch_size) for s in sizes] == [(10, 40), (30, 120)]
    with pytest.raises(ValueError, match="multiple of 4"):
        expand_grid(parse_grid(["batch_size=42"]), base)
    random = load_config(None, [*TINY, "sampler.kind=random"])
    (cell,) = expand_grid(parse_grid(["batch_size=42"]), random)
    assert (
        load_config(None, [*TINY, "sampler.kind=random", *cell.overrides]).sampler.batch_size == 42
    )


def test_axes_that_set_one_key_differently_are_refused() -> None:
    with pytest.raises(ValueError, match=r"method.*mixup=off.*mixup.enabled"):
        expand_grid(parse_grid(["method=idml", "mixup=off"]))
    # The same setting from two axes is no conflict.
    (cell,) = expand_grid(parse_grid(["method=idml", "mixup=on"]))
    assert cell.overrides.count("mixup.enabled=true") == 2


def test_cell_ids_are_folder_safe_and_distinct() -> None:
    plain = Cell((("metric", "ism"), ("mixup", "on")), ())
    assert plain.id == "metric-ism__mixup-on"
    odd = [Cell((("data.train_crop_scale", v),), ()) for v in ("[0.8,1.0]", "[0.8_1.0]")]
    ids = [c.id for c in odd]
    assert len(set(ids)) == 2
    assert all(c.isalnum() or c in "._+-" for i in ids for c in i)
    assert len(Cell((("a" * 200, "b"),), ()).id) <= 96


def test_config_difference_ignores_keys_that_cannot_change_results() -> None:
    a = {"seed": 0, "device": "cpu", "data": {"num_workers": 0, "dataset": "digits"}}
    b: dict[str, Any] = {
        "seed": 0,
        "device": "cuda",
        "data": {"num_workers": 8, "dataset": "digits"},
    }
    assert config_difference(a, b) == []
    b["data"]["dataset"] = "cub"
    assert config_difference(a, b) == ["data.dataset: 'digits' -> 'cub'"]


# --------------------------------------------------------------------------- table
def _seed(seed: int, r1: float, nmi: float, seconds: float) -> SeedResult:
    return SeedResult(seed, Path(f"s{seed}"), {"recall@1": r1, "nmi": nmi}, {}, seconds, "trained")


def test_table_shows_mean_and_sample_std_in_percent_and_raw_fractions_in_csv(
    tmp_path: Path,
) -> None:
    axes = [GridAxis("metric", ("plain", "ism")), GridAxis("mixup", ("on",))]
    cells = expand_grid(axes)
    result = AblationResult(
        axes,
        [
            # recall@1 0.5 and 0.7: mean 0.6, sample std sqrt(((0.1)^2 + (0.1)^2) / 1) = 0.141421
            CellResult(cells[0], [_seed(0, 0.5, 0.30, 10.0), _seed(1, 0.7, 0.40, 14.0)]),
            CellResult(cells[1], [_seed(0, 0.8, 0.50, 12.0)]),  # one seed: no spread
        ],
        tmp_path,
    )
    lines = result.markdown().splitlines()
    assert lines[0] == "| metric | mixup | R@1 | NMI | time (s) |"
    assert lines[2] == "| plain | ✓ | 60.0 ± 14.1 | 35.0 ± 7.1 | 12.0 ± 2.8 |"
    assert lines[3] == "| ISM | ✓ | 80.0 | 50.0 | 12.0 |"
    rows = list(csv.DictReader(io.StringIO(result.csv())))
    assert rows[0]["cell"] == "metric-plain__mixup-on" and rows[0]["seeds"] == "2"
    # float64 mean/std of two values, written with 10 significant digits: rounding ≤ 5e-10 relative.
    assert float(rows[0]["recall@1_mean"]) == pytest.approx(0.6, rel=1e-9)
    assert float(rows[0]["recall@1_std"]) == pytest.approx(math.sqrt(0.02), rel=1e-9)
    assert rows[1]["recall@1_std"] == ""
    md, table = result.write()
    assert md.read_text() == result.markdown() and table.read_text() == result.csv()


# --------------------------------------------------------------------------- real runs
@pytest.fixture
def count_fits(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Path, bool]]:
    """Record every Trainer.fit call as (run folder, resume)."""
    calls: list[tuple[Path, bool]] = []
    original = Trainer.fit

    def counting(self: Trainer, resume: bool = False) -> TrainResult:
        calls.append((self.run_dir, resume))
        return original(self, resume=resume)

    monkeypatch.setattr(Trainer, "fit", counting)
    return calls


def _base_config(tmp_path: Path) -> Path:
    path = tmp_path / "base.yaml"
    dump_config(load_config(None, [*TINY, "loss.name=multi_similarity", "name=tiny"]), path)
    return path


@pytest.mark.slow
def test_grid_of_2x2_cells_and_2_seeds_writes_the_table_and_reuses_finished_cells(
    tmp_path: Path, count_fits: list[tuple[Path, bool]], capsys: pytest.CaptureFixture[str]
) -> None:
    config, out = _base_config(tmp_path), tmp_path / "ablation"
    axes = parse_grid(["metric=plain,ism", "mixup=on,off"])
    lines: list[str] = []
    result = run_ablation(config, axes, seeds=2, out_dir=out, log=lines.append)
    assert len(count_fits) == 8 and not any(resume for _, resume in count_fits)
    assert len(lines) == 4 and lines[0].startswith("[1/4] metric=plain mixup=on: R@1 ")
    assert "(2 run(s): 2 trained; " in lines[0]

    # Cells and seeds land where documented, each with the run's own files.
    ids = [
        "metric-plain__mixup-on",
        "metric-plain__mixup-off",
        "metric-ism__mixup-on",
        "metric-ism__mixup-off",
    ]
    assert [c.cell.id for c in result.cells] == ids
    for cell_id in ids:
        for seed in (0, 1):
            run = out / "cells" / cell_id / f"seed{seed}"
            assert (run / "result.json").is_file() and (run / "metrics.jsonl").is_file()
            saved = load_config(run / "config.yaml")
            assert saved.seed == seed
            assert saved.metric.introspective == ("ism" in cell_id)
            assert saved.mixup.enabled == cell_id.endswith("on")

    # Each table cell is the mean ± std of the runs' own logged final recall@1.
    table = (out / "ablation.md").read_text().splitlines()
    assert (
        table[0] == "| metric | mixup | R@1 | R@2 | R@4 | R@8 | RP | MAP@R | MAP | MRR | time (s) |"
    )
    expected_labels = [("plain", "✓"), ("plain", "–"), ("ISM", "✓"), ("ISM", "–")]
    for row, cell_id, labels in zip(table[2:6], ids, expected_labels, strict=True):
        values = []
        for seed in (0, 1):
            log = (out / "cells" / cell_id / f"seed{seed}" / "metrics.jsonl").read_text()
            values.append(json.loads(log.splitlines()[-1])["test/recall@1"])
        mean = sum(values) / 2
        std = abs(values[0] - values[1]) / math.sqrt(2)
        columns = [c.strip() for c in row.strip("|").split("|")]
        assert columns[:2] == list(labels)
        assert columns[2] == f"{100 * mean:.1f} ± {100 * std:.1f}"
    rows = list(csv.DictReader((out / "ablation.csv").open()))
    assert [r["cell"] for r in rows] == ids and all(r["seeds"] == "2" for r in rows)
    assert json.loads((out / "grid.json").read_text())["grid"] == {
        "metric": ["plain", "ism"],
        "mixup": ["on", "off"],
    }

    # Second run of the same grid: nothing trains, no result file is rewritten, same table.
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("cells/*/seed*/result.json")}
    before = (out / "ablation.md").read_text()
    again = run_ablation(config, axes, seeds=2, out_dir=out, log=lines.append)
    assert len(count_fits) == 8
    assert all(run.reused for cell in again.cells for run in cell.runs)
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    assert (out / "ablation.md").read_text() == before
    assert lines[-1].endswith("(2 run(s): 2 reused; 0.0 s of training)")

    # A metric column no run reports is refused, naming the ones that exist (nothing retrains).
    with pytest.raises(ValueError, match=r"--metrics recal@1: no run reports them.*recall@1"):
        run_ablation(config, axes, 2, out, metrics=["recal@1"], log=lines.append)

    # The CLI on the same folder reuses everything too and prints the table.
    assert (
        main(
            [
                "ablate",
                str(config),
                "--grid",
                "metric=plain,ism",
                "--grid",
                "mixup=on,off",
                "--seeds",
                "2",
                "--out",
                str(out),
                "--metrics",
                "recall@1,map@r",
            ]
        )
        == 0
    )
    assert len(count_fits) == 8
    printed = capsys.readouterr().out
    assert "| metric | mixup | R@1 | MAP@R | time (s) |" in printed and "ablation.md" in printed
    assert printed.count("2 reused") == 4


@pytest.mark.slow
def test_changed_config_reruns_and_an_interrupted_run_resumes(
    tmp_path: Path, count_fits: list[tuple[Path, bool]]
) -> None:
    config, out = _base_config(tmp_path), tmp_path / "ablation"
    axes = parse_grid(["metric=plain"])
    first = run_ablation(config, axes, seeds=1, out_dir=out, log=lambda _: None)
    run = out / "cells" / "metric-plain" / "seed0"
    r1 = first.cells[0].runs[0].final_metrics["recall@1"]

    # Lost result file (interrupted after the last checkpoint): resume, same numbers.
    (run / "result.json").unlink()
    resumed = run_ablation(config, axes, seeds=1, out_dir=out, log=lambda _: None)
    assert count_fits[-1] == (run, True)
    assert resumed.cells[0].runs[0].status == "resumed"
    assert resumed.cells[0].runs[0].final_metrics["recall@1"] == r1

    # A base-config change makes the stored result stale: the run is redone from scratch.
    changed = run_ablation(
        config, axes, seeds=1, out_dir=out, overrides=["optim.lr=0.002"], log=lambda _: None
    )
    assert count_fits[-1] == (run, False) and len(count_fits) == 3
    assert changed.cells[0].runs[0].status == "retrained"
    assert json.loads((run / "result.json").read_text())["config"]["optim"]["lr"] == 0.002
    # The earlier run was moved aside whole, not deleted, and the grid's tables ignore it.
    (aside,) = run.parent.glob("seed0.replaced-*")
    assert json.loads((aside / "result.json").read_text())["config"]["optim"]["lr"] != 0.002
    assert (aside / "metrics.jsonl").stat().st_size > 0
    runs, _ = expand_run_dirs([out])
    assert runs == [run]
    # A folder another live process is writing is neither moved nor trained into.
    (run / ".lock").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    with pytest.raises(RunLockedError, match=f"process {os.getpid()}"):
        run_ablation(config, axes, 1, out, overrides=["optim.lr=0.003"], log=lambda _: None)
    assert len(count_fits) == 3 and len(list(run.parent.glob("seed0.replaced-*"))) == 1


def test_bad_cell_config_fails_before_any_training(
    tmp_path: Path, count_fits: list[tuple[Path, bool]]
) -> None:
    config = _base_config(tmp_path)
    with pytest.raises(ValueError, match=r"grid cell metric\.tau=0.*metric\.tau"):
        run_ablation(config, parse_grid(["metric.tau=1,0"]), 1, tmp_path / "out")
    with pytest.raises(ValueError, match=r"unknown key 'metric\.gama'"):
        run_ablation(config, parse_grid(["metric.gama=1"]), 1, tmp_path / "out")
    # A metric the run does not report is found before the first cell trains, not after it.
    with pytest.raises(ValueError, match=r"grid cell eval\.select=recall@3: .*recall@1"):
        run_ablation(config, parse_grid(["eval.select=recall@1,recall@3"]), 1, tmp_path / "out")
    with pytest.raises(ValueError, match="--seeds must be >= 1"):
        run_ablation(config, parse_grid(["metric=plain"]), 0, tmp_path / "out")
    assert count_fits == [] and not (tmp_path / "out" / "cells").exists()


@pytest.mark.slow
def test_a_failing_run_names_its_cell_and_finished_cells_are_kept(
    tmp_path: Path, count_fits: list[tuple[Path, bool]]
) -> None:
    config, out = _base_config(tmp_path), tmp_path / "ablation"
    # A learning rate of 1e30 passes every check and diverges inside Trainer.fit.
    axes = parse_grid(["optim.lr=0.001,1e30"])
    with pytest.raises(FloatingPointError, match=r"grid cell optim\.lr=1e30, seed 0: NaN or inf"):
        run_ablation(config, axes, seeds=1, out_dir=out, log=lambda _: None)
    assert len(count_fits) == 2
    # The finished cell is stored: a grid of it alone reuses it.
    again = run_ablation(config, parse_grid(["optim.lr=0.001"]), 1, out, log=lambda _: None)
    assert again.cells[0].runs[0].reused and len(count_fits) == 2


def test_tables_only_tabulates_finished_runs_and_trains_nothing(
    tmp_path: Path, count_fits: list[tuple[Path, bool]]
) -> None:
    config, out = _base_config(tmp_path), tmp_path / "ablation"
    axes = parse_grid(["optim.lr=0.001,1e30"])
    with pytest.raises(FloatingPointError, match="NaN"):
        run_ablation(config, axes, seeds=1, out_dir=out, log=lambda _: None)
    fits = len(count_fits)
    lines: list[str] = []
    table = run_ablation(config, axes, 1, out, log=lines.append, train_missing=False)
    assert len(count_fits) == fits  # nothing trained
    assert [c.cell.name for c in table.cells] == ["optim.lr=0.001"]
    assert any("no finished run, left out" in line for line in lines)
    assert (out / "ablation.md").is_file()


def test_a_run_written_before_a_config_key_existed_is_still_reused(
    tmp_path: Path, count_fits: list[tuple[Path, bool]]
) -> None:
    """Keys added to the schema later take their defaults when a stored result is compared, so an
    old finished run is reused rather than retrained (its numbers cannot have depended on them)."""
    config, out = _base_config(tmp_path), tmp_path / "ablation"
    axes = parse_grid(["metric=ism"])
    run_ablation(config, axes, seeds=1, out_dir=out, log=lambda _: None)
    assert len(count_fits) == 1
    (result_file,) = out.glob("cells/*/seed0/result.json")
    stored = json.loads(result_file.read_text())
    del stored["config"]["metric"]["warmup_epochs"]  # as written before the ISM warm-up existed
    result_file.write_text(json.dumps(stored))
    again = run_ablation(config, axes, seeds=1, out_dir=out, log=lambda _: None)
    assert len(count_fits) == 1 and again.cells[0].runs[0].reused
    stored["config"]["metric"]["tau"] = 7.0  # a real difference still retrains
    result_file.write_text(json.dumps(stored))
    run_ablation(config, axes, seeds=1, out_dir=out, log=lambda _: None)
    assert len(count_fits) == 2
