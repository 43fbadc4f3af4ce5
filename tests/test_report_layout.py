"""Reports that fit a 1400 px screen: every page kind (a demo-style comparison, an ablation, a
classification run, a calibrated retrieval run, a search page) measured in headless Chromium — no horizontal overflow, no
column hidden in a scrolling box, no text drawn over text or images, with ``<details>`` closed and
opened — and every figure of those pages checked for overlapping labels and too many lines.

Also, without a browser: the figures that used to collide (long class names in the retrieval grid,
``||u||`` ticks that differ in the fourth digit, eight precision–recall curves, nine test-metric
curves) and the precision ``||u||`` is printed with.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from browser import CHROMIUM, measure_layout
from figure_checks import lines_per_panel, overlapping_texts, recording_figures
from idml.app.cli import main
from idml.app.reports import AnalysisOptions, figures, read_run, write_report
from idml.app.reports import runs as report_runs
from idml.app.reports.figure_style import MAX_LINES
from tiny_run import CLASSIFICATION, TINY, write_images

WIDTH = 1400
"""The screen the pages must fit (a laptop's browser window)."""

_TINY = [*TINY, "loss.name=multi_similarity"]
_SMALL_ANALYSIS = ["--tsne-points", "60", "--queries", "3", "--no-progress"]
"""Fewer t-SNE points and grid rows than by default: the same page kinds, in less time."""
_needs_chromium = pytest.mark.skipif(
    CHROMIUM is None,
    reason="chromium is not installed (make setup; Debian: apt-get install chromium)",
)


def _sets(items: list[str]) -> list[str]:
    return [a for item in items for a in ("--set", item)]


@pytest.fixture(scope="module")
def pages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The five page kinds built from tiny runs, and the checks of every figure they drew."""
    root = tmp_path_factory.mktemp("pages")
    config = root / "tiny.yaml"
    config.write_text("name: tiny\n")
    made: dict[str, Any] = {}
    with pytest.MonkeyPatch.context() as patch, recording_figures(patch) as drawn:
        # An ablation: 2 cells × 3 seeds = 6 runs (more precision–recall curves than a panel
        # holds), reported with every run's section.
        ablation = root / "ablation"
        grid = ["--grid", "method=baseline,idml", "--seeds", "3"]
        assert main(["ablate", str(config), *grid, "--out", str(ablation), "--no-progress",
                     *_sets(_TINY)]) == 0  # fmt: skip
        # The reference chosen is not the first cell in the folder: the table lists it first.
        assert main(["report", str(ablation), "--out", str(root / "ablation-report"),
                     "--reference", "method=idml", *_SMALL_ANALYSIS]) == 0  # fmt: skip
        made["ablation"] = root / "ablation-report" / "index.html"
        # `idml demo`'s page: baseline and IDML arms, seeds averaged, one section per arm.
        cells = sorted((ablation / "cells").iterdir())
        runs = [seed for cell in cells for seed in sorted(cell.glob("seed*"))[:2]]
        options = AnalysisOptions(tsne_points=60, num_queries=3)
        made["demo"] = write_report(runs, root / "demo-report", options, sections_per_group=1)
        # A classification run with an uncertainty head.
        extra = ["optim.epochs=2", "optim.max_steps_per_epoch=2", "model.uncertainty.enabled=true",
                 "metric.introspective=true", "mixup.enabled=true", "mixup.kind=cutmix",
                 "data.samples_per_class=30"]  # fmt: skip
        run = root / "classification"
        assert main(["train", str(config), "--out", str(run), "--no-progress",
                     *_sets([*CLASSIFICATION, *extra])]) == 0  # fmt: skip
        assert main(["report", str(run), *_SMALL_ANALYSIS]) == 0
        made["classification"] = run / "report" / "index.html"
        # A run calibrated on held-out training classes: its reliability diagram, abstention
        # thresholds and calibrated risk-coverage curve (idml.app.calibration).
        held_out = ["data.num_train_classes=8", "calibration.held_out_classes=0.5",
                    "sampler.classes_per_batch=4"]  # fmt: skip
        run = root / "calibrated"
        assert main(["train", str(config), "--out", str(run), "--no-progress",
                     *_sets([*_TINY, *held_out])]) == 0  # fmt: skip
        assert (run / "calibration.json").exists()
        assert main(["report", str(run), *_SMALL_ANALYSIS]) == 0
        made["calibrated"] = run / "report" / "index.html"
        made["figures"] = dict(drawn)
    # A search page: 13 tiles a row (they wrap), a class folder with a long name.
    gallery = write_images(root / "gallery", classes=3, per_class=5, shape=(20, 20))
    (gallery / "b").rename(gallery / ("a_class_folder_name_much_longer_than_a_tile_" * 2))
    model = cells[1] / "seed0"  # method=idml: an uncertainty head
    assert main(["index", str(gallery), "--out", str(root / "index"), "--checkpoint", str(model),
                 "--no-progress"]) == 0  # fmt: skip
    made["search"] = root / "search.html"
    assert main(["search", str(root / "index"), str(gallery / "a"), "-k", "12", "--html",
                 str(made["search"]), "--no-progress"]) == 0  # fmt: skip
    made["ablation_dir"] = ablation
    return made


PAGE_KINDS = ["demo", "ablation", "classification", "calibrated", "search"]


@pytest.mark.slow
@_needs_chromium
@pytest.mark.parametrize("kind", PAGE_KINDS)
def test_page_fits_1400_px_with_nothing_hidden_or_overlapping(
    pages: dict[str, Any], kind: str, tmp_path: Path
) -> None:
    layout = measure_layout(pages[kind], tmp_path / "profile", WIDTH)
    for state in ("closed", "opened"):  # as first shown, and with every <details> opened
        seen = layout[state]
        assert seen["scrollWidth"] <= seen["clientWidth"] <= WIDTH, (state, seen["wide"])
        assert seen["wide"] == [], state
        assert seen["clipped"] == [], state
        assert seen["overlaps"] == [], state
        assert seen["images"] and all(complete and width > 0 for complete, width in seen["images"])


@pytest.mark.slow
def test_figures_of_every_page_have_no_overlapping_labels(pages: dict[str, Any]) -> None:
    drawn = pages["figures"]
    assert len(drawn) > 20
    for name, checks in drawn.items():
        assert checks["overlaps"] == [], name
        assert max(checks["lines"], default=0) <= MAX_LINES + 1, name  # + the grey reference


@pytest.mark.slow
def test_ablation_page_leads_with_the_seed_table_and_collapses_each_run(
    pages: dict[str, Any], tmp_path: Path
) -> None:
    page = pages["ablation"].read_text(encoding="utf-8")
    seeds, first_run = page.index("<h2>Seeds and differences</h2>"), page.index("<details")
    assert seeds < first_run
    # The reference is the first row of the seed table, though its cell is the second folder.
    rows = page[seeds:].split("<tr>")
    assert "method=idml (reference)" in rows[2] and "method=baseline" in rows[3]
    # Six runs, each under a closed <details>, and the per-run comparison collapsed as well.
    assert page.count("<details>") == 7 and "<details open>" not in page
    assert page.count("<summary>Run ") == 6
    csv_head = (pages["ablation"].parent / "seeds.csv").read_text().splitlines()[0]
    assert "recall@1_p_holm" in csv_head and "recall@1_delta_low" in csv_head
    if CHROMIUM is not None:
        layout = measure_layout(pages["ablation"], tmp_path / "profile", WIDTH)
        # Closed it is a page of tables; opened it holds eight runs' figures.
        assert layout["closed"]["height"] < 4000 < layout["opened"]["height"]


@pytest.mark.slow
def test_search_page_wraps_and_shows_the_spread_of_u(pages: dict[str, Any]) -> None:
    page = pages["search"].read_text()
    levels = re.findall(r"\|\|u\|\| (\d\.\d+)", page)
    assert len(levels) == 5 * 13
    # As many decimals as it takes to tell the page's levels apart.
    assert len(set(levels)) > 1
    decimals = {len(v.split(".")[1]) for v in levels}
    assert len(decimals) == 1 and decimals.pop() >= 4


# --------------------------------------------------------------------------- figures alone
def test_retrieval_grid_captions_of_long_class_names_do_not_collide() -> None:
    rng = np.random.default_rng(0)
    names = tuple(f"{i:03d}.A_bird_species_with_a_very_long_name_{i}" for i in range(6))
    analysis = report_runs.TestAnalysis(
        checkpoint="best",
        epoch=1,
        metrics={},
        labels=np.repeat(np.arange(6), 4),
        class_names=names,
        pr_curve=(np.zeros(1), np.zeros(1)),
        uncertainty=0.0201 + 1e-5 * rng.random(24),
        mixed_uncertainty=None,
        queries=np.array([0, 4, 8]),
        neighbors=rng.integers(0, 24, (3, 5)),
        grid_images=rng.random((3, 6, 12, 12, 3)),
        tsne=None,
        tsne_labels=np.zeros(0),
    )
    figure = figures.retrieval_grid(analysis)
    assert overlapping_texts(figure) == []
    captions = [t.get_text() for t in figure.axes[0].texts]
    assert all("…" in c.splitlines()[1] for c in captions)  # long names shortened in the middle
    # ||u|| in [0.02010, 0.02011): enough decimals that they differ (six here), not 0.02 each.
    levels = [c.splitlines()[2] for c in captions]
    assert len(set(levels)) > 1 and all(len(x.split(" ")[1]) == 8 for x in levels)


def test_histogram_ticks_of_levels_close_together_stay_apart() -> None:
    rng = np.random.default_rng(1)
    original = 0.019560 + 3e-5 * rng.random(200)
    figure = figures.uncertainty_histogram(original, original + 2e-5)
    assert overlapping_texts(figure) == []


def test_conditions_figure_names_each_auroc_in_percent() -> None:
    """The ||u|| of clean vs altered images: each alteration's AUROC in %, as the page's tables."""
    from idml.app.reports import analysis_figures

    rng = np.random.default_rng(0)
    levels = {name: rng.random(20) for name in ("clean", "mixup", "low_resolution", "blur")}
    auroc = {"mixup": 0.7567, "low_resolution": 1.0, "blur": 0.5}
    figure = analysis_figures.uncertainty_by_condition(levels, auroc)
    labels = [t.get_text() for t in figure.axes[0].get_xticklabels()]
    assert labels == [
        "clean",
        "mixup\nAUROC 75.7 %",
        "low resolution\nAUROC 100.0 %",
        "blur\nAUROC 50.0 %",
    ]
    assert overlapping_texts(figure) == []


def test_many_runs_become_small_multiples(tmp_path: Path) -> None:
    names = [f"metric=ism, mixup=on, run {i}" for i in range(8)]
    recall = np.linspace(0, 1, 11)
    curves = [(recall, 1 - recall * (0.5 + 0.05 * i)) for i in range(8)]
    figure = figures.pr_curves(names, curves)
    # 8 runs: two panels of four, the second with the first run in grey to compare against.
    assert lines_per_panel(figure) == [4, 5]
    assert overlapping_texts(figure) == []

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("name: r\n")
    metrics = ["recall@1", "recall@2", "recall@4", "recall@8", "r_precision", "map@r", "map"]
    metrics += ["mrr", "nmi", "r_auroc_top1"]
    lines = [
        {
            "epoch": e,
            "loss/total": 1.0 / e,
            "lr/backbone": 0.1,
            **{f"test/{m}": 0.5 for m in metrics},
        }
        for e in (1, 2)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    figure = figures.training_curves(read_run(run))
    titles = [a.get_title() for a in figure.axes if a.get_visible()]
    assert titles == ["losses", "test Recall@K", "test retrieval metrics", "learning rate"]
    assert max(lines_per_panel(figure)) <= MAX_LINES
    assert overlapping_texts(figure) == []


WIDE_METRICS = [
    *(f"recall@{k}" for k in (1, 2, 4, 8)),
    *("r_precision", "map@r", "map", "mrr", "nmi"),
    *("u_clean", "u_mixup", "u_low_resolution", "u_blur", "u_occlusion"),
    *(f"r_auroc_{s}" for s in ("top1", "margin@10", "agreement@10", "csls@10", "norm_u")),
    *(f"aurc_{s}" for s in ("top1", "margin@10", "agreement@10", "csls@10", "norm_u", "oracle")),
    *(f"selective_recall@1_cov{c}" for c in (50, 80, 90)),
    *(f"conformal_{k}@{t}" for k in ("precision", "coverage") for t in (0.9, 0.95)),
]
"""Every metric family a retrieval run logs, with the widest cells they make."""


@pytest.mark.slow
@_needs_chromium
def test_seed_table_with_intervals_fits_1400_px(tmp_path: Path) -> None:
    """The seed table at its widest: long group labels, three seeds each (every Δ tested, with
    an interval as its second line), negative intervals, ||u|| levels at six decimals."""
    from idml.app.config import dump_config, load_config

    rng = np.random.default_rng(0)
    runs: list[Path] = []
    for arm, extra in (
        ("baseline", []),
        ("metric=ism, mixup=on, ssr=on, a long name", ["optim.lr=0.01"]),
    ):
        for seed in range(3):
            run = tmp_path / f"{len(runs)}"
            run.mkdir()
            dump_config(
                load_config(None, [*_TINY, f"name={arm}", f"seed={seed}", *extra]),
                run / "config.yaml",
            )
            values = {
                f"test/{m}": (0.0200 + 3e-5 * rng.random())
                if m.startswith("u_")
                else 0.5 + 0.4 * rng.random()
                for m in WIDE_METRICS
            }
            (run / "metrics.jsonl").write_text(json.dumps({"epoch": 0, **values}) + "\n")
            runs.append(run)
    index = write_report(runs, tmp_path / "report", analyse=False)
    page = index.read_text(encoding="utf-8")
    assert page.count('<span class="interval">[-') > 10  # wide, signed intervals throughout
    layout = measure_layout(index, tmp_path / "profile", WIDTH)
    for state in ("closed", "opened"):
        seen = layout[state]
        assert seen["scrollWidth"] <= seen["clientWidth"] <= WIDTH, (state, seen["wide"])
        assert seen["wide"] == [] and seen["clipped"] == [] and seen["overlaps"] == [], state


def test_overlap_check_finds_colliding_labels() -> None:
    """The figure check can fail: two texts drawn at one place are reported."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(3, 2))
    axes = figure.subplots()
    axes.text(0.5, 0.5, "first label")
    axes.text(0.52, 0.5, "second label")
    assert overlapping_texts(figure) == [("first label", "second label")]


@pytest.mark.slow
@_needs_chromium
def test_layout_check_finds_overflow_clipping_and_overlap(tmp_path: Path) -> None:
    """The browser check can fail: a table wider than the screen, a column behind a scroll bar
    and text over text are all reported."""
    page = tmp_path / "bad.html"
    cells = "".join(f"<td>column {i} with a long value</td>" for i in range(40))
    page.write_text(
        '<!DOCTYPE html><html><head><meta charset="utf-8"><link rel="icon" href="data:,">'
        f"</head><body><table><tr>{cells}</tr></table>"
        f'<div style="overflow-x:auto;width:300px"><table><tr>{cells}</tr></table></div>'
        '<p style="position:relative">under</p><p style="position:relative;top:-1.2em">over</p>'
        "</body></html>"
    )
    seen = measure_layout(page, tmp_path / "profile", WIDTH)["closed"]
    assert seen["scrollWidth"] > WIDTH and seen["wide"]
    assert seen["clipped"] and seen["overlaps"]
