"""HTML tables that fit a 1400 px screen.

A run reports up to twenty metrics (Recall@K, RP, MAP@R, MAP, MRR, NMI, the ``||u||`` levels,
AUROC and AURC of three confidence scores); in one table they make it wider than the page, and the
last columns hide behind a scroll bar. :func:`split_columns` packs the metric columns into tables
of at most a few columns, the members of a family (:func:`~idml.app.metric_display.metric_family`)
kept together, and :func:`html_table` writes each one with the row labels repeated, so every
column is on screen. Number cells never wrap (``67.20 ± 0.45`` stays on one line); label cells do.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass

from idml.app.metric_display import METRIC_FAMILIES, metric_family


@dataclass(frozen=True)
class Cell:
    """One table cell: its text (escaped when written), its CSS classes (``text``: a
    left-aligned label that may wrap; ``significant``: a significant difference), a second,
    smaller line (``note``: a difference's interval) and a tooltip (``title``)."""

    text: str
    css: str = ""
    note: str = ""
    title: str = ""

    def html(self, tag: str = "td") -> str:
        attribute = f' class="{self.css}"' if self.css else ""
        if self.title:
            attribute += f' title="{html.escape(self.title)}"'
        note = f'<br><span class="interval">{html.escape(self.note)}</span>' if self.note else ""
        return f"<{tag}{attribute}>{html.escape(self.text)}{note}</{tag}>"


def text_cell(text: str) -> Cell:
    """A row or column label: left-aligned, may wrap."""
    return Cell(text, "text")


def html_table(head: Sequence[Cell], rows: Sequence[Sequence[Cell]], caption: str = "") -> str:
    """``<table>`` with one header row; ``caption`` above it names what the columns hold."""
    top = f"<caption>{html.escape(caption)}</caption>" if caption else ""
    header = "<tr>" + "".join(c.html("th") for c in head) + "</tr>"
    body = "\n".join("<tr>" + "".join(c.html() for c in row) + "</tr>" for row in rows)
    return f"<table>{top}{header}\n{body}</table>"


FAMILY_CAPTIONS = {
    "retrieval": "retrieval",
    "classification": "classification",
    "uncertainty": "uncertainty level ||u||",
    "auroc": "confidence — R-AUROC: ranking right answers above wrong ones (50 % = chance)",
    "aurc": "confidence — AURC: error rate over the coverage (lower is better)",
    "abstention": "confidence — abstention: R@1 of the most confident answers; precision and "
    "coverage of the threshold certified for each target precision",
    "other": "other",
}


def split_columns(keys: Sequence[str], per_table: int) -> list[tuple[str, list[str]]]:
    """``keys`` (in their order) in tables of at most ``per_table`` columns: families in
    :data:`~idml.app.metric_display.METRIC_FAMILIES` order, several small ones sharing a table,
    a large one split. Returns ``(caption, keys)`` per table."""
    if per_table < 1:
        raise ValueError(f"per_table must be >= 1, got {per_table}")
    families = {f: [k for k in keys if metric_family(k) == f] for f in METRIC_FAMILIES}
    tables: list[tuple[list[str], list[str]]] = []  # (family names, keys)
    for family, members in families.items():
        for start in range(0, len(members), per_table):
            chunk = members[start : start + per_table]
            if tables and len(tables[-1][1]) + len(chunk) <= per_table and start == 0:
                tables[-1][0].append(family)
                tables[-1][1].extend(chunk)
            else:
                tables.append(([family], list(chunk)))
    return [("; ".join(FAMILY_CAPTIONS[f] for f in names), chunk) for names, chunk in tables]
