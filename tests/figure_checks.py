"""Checks of a Matplotlib figure as drawn: text that overlaps other text (tick labels that
collide, captions that run into each other) and lines per panel.

:func:`recording_figures` wraps :func:`idml.app.reports.figures.save_png`, so a test that writes a
report collects every figure of the page before it becomes a PNG.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TypedDict

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Text

OVERLAP_PX = 1.0
"""Two text boxes overlap when they share more than this many pixels in both directions (a box
that merely touches another, as stacked legend entries do, is not an overlap)."""


def overlapping_texts(figure: Figure) -> list[tuple[str, str]]:
    """Pairs of drawn, non-empty texts of ``figure`` whose boxes overlap."""
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    renderer = canvas.get_renderer()
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in _drawn_texts(figure)]
    pairs = []
    for i, (a_text, a) in enumerate(boxes):
        for b_text, b in boxes[i + 1 :]:
            width = min(a.x1, b.x1) - max(a.x0, b.x0)
            height = min(a.y1, b.y1) - max(a.y0, b.y0)
            if width > OVERLAP_PX and height > OVERLAP_PX:
                pairs.append((a_text, b_text))
    return pairs


def _drawn_texts(figure: Figure) -> list[Text]:
    """The texts a drawn figure shows: per visible axes its title, axis labels, the tick labels
    within the view (Matplotlib keeps spare tick objects it does not draw), offset texts, text
    annotations and legend; and the figure's own texts and legends."""
    texts: list[Text] = [*figure.texts]
    legends = list(figure.legends)
    for axes in figure.axes:
        if not axes.get_visible():
            continue
        texts += [axes.title, *axes.texts]
        for axis in (axes.xaxis, axes.yaxis):
            texts += [axis.label, axis.get_offset_text()]
            low, high = sorted(axis.get_view_interval())
            span = (high - low) * 1e-9
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                if low - span <= tick.get_loc() <= high + span:
                    texts += [tick.label1, tick.label2]
        legend = axes.get_legend()
        if legend is not None:
            legends.append(legend)
    for legend in legends:
        texts += [*legend.get_texts(), legend.get_title()]
    return [t for t in texts if t.get_visible() and t.get_text().strip()]


def lines_per_panel(figure: Figure) -> list[int]:
    """How many data lines each visible axes draws (legend handles and grid lines aside)."""
    return [
        sum(1 for line in axes.get_lines() if not str(line.get_label()).startswith("_"))
        for axes in figure.axes
        if axes.get_visible()
    ]


class FigureChecks(TypedDict):
    """What :func:`recording_figures` finds in one figure."""

    overlaps: list[tuple[str, str]]
    """The :func:`overlapping_texts`."""
    lines: list[int]
    """The :func:`lines_per_panel`."""


@contextlib.contextmanager
def recording_figures(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, FigureChecks]]:
    """Check each figure :func:`~idml.app.reports.figures.save_png` writes, by file name, before
    it is written (``save_png`` clears the figure)."""
    from idml.app.reports import figure_style, figures

    seen: dict[str, FigureChecks] = {}
    real = figure_style.save_png

    def record(figure: Figure, path: Path, dpi: int = 100) -> Path:
        seen[path.name] = {
            "overlaps": overlapping_texts(figure),
            "lines": lines_per_panel(figure),
        }
        return real(figure, path, dpi)

    monkeypatch.setattr(figures, "save_png", record)  # what PageFigures.figure calls
    yield seen
