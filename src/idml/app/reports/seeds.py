"""Seed-aware comparisons: runs grouped by recipe, mean ± std over seeds, Δ against a reference.

A **group** is a set of runs whose configs differ only by ``seed`` (and by ``name`` and the keys
that cannot change a result, such as the device): the cells of an ``idml ablate`` folder, or
several run folders given to ``idml report``. Each metric of a group is shown as
``mean ± std`` over its seeds (sample standard deviation, ``ddof = 1``, as the ablation tables)
with the number of seeds ``n``, and ``Δ = mean(group) − mean(reference)`` in percentage points
against a chosen reference group (by default the baseline: the first group trained without ISM,
Mixup or SSR, else the first group), which the table lists first. The numbers are each run's last
logged evaluation (``test/<metric>`` of ``metrics.jsonl``), so the table equals what the runs
logged.

Whether a Δ is real is decided as in the project's studies (``benchmarks/study_idml.py``), by
:mod:`idml.statistics`: each Δ is tested over the seeds — a paired t-test when the two groups ran
exactly the same seeds (seed ``s`` of both shares its initialisation and batches, matched by the
``seed`` value), Welch's t-test otherwise, no test with fewer than two seeds on a side
(:func:`~idml.statistics.compare_seeds`) — the p-values of every tested Δ of the table are
Holm-adjusted together (:func:`~idml.statistics.holm`), and a Δ whose adjusted p is below 0.05 is
marked ``▲`` (better than the reference) or ``▼`` (worse), the better side of each metric given by
:func:`~idml.app.metric_display.metric_direction` (AURC, ECE, NLL: lower); ``≠`` where no side is
better (``||u||`` levels). Every tested Δ comes with its 95 % t-interval.

The layout is the papers' (Wang et al. 2022, Table I; Fu et al. 2021, Table 1): one row per method,
Recall@K by K, then RP, MAP@R, NMI; Markdown and CSV come with it for papers and spreadsheets.
"""

from __future__ import annotations

import csv
import functools
import io
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from idml.app.config import RUNTIME_KEYS, config_difference, config_to_dict
from idml.app.metric_display import (
    LOWER_IS_BETTER,
    NO_BETTER_SIDE,
    format_delta,
    format_metric,
    metric_direction,
    metric_heading,
    metric_label,
    table_decimals,
)
from idml.app.reports.runs import RunLog
from idml.app.reports.tables import Cell, html_table, split_columns, text_cell
from idml.statistics import DEFAULT_ALPHA, Comparison, compare_seeds, holm

BETTER, WORSE, DIFFERENT = "▲", "▼", "≠"
"""The marks of a significant Δ: better or worse than the reference (by
:func:`~idml.app.metric_display.metric_direction`), or different where no side is better."""
SEED_METRICS_PER_TABLE = 3
"""Metrics per HTML seed table (two columns each, mean ± std and Δ over its interval): fits
1400 px."""

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

    def seed_values(self, metric: str) -> list[tuple[int, float]]:
        """``(seed, value)`` of each run that has the metric (what a test over seeds takes)."""
        values = self.values(metric)
        return [(s, float(v)) for s, v in zip(self.seeds, values, strict=True) if np.isfinite(v)]

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
            if label and any(g.label == label for g in groups):  # two recipes with one name
                label = f"{label} ({run.run_dir.name})"
            groups.append(Group(label, [run]))
            dicts.append(wanted)
    _label_unnamed(groups, dicts)
    return groups


def _label_unnamed(groups: list[Group], dicts: list[dict]) -> None:
    """Name the groups that came without a label (e.g. an ``idml ablate`` folder of one cell, whose
    grid assigned nothing) by the config keys in which the groups differ, with this group's values:
    ``mixup.enabled=True, metric.introspective=True``."""
    if all(g.label for g in groups):
        return
    keys: list[str] = []
    for other in dicts[1:]:
        for line in config_difference(dicts[0], other, GROUP_IGNORED_KEYS):
            key = line.split(":", 1)[0]
            if key not in keys:
                keys.append(key)
    for group, stored in zip(groups, dicts, strict=True):
        if not group.label:
            values = [f"{key}={_dotted(stored, key)}" for key in keys]
            group.label = ", ".join(values) or group.runs[0].run_dir.name


def _dotted(config: dict, key: str) -> object:
    """The value at a dotted key of a config dict (``None`` where a section lacks it)."""
    value: object = config
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


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


@dataclass(frozen=True)
class Difference:
    """One group's Δ against the reference on one metric, tested over seeds
    (:func:`~idml.statistics.compare_seeds`), with its Holm-adjusted p-value over the table."""

    comparison: Comparison | None
    """The test (``None``: fewer than two seeds on a side)."""
    adjusted_p: float
    """Holm-adjusted over every tested Δ of the table (NaN: not tested)."""
    direction: int
    """:func:`~idml.app.metric_display.metric_direction` of the metric."""

    @property
    def tested(self) -> bool:
        return not math.isnan(self.adjusted_p)

    @property
    def significant(self) -> bool:
        return self.comparison is not None and self.comparison.significant(self.adjusted_p)

    @property
    def mark(self) -> str:
        """:data:`BETTER`, :data:`WORSE` or :data:`DIFFERENT` when significant, else ``""``."""
        if not self.significant:
            return ""
        assert self.comparison is not None
        sign = self.direction * (1 if self.comparison.difference > 0 else -1)
        return {1: BETTER, -1: WORSE}.get(sign, DIFFERENT)


@dataclass
class SeedTable:
    """The comparison: groups × metrics, mean ± std (n) and Δ against the reference, each Δ
    tested over seeds with Holm's correction over the table (:meth:`difference`)."""

    groups: list[Group]
    reference: Group
    metrics: list[str]

    @property
    def compares(self) -> bool:
        """Whether there is anything to compare: two groups, or a group of two seeds or more (one
        run alone is its own numbers, shown in the run's table)."""
        return len(self.groups) > 1 or any(len(g.runs) > 1 for g in self.groups)

    def cell(self, group: Group, metric: str) -> tuple[float, float, int, float]:
        """Mean, std, n and Δ (``group − reference``; NaN for the reference), as fractions."""
        mean, std, n = group.mean_std(metric)
        ref = self.reference.mean_std(metric)[0]
        delta = math.nan if group is self.reference else mean - ref
        return mean, std, n, delta

    @functools.cached_property
    def _differences(self) -> dict[tuple[int, str], Difference]:
        """Every non-reference group × metric, tested and Holm-adjusted over the whole table."""
        cells = [
            (i, metric, compare_seeds(self.reference.seed_values(metric), g.seed_values(metric)))
            for i, g in enumerate(self.groups)
            if g is not self.reference
            for metric in self.metrics
        ]
        adjusted = holm([math.nan if c is None else c.p_value for *_, c in cells])
        return {
            (i, metric): Difference(c, p, metric_direction(metric))
            for (i, metric, c), p in zip(cells, adjusted, strict=True)
        }

    def difference(self, group: Group, metric: str) -> Difference | None:
        """The group's tested Δ on ``metric`` (``None`` for the reference)."""
        index = next(i for i, g in enumerate(self.groups) if g is group)
        return self._differences.get((index, metric))

    @property
    def tests(self) -> tuple[int, int]:
        """How many Δ of the table were tested (the Holm family's size) and how many paired."""
        tested = [d for d in self._differences.values() if d.tested]
        return len(tested), sum(1 for d in tested if d.comparison and d.comparison.paired)

    def group_label(self, group: Group) -> str:
        return group.label + (" (reference)" if group is self.reference else "")

    def display(self, group: Group, metric: str) -> tuple[str, str, str]:
        """``mean ± std``, ``Δ`` with its mark (:meth:`difference`) and the Δ's 95 % interval
        ``[low, high]`` ("" when untested) of one cell, in the metric's unit
        (:func:`~idml.app.metric_display.metric_unit`: % and percentage points for fractions),
        with as many decimals as the column's spread needs."""
        digits = self._decimals[metric]
        mean, std, _, delta = self.cell(group, metric)
        found = self.difference(group, metric)
        text = format_delta(metric, delta, **digits)
        interval = ""
        if found is not None and found.comparison is not None:
            text += f" {found.mark}" if found.mark else ""
            c = found.comparison
            if math.isfinite(c.low):
                low, high = (format_delta(metric, v, **digits) for v in (c.low, c.high))
                interval = f"[{low}, {high}]"
        return format_metric(metric, mean, std, **digits), text, interval

    @functools.cached_property
    def _decimals(self) -> dict[str, dict[str, int]]:
        """Decimals of each metric's column, from the group means (``||u||`` columns pooled)."""
        return table_decimals({m: [self.cell(g, m)[0] for g in self.groups] for m in self.metrics})

    def rows(self) -> list[list[str]]:
        """Display rows: label, seeds, then ``mean ± std`` and ``Δ [interval]`` per metric
        (:meth:`display`)."""
        out = []
        for group in self.groups:
            row = [self.group_label(group), str(len(group.runs))]
            for metric in self.metrics:
                value, delta, interval = self.display(group, metric)
                row += [value, f"{delta} {interval}".strip()]
            out.append(row)
        return out

    def header(self) -> list[str]:
        head = ["method", "seeds"]
        for metric in self.metrics:
            head += [metric_heading(metric), "Δ [95 % CI]"]
        return head

    @property
    def legend(self) -> str:
        """What the numbers and marks are (below every rendering of the table)."""
        tested, paired = self.tests
        lower = sorted(  # every AURC column under one name
            {
                "AURC" if m.startswith("aurc") else metric_label(m)
                for m in self.metrics
                if metric_direction(m) == LOWER_IS_BETTER
            }
        )
        undirected = any(metric_direction(m) == NO_BETTER_SIDE for m in self.metrics)
        text = (
            "Mean ± sample std over seeds of each run's last evaluation, in each column's unit; "
            f"Δ = mean − mean of {self.reference.label!r} (the reference, first), in the same unit "
            "(percentage points for %), with its 95 % t-interval [low, high]. "
        )
        if not tested:
            return text + (
                "No Δ is tested: a test needs at least two seeds (with some spread) in both the "
                "group and the reference."
            )
        same = "matched by seed: same initialisation and batches"
        if paired == tested:
            tests = f"a paired t-test over the seeds both groups ran ({same})"
        elif paired == 0:
            tests = "Welch's t-test (the groups ran different seeds)"
        else:
            tests = (
                f"a paired t-test where both groups ran the same seeds ({paired} of them; {same}), "
                "Welch's t-test otherwise"
            )
        return text + (
            f"{BETTER} better / {WORSE} worse than the reference"
            + (f" (lower is better for {', '.join(lower)})" if lower else "")
            + (f", {DIFFERENT} different where no side is better (||u||)" if undirected else "")
            + f": p < {DEFAULT_ALPHA:g} after Holm's correction over the {tested} tested Δ of "
            f"this table, each {tests}. A Δ without an interval is not tested (fewer than two "
            "seeds on a side, or no spread)."
        )

    def markdown(self) -> str:
        """Markdown table with a caption line that says what the numbers are."""
        head = self.header()
        lines = [
            "| " + " | ".join(head) + " |",
            "| --- | ---: |" + " ---: |" * (len(head) - 2),
            *("| " + " | ".join(row) + " |" for row in self.rows()),
            "",
            self.legend,
        ]
        return "\n".join(lines) + "\n"

    def html(self) -> str:
        """The table in HTML: several tables of at most :data:`SEED_METRICS_PER_TABLE` metrics
        (families together), each repeating the group labels, so it fits a 1400 px screen; a Δ's
        interval is its cell's second line, its test the cell's tooltip."""
        parts = []
        for caption, keys in split_columns(self.metrics, SEED_METRICS_PER_TABLE):
            head = [text_cell("method"), Cell("seeds")]
            for metric in keys:
                head += [Cell(metric_heading(metric)), Cell("Δ [95 % CI]")]
            rows = []
            for group in self.groups:
                row = [text_cell(self.group_label(group)), Cell(str(len(group.runs)))]
                for metric in keys:
                    value, delta, interval = self.display(group, metric)
                    found = self.difference(group, metric)
                    significant = found is not None and found.significant
                    tooltip = "" if found is None else _describe_test(found)
                    css = "significant" if significant else ""
                    row += [Cell(value), Cell(delta, css, note=interval, title=tooltip)]
                rows.append(row)
            parts.append(html_table(head, rows, caption))
        return "\n".join(parts)

    def csv(self) -> str:
        """CSV with fractions per metric: ``<metric>_mean``, ``_std``, ``_n``, ``_delta``, its
        interval ``_delta_low``/``_delta_high``, ``_test`` (``paired``, ``welch``, or empty:
        untested), ``_p``, ``_p_holm``, ``_effect_size`` (Cohen's d_z paired, Hedges' g Welch)
        and ``_significant`` (1, 0, or empty when untested)."""
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        parts = (
            "mean",
            "std",
            "n",
            "delta",
            "delta_low",
            "delta_high",
            "test",
            "p",
            "p_holm",
            "effect_size",
            "significant",
        )
        cols = [f"{m}_{s}" for m in self.metrics for s in parts]
        writer.writerow(["group", "reference", "seeds", *cols])
        for group in self.groups:
            values: list[str] = []
            for metric in self.metrics:
                mean, std, n, delta = self.cell(group, metric)
                values += [_num(mean), _num(std), str(n), _num(delta)]
                found = self.difference(group, metric)
                c = None if found is None else found.comparison
                if found is None or c is None:
                    values += [""] * 7
                    continue
                values += [_num(c.low), _num(c.high), "paired" if c.paired else "welch"]
                values += [_num(c.p_value), _num(found.adjusted_p), _num(c.effect_size)]
                values.append(str(int(found.significant)) if found.tested else "")
            writer.writerow(
                [group.label, group is self.reference, " ".join(map(str, group.seeds)), *values]
            )
        return buffer.getvalue()


def _describe_test(found: Difference) -> str:
    """A Δ cell's tooltip: which test, over how many seeds, its p-values and effect size."""
    c = found.comparison
    if c is None:
        return "not tested: fewer than two seeds on a side"
    if not found.tested:
        return f"not tested: no spread over the {c.n} seeds"
    if c.paired:
        test, effect = f"paired t-test over {c.n} seeds", f"Cohen's d_z {c.effect_size:+.2f}"
    else:
        test, effect = "Welch's t-test", f"Hedges' g {c.effect_size:+.2f}"
    return f"{test}: p = {c.p_value:.3g}, Holm-adjusted {found.adjusted_p:.3g}; {effect}"


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
    chosen = pick_reference(groups, reference)
    # The reference first: every Δ below is read against the row above them.
    ordered = [chosen, *(g for g in groups if g is not chosen)]
    return SeedTable(ordered, chosen, keys)


def _num(value: float) -> str:
    return "" if math.isnan(value) else f"{value:.10g}"


# --------------------------------------------------------------------------- HTML
def seeds_section(table: SeedTable) -> str:
    """The report's section: the seed table (when it :attr:`~SeedTable.compares` anything) and,
    per group with published numbers, the paper; "" when there is neither."""
    import html

    papers = _paper_sections(table)
    if not table.compares:
        # One run: its numbers are the run table's; only the paper's are new.
        return "\n".join(["<h2>Published numbers</h2>", *papers]) if papers else ""
    legend = f"{table.legend} Also in seeds.md and seeds.csv beside this page."
    parts = [
        "<h2>Seeds and differences</h2>",
        table.html(),
        f'<p class="meta">{html.escape(legend)}</p>',
    ]
    return "\n".join(parts + papers)


def _paper_sections(table: SeedTable) -> list[str]:
    """:func:`paper_section` of each group with published numbers."""
    parts = []
    for group in table.groups:
        published = group.runs[0].config.published
        if published is not None:
            from idml.app.paper import recipe_differences

            differences = recipe_differences(
                published.recipe,
                config_to_dict(group.runs[0].config),
                published.classes,
                _training_classes(group.runs[0]),
            )
            parts.append(
                paper_section(
                    group, published.source, published.metrics, differences, bool(published.recipe)
                )
            )
    return parts


def _training_classes(run: RunLog) -> int | None:
    """The number of training classes a run's latest checkpoint records (``None``: unknown)."""
    from idml.app.checkpoint import CheckpointError, read_state, resolve_checkpoint

    try:
        value = read_state(resolve_checkpoint(run.run_dir)).get("num_train_classes")
    except CheckpointError:
        return None
    return value if isinstance(value, int) else None


def paper_section(
    group: Group,
    source: str,
    published: dict[str, float],
    differences: Sequence[str] = (),
    recipe_known: bool = True,
) -> str:
    """ "Paper vs this run" for one group: the source's numbers, the seed mean and Δ; when the
    group's recipe ``differences`` from the source's, only what differs (no Δ)."""
    import html

    from idml.app.paper import compare_with_paper

    heading = f"<h3>Paper vs this run: {html.escape(group.label)}</h3>"
    if differences:
        items = "".join(f"<li>{html.escape(d)}</li>" for d in differences)
        return (
            heading + f'<p class="note">Not compared: this run is not the recipe of '
            f"{html.escape(source)}, so a difference from its numbers would not measure the "
            f"method. What differs:</p><ul>{items}</ul>"
        )
    unchecked = (
        ""
        if recipe_known
        else " The source's recipe is not recorded, so this run was not checked against it."
    )
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
        heading + f'<p class="meta">Source: {html.escape(source)}. Run: mean of {seeds} seed(s), '
        f"last evaluation. Values in %, Δ = run − paper in percentage points.{unchecked}</p>"
        '<table><tr><th class="text">metric</th><th>paper</th><th>run</th><th>Δ</th></tr>\n'
        f"{cells}</table>"
    )
