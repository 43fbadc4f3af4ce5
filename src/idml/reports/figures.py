"""The report's figures, drawn with Matplotlib's object API (no pyplot, so no global backend state).

Every function returns a :class:`matplotlib.figure.Figure`; :func:`save_png` writes and releases it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from idml.reports.runs import RunLog, TestAnalysis

CORRECT = "#1a9641"
WRONG = "#d7191c"
_RANKING_PARTS = ("loss/ranking", "loss/ranking_sort", "loss/ranking_pos")


def save_png(figure: Figure, path: Path, dpi: int = 100) -> Path:
    """Write ``figure`` as PNG (the Agg canvas is attached by ``savefig``) and return the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=dpi, bbox_inches="tight")
    figure.clear()
    return path


def _plot_series(axes: Axes, log: RunLog, keys: Sequence[str], prefix: str) -> None:
    for key in keys:
        epochs, values = log.series(key)
        if len(epochs):
            # Markers keep one-epoch runs visible (a line needs two points).
            axes.plot(epochs, values, marker="o", markersize=3, label=key.removeprefix(prefix))
    axes.set_xlabel("epoch")
    # Whole epochs only, with a margin, so a one-epoch run gets one tick instead of fractions.
    last = max((int(line["epoch"]) + 1 for line in log.history), default=1)
    axes.set_xlim(0.5, last + 0.5)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)


def training_curves(log: RunLog) -> Figure:
    """Losses, SSR's ranking loss (when on), test metrics and learning rates per epoch."""
    losses = [k for k in log.keys("loss/") if k not in _RANKING_PARTS]
    ranking = [k for k in _RANKING_PARTS if k in log.keys("loss/")]
    # Confidence scores (auroc_*/aurc_*) have their own figure; here the retrieval metrics.
    metrics = [k for k in log.keys("test/") if not k.startswith(("test/auroc_", "test/aurc_"))]
    rates = log.keys("lr/")
    panels = [("losses", losses, "loss/", False)]
    if ranking:
        panels.append(("SSR ranking loss", ranking, "loss/", False))
    if metrics:
        panels.append(("test metrics", metrics, "test/", False))
    panels.append(("learning rate", rates, "lr/", True))
    figure = Figure(figsize=(4.2 * len(panels), 3.4))
    for axes, (title, keys, prefix, log_scale) in zip(
        figure.subplots(1, len(panels), squeeze=False)[0], panels, strict=True
    ):
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
    weak.set_yscale("log")
    weak.set_ylabel("weakening e^(-y)  (1 = plain metric)")
    weak.set_title("ISM weakening (median, 10–90 %)")
    share.set_ylabel("% of relations with e^(-y) < 0.01")
    share.set_ylim(-2, 102)
    share.set_title("saturated relations")
    last = max((int(line["epoch"]) + 1 for line in log.history), default=1)
    for axes in (weak, share):
        axes.set_xlabel("epoch")
        axes.set_xlim(0.5, last + 0.5)
        axes.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8, loc="best")
    figure.tight_layout()
    return figure


def risk_coverage_curves(
    curves: dict[str, tuple[np.ndarray, np.ndarray]], oracle: float | None = None
) -> Figure:
    """Risk–coverage: answering only the most confident share of the queries, the error rate of
    the answers kept (top-1 neighbour of another class), per confidence score."""
    figure = Figure(figsize=(5.2, 3.6))
    axes = figure.subplots()
    styles = ["-", "--", ":"]
    for (name, (coverage, risk)), style in zip(curves.items(), itertools.cycle(styles)):
        area = float(np.sum(risk * np.diff(coverage, prepend=0.0)))
        axes.plot(100 * coverage, 100 * risk, style, label=f"{name} (AURC {100 * area:.2f})")
    if oracle is not None:
        axes.axhline(
            100 * oracle,
            color="grey",
            linewidth=0.8,
            linestyle="-.",
            label=f"best possible AURC {100 * oracle:.2f}",
        )
    axes.set_xlabel("coverage: % of queries answered (most confident first)")
    axes.set_ylabel("% wrong top-1 among them")
    axes.set_title("risk–coverage")
    axes.set_xlim(0, 100)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, loc="upper left")
    figure.tight_layout()
    return figure


def uncertainty_by_condition(levels: dict[str, np.ndarray], auroc: dict[str, float]) -> Figure:
    """``||u||`` of the same test images clean and altered (Mixup, low resolution, blur,
    occlusion), with the AUROC of ``||u||`` for telling each altered version from the clean one."""
    figure = Figure(figsize=(6.4, 3.6))
    axes = figure.subplots()
    names = list(levels)
    labels = [
        name.replace("_", " ") + ("" if name not in auroc else f"\nAUROC {auroc[name]:.2f}")
        for name in names
    ]
    axes.boxplot([levels[n] for n in names], showfliers=False, widths=0.6)
    axes.set_xticks(range(1, len(names) + 1), labels, fontsize=8)
    axes.set_ylabel("uncertainty level ||u||")
    axes.set_title("test images: clean vs altered")
    axes.grid(alpha=0.3, axis="y")
    figure.tight_layout()
    return figure


def uncertainty_histogram(original: np.ndarray, mixed: np.ndarray | None) -> Figure:
    """Histogram of ``||u||`` of original vs mixed test images (Wang et al. 2022, Fig. 9)."""
    figure = Figure(figsize=(5.0, 3.4))
    axes = figure.subplots()
    pooled = original if mixed is None else np.concatenate([original, mixed])
    bins = np.histogram_bin_edges(pooled, bins=40)
    axes.hist(original, bins=bins, alpha=0.6, density=True, label=f"original ({len(original)})")
    if mixed is not None:
        axes.hist(mixed, bins=bins, alpha=0.6, density=True, label=f"mixed ({len(mixed)})")
    axes.set_xlabel("uncertainty level ||u||")
    axes.set_ylabel("density")
    axes.set_title("test-set uncertainty")
    axes.legend(fontsize=8)
    figure.tight_layout()
    return figure


def recall_bars(names: Sequence[str], metrics: Sequence[dict[str, float]]) -> Figure:
    """Recall@K of each run as grouped bars (one group per K, one colour per run)."""
    ks = sorted(
        {int(k.removeprefix("recall@")) for m in metrics for k in m if k.startswith("recall@")}
    )
    figure = Figure(figsize=(max(4.5, 1.2 * len(ks) * max(1, len(names)) / 2 + 2), 3.6))
    axes = figure.subplots()
    width = 0.8 / max(1, len(names))
    positions = np.arange(len(ks))
    for i, (name, values) in enumerate(zip(names, metrics, strict=True)):
        heights = [100 * values.get(f"recall@{k}", np.nan) for k in ks]
        bars = axes.bar(positions + (i - (len(names) - 1) / 2) * width, heights, width, label=name)
        axes.bar_label(bars, fmt="%.1f", fontsize=7)
    axes.set_xticks(positions, [f"R@{k}" for k in ks])
    axes.set_ylabel("%")
    axes.set_ylim(0, 105)
    axes.set_title("Recall@K")
    axes.legend(fontsize=8)
    figure.tight_layout()
    return figure


def pr_curves(names: Sequence[str], curves: Sequence[tuple[np.ndarray, np.ndarray]]) -> Figure:
    """Interpolated precision against recall, averaged over queries, one line per run."""
    figure = Figure(figsize=(5.0, 3.8))
    axes = figure.subplots()
    for name, (recall, precision) in zip(names, curves, strict=True):
        axes.plot(recall, precision, marker="o", markersize=3, label=name)
    axes.set_xlabel("recall")
    axes.set_ylabel("precision")
    axes.set_xlim(0, 1)
    axes.set_ylim(0, 1.02)
    axes.grid(alpha=0.3)
    axes.set_title("precision–recall (test split)")
    axes.legend(fontsize=8)
    figure.tight_layout()
    return figure


def retrieval_grid(analysis: TestAnalysis, min_tile: int = 64) -> Figure:
    """Each query (left) and its top-k neighbours, framed green when correct, red when not.

    The layout of Fu et al. 2021, Fig. 5; labels add the class and, with an uncertainty head, each
    image's uncertainty level ``||u||``. The tiles are composed into one image (one Axes), small
    images enlarged to ``min_tile`` pixels by pixel repetition.
    """
    images = analysis.grid_images
    if images.shape[-1] == 1:
        images = np.repeat(images, 3, axis=-1)
    rows, cols, height, width, _ = images.shape
    scale = max(1, math.ceil(min_tile / max(height, width)))
    images = images.repeat(scale, axis=2).repeat(scale, axis=3)
    height, width = height * scale, width * scale
    border = max(2, height // 16)
    band = height // 2 + 2 * border  # room above each row for two lines of labels
    gap = 2 * border
    correct = analysis.correct
    frame = np.where(correct[..., None], to_rgb(CORRECT), to_rgb(WRONG))
    frame = np.concatenate([np.zeros((rows, 1, 3)), frame], axis=1)  # queries: black frame
    tile_h, tile_w = height + 2 * border, width + 2 * border
    canvas = np.ones((rows, cols, band + tile_h, tile_w + gap, 3))
    canvas[:, :, band:, :tile_w] = frame[:, :, None, None, :]
    canvas[:, :, band + border : band + border + height, border : border + width] = images
    canvas = canvas.transpose(0, 2, 1, 3, 4).reshape(
        rows * (band + tile_h), cols * (tile_w + gap), 3
    )

    figure = Figure(figsize=(1.5 * cols, 1.7 * rows))
    axes = figure.subplots()
    axes.imshow(canvas, interpolation="nearest")
    axes.set_axis_off()
    ids = np.concatenate([analysis.queries[:, None], analysis.neighbors], axis=1)
    for r in range(rows):
        for c in range(cols):
            name = analysis.class_names[int(analysis.labels[ids[r, c]])]
            text = f"query: {name}" if c == 0 else f"#{c} {name}"
            if analysis.uncertainty is not None:
                text += f"\n||u||={analysis.uncertainty[ids[r, c]]:.2f}"
            color = "black" if c == 0 else (CORRECT if correct[r, c - 1] else WRONG)
            x = c * (tile_w + gap) + tile_w / 2
            y = r * (band + tile_h) + band - border
            axes.text(x, y, text, ha="center", va="bottom", fontsize=8, color=color)
    figure.tight_layout()
    return figure


def tsne_scatter(points: np.ndarray, labels: np.ndarray, class_names: Sequence[str]) -> Figure:
    """t-SNE of test embeddings coloured by class (with a legend up to 20 classes)."""
    figure = Figure(figsize=(5.5, 4.6))
    axes = figure.subplots()
    classes = np.unique(labels)
    if len(classes) <= 20:
        palette = colormaps["tab10" if len(classes) <= 10 else "tab20"]
        for i, cls in enumerate(classes):
            here = labels == cls
            axes.scatter(*points[here].T, s=8, color=palette(i), label=class_names[int(cls)])
        axes.legend(fontsize=7, title="class", loc="center left", bbox_to_anchor=(1.0, 0.5))
    else:
        codes = np.searchsorted(classes, labels)
        axes.scatter(*points.T, s=6, c=codes, cmap="hsv", vmin=0, vmax=len(classes))
    axes.set_xticks([])
    axes.set_yticks([])
    axes.set_title(f"t-SNE of {len(labels)} test embeddings ({len(classes)} classes)")
    figure.tight_layout()
    return figure
