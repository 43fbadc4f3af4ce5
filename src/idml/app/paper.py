"""A run beside the numbers its recipe's paper reports ("paper vs this run").

Presets carry ``published: {source, metrics}`` (metrics in %, as the papers print them; see
``scripts/parse_published.py``). idml evaluates these metrics as fractions in [0, 1]; the
comparison puts both in %, with ``Δ = run − paper`` in percentage points, for every metric the source
reports (a metric not shown in %, such as NLL in nats, is compared in its own unit:
:func:`~idml.app.metric_display.metric_unit`).
A metric the source reports but the run did not compute (say NMI switched off, or a Recall@K not in
``eval.ks``) is listed with the run's value missing, so nothing is dropped silently.

This module takes plain mappings, so the trainer's CLI, ``idml report`` and notebooks share it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from idml.app.metric_display import metric_scale


@dataclass(frozen=True)
class PaperRow:
    """One metric: the source's value and the run's, both in %, and their difference."""

    metric: str
    paper: float
    run: float | None

    @property
    def delta(self) -> float | None:
        """``run − paper`` in percentage points (``None`` when the run lacks the metric)."""
        return None if self.run is None else self.run - self.paper


def compare_with_paper(
    published: Mapping[str, float], metrics: Mapping[str, float]
) -> list[PaperRow]:
    """Rows in the source's order; ``metrics`` are idml's fractions (``recall@1``: 0.683)."""
    rows = []
    for key, paper in published.items():
        value = metrics.get(key)
        run = None
        if value is not None and math.isfinite(float(value)):
            run = metric_scale(key) * float(value)
        rows.append(PaperRow(key, float(paper), run))
    return rows


def _cells(row: PaperRow) -> tuple[str, str, str, str]:
    run = "n/a" if row.run is None else f"{row.run:.1f}"
    delta = "n/a" if row.delta is None else f"{row.delta:+.1f}"
    return row.metric, f"{row.paper:.1f}", run, delta


def format_paper_table(source: str, rows: list[PaperRow], title: str = "paper vs this run") -> str:
    """A plain-text table for terminals and logs (values in %, Δ in percentage points)."""
    cells = [("metric", "paper", "run", "Δ (pp)"), *(_cells(r) for r in rows)]
    widths = [max(len(c[i]) for c in cells) for i in range(4)]
    lines = [f"{title} ({source}; %)"]
    for i, c in enumerate(cells):
        first = c[0].ljust(widths[0])
        rest = "  ".join(v.rjust(w) for v, w in zip(c[1:], widths[1:], strict=True))
        lines.append(f"  {first}  {rest}")
        if i == 0:
            lines.append("  " + "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def paper_table_markdown(source: str, rows: list[PaperRow]) -> str:
    """The same table in Markdown."""
    lines = [
        f"Source: {source} (values in %, Δ = run − paper in percentage points)",
        "",
        "| metric | paper | run | Δ |",
        "| --- | ---: | ---: | ---: |",
    ]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    return "\n".join(lines)
