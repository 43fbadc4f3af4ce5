"""Seed-aware comparisons: runs grouped by recipe, mean ± std over seeds, Δ against a reference.

A **group** is a set of runs whose configs differ only by ``seed`` (and by ``name`` and the keys
that cannot change a result, such as the device): the cells of an ``idml ablate`` folder, or
several run folders given to ``idml report``. Each metric of a group is shown as
``mean ± std`` over its seeds (sample standard deviation, ``ddof = 1``, as the ablation tables)
with the number of seeds ``n``, and ``Δ = mean(group) − mean(reference)`` in percentage points
against a chosen reference group (by default the baseline: the first group trained without ISM,
Mixup or SSR, else the first group). The numbers are each run's last logged evaluation
(``test/<metric>`` of ``metrics.jsonl``), so the table equals what the runs logged.

The layout is the papers' (Wang et al. 2022, Table I; Fu et al. 2021, Table 1): one row per method,
Recall@K by K, then RP, MAP@R, NMI; Markdown and CSV come with it for papers and spreadsheets.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from idml.app.config import RUNTIME_KEYS, config_difference, config_to_dict
from idml.app.metric_display import format_delta, format_metric, metric_heading
from idml.app.reports.runs import RunLog

GROUP_IGNORED_KEYS = RUNTIME_KEYS | {"seed", "name"}
"""Config keys that may differ between the seeds of one group."""


def expand_run_dirs(paths: Sequence[Path]) -> tuple[list[Path], dict[Path, str]]:
    """Run folders of ``paths``: an ``idml ablate`` folder stands for its cells' seed runs.

    Returns the run folders in order and, for those of an ablation, the label of their cell
    (the grid assignment, e.g. ``metric=ism, mixup=on``).
    """
    runs: list[Path] = []
    cells: dict[Path, str] = {}
    for path in map(Path, paths):
        if (path / "config.yaml").is_file() or not (path / "cells").is_dir():
            runs.append(path)  # a run folder (read_run explains what is wrong with anything else)
            continue
        found = sorted(
            (seed for cell in sorted((path / "cells").iterdir()) for seed in cell.glob("seed*")),
            key=lambda p: (p.parent.name, _seed_number(p)),
        )
        # `seed3.replaced-<time>` folders are earlier runs `idml ablate` moved aside: not this grid's.
        found = [p for p in found if _SEED_DIR.fullmatch(p.name) and (p / "config.yaml").is_file()]
        if not found:
            raise FileNotFoundError(
                f"{path} has a cells/ folder but no finished run in cells/*/seed*/; "
                "run `idml ablate` into it first"
            )
        for seed_dir in found:
            runs.append(seed_dir)
            cells[seed_dir] = _cell_label(seed_dir)
    return runs, cells


_SEED_DIR = re.compile(r"seed\d+")


def _seed_number(path: Path) -> int:
    digits = path.name.removeprefix("seed")
    return int(digits) if digits.isdigit() else 0


def _cell_label(seed_dir: Path) -> str:
    try:
        assignment = json.loads((seed_dir / "result.json").read_text())["assignment"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError, TypeError):
        return seed_dir.parent.name
    return ", ".join(f"{k}={v}" for k, v in assignment.items())


@dataclass
class Group:
    """Runs of one recipe (its seeds), their metrics and what makes it this recipe."""

    label: str
    runs: list[RunLog]

    @property
    def seeds(self) -> list[int]:
        return [r.config.seed for r in self.runs]

    def values(self, metric: str) -> np.ndarray:
        """The metric of each seed's last evaluation (NaN where a run lacks it)."""
        return np.array([r.last_metrics.get(metric, math.nan) for r in self.runs], float)

    def mean_std(self, metric: str) -> tuple[float, float, int]:
        """Mean, sample std (``ddof = 1``; NaN for one seed) and the number of seeds used."""
        values = self.values(metric)
        values = values[np.isfinite(values)]
        if values.size == 0:
            return math.nan, math.nan, 0
        std = float(values.std(ddof=1)) if values.size > 1 else math.nan
        return float(values.mean()), std, int(values.size)

    @property
    def is_baseline(self) -> bool:
        cfg = self.runs[0].config
        return not (cfg.metric.introspective or cfg.mixup.enabled or cfg.ssr.enabled)


def group_runs(runs: Sequence[RunLog], labels: Sequence[str]) -> list[Group]:
    """Runs whose configs differ only by :data:`GROUP_IGNORED_KEYS`, in first-seen order."""
    groups: list[Group] = []
    dicts: list[dict] = []
    for run, label in zip(runs, labels, strict=True):
        wanted = config_to_dict(run.config)
        for group, stored in zip(groups, dicts, strict=True):
            if not config_difference(stored, wanted, GROUP_IGNORED_KEYS):
                group.runs.append(run)
                break
        else:
            if any(g.label == label for g in groups):  # two recipes with one name
                label = f"{label} ({run.run_dir.name})"
            groups.append(Group(label, [run]))
            dicts.append(wanted)
    return groups


def pick_reference(groups: Sequence[Group], reference: str | None = None) -> Group:
    """The group named ``reference`` (a label), else the first baseline, else the first group."""
    if reference is not None:
        for group in groups:
            if group.label == reference:
                return group
        raise ValueError(
            f"--reference {reference!r} is not one of the compared groups: "
            + ", ".join(repr(g.label) for g in groups)
        )
    return next((g for g in groups if g.is_baseline), groups[0])


@dataclass
class SeedTable:
    """The comparison: groups × metrics, mean ± std (n) and Δ against the reference."""

    groups: list[Group]
    reference: Group
    metrics: list[str]

    def cell(self, group: Group, metric: str) -> tuple[float, float, int, float]:
        """Mean, std, n and Δ (``group − reference``; NaN for the reference), as fractions."""
        mean, std, n = group.mean_std(metric)
        ref = self.reference.mean_std(metric)[0]
        delta = math.nan if group is self.reference else mean - ref
        return mean, std, n, delta

    def rows(self) -> list[list[str]]:
        """Display rows: label, seeds, then ``mean ± std`` and ``Δ`` per metric, in the metric's
        unit (:func:`~idml.app.metric_display.metric_unit`: % for fractions)."""
        out = []
        for group in self.groups:
            row = [group.label + (" (reference)" if group is self.reference else "")]
            row.append(str(len(group.runs)))
            for metric in self.metrics:
                mean, std, _, delta = self.cell(group, metric)
                row.append(format_metric(metric, mean, std))
                row.append(format_delta(metric, delta))
            out.append(row)
        return out

    def header(self) -> list[str]:
        head = ["method", "seeds"]
        for metric in self.metrics:
            head += [metric_heading(metric), "Δ"]
        return head

    def markdown(self) -> str:
        """Markdown table with a caption line that says what the numbers are."""
        head = self.header()
        lines = [
            "| " + " | ".join(head) + " |",
            "| --- | ---: |" + " ---: |" * (len(head) - 2),
            *("| " + " | ".join(row) + " |" for row in self.rows()),
            "",
            "Mean ± sample std over seeds (last evaluation of each run), in each column's unit; "
            f"Δ = mean − mean of {self.reference.label!r}, in the same unit (percentage points "
            "for %).",
        ]
        return "\n".join(lines) + "\n"

    def csv(self) -> str:
        """CSV with fractions: ``<metric>_mean``, ``_std``, ``_n``, ``_delta`` per metric."""
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        cols = [f"{m}_{s}" for m in self.metrics for s in ("mean", "std", "n", "delta")]
        writer.writerow(["group", "reference", "seeds", *cols])
        for group in self.groups:
            values: list[str] = []
            for metric in self.metrics:
                mean, std, n, delta = self.cell(group, metric)
                values += [_num(mean), _num(std), str(n), _num(delta)]
            writer.writerow(
                [group.label, group is self.reference, " ".join(map(str, group.seeds)), *values]
            )
        return buffer.getvalue()


def seed_table(
    runs: Sequence[RunLog],
    labels: Sequence[str],
    reference: str | None = None,
    metrics: Sequence[str] | None = None,
) -> SeedTable:
    """Group ``runs`` by recipe and compare the groups (see the module docstring)."""
    from idml.app.metric_display import metric_sort_key

    groups = group_runs(runs, labels)
    keys = (
        list(metrics)
        if metrics
        else sorted({k for r in runs for k in r.last_metrics}, key=metric_sort_key)
    )
    return SeedTable(groups, pick_reference(groups, reference), keys)


def _num(value: float) -> str:
    return "" if math.isnan(value) else f"{value:.10g}"


# --------------------------------------------------------------------------- HTML
def seeds_section(table: SeedTable) -> str:
    """The report's section: the seed table and, per group with published numbers, the paper."""
    import html

    head = "".join(
        f'<th class="text">{html.escape(h)}</th>' if i == 0 else f"<th>{html.escape(h)}</th>"
        for i, h in enumerate(table.header())
    )
    body = "\n".join(
        "<tr>"
        + "".join(
            f'<td class="text">{html.escape(c)}</td>' if i == 0 else f"<td>{html.escape(c)}</td>"
            for i, c in enumerate(row)
        )
        + "</tr>"
        for row in table.rows()
    )
    parts = [
        "<h2>Seeds and differences</h2>",
        f"<table><tr>{head}</tr>\n{body}</table>",
        '<p class="meta">'
        + html.escape(
            "Mean ± sample std over seeds of each run's last evaluation, in each column's unit; "
            f"Δ = mean − mean of {table.reference.label!r} (the reference), in the same unit "
            "(percentage points for %). Also in "
            "seeds.md and seeds.csv beside this page."
        )
        + "</p>",
    ]
    for group in table.groups:
        published = group.runs[0].config.published
        if published is not None:
            parts.append(paper_section(group, published.source, published.metrics))
    return "\n".join(parts)


def paper_section(group: Group, source: str, published: dict[str, float]) -> str:
    """ "Paper vs this run" for one group: the source's numbers, the seed mean and Δ."""
    import html

    from idml.app.paper import compare_with_paper

    means = {k: group.mean_std(k)[0] for k in published}
    rows = compare_with_paper(published, {k: v for k, v in means.items() if math.isfinite(v)})
    cells = "\n".join(
        f'<tr><td class="text">{html.escape(r.metric)}</td><td>{r.paper:.1f}</td>'
        f"<td>{'n/a' if r.run is None else f'{r.run:.1f}'}</td>"
        f"<td>{'n/a' if r.delta is None else f'{r.delta:+.1f}'}</td></tr>"
        for r in rows
    )
    seeds = len(group.runs)
    return (
        f"<h3>Paper vs this run: {html.escape(group.label)}</h3>"
        f'<p class="meta">Source: {html.escape(source)}. Run: mean of {seeds} seed(s), last '
        "evaluation. Values in %, Δ = run − paper in percentage points.</p>"
        '<table><tr><th class="text">metric</th><th>paper</th><th>run</th><th>Δ</th></tr>\n'
        f"{cells}</table>"
    )
