"""A run beside the numbers its recipe's paper reports ("paper vs this run").

Presets carry ``published: {source, metrics}`` (metrics in %, as the papers print them; see
``scripts/parse_published.py``). idml evaluates these metrics as fractions in [0, 1]; the
comparison puts both in %, with ``Δ = run − paper`` in percentage points, for every metric the source
reports (a metric not shown in %, such as NLL in nats, is compared in its own unit:
:func:`~idml.app.metric_display.metric_unit`).
A metric the source reports but the run did not compute (say NMI switched off, or a Recall@K not in
``eval.ks``) is listed with the run's value missing, so nothing is dropped silently.

The comparison only means something for the source's own experiment. A preset records the recipe
behind its numbers (``published.recipe``: the values of :data:`RECIPE_KEYS` and of its scheduler's
:data:`SCHEDULE_KEYS`, and for a folder dataset ``published.classes``); a run that changed any of
them — another dataset or folder of images, backbone, embedding size or schedule — is not compared:
:func:`recipe_differences` names what differs and no Δ is printed. A ``published`` block without a
recipe (older run folders, hand-written configs) cannot be checked, and the comparison says so.

This module takes plain mappings, so the trainer's CLI, ``idml report`` and notebooks share it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from idml.app.metric_display import metric_scale

RECIPE_KEYS: tuple[str, ...] = (
    "data.dataset",
    "model.backbone",
    "model.pretrained",
    "model.embedding_dim",
    "optim.epochs",
    "optim.scheduler",
)
"""What makes a source's run: the data, the backbone and its initialisation, the embedding size
and the schedule (its length and kind; :data:`SCHEDULE_KEYS` add the scheduler's own settings)."""

SCHEDULE_KEYS: dict[str, tuple[str, ...]] = {
    "step": ("optim.step_size", "optim.step_gamma"),
    "multistep": ("optim.milestones", "optim.step_gamma"),
}
"""The settings of each scheduler that shape the schedule (cosine and none have none beyond
``optim.epochs``)."""


def config_value(config: Mapping[str, Any], key: str) -> Any:
    """The value of a dotted ``key`` in a config dict (as ``config_to_dict`` writes it).

    Raises:
        KeyError: no such key (the message names it).
    """
    value: Any = config
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            raise KeyError(f"{key} is not a config key")
        value = value[part]
    return value


def recipe_of(config: Mapping[str, Any]) -> dict[str, Any]:
    """The recipe of a config dict: the values of :data:`RECIPE_KEYS` and of its scheduler's
    :data:`SCHEDULE_KEYS` (what a preset records as ``published.recipe``)."""
    keys = RECIPE_KEYS + SCHEDULE_KEYS.get(str(config_value(config, "optim.scheduler")), ())
    return {key: config_value(config, key) for key in keys}


def _same(key: str, source: Any, run: Any) -> bool:
    if key == "model.pretrained":
        # ImageNet weights from the cache or from a local file are the same initialisation.
        return bool(source) == bool(run)
    return source == run


def recipe_differences(
    recipe: Mapping[str, Any],
    config: Mapping[str, Any],
    source_classes: int | None = None,
    classes: int | None = None,
) -> list[str]:
    """How a run (its config dict and, when known, its number of training ``classes``) departs
    from a source's ``recipe`` (and the ``source_classes`` of its dataset): one
    ``"key: run's value (source: its value)"`` per difference, ``[]`` for the source's run."""
    out = []
    for key, source in recipe.items():
        try:
            run = config_value(config, key)
        except KeyError:
            run = None
        if not _same(key, source, run):
            out.append(f"{key}: {_show(run)} (source: {_show(source)})")
    if source_classes is not None and classes is not None and classes != source_classes:
        out.append(f"training classes: {classes} (source: {source_classes})")
    return out


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return str(value) if not isinstance(value, list) else "[" + ", ".join(map(str, value)) + "]"


def paper_vs_run(
    source: str,
    published: Mapping[str, float],
    metrics: Mapping[str, float],
    differences: list[str],
    recipe_known: bool,
    title: str = "paper vs this run",
) -> str:
    """The terminal's "paper vs this run": the table (:func:`format_paper_table`) for the
    source's run, else one line naming the differences and no Δ."""
    if differences:
        return f"{title}: not compared; this run is not the recipe of {source}: " + "; ".join(
            differences
        )
    if not recipe_known:
        title += " (the source's recipe is not recorded: not checked against this run)"
    return format_paper_table(source, compare_with_paper(published, metrics), title)


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
