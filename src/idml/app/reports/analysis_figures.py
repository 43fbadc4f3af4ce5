"""The figures of a run's test-set analysis: risk–coverage, uncertainty by condition and its
histogram, the retrieval grid, t-SNE, and a classification run's reliability diagram, confusion
matrix and mistakes (:mod:`idml.app.reports.figures`)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
from matplotlib import colormaps
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from idml.app.metric_display import decimals_for, format_metric
from idml.app.reports.figure_style import (
    CORRECT,
    WRONG,
    wrap_label,
)
from idml.app.reports.runs import TestAnalysis
from idml.evaluation.classification import CalibrationBins


def risk_coverage_curves(
    curves: dict[str, tuple[np.ndarray, np.ndarray]],
    oracle: float | None = None,
    answers: str = "queries",
    error: str = "wrong top-1",
    legend: str = "upper left",
) -> Figure:
    """Risk–coverage (Geifman & El-Yaniv 2017): answering only the most confident share of the
    ``answers``, the share of ``error`` among the answers kept, per confidence score."""
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
    axes.set_xlabel(f"coverage: % of {answers} answered (most confident first)")
    axes.set_ylabel(f"% {error} among them")
    axes.set_title("risk–coverage")
    axes.set_xlim(0, 100)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, loc=cast(Any, legend))  # one of matplotlib's location names
    figure.tight_layout()
    return figure


def uncertainty_by_condition(levels: dict[str, np.ndarray], auroc: dict[str, float]) -> Figure:
    """``||u||`` of the same test images clean and altered (Mixup, low resolution, blur,
    occlusion), with the AUROC of ``||u||`` for telling each altered version from the clean one."""
    figure = Figure(figsize=(6.4, 3.6))
    axes = figure.subplots()
    names = list(levels)
    labels = [
        name.replace("_", " ")
        + (
            ""
            if name not in auroc
            else f"\nAUROC {format_metric('auroc', auroc[name], percent_digits=1)} %"
        )
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
    bins = np.histogram_bin_edges(pooled, bins=40).tolist()
    axes.hist(original, bins=bins, alpha=0.6, density=True, label=f"original ({len(original)})")
    if mixed is not None:
        axes.hist(mixed, bins=bins, alpha=0.6, density=True, label=f"mixed ({len(mixed)})")
    axes.set_xlabel("uncertainty level ||u||")
    axes.set_ylabel("density")
    axes.set_title("test-set uncertainty")
    # Levels that differ in the fourth digit make long tick labels: few enough to stay apart.
    axes.xaxis.set_major_locator(MaxNLocator(nbins=4))
    axes.legend(fontsize=8)
    figure.tight_layout()
    return figure


GRID_NAME_CHARS = 14
"""Characters of a class name above a retrieval-grid tile (longer names lose their middle, …): the
caption stays narrower than its tile, so neighbouring captions never run into each other."""


def retrieval_grid(analysis: TestAnalysis, min_tile: int = 64) -> Figure:
    """Each query (left) and its top-k neighbours, framed green when correct, red when not.

    The layout of Fu et al. 2021, Fig. 5; labels add the class (at most :data:`GRID_NAME_CHARS`
    characters) and, with an uncertainty head, each image's uncertainty level ``||u||`` with the
    decimals that tell the shown levels apart. The tiles are composed into one image (one Axes),
    small images enlarged to ``min_tile`` pixels by pixel repetition.
    """
    images = analysis.grid_images
    if images.shape[-1] == 1:
        images = np.repeat(images, 3, axis=-1)
    rows, cols, height, width, _ = images.shape
    scale = max(1, math.ceil(min_tile / max(height, width)))
    images = images.repeat(scale, axis=2).repeat(scale, axis=3)
    height, width = height * scale, width * scale
    border = max(2, height // 16)
    band = height * 3 // 4 + 2 * border  # room above each row for three lines of labels
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

    figure = Figure(figsize=(1.5 * cols, 1.9 * rows))
    axes = figure.subplots()
    axes.imshow(canvas, interpolation="nearest")
    axes.set_axis_off()
    ids = np.concatenate([analysis.queries[:, None], analysis.neighbors], axis=1)
    digits = 0
    if analysis.uncertainty is not None:
        digits = decimals_for(analysis.uncertainty[ids].ravel().tolist(), minimum=2)
    for r in range(rows):
        for c in range(cols):
            name = wrap_label(
                analysis.class_names[int(analysis.labels[ids[r, c]])], GRID_NAME_CHARS, lines=1
            )
            text = ("query" if c == 0 else f"#{c}") + f"\n{name}"
            if analysis.uncertainty is not None:
                text += f"\n||u|| {analysis.uncertainty[ids[r, c]]:.{digits}f}"
            color = "black" if c == 0 else (CORRECT if correct[r, c - 1] else WRONG)
            x = c * (tile_w + gap) + tile_w / 2
            y = r * (band + tile_h) + band - border
            axes.text(x, y, text, ha="center", va="bottom", fontsize=7.5, color=color)
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
            xs, ys = points[here].T
            axes.scatter(xs, ys, s=8, color=palette(i), label=class_names[int(cls)])
        axes.legend(fontsize=7, title="class", loc="center left", bbox_to_anchor=(1.0, 0.5))
    else:
        codes = np.searchsorted(classes, labels)
        xs, ys = points.T
        axes.scatter(xs, ys, s=6, c=codes, cmap="hsv", vmin=0, vmax=len(classes))
    axes.set_xticks([])
    axes.set_yticks([])
    axes.set_title(f"t-SNE of {len(labels)} test embeddings ({len(classes)} classes)")
    figure.tight_layout()
    return figure


def reliability_diagram(
    bins: CalibrationBins,
    ece: float | None = None,
    confidence: str = "max softmax probability",
    items: str = "images",
) -> Figure:
    """Reliability diagram (Guo et al. 2017, Fig. 1): per equal-width bin of ``confidence``, the
    accuracy (bars) against the diagonal ``accuracy = confidence``, the gap to each bin's mean
    confidence shaded; below, how many ``items`` fall in each bin."""
    figure = Figure(figsize=(5.0, 5.2))
    top, bottom = figure.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    edges = bins.edges.numpy()
    left, width = edges[:-1], np.diff(edges)
    counts = bins.counts.numpy()
    filled = counts > 0
    accuracy = np.where(filled, bins.accuracy.numpy(), 0.0)
    mean_confidence = bins.mean_confidence.numpy()
    top.bar(
        left, accuracy, width, align="edge", color="#2c7bb6", edgecolor="white", label="accuracy"
    )
    gap_low = np.minimum(accuracy, mean_confidence)[filled]
    gap = np.abs(mean_confidence - accuracy)[filled]
    top.bar(
        left[filled],
        gap,
        width[filled],
        bottom=gap_low,
        align="edge",
        color=WRONG,
        alpha=0.3,
        edgecolor=WRONG,
        label="gap to mean confidence",
    )
    top.plot([0, 1], [0, 1], "--", color="grey", linewidth=1, label="calibrated")
    top.set_xlim(0, 1)
    top.set_ylim(0, 1)
    top.set_ylabel("accuracy in bin")
    title = "reliability diagram"
    if ece is not None:
        title += f" (ECE {100 * ece:.2f} %)"
    top.set_title(title)
    top.grid(alpha=0.3)
    top.legend(fontsize=8, loc="upper left")
    bottom.bar(left, counts, width, align="edge", color="#888888", edgecolor="white")
    bottom.set_xlabel(f"confidence: {confidence}")
    bottom.set_ylabel(items)
    bottom.grid(alpha=0.3, axis="y")
    figure.tight_layout()
    return figure


CONFUSION_NAMED_CLASSES = 30
"""Up to this many classes the confusion matrix names every class on its axes; beyond, the axes
carry class numbers at a readable spacing (the page lists the most confused pairs by name)."""


def confusion_matrix_figure(normalized: np.ndarray, class_names: Sequence[str]) -> Figure:
    """The confusion matrix normalised per true class (row sums 1): row = true class, column =
    predicted class. Cells carry their share in % for up to 12 classes; up to
    :data:`CONFUSION_NAMED_CLASSES` the axes name each class (long names shortened), beyond that
    they number the classes."""
    classes = normalized.shape[0]
    side = min(11.0, max(4.8, 2.4 + 0.26 * classes))
    figure = Figure(figsize=(side + 1.0, side))
    axes = figure.subplots()
    image = axes.imshow(normalized, cmap="Blues", vmin=0.0, vmax=1.0, interpolation="nearest")
    figure.colorbar(image, ax=axes, fraction=0.046, pad=0.04, label="share of the true class")
    if classes <= CONFUSION_NAMED_CLASSES:
        ticks = np.arange(classes)
        names = [wrap_label(str(n), 14, lines=1) for n in class_names]
        fontsize = 8 if classes <= 15 else 7
        axes.set_xticks(ticks, names, rotation=90, fontsize=fontsize)
        axes.set_yticks(ticks, names, fontsize=fontsize)
    else:
        step = math.ceil(classes / 20)
        ticks = np.arange(0, classes, step)
        axes.set_xticks(ticks, [str(t) for t in ticks], fontsize=7, rotation=90)
        axes.set_yticks(ticks, [str(t) for t in ticks], fontsize=7)
    if classes <= 12:
        for t in range(classes):
            for p in range(classes):
                share = normalized[t, p]
                if share > 0:
                    colour = "white" if share > 0.5 else "black"
                    axes.text(
                        p,
                        t,
                        f"{100 * share:.0f}",
                        ha="center",
                        va="center",
                        fontsize=7,
                        color=colour,
                    )
    what = "class" if classes <= CONFUSION_NAMED_CLASSES else "class number"
    axes.set_xlabel(f"predicted {what}")
    axes.set_ylabel(f"true {what}")
    axes.set_title(f"confusion matrix ({classes} classes; rows sum to 1)")
    figure.tight_layout()
    return figure


def mistakes_grid(
    images: np.ndarray,
    true_names: Sequence[str],
    predicted_names: Sequence[str],
    confidences: Sequence[float],
    columns: int = 6,
) -> Figure:
    """Test images the classifier got wrong, most confident first: each with its true class, the
    predicted class and the predicted class's softmax probability."""
    count = len(images)
    columns = max(1, min(columns, count))
    rows = math.ceil(count / columns)
    # Constrained layout keeps each three-line title clear of the row above.
    figure = Figure(figsize=(1.9 * columns, 2.5 * rows), layout="constrained")
    grid = figure.subplots(rows, columns, squeeze=False).ravel()
    if images.shape[-1] == 1:
        images = np.repeat(images, 3, axis=-1)
    for axes in grid[count:]:
        axes.set_visible(False)
    for i, axes in enumerate(grid[:count]):
        axes.imshow(images[i], interpolation="nearest")
        axes.set_xticks([])
        axes.set_yticks([])
        for spine in axes.spines.values():
            spine.set_edgecolor(WRONG)
            spine.set_linewidth(2)
        axes.set_title(
            f"true: {wrap_label(str(true_names[i]), 16, lines=1)}\n"
            f"pred: {wrap_label(str(predicted_names[i]), 16, lines=1)}\np = {confidences[i]:.2f}",
            fontsize=8,
        )
    return figure
