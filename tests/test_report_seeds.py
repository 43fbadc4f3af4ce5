"""`idml report` of ablations and seeds: mean ± std, Δ against a reference, paper numbers."""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

import numpy as np
import pytest

from idml.app.ablation import parse_grid, run_ablation
from idml.app.cli import main
from idml.app.config import dump_config, load_config
from idml.app.reports import read_run
from idml.app.reports.seeds import expand_run_dirs, group_runs, seed_table
from tiny_run import IDML, TINY


def _logged(run: Path, metric: str) -> float:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    return [line[f"test/{metric}"] for line in lines if f"test/{metric}" in line][-1]


@pytest.fixture(scope="module")
def ablation(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("abl")
    base = root / "base.yaml"
    dump_config(load_config(None, [*TINY, "loss.name=multi_similarity", "name=tiny"]), base)
    run_ablation(base, parse_grid(["mixup=off,on"]), seeds=2, out_dir=root / "abl")
    return root / "abl"


def test_report_of_an_ablation_folder_has_mean_std_and_delta_of_the_logged_metrics(
    ablation: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report"
    assert main(["report", str(ablation), "--no-test", "--no-progress", "--out", str(out)]) == 0
    rows = {r["group"]: r for r in csv.DictReader((out / "seeds.csv").open())}
    assert list(rows) == ["mixup=off", "mixup=on"]
    assert rows["mixup=off"]["reference"] == "True"  # the baseline: no ISM, Mixup or SSR
    cells = {"mixup=off": "mixup-off", "mixup=on": "mixup-on"}
    means = {}
    for group, cell in cells.items():
        for metric in ("recall@1", "map@r"):
            values = np.array(
                [_logged(ablation / "cells" / cell / f"seed{s}", metric) for s in (0, 1)]
            )
            # float64 mean/std of two logged float64 values, printed with 10 significant digits.
            assert float(rows[group][f"{metric}_mean"]) == pytest.approx(values.mean(), rel=1e-9)
            assert float(rows[group][f"{metric}_std"]) == pytest.approx(
                values.std(ddof=1), rel=1e-9, abs=1e-12
            )
            assert rows[group][f"{metric}_n"] == "2"
            means[group, metric] = values.mean()
        assert rows[group]["seeds"] == "0 1"
    delta = means["mixup=on", "recall@1"] - means["mixup=off", "recall@1"]
    # Recall@1 over the 200 test images is k/200, so means and Δ are multiples of 1/400 (at most
    # four decimals), which .10g writes exactly; the float64 Δ here is a few ulp from that decimal:
    # abs 1e-12 (rel 1e-9 is the 10-digit bound in general; also the flipped Δ below).
    assert float(rows["mixup=on"]["recall@1_delta"]) == pytest.approx(delta, rel=1e-9, abs=1e-12)
    assert rows["mixup=off"]["recall@1_delta"] == ""
    markdown = (out / "seeds.md").read_text()
    assert "| mixup=off (reference) | 2 |" in markdown
    assert f"{100 * delta:+.2f}" in markdown.splitlines()[3]
    page = (out / "index.html").read_text()
    assert "Seeds and differences" in page and "mixup=on" in page
    assert "last logged evaluation; NMI: skipped" in page  # TINY switches NMI off; said so

    # Another reference: the Δ flips sign; an unknown one is refused before any work.
    other = tmp_path / "other"
    args = ["report", str(ablation), "--no-test", "--no-progress", "--out", str(other)]
    assert main([*args, "--reference", "mixup=on"]) == 0
    flipped = {r["group"]: r for r in csv.DictReader((other / "seeds.csv").open())}
    assert float(flipped["mixup=off"]["recall@1_delta"]) == pytest.approx(-delta, abs=1e-12)
    assert main([*args, "--reference", "mixup=maybe"]) == 2
    assert "'mixup=maybe' is not one of the compared groups" in capsys.readouterr().err


def _fake(root: Path, seed: int, r1: float, extra: list[str] | None = None) -> Path:
    root.mkdir(parents=True)
    published = "published={source: Test paper Table 9, metrics: {recall@1: 60.0}}"
    cfg = load_config(None, [*TINY, "name=fake", f"seed={seed}", published, *(extra or [])])
    dump_config(cfg, root / "config.yaml")
    line = {"epoch": 0, "steps": 2, "seconds": 1.0, "test/recall@1": r1}
    (root / "metrics.jsonl").write_text(json.dumps(line) + "\n")
    return root


def test_run_folders_that_differ_by_seed_form_one_group_with_the_paper_beside(
    tmp_path: Path,
) -> None:
    a = _fake(tmp_path / "s0", 0, 0.60)
    b = _fake(tmp_path / "s1", 1, 0.64)
    c = _fake(tmp_path / "lr", 0, 0.50, ["optim.lr=0.01"])
    runs, cells = expand_run_dirs([a, b, c])
    assert runs == [a, b, c] and cells == {}
    logs = [read_run(r) for r in runs]
    table = seed_table(logs, [x.config.name for x in logs])
    assert [len(g.runs) for g in table.groups] == [2, 1]
    assert table.groups[1].label == "fake (lr)"  # same name, other recipe: told apart
    mean, std, n, delta = table.cell(table.groups[0], "recall@1")
    # float64 mean and sample std of two values in another order/formula than numpy's: an ulp or
    # two of 0.62 and 0.028 (≤ 2.2e-16): abs 1e-15.
    assert mean == pytest.approx(0.62, abs=1e-15) and n == 2
    assert std == pytest.approx(np.std([0.60, 0.64], ddof=1), abs=1e-15)
    assert np.isnan(delta)  # the first baseline group is the reference
    out = tmp_path / "report"
    assert main(["report", str(a), str(b), str(c), "--no-test", "--out", str(out)]) == 0
    page = (out / "index.html").read_text()
    assert "Paper vs this run: fake" in page and "Test paper Table 9" in page
    assert "<td>60.0</td><td>62.0</td><td>+2.0</td>" in page


def test_the_paper_is_compared_only_with_its_own_recipe(tmp_path: Path) -> None:
    """A group that keeps the source's recipe gets the paper table with Δ; one that changed the
    dataset or embedding size gets what differs and no Δ."""
    kept = "published.recipe={data.dataset: digits, model.embedding_dim: 16}"
    changed = "published.recipe={data.dataset: cub, model.embedding_dim: 512}"
    same = _fake(tmp_path / "same", 0, 0.61, [kept])
    other = _fake(tmp_path / "other", 0, 0.55, [changed, "optim.lr=0.01"])
    out = tmp_path / "report"
    assert main(["report", str(same), str(other), "--no-test", "--out", str(out)]) == 0
    page = (out / "index.html").read_text()
    sections = page.split("<h3>Paper vs this run: ")[1:]
    assert [section.split("</h3>")[0] for section in sections] == ["fake", "fake (other)"]
    assert "<td>60.0</td><td>61.0</td><td>+1.0</td>" in sections[0]
    assert "not recorded" not in sections[0]
    assert "Not compared" in sections[1] and "<td>" not in sections[1].split("</ul>")[0]
    assert "data.dataset: digits (source: cub)" in sections[1]
    assert "model.embedding_dim: 16 (source: 512)" in sections[1]


def test_the_reference_comes_first_and_significant_deltas_are_marked(tmp_path: Path) -> None:
    idml = [*IDML, "name=fake-idml"]
    # IDML runs first on the command line; the baseline is the reference and leads the table.
    runs = [
        _fake(tmp_path / "i0", 0, 0.70, idml),
        _fake(tmp_path / "i1", 1, 0.71, idml),
        _fake(tmp_path / "b0", 0, 0.60),
        _fake(tmp_path / "b1", 1, 0.62),
        _fake(tmp_path / "one", 0, 0.90, ["optim.lr=0.01"]),
    ]
    logs = [read_run(r) for r in runs]
    table = seed_table(logs, [x.config.name for x in logs])
    assert [g.label for g in table.groups] == ["fake", "fake-idml", "fake (one)"]
    assert table.reference is table.groups[0] and table.compares
    # Paired over seeds 0 and 1: d = (0.10, 0.09), t = 0.095 / (0.005√2 / √2) = 19 with one
    # degree of freedom (Cauchy): p = 1 − (2/π)·atan 19 = 0.03348; the only test of the table
    # (one seed has no spread), so Holm leaves it: ▲.
    found = table.difference(table.groups[1], "recall@1")
    assert found is not None and found.comparison is not None and found.comparison.paired
    # float64 t-test of two-decimal inputs: differences of ~1e-16 in t, far below 1e-9 relative.
    assert found.adjusted_p == pytest.approx(1 - 2 / math.pi * math.atan(19), rel=1e-9)
    assert found.mark == "▲" and table.tests == (1, 1)
    untested = table.difference(table.groups[2], "recall@1")
    assert untested is not None and untested.comparison is None and untested.mark == ""
    assert table.difference(table.groups[0], "recall@1") is None
    rows = table.rows()
    assert rows[0][0] == "fake (reference)" and rows[1][3].startswith("+9.50 ▲ [")
    assert rows[2][3] == "+29.00"  # not tested: no mark, no interval
    lines = list(csv.DictReader(io.StringIO(table.csv())))
    assert [x["recall@1_significant"] for x in lines] == ["", "1", ""]
    assert [x["recall@1_test"] for x in lines] == ["", "paired", ""]
    page = table.html()
    assert (
        '<td class="significant" title="paired t-test over 2 seeds: p = 0.0335, Holm-adjusted 0.0335; Cohen'
        in page
    )
    assert '+9.50 ▲<br><span class="interval">[' in page


def _runs(root: Path, name: str, values: list[float], extra: list[str], seeds: list[int]) -> list:
    """Fake runs of one recipe, seed ``seeds[i]`` logging R@1 ``values[i]``."""
    return [
        read_run(_fake(root / f"{name}{s}", s, v, [f"name={name}", *extra]))
        for s, v in zip(seeds, values, strict=True)
    ]


def test_paired_holm_marks_by_hand_where_the_spread_said_otherwise(tmp_path: Path) -> None:
    """Three seeds each, the same seeds in every group (paired). With two degrees of freedom the
    t-distribution has a closed form: two-sided p = 1 − t/√(t² + 2), and t_0.975 = √(2·0.95²/
    (1 − 0.95²)) = 4.30265."""
    ref = [0.620, 0.595, 0.570]  # mean 0.595, std 0.025
    small = [0.640, 0.616, 0.592]  # d = (0.020, 0.021, 0.022): Δ 0.021 < std 0.025 and 0.024
    noisy = [0.630, 0.615, 0.630]  # d = (0.01, 0.02, 0.06): Δ 0.03 > std 0.025 and 0.0087
    logs = [
        *_runs(tmp_path, "base", ref, [], [0, 1, 2]),
        *_runs(tmp_path, "small", small, ["optim.lr=0.01"], [0, 1, 2]),
        *_runs(tmp_path, "noisy", noisy, ["optim.lr=0.02"], [0, 1, 2]),
    ]
    table = seed_table(logs, [x.config.name for x in logs])
    assert [g.label for g in table.groups] == ["base", "small", "noisy"]
    small_found = table.difference(table.groups[1], "recall@1")
    noisy_found = table.difference(table.groups[2], "recall@1")
    assert small_found is not None and noisy_found is not None
    assert small_found.comparison is not None and noisy_found.comparison is not None
    # small: d̄ = 0.021, s_d = 0.001, t = 0.021·√3/0.001 = 21√3, t² = 1323: p = 1 − √(1323/1325)
    # = 7.55e-4, Holm ×2 (two tests) = 1.51e-3 < 0.05: ▲, though |Δ| is inside both spreads.
    p_small = 1 - math.sqrt(1323 / 1325)
    # noisy: d̄ = 0.03, s_d² = 0.0014/2, t² = 0.0009·3/0.0007 = 27/7: p = 1 − √(27/41) = 0.1885,
    # Holm max(2·p_small, p) = 0.1885: no mark, though |Δ| exceeds both spreads.
    p_noisy = 1 - math.sqrt(27 / 41)
    # Inputs with three decimals, float64 sums of three terms: each p within ~1e-12 of the closed
    # form, far inside rel 1e-6 (the closed form itself is exact).
    assert small_found.comparison.p_value == pytest.approx(p_small, rel=1e-6)
    assert small_found.adjusted_p == pytest.approx(2 * p_small, rel=1e-6)
    assert noisy_found.comparison.p_value == pytest.approx(p_noisy, rel=1e-6)
    assert noisy_found.adjusted_p == pytest.approx(p_noisy, rel=1e-6)
    assert (small_found.mark, noisy_found.mark) == ("▲", "")
    # 95 % intervals: Δ ± 4.30265·s_d/√3 — small ±0.002484, noisy ±0.065726 (in points below).
    half = math.sqrt(2 * 0.95**2 / (1 - 0.95**2))
    assert small_found.comparison.high - 0.021 == pytest.approx(half * 0.001 / math.sqrt(3))
    rows = table.rows()
    assert rows[1][2:] == ["61.60 ± 2.40", "+2.10 ▲ [+1.85, +2.35]"]
    assert rows[2][2:] == ["62.50 ± 0.87", "+3.00 [-3.57, +9.57]"]
    markdown = table.markdown()
    assert "| base (reference) | 3 | 59.50 ± 2.50 |  |" in markdown
    legend = markdown.splitlines()[-1]
    assert "p < 0.05 after Holm's correction over the 2 tested Δ of this table" in legend
    assert "each a paired t-test over the seeds both groups ran (matched by seed" in legend
    lines = {x["group"]: x for x in csv.DictReader(io.StringIO(table.csv()))}
    assert float(lines["small"]["recall@1_p_holm"]) == pytest.approx(2 * p_small, rel=1e-6)
    assert float(lines["noisy"]["recall@1_delta_low"]) == pytest.approx(
        0.03 - half * math.sqrt(0.0007 / 3), rel=1e-6
    )
    assert (lines["small"]["recall@1_significant"], lines["noisy"]["recall@1_significant"]) == (
        "1",
        "0",
    )


def test_other_seeds_are_compared_unpaired_and_the_mark_knows_which_side_is_better(
    tmp_path: Path,
) -> None:
    """Welch where the seeds differ (scipy's test as the oracle); ▲ for a lower AURC, ▼ for a
    lower R@1, ≠ for a different ||u|| level (no better side)."""
    from scipy import stats

    def fake(root: Path, seed: int, metrics: dict[str, float], extra: list[str]) -> Path:
        run = _fake(root, seed, 0.0, extra)
        line = {
            "epoch": 0,
            "steps": 2,
            "seconds": 1.0,
            **{f"test/{k}": v for k, v in metrics.items()},
        }
        (run / "metrics.jsonl").write_text(json.dumps(line) + "\n")
        return run

    base = [(0.60, 0.30, 1.00), (0.61, 0.31, 1.01), (0.62, 0.29, 1.02)]
    other = [(0.50, 0.10, 2.00), (0.52, 0.11, 2.01), (0.51, 0.12, 2.03)]
    keys = ("recall@1", "aurc_top1", "u_clean")
    runs = [fake(tmp_path / f"b{s}", s, dict(zip(keys, v)), []) for s, v in enumerate(base)]
    runs += [
        fake(tmp_path / f"o{s}", s + 3, dict(zip(keys, v)), ["optim.lr=0.01"])
        for s, v in enumerate(other)
    ]
    logs = [read_run(r) for r in runs]
    table = seed_table(logs, [x.config.name + x.run_dir.name[0] for x in logs])
    group = table.groups[1]
    marks = {}
    for i, key in enumerate(keys):
        found = table.difference(group, key)
        assert found is not None and found.comparison is not None
        assert not found.comparison.paired  # seeds 3–5 against 0–2
        reference = stats.ttest_ind([v[i] for v in other], [v[i] for v in base], equal_var=False)
        # The same float64 Welch statistic: a few ulp apart.
        assert found.comparison.p_value == pytest.approx(reference.pvalue, rel=1e-9)
        marks[key] = found.mark
    assert marks == {"recall@1": "▼", "aurc_top1": "▲", "u_clean": "≠"}
    assert table.tests == (3, 0)
    legend = table.legend
    assert "(lower is better for AURC)" in legend and "≠ different where no side" in legend
    assert "each Welch's t-test" in legend


def test_one_run_has_no_seed_table_and_keeps_the_papers_numbers(tmp_path: Path) -> None:
    run = _fake(tmp_path / "run", 0, 0.61)
    table = seed_table([read_run(run)], ["fake"])
    assert not table.compares
    out = tmp_path / "report"
    assert main(["report", str(run), "--no-test", "--out", str(out)]) == 0
    page = (out / "index.html").read_text()
    assert "Seeds and differences" not in page and "Δ [95 % CI]" not in page
    assert "<h2>Published numbers</h2>" in page and "Paper vs this run: fake" in page
    # Without published numbers there is nothing of that section left.
    plain = tmp_path / "plain"
    plain.mkdir()
    cfg = load_config(None, [*TINY, "name=plain"])
    dump_config(cfg, plain / "config.yaml")
    (plain / "metrics.jsonl").write_text(json.dumps({"epoch": 0, "test/recall@1": 0.5}) + "\n")
    assert main(["report", str(plain), "--no-test", "--out", str(tmp_path / "r2")]) == 0
    page = (tmp_path / "r2" / "index.html").read_text()
    assert "Seeds and differences" not in page and "Published numbers" not in page
    # Two seeds of one recipe: a table to read (mean ± std), though no Δ.
    second = _fake(tmp_path / "run1", 1, 0.63)
    assert seed_table([read_run(run), read_run(second)], ["fake", "fake"]).compares


def test_an_ablation_folder_without_runs_is_refused(tmp_path: Path) -> None:
    (tmp_path / "abl" / "cells" / "x").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="no finished run in cells"):
        expand_run_dirs([tmp_path / "abl"])


def test_recall_dots_zoom_to_the_data_and_panels_wrap() -> None:
    from idml.app.reports import figures

    names = ["a" * 60, "b"]
    metrics = [{f"recall@{k}": 0.66 + 0.01 * k for k in (1, 2, 4, 8)}, {"recall@1": 0.683}]
    figure = figures.recall_dots(names, metrics, [{"recall@1": 0.004}, {}])
    axes = [a for a in figure.axes if a.get_visible()]
    assert len(axes) == 4
    low, high = axes[0].get_xlim()
    # R@1 values 67.0 and 68.3 (± 0.4): the axis spans them with a margin, far from 0–100.
    assert 65.0 < low < 66.7 and 68.7 < high < 70.0
    assert "zoomed" in axes[0].get_xlabel()
    rows = {round(a.get_position().y0, 3) for a in axes}
    assert len(rows) == 2  # four panels wrap onto two rows of PANEL_COLUMNS
    labels = [t.get_text() for t in axes[0].get_yticklabels()]
    assert labels[0].count("\n") == 1 and "…" in labels[0]  # a long name: two lines, middle cut


def test_coinciding_lines_are_named_in_the_legend_below_the_axes(tmp_path: Path) -> None:
    from idml.app.reports import figures

    run = _fake(tmp_path / "r", 0, 0.5)
    lines = [{"epoch": e, "loss/total": 1.0, "lr/backbone": 0.1, "lr/head": 0.1} for e in range(2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    figure = figures.training_curves(read_run(run))
    rate = next(a for a in figure.axes if a.get_title() == "learning rate")
    legend = rate.get_legend()
    assert legend is not None
    assert [t.get_text() for t in legend.get_texts()] == ["backbone", "head (= backbone)"]
    styles = {line.get_linestyle() for line in rate.get_lines()}
    assert len(styles) == 2  # drawn with different dashes, so both remain visible
    # The legend sits below the axes (anchored under them), not on the data.
    # (Legend has no public getter for its loc code: 9 is "upper center".)
    loc = legend._loc  # type: ignore[attr-defined]
    assert loc == 9 and legend.get_bbox_to_anchor().y0 < rate.bbox.y0


def test_groups_without_a_label_are_named_by_what_differs(tmp_path: Path) -> None:
    # One-cell `idml ablate` folders (an empty grid) give their runs no label.
    plain = _runs(tmp_path, "a", [0.5, 0.6], [], [0, 1])
    mixed = _runs(tmp_path, "b", [0.7, 0.8], ["mixup.enabled=true"], [0, 1])
    groups = group_runs([*plain, *mixed], [""] * 4)
    # The name differs too (a, b), but a run's name never separates groups (GROUP_IGNORED_KEYS).
    assert [g.label for g in groups] == ["mixup.enabled=False", "mixup.enabled=True"]
    assert [len(g.runs) for g in groups] == [2, 2]


def test_run_labels_are_the_shortest_distinct_path_endings(tmp_path: Path) -> None:
    from idml.app.reports.page import _labels

    runs = [
        read_run(_fake(tmp_path / arm / "s0" / "cells" / "base" / "seed0", 0, 0.5))
        for arm in ("baseline", "idml")
    ]
    assert _labels(runs) == ["baseline/s0/cells/base/seed0", "idml/s0/cells/base/seed0"]
