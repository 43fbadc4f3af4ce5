"""The report's figures, drawn with Matplotlib's object API (no pyplot, so no global backend state).

This module draws the training curves and the comparison of runs, and re-exports the test-set
figures of :mod:`idml.app.reports.analysis_figures`. Every function returns a
:class:`matplotlib.figure.Figure`; :func:`save_png` writes and releases it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from idml.app.metric_display import metric_family, metric_label, metric_unit
from idml.app.reports.analysis_figures import (
    CONFUSION_NAMED_CLASSES,
    confusion_matrix_figure,
    mistakes_grid,
    reliability_diagram,
    retrieval_grid,
    risk_coverage_curves,
    tsne_scatter,
    uncertainty_by_condition,
    uncertainty_histogram,
)
from idml.app.reports.figure_style import (
    CORRECT,
    MAX_LINES,
    PANEL_COLUMNS,
    WRONG,
    legend_below,
    line_groups,
    line_style,
    panel_grid,
    save_png,
    wrap_label,
)
from idml.app.reports.runs import RunLog
from idml.evaluation.confidence import is_confidence_metric

__all__ = [
    "CONFUSION_NAMED_CLASSES",
    "CORRECT",
    "MAX_LINES",
    "PANEL_COLUMNS",
    "WRONG",
    "confusion_matrix_figure",
    "ism_saturation",
    "mistakes_grid",
    "pr_curves",
    "recall_dots",
    "reliability_diagram",
    "retrieval_grid",
    "risk_coverage_curves",
    "save_png",
    "training_curves",
    "tsne_scatter",
    "uncertainty_by_condition",
    "uncertainty_histogram",
    "uncertainty_trend",
]

_RANKING_PARTS = ("loss/ranking", "loss/ranking_sort", "loss/ranking_pos")


def _plot_series(axes: Axes, log: RunLog, keys: Sequence[str], prefix: str) -> None:
    drawn: list[tuple[str, np.ndarray, np.ndarray]] = []
    for i, key in enumerate(keys):
        epochs, values = log.series(key)
        if len(epochs):
            label = key.removeprefix(prefix)
            # A series on top of an earlier one (equal learning rates) says so in the legend.
            same = next(
                (
                    name
                    for name, e, v in drawn
                    if np.array_equal(e, epochs) and np.allclose(v, values, rtol=1e-12, atol=0)
                ),
                None,
            )
            drawn.append((label, epochs, values))
            if same is not None:
                label += f" (= {same})"
            # Markers keep one-epoch runs visible (a line needs two points).
            axes.plot(epochs, values, label=label, **line_style(i))
    axes.set_xlabel("epoch")
    # Whole epochs only, with a margin, so a one-epoch run gets one tick instead of fractions.
    last = max((int(line["epoch"]) for line in log.history), default=1)
    axes.set_xlim(0.5, last + 0.5)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    axes.grid(alpha=0.3)
    legend_below(axes)


def _split(title: str, keys: list[str]) -> list[tuple[str, list[str]]]:
    """``keys`` in panels of at most :data:`MAX_LINES` lines (small multiples), numbered."""
    groups = line_groups(len(keys))
    if len(groups) <= 1:
        return [(title, keys)]
    return [
        (f"{title} ({i + 1}/{len(groups)})", [keys[j] for j in g]) for i, g in enumerate(groups)
    ]


def _metric_panels(keys: list[str]) -> list[tuple[str, list[str]]]:
    """Test-metric curves by kind — Recall@K; the other retrieval metrics; accuracy; NLL;
    ``||u||`` levels — so one panel holds one scale and a handful of lines."""
    kinds: dict[tuple[str, str, bool], list[str]] = {}
    for key in keys:
        name = key.removeprefix("test/")
        kinds.setdefault(
            (metric_family(name), metric_unit(name), name.startswith("recall@")), []
        ).append(key)
    panels = []
    for (family, _, recall), members in kinds.items():
        if recall:
            title = "test Recall@K"
        elif len(members) == 1:
            title = f"test {metric_label(members[0].removeprefix('test/'))}"
        else:
            title = "test ||u|| levels" if family == "uncertainty" else f"test {family} metrics"
        panels += _split(title, members)
    return panels


def training_curves(log: RunLog) -> Figure:
    """Losses, SSR's ranking loss (when on), test metrics and learning rates per epoch: one panel
    per kind of curve, each with at most :data:`MAX_LINES` lines (more become further panels)."""
    losses = [k for k in log.keys("loss/") if k not in _RANKING_PARTS]
    ranking = [k for k in _RANKING_PARTS if k in log.keys("loss/")]
    # Confidence metrics have their own figure; here the retrieval metrics.
    metrics = [k for k in log.keys("test/") if not is_confidence_metric(k.removeprefix("test/"))]
    rates = log.keys("lr/")
    panels = [(title, keys, "loss/", False) for title, keys in _split("losses", losses)]
    if ranking:
        panels.append(("SSR ranking loss", ranking, "loss/", False))
    panels += [(title, keys, "test/", False) for title, keys in _metric_panels(metrics)]
    panels += [(title, keys, "lr/", True) for title, keys in _split("learning rate", rates)]
    figure, grid = panel_grid(len(panels))
    for axes, (title, keys, prefix, log_scale) in zip(grid, panels, strict=True):
        _plot_series(axes, log, keys, prefix)
        axes.set_title(title)
        if log_scale and any(np.all(log.series(k)[1] > 0) for k in keys):
            axes.set_yscale("log")
    figure.tight_layout()
    return figure


def uncertainty_trend(log: RunLog) -> Figure:
    """Mean ``||u||`` of original and mixed training images per epoch (Wang et al. 2022, Fig. 7)."""
    figure = Figure(figsize=(5.0, 3.4))
    axes = figure.subplots()
    _plot_series(axes, log, log.keys("uncertainty/"), "uncertainty/")
    axes.set_ylabel("mean uncertainty level ||u||")
    axes.set_title("uncertainty during training")
    figure.tight_layout()
    return figure


def ism_saturation(log: RunLog) -> Figure:
    """ISM's weakening ``e^{−y}`` of positive and negative relations per epoch (median, with the
    10–90 % band) and the share of saturated relations (``e^{−y} < 10⁻²``): is ISM working?"""
    figure = Figure(figsize=(9.0, 3.4))
    weak, share = figure.subplots(1, 2)
    colors = {"pos": "#2c7bb6", "neg": "#d7191c"}
    names = {"pos": "positive", "neg": "negative"}
    for kind, color in colors.items():
        epochs, median = log.series(f"ism/{kind}_q50")
        if not len(epochs):
            continue
        _, low = log.series(f"ism/{kind}_q10")
        _, high = log.series(f"ism/{kind}_q90")
        weak.plot(epochs, median, marker="o", markersize=3, color=color, label=names[kind])
        if len(low) == len(epochs) and len(high) == len(epochs):
            weak.fill_between(epochs, low, high, color=color, alpha=0.15, linewidth=0)
        epochs, saturated = log.series(f"ism/{kind}_saturated")
        share.plot(
            epochs, 100 * saturated, marker="o", markersize=3, color=color, label=names[kind]
        )
    # A log axis only when some relations are weakened by orders of magnitude; near 1 it would
    # label a 0.1 % range in powers of ten.
    lows = [log.series(f"ism/{k}_q10")[1] for k in colors]
    if any(len(v) and float(np.min(v)) < 0.1 for v in lows):
        weak.set_yscale("log")
    weak.set_ylabel("weakening e^(-y)  (1 = plain metric)")
    weak.set_title("ISM weakening (median, 10–90 %)")
    share.set_ylabel("% of relations with e^(-y) < 0.01")
    share.set_ylim(-2, 102)
    share.set_title("saturated relations")
    last = max((int(line["epoch"]) for line in log.history), default=1)
    for axes in (weak, share):
        axes.set_xlabel("epoch")
        axes.set_xlim(0.5, last + 0.5)
        axes.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8, loc="best")
    figure.tight_layout()
    return figure


def recall_dots(
    names: Sequence[str],
    metrics: Sequence[dict[str, float]],
    errors: Sequence[dict[str, float]] | None = None,
) -> Figure:
    """Recall@K of each run (or seed group) as dots, one panel per K, on a zoomed axis.

    The gains the papers report are 1–3 points; on a 0–100 axis they vanish, so each panel's axis
    spans the data plus a margin (and says so). ``errors`` (same keys, fractions) draws ± std over
    seeds as intervals. Runs are rows named on the left of each panel row, so long names do not
    collide with each other or with the data.
    """
    ks = sorted(
        {int(k.removeprefix("recall@")) for m in metrics for k in m if k.startswith("recall@")}
    )
    # Each row has room for a two-line name, so neighbouring names never overlap.
    height = 1.1 + 0.45 * len(names)
    figure, grid = panel_grid(len(ks), width=4.6, height=height)
    rows = np.arange(len(names))[::-1]  # first run on top
    for panel, (axes, k) in enumerate(zip(grid, ks, strict=True)):
        key = f"recall@{k}"
        values = np.array([100 * m.get(key, np.nan) for m in metrics])
        spread = np.array([100 * (e or {}).get(key, 0.0) for e in (errors or [{}] * len(names))])
        spread = np.nan_to_num(spread)
        for i, (row, value, err) in enumerate(zip(rows, values, spread, strict=True)):
            if np.isfinite(value):
                colour = f"C{i % 10}"
                axes.errorbar(value, row, xerr=err or None, fmt="o", color=colour, capsize=3)
                axes.annotate(
                    f"{value:.1f}" + (f" ± {err:.1f}" if err else ""),
                    (value, row),
                    xytext=(0, 7),
                    textcoords="offset points",
                    ha="center",
                    fontsize=8,
                )
        finite = np.isfinite(values)
        if finite.any():
            low = float(np.min(values[finite] - spread[finite]))
            high = float(np.max(values[finite] + spread[finite]))
            margin = max(0.5, 0.15 * (high - low))
            axes.set_xlim(max(0.0, low - margin), min(100.0, high + margin))
        axes.set_ylim(-0.7, len(names) - 0.3)
        shown = [wrap_label(n, 26) for n in names] if panel % PANEL_COLUMNS == 0 else []
        axes.set_yticks(rows, shown, fontsize=8)
        axes.grid(axis="x", alpha=0.3)
        axes.set_title(f"R@{k}")
        axes.set_xlabel("% (axis zoomed to the data)")
    figure.tight_layout()
    return figure


def pr_curves(names: Sequence[str], curves: Sequence[tuple[np.ndarray, np.ndarray]]) -> Figure:
    """Interpolated precision against recall, averaged over queries, one line per run; more than
    :data:`MAX_LINES` runs become small multiples, each panel with the first run (grey) to
    compare against."""
    groups = line_groups(len(names))
    figure, grid = panel_grid(len(groups), width=5.0, height=4.2)
    for panel, (axes, group) in enumerate(zip(grid, groups, strict=True)):
        if panel > 0:  # the first run, as the common reference of every panel
            recall, precision = curves[0]
            axes.plot(recall, precision, color="0.7", linewidth=1, label=f"{names[0]} (panel 1)")
        for i in group:
            recall, precision = curves[i]
            axes.plot(recall, precision, label=names[i], **line_style(i))
        axes.set_xlabel("recall")
        axes.set_ylabel("precision")
        axes.set_xlim(0, 1)
        axes.set_ylim(0, 1.02)
        axes.grid(alpha=0.3)
        part = f" ({panel + 1}/{len(groups)})" if len(groups) > 1 else ""
        axes.set_title(f"precision–recall (test split){part}")
        legend_below(axes, columns=2)
    figure.tight_layout()
    return figure
