"""The results of an ablation grid: one :class:`SeedResult` per run, one :class:`CellResult` per
cell, and the :class:`AblationResult` table (Markdown and CSV, ``mean ± std`` over seeds)."""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from idml.app.ablation._grid import Cell, GridAxis
from idml.app.checkpoint import atomic_write_text
from idml.app.metric_display import (
    PERCENT,
    format_metric,
    metric_heading,
    metric_label,
    metric_sort_key,
    metric_unit,
)
from idml.evaluation.confidence import is_confidence_metric

Selection = Literal["final", "best"]


@dataclass(frozen=True)
class SeedResult:
    """One finished run of a cell."""

    seed: int
    run_dir: Path
    final_metrics: dict[str, float]
    best_metrics: dict[str, float]
    wall_seconds: float
    status: Literal["reused", "trained", "resumed", "retrained"]
    """``retrained``: a stored result of another config was replaced."""

    @property
    def reused(self) -> bool:
        """The run was not trained now: its stored result matched the config."""
        return self.status == "reused"

    def metrics(self, select: Selection) -> dict[str, float]:
        """Metrics of the last epoch (``final``) or of the best epoch (``best``)."""
        return self.best_metrics if select == "best" and self.best_metrics else self.final_metrics


@dataclass
class CellResult:
    """All seeds of one cell."""

    cell: Cell
    runs: list[SeedResult]

    def values(self, metric: str, select: Selection) -> np.ndarray:
        """The metric over seeds (NaN where a run lacks it)."""
        return np.array([r.metrics(select).get(metric, math.nan) for r in self.runs], float)

    def mean_std(self, metric: str, select: Selection) -> tuple[float, float]:
        """Mean and sample standard deviation (``ddof = 1``; NaN for a single seed)."""
        return _mean_std(self.values(metric, select))

    def wall_mean_std(self) -> tuple[float, float]:
        """Mean and sample standard deviation of the runs' wall-clock seconds."""
        return _mean_std(np.array([r.wall_seconds for r in self.runs], float))


def _mean_std(values: np.ndarray) -> tuple[float, float]:
    values = values[np.isfinite(values)]
    if values.size == 0:
        return math.nan, math.nan
    std = float(values.std(ddof=1)) if values.size > 1 else math.nan
    return float(values.mean()), std


@dataclass
class AblationResult:
    """The table of an ablation: one row per cell, ``mean ± std`` over seeds per metric."""

    axes: list[GridAxis]
    cells: list[CellResult]
    out_dir: Path
    select: Selection = "final"
    metrics: list[str] | None = None

    @property
    def metric_keys(self) -> list[str]:
        """Columns: the requested metrics, else every retrieval metric any run reports, in paper
        order (confidence metrics, ``r_auroc_*``, ``aurc_*``, …, only when asked for by name)."""
        if self.metrics is not None:
            return list(self.metrics)
        keys = {
            k
            for c in self.cells
            for r in c.runs
            for k in r.metrics(self.select)
            if not is_confidence_metric(k)
        }
        return sorted(keys, key=metric_sort_key)

    def markdown(self, digits: int = 1) -> str:
        """The table in Markdown: axis columns, metrics as ``mean ± std`` in their unit
        (:func:`~idml.app.metric_display.metric_unit`: % for fractions), wall time."""
        metrics = self.metric_keys
        header = [a.key for a in self.axes] + [metric_column(m) for m in metrics] + ["time (s)"]
        rows = []
        for cell in self.cells:
            labels = [
                axis.label(value)
                for axis, (_, value) in zip(self.axes, cell.cell.assignment, strict=True)
            ]
            values = [
                format_metric(m, *cell.mean_std(m, self.select), percent_digits=digits)
                for m in metrics
            ]
            rows.append(
                labels + values + [format_metric("seconds", *cell.wall_mean_std(), digits=1)]
            )
        seeds = sorted({len(c.runs) for c in self.cells})
        lines = [
            "| " + " | ".join(header) + " |",
            "|" + "|".join(":---:" for _ in header) + "|",
            *("| " + " | ".join(row) + " |" for row in rows),
            "",
            f"Metrics in % unless the column names another unit ({self.select} epoch), mean ± sample std over "
            f"{'/'.join(map(str, seeds))} seed(s); time: mean wall-clock seconds per run.",
        ]
        return "\n".join(lines) + "\n"

    def csv(self) -> str:
        """The table as CSV: axis values, then ``<metric>_mean``/``<metric>_std`` as fractions."""
        metrics = self.metric_keys
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(
            ["cell", *(a.key for a in self.axes), "seeds"]
            + [f"{m}_{s}" for m in metrics for s in ("mean", "std")]
            + ["wall_seconds_mean", "wall_seconds_std"]
        )
        for cell in self.cells:
            numbers = [v for m in metrics for v in cell.mean_std(m, self.select)]
            numbers += list(cell.wall_mean_std())
            writer.writerow(
                [cell.cell.id, *(v for _, v in cell.cell.assignment), len(cell.runs)]
                + ["" if math.isnan(v) else f"{v:.10g}" for v in numbers]
            )
        return buffer.getvalue()

    def write(self) -> tuple[Path, Path]:
        """Write ``ablation.md`` and ``ablation.csv`` into the output folder."""
        md, table = self.out_dir / "ablation.md", self.out_dir / "ablation.csv"
        atomic_write_text(md, self.markdown())
        atomic_write_text(table, self.csv())
        return md, table


def metric_column(key: str) -> str:
    """Column name: the label alone for % metrics (the caption says %), else with its unit."""
    return metric_label(key) if metric_unit(key) == PERCENT else metric_heading(key)
