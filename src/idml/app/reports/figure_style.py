"""What the report's figures share: colours, line styles, legends, panel grids, label wrapping and
:func:`save_png`."""

from __future__ import annotations

import io
import itertools
import math
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from idml.app.storage import write_file

CORRECT = "#1a9641"
WRONG = "#d7191c"


def save_png(figure: Figure, path: Path, dpi: int = 100) -> Path:
    """Write ``figure`` as PNG (the Agg canvas is attached by ``savefig``) and return the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()  # then one atomic write: a full disk names the folder, no half PNG
    figure.savefig(buffer, format="png", dpi=dpi, bbox_inches="tight")
    figure.clear()
    write_file(path, buffer.getvalue(), what=f"figure {path.name}")
    return path


# Lines that coincide (the backbone and head learning rates differ by a constant factor, or equal
# each other in warm-up) stay distinguishable by dash pattern and marker, not by colour alone.
_LINE_STYLES = ("-", "--", ":", "-.")
_MARKERS = ("o", "s", "^", "D", "v", "P")
PANEL_COLUMNS = 2
"""Panels per row: more panels wrap onto further rows instead of shrinking the fonts."""

MAX_LINES = 5
"""Lines one panel draws at most; more become small multiples (one panel per group of lines),
since five dash patterns and colours are about what a reader tells apart."""


def line_groups(count: int, size: int = MAX_LINES) -> list[range]:
    """``range(count)`` in consecutive groups of at most ``size``, of nearly equal length
    (6 lines: 3 + 3 rather than 5 + 1)."""
    if count <= 0:
        return []
    panels = math.ceil(count / size)
    edges = [round(i * count / panels) for i in range(panels + 1)]
    return [range(a, b) for a, b in itertools.pairwise(edges)]


def line_style(i: int) -> dict[str, Any]:
    return {
        "linestyle": _LINE_STYLES[i % len(_LINE_STYLES)],
        "marker": _MARKERS[i % len(_MARKERS)],
        "markersize": 4,
        "markerfacecolor": "none" if i % 2 else None,
    }


def legend_below(axes: Axes, columns: int = 3) -> None:
    """A legend under the axes, outside the data, when anything is labelled."""
    handles, labels = axes.get_legend_handles_labels()
    if handles:
        axes.legend(
            handles,
            [wrap_label(label, 28) for label in labels],
            fontsize=8,
            loc="upper center",
            bbox_to_anchor=(0.5, -0.2),
            ncol=min(columns, len(handles)),
            frameon=False,
        )


def wrap_label(text: str, width: int, lines: int = 2) -> str:
    """``text`` in at most ``lines`` lines of ``width``; longer names lose their middle (…)."""
    if len(text) > width * lines:
        keep = width * lines - 1
        text = text[: keep - keep // 2] + "…" + text[len(text) - keep // 2 :]
    return "\n".join(text[i : i + width] for i in range(0, len(text), width))


def panel_grid(count: int, width: float = 4.6, height: float = 3.6) -> tuple[Figure, list[Axes]]:
    """``count`` panels of a fixed size, :data:`PANEL_COLUMNS` per row (spare cells hidden)."""
    columns = min(PANEL_COLUMNS, count)
    rows = math.ceil(count / columns)
    figure = Figure(figsize=(width * columns, height * rows))
    grid = figure.subplots(rows, columns, squeeze=False).ravel()
    for spare in grid[count:]:
        spare.set_visible(False)
    return figure, list(grid[:count])
