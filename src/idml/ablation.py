"""Ablation grids: train every cell of a grid for several seeds and tabulate mean ± std.

A grid is a list of axes, ``key=v1,v2,…``. A key is either

* a **preset** named after the papers' ablations, whose values expand to several config overrides —
  ``metric=plain,ism,ism_dis`` and ``mixup=on,off`` (IDML paper, Wang et al. 2022: Table 2 for the
  components, Table 4 for the metric formulation), ``test_ism=on,off`` (its Table 5),
  ``batch_size=…`` (its Table 6), ``ssr=on,off`` (Fu et al. 2021), ``method=baseline,idml,ssr,
  idml_ssr`` — or an alias of one config key
  (``gamma`` → ``metric.gamma``, ``tau`` → ``metric.tau``, …; see :data:`PRESETS`). The values of
  ``metric``, ``mixup=on`` and ``method`` are the packaged method fragments (``method/ism``,
  ``method/idml``, …; :mod:`idml.config`, "Composition") written as overrides, so a grid cell and a
  preset that includes the fragment mean the same method; ``method=…`` first switches every
  component off (``method/baseline``), and the ISM values pin ``metric.variant``;
* any **raw config key** (``metric.gamma=0,2,4``, ``model.embedding_dim=128,512``), set through the
  same ``key.sub=value`` overrides as ``idml train --set``.

The grid is the Cartesian product of its axes (first axis slowest, as the rows of the papers'
tables). Each ``(cell, seed)`` run lives in ``OUT/cells/<cell-id>/seed<k>/`` (a normal run folder plus
``result.json``); a run is **reused** when its ``result.json`` exists and the config it records equals
the one the grid asks for now (keys in :data:`IGNORED_KEYS`, which cannot change a result, aside).
An interrupted run resumes from its last checkpoint. Every cell's config is built and validated
before the first run starts, so a typo fails in seconds, not after hours of training.

The table (``OUT/ablation.md`` and ``OUT/ablation.csv``) has one row per cell: the axis values
(``✓``/``–`` for on/off presets), each metric as ``mean ± std`` over seeds (sample standard deviation,
``ddof = 1``; percent in the Markdown, raw fractions in the CSV) and the mean wall time of a run.

Example:
    >>> axes = parse_grid(["metric=plain,ism", "metric.gamma=0,2"])
    >>> [cell.id for cell in expand_grid(axes)]
    ['metric-plain__metric.gamma-0', 'metric-plain__metric.gamma-2', 'metric-ism__metric.gamma-0', 'metric-ism__metric.gamma-2']
    >>> expand_grid(axes)[2].overrides
    ('model.uncertainty.enabled=true', 'metric.introspective=true', 'metric.variant=soft', 'metric.gamma=0')
"""

from __future__ import annotations

import csv
import hashlib
import io
import itertools
import json
import math
import re
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import yaml

from idml.checkpoint import atomic_write_text
from idml.config import (
    RUNTIME_KEYS,
    Config,
    config_difference,
    config_to_dict,
    load_config,
    merge_configs,
    read_fragment,
    stored_config_dict,
    to_overrides,
)
from idml.metric_display import (
    PERCENT,
    format_metric,
    metric_heading,
    metric_label,
    metric_sort_key,
    metric_unit,
)
from idml.preflight import check_run_config
from idml.run_folder import claim_run_folder, move_run_aside

RESULT_FILE = "result.json"
"""Written into a seed folder when its run has finished; its presence marks the run as reusable."""

IGNORED_KEYS: frozenset[str] = RUNTIME_KEYS
"""Config keys that cannot change a run's numbers (where and how fast it ran): ignored on reuse."""

Selection = Literal["final", "best"]


# --------------------------------------------------------------------------- presets
@dataclass(frozen=True)
class ChoicePreset:
    """A named axis whose values each expand to a fixed list of config overrides.

    ``choices`` maps a canonical value to ``(overrides, table label)``; ``synonyms`` maps other
    spellings (``true``, ``yes``, ``ism-dis``) to canonical values. ``switch`` marks on/off axes,
    drawn as ``✓``/``–`` columns like the papers' ablation tables.
    """

    name: str
    description: str
    choices: Mapping[str, tuple[tuple[str, ...], str]]
    synonyms: Mapping[str, str] = field(default_factory=dict)
    switch: bool = False

    def canonical(self, value: str) -> str:
        """The canonical spelling of ``value``; ``ValueError`` listing the choices if unknown."""
        key = value.strip().lower()
        key = self.synonyms.get(key, key)
        if key not in self.choices:
            raise ValueError(
                f"--grid {self.name}={value}: unknown value {value!r}; choose from "
                f"{', '.join(self.choices)}"
            )
        return key

    def overrides(self, value: str, base: Config | None) -> tuple[str, ...]:
        """The config overrides of one (canonical) value."""
        return self.choices[value][0]

    def label(self, value: str) -> str:
        """How the value appears in the table."""
        if self.switch:
            return "✓" if value == "on" else "–"
        return self.choices[value][1]


@dataclass(frozen=True)
class AliasPreset:
    """A short name for one config key (``gamma`` → ``metric.gamma``); values are YAML scalars."""

    name: str
    key: str
    description: str

    def canonical(self, value: str) -> str:
        """The value in one spelling (see :func:`canonical_value`)."""
        return canonical_value(value)

    def overrides(self, value: str, base: Config | None) -> tuple[str, ...]:
        """``key=value`` for the aliased key."""
        return (f"{self.key}={value}",)

    def label(self, value: str) -> str:
        """The value itself."""
        return value


@dataclass(frozen=True)
class BatchSizePreset:
    """The batch size ``B`` whatever the sampler: ``P = B / K`` classes of the balanced sampler.

    For the IDML paper's batch-size ablation (Wang et al. 2022, Table 6): the balanced sampler keeps
    ``K`` (``sampler.images_per_class``) and draws ``P = B / K`` classes; the random sampler takes
    ``sampler.batch_size = B``.
    """

    name: str = "batch_size"
    description: str = "batch size B (balanced sampler: B / images_per_class classes per batch)"

    def canonical(self, value: str) -> str:
        """The batch size as a decimal integer; ``ValueError`` unless positive."""
        try:
            size = int(value)
        except ValueError:
            size = 0
        if size <= 0:
            raise ValueError(f"--grid batch_size={value}: batch sizes must be positive integers")
        return str(size)

    def overrides(self, value: str, base: Config | None) -> tuple[str, ...]:
        """Sampler settings for batch size ``value`` given the base config's sampler."""
        size = int(value)
        if base is None or base.sampler.kind == "random":
            return (f"sampler.batch_size={size}",)
        per_class = base.sampler.images_per_class
        if size % per_class:
            raise ValueError(
                f"--grid batch_size={value}: the balanced sampler draws {per_class} images per "
                f"class (sampler.images_per_class), so the batch size must be a multiple of "
                f"{per_class}"
            )
        return (f"sampler.classes_per_batch={size // per_class}", f"sampler.batch_size={size}")

    def label(self, value: str) -> str:
        """The batch size itself."""
        return value


Preset = ChoicePreset | AliasPreset | BatchSizePreset

_ON_OFF_SYNONYMS = {"true": "on", "yes": "on", "1": "on", "false": "off", "no": "off", "0": "off"}


def _method(*names: str, variant: str | None = None) -> tuple[str, ...]:
    """Packaged fragments merged in order (``method/baseline``, ``method/idml``) as overrides;
    ``variant`` pins ISM's ``metric.variant``, so the value means one metric whatever the base
    config says."""
    merged: dict[str, Any] = {}
    for name in names:
        merged = merge_configs(merged, read_fragment(name))
    if variant is not None:
        merged = merge_configs(merged, {"metric": {"variant": variant}})
    return tuple(to_overrides(merged))


def _full(method: str) -> tuple[str, ...]:
    """``method=…``: every component off (``method/baseline``), then the method's own on."""
    ism = method in ("idml", "idml_ssr")
    return _method("method/baseline", f"method/{method}", variant="soft" if ism else None)


def _switch(name: str, description: str, key: str) -> ChoicePreset:
    return ChoicePreset(
        name,
        description,
        {"on": ((f"{key}=true",), "on"), "off": ((f"{key}=false",), "off")},
        _ON_OFF_SYNONYMS,
        switch=True,
    )


PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in (
        ChoicePreset(
            "metric",
            "training metric: plain, ISM (IDML eq. 5-7), ISM-Dis (uncertainty pushes pairs "
            "apart; IDML Table 4) or ISM's strict indicator form",
            {
                "plain": (_method("method/plain"), "plain"),
                "ism": (_method("method/ism", variant="soft"), "ISM"),
                "ism_dis": (_method("method/ism", variant="dissimilar"), "ISM-Dis"),
                "ism_strict": (_method("method/ism", variant="strict"), "ISM-strict"),
            },
            {
                "baseline": "plain",
                "ism-dis": "ism_dis",
                "dis": "ism_dis",
                "dissimilar": "ism_dis",
                "ism-strict": "ism_strict",
                "strict": "ism_strict",
            },
        ),
        ChoicePreset(
            "mixup",
            "Mixup images with set labels (IDML §III-C, Table 2)",
            {"on": (_method("method/mixup"), "on"), "off": (("mixup.enabled=false",), "off")},
            _ON_OFF_SYNONYMS,
            switch=True,
        ),
        _switch("ssr", "self-supervised ranking auxiliary task (Fu et al. 2021)", "ssr.enabled"),
        _switch(
            "test_ism",
            "rank with ISM at test time (Wang et al. 2022 Table 5)",
            "eval.introspective",
        ),
        ChoicePreset(
            "method",
            "baseline, IDML (uncertainty head + ISM + Mixup), SSR, or IDML with SSR",
            {
                "baseline": (_full("baseline"), "baseline"),
                "idml": (_full("idml"), "IDML"),
                "ssr": (_full("ssr"), "SSR"),
                "idml_ssr": (_full("idml_ssr"), "IDML+SSR"),
            },
            {"plain": "baseline", "idml+ssr": "idml_ssr", "idml-ssr": "idml_ssr"},
        ),
        BatchSizePreset(),
        AliasPreset("gamma", "metric.gamma", "ISM introspective bias γ"),
        AliasPreset("tau", "metric.tau", "ISM weakening degree τ"),
        AliasPreset("ssr_weight", "ssr.task.weight", "SSR ranking-loss weight γ_r"),
        AliasPreset("embedding_dim", "model.embedding_dim", "embedding size d"),
        AliasPreset("loss", "loss.name", "loss function"),
    )
}
"""Named grid axes. Keys without a dot must be one of these (or a top-level config key)."""


def describe_presets() -> str:
    """One line per preset: name, values and what it sets (for ``idml ablate --help``)."""
    lines = []
    for name, preset in PRESETS.items():
        values = ", ".join(preset.choices) if isinstance(preset, ChoicePreset) else "<value>"
        lines.append(f"  {name}={values}: {preset.description}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- grid
@dataclass(frozen=True)
class GridAxis:
    """One axis of the grid: a preset or a raw config key, and its values (canonical spelling)."""

    key: str
    values: tuple[str, ...]

    @property
    def preset(self) -> Preset | None:
        """The named preset of this axis (``None`` for a raw config key)."""
        return PRESETS.get(self.key)

    def label(self, value: str) -> str:
        """The value as the table shows it."""
        preset = self.preset
        return preset.label(value) if preset is not None else value

    def overrides(self, value: str, base: Config | None) -> tuple[str, ...]:
        """Config overrides of one value of this axis."""
        preset = self.preset
        if preset is not None:
            return preset.overrides(value, base)
        return (f"{self.key}={value}",)


@dataclass(frozen=True)
class Cell:
    """One point of the grid: a value per axis and the overrides they expand to."""

    assignment: tuple[tuple[str, str], ...]
    overrides: tuple[str, ...]

    @property
    def name(self) -> str:
        """Human-readable, e.g. ``metric=ism mixup=on``."""
        return " ".join(f"{key}={value}" for key, value in self.assignment)

    @property
    def id(self) -> str:
        """Folder-safe identifier, e.g. ``metric-ism__mixup-on`` (a hash suffix when it had to be
        shortened or characters were replaced, so distinct cells never share a folder)."""
        raw = "__".join(f"{key}-{value}" for key, value in self.assignment) or "base"
        safe = re.sub(r"[^A-Za-z0-9._+-]", "_", raw)
        if safe != raw or len(safe) > 96:
            digest = hashlib.sha1(raw.encode()).hexdigest()[:8]
            safe = f"{safe[:80]}_{digest}"
        return safe


def canonical_value(text: str) -> str:
    """A raw override value in one canonical spelling (``0.10`` and ``0.1`` are the same value).

    Values are YAML scalars, as in ``idml train --set``; strings stay as typed.

    >>> canonical_value("0.10"), canonical_value("[0.8, 1.0]"), canonical_value("margin")
    ('0.1', '[0.8,1.0]', 'margin')
    """
    text = text.strip()
    try:
        parsed = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(parsed, str):
        return text
    return json.dumps(parsed, separators=(",", ":"))


def split_values(text: str) -> list[str]:
    """Split ``v1,v2,…`` at top-level commas (commas inside ``[]``/``{}`` or quotes stay).

    >>> split_values("0.1,[0.8, 1.0],'a,b'")
    ['0.1', '[0.8, 1.0]', "'a,b'"]
    """
    parts: list[str] = []
    depth, quote, start = 0, "", 0
    for i, char in enumerate(text):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts]


def parse_grid(specs: Sequence[str]) -> list[GridAxis]:
    """Parse ``--grid`` arguments (``key=v1,v2,…``) into axes, validating keys and values.

    Raises:
        ValueError: malformed spec, empty or repeated value, repeated axis, ``seed`` as an axis
            (use ``seeds``), ``name`` or a key of :data:`IGNORED_KEYS` (every value would give the
            same runs), or a dot-less key that is not a preset.
    """
    axes: list[GridAxis] = []
    seen: set[str] = set()
    for spec in specs:
        key, sep, rest = spec.partition("=")
        key = key.strip()
        if not sep or not key or not rest.strip():
            raise ValueError(f"--grid {spec!r} must look like key=v1,v2 (e.g. metric=plain,ism)")
        if key == "seed":
            raise ValueError("--grid seed=… is not an axis; use --seeds N to repeat every cell")
        if key in seen:
            raise ValueError(f"--grid {key} is given twice; list all its values in one --grid")
        if key == "name" or key in IGNORED_KEYS:
            # name is set per cell and seed; the others cannot change a run's numbers.
            raise ValueError(
                f"--grid {key}=… cannot be an axis: every value would give the same runs "
                f"(name is set per cell; {', '.join(sorted(IGNORED_KEYS))} do not change results)"
            )
        if "." not in key and key not in PRESETS:
            raise ValueError(
                f"--grid {key}: not a preset and not a config key; presets are "
                f"{', '.join(PRESETS)}, config keys look like section.key (e.g. metric.gamma)"
            )
        seen.add(key)
        preset = PRESETS.get(key)
        values: list[str] = []
        for value in split_values(rest):
            if not value:
                raise ValueError(f"--grid {spec!r} has an empty value; remove the extra comma")
            canon = preset.canonical(value) if preset is not None else canonical_value(value)
            if canon in values:
                raise ValueError(f"--grid {spec!r} lists the value {value!r} twice")
            values.append(canon)
        axes.append(GridAxis(key, tuple(values)))
    return axes


def expand_grid(axes: Sequence[GridAxis], base: Config | None = None) -> list[Cell]:
    """The Cartesian product of the axes (first axis slowest), each cell with its overrides.

    ``base`` is the config the overrides apply to (the ``batch_size`` preset needs its sampler).

    Raises:
        ValueError: two axes setting one config key to different values in some cell (e.g.
            ``method=idml`` and ``mixup=off``) — the cell would silently depend on axis order.
    """
    cells = []
    for combo in itertools.product(*(axis.values for axis in axes)):
        assignment = tuple((axis.key, value) for axis, value in zip(axes, combo, strict=True))
        overrides: list[str] = []
        owner: dict[str, tuple[str, str]] = {}
        for axis, value in zip(axes, combo, strict=True):
            for item in axis.overrides(value, base):
                key, _, setting = item.partition("=")
                previous = owner.get(key)
                if previous is not None and previous[1] != setting:
                    raise ValueError(
                        f"--grid {previous[0]} and --grid {axis.key}={value} both set {key} "
                        f"({previous[1]} vs {setting}); drop one of the two axes"
                    )
                owner[key] = (f"{axis.key}={value}" if previous is None else previous[0], setting)
                overrides.append(item)
        cells.append(Cell(assignment, tuple(overrides)))
    return cells


# --------------------------------------------------------------------------- results
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
        order (the confidence scores ``auroc_*``/``aurc_*`` only when asked for by name)."""
        if self.metrics is not None:
            return list(self.metrics)
        keys = {
            k
            for c in self.cells
            for r in c.runs
            for k in r.metrics(self.select)
            if not k.startswith(("auroc_", "aurc_"))
        }
        return sorted(keys, key=metric_sort_key)

    def markdown(self, digits: int = 1) -> str:
        """The table in Markdown: axis columns, metrics as ``mean ± std`` in their unit
        (:func:`~idml.metric_display.metric_unit`: % for fractions), wall time."""
        metrics = self.metric_keys
        header = [a.key for a in self.axes] + [_column(m) for m in metrics] + ["time (s)"]
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


def _column(key: str) -> str:
    """Column name: the label alone for % metrics (the caption says %), else with its unit."""
    return metric_label(key) if metric_unit(key) == PERCENT else metric_heading(key)


# --------------------------------------------------------------------------- running
def _read_result(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


@dataclass(frozen=True)
class _Plan:
    cell: Cell
    seed: int
    cfg: Config
    run_dir: Path


def run_ablation(
    config: Path | None,
    axes: Sequence[GridAxis],
    seeds: int,
    out_dir: Path,
    overrides: Sequence[str] = (),
    select: Selection = "final",
    metrics: Sequence[str] | None = None,
    progress: bool = False,
    log: Callable[[str], object] = print,
    train_missing: bool = True,
) -> AblationResult:
    """Train every cell of the grid for ``seeds`` seeds (reusing finished runs) and write the table.

    Seeds are ``base.seed + i`` for ``i < seeds`` (``base`` = the config with ``overrides``). Runs go
    to ``out_dir/cells/<cell-id>/seed<k>/``. ``log`` receives one line per cell.

    Args:
        config: YAML config of the base run (``None``: the defaults).
        axes: from :func:`parse_grid`.
        seeds: runs per cell (>= 1).
        out_dir: ablation folder (``grid.json``, ``ablation.md``, ``ablation.csv``, ``cells/``).
        overrides: ``key=value`` changes to the base config shared by all cells.
        select: tabulate the metrics of the ``final`` epoch or of the ``best`` one.
        metrics: metric columns (default: all the runs report).
        progress: show the trainer's progress bars.
        log: where progress lines go.
        train_missing: ``False`` trains nothing: the table is drawn from the finished runs alone
            (cells without any are left out and logged), e.g. to tabulate a grid cut short.

    Returns:
        The :class:`AblationResult` (already written to ``ablation.md``/``ablation.csv``).
    """
    from idml.classification_task import make_trainer

    if seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {seeds}")
    if select not in ("final", "best"):
        raise ValueError(f"select must be 'final' or 'best', got {select!r}")
    out_dir = Path(out_dir)
    base = load_config(config, list(overrides))
    cells = expand_grid(axes, base)
    plans: list[list[_Plan]] = []
    for cell in cells:
        runs = []
        for offset in range(seeds):
            seed = base.seed + offset
            try:
                cfg = load_config(
                    config,
                    [
                        *overrides,
                        *cell.overrides,
                        f"seed={seed}",
                        f"name={base.name}-{cell.id}-seed{seed}",
                    ],
                )
                check_run_config(cfg)  # eval.select, resize, learning rates: before any training
            except ValueError as err:
                raise ValueError(f"grid cell {cell.name}: {err}") from err
            runs.append(_Plan(cell, seed, cfg, out_dir / "cells" / cell.id / f"seed{seed}"))
        plans.append(runs)

    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(
        out_dir / "grid.json",
        json.dumps(
            {
                "config": None if config is None else str(config),
                "overrides": list(overrides),
                "grid": {a.key: list(a.values) for a in axes},
                "seeds": [base.seed + i for i in range(seeds)],
                "cells": [
                    {"id": c.id, "name": c.name, "overrides": list(c.overrides)} for c in cells
                ],
            },
            indent=2,
        ),
    )
    results: list[CellResult] = []
    for number, runs in enumerate(plans, start=1):
        if train_missing:
            done = [_run_one(plan, progress, make_trainer, log) for plan in runs]
        else:
            done = [r for r in (_finished(plan) for plan in runs) if r is not None]
            if not done:
                log(f"[{number}/{len(plans)}] {runs[0].cell.name}: no finished run, left out")
                continue
        cell_result = CellResult(runs[0].cell, done)
        results.append(cell_result)
        log(_cell_line(number, len(plans), cell_result, select, metrics))
    reported = {k for cell in results for run in cell.runs for k in run.metrics(select)}
    unknown = [m for m in metrics or [] if m not in reported]
    if unknown:
        # Every run is stored by now, so re-running with corrected names only redraws the table.
        raise ValueError(
            f"--metrics {', '.join(unknown)}: no run reports them; the runs report "
            f"{', '.join(sorted(reported, key=metric_sort_key))}"
        )
    table = AblationResult(list(axes), results, out_dir, select, list(metrics) if metrics else None)
    table.write()
    return table


def _finished(plan: _Plan) -> SeedResult | None:
    """The seed's finished run when its stored config matches the grid's, else ``None``."""
    stored = _read_result(plan.run_dir / RESULT_FILE)
    if stored is None or config_difference(
        stored_config_dict(stored.get("config", {})), config_to_dict(plan.cfg)
    ):
        return None
    return _seed_result(plan, stored, "reused")


def _run_one(
    plan: _Plan, progress: bool, trainer_cls: Any, log: Callable[[str], object] = print
) -> SeedResult:
    """Reuse the seed's finished run when its config matches; else (re)train it."""
    wanted = config_to_dict(plan.cfg)
    result_path = plan.run_dir / RESULT_FILE
    reusable = _finished(plan)
    if reusable is not None:
        return reusable
    stale = _read_result(result_path) is not None
    if stale or (plan.run_dir.exists() and not _resumable(plan)):
        # A finished run of another config (the base config or a preset changed), or the debris of
        # one: its checkpoints must not be resumed nor mixed with the new run's. It is moved aside
        # as `--overwrite` does (never deleted: it may be the only copy of hours of training), and
        # the claim refuses a folder that another live process is still writing.
        with claim_run_folder(plan.run_dir, resume=False, overwrite=True, log=_quiet) as moved:
            if moved is None and any(plan.run_dir.iterdir()):
                moved = move_run_aside(plan.run_dir)  # debris without a log or checkpoints
        if moved is not None:
            log(
                f"{plan.cell.name}, seed {plan.seed}: its earlier run had another config; moved to {moved}"
            )
    resume = _resumable(plan)
    start = time.perf_counter()
    try:
        trainer = trainer_cls(plan.cfg, plan.run_dir, progress=progress)
        outcome = trainer.fit(resume=resume)
    except FloatingPointError as err:
        # Name the cell: a failure deep inside the grid is otherwise hard to place.
        raise FloatingPointError(f"grid cell {plan.cell.name}, seed {plan.seed}: {err}") from err
    except ValueError as err:
        raise ValueError(f"grid cell {plan.cell.name}, seed {plan.seed}: {err}") from err
    wall = time.perf_counter() - start
    if resume:
        # The epochs trained before the interruption count towards the run's wall time too.
        wall += sum(float(h.get("seconds", 0.0)) for h in outcome.history[: trainer.start_epoch])
    record = {
        "cell": plan.cell.id,
        "assignment": dict(plan.cell.assignment),
        "seed": plan.seed,
        "final_metrics": dict(outcome.final_metrics),
        "best_metrics": dict(outcome.best_metrics),
        "best_epoch": outcome.best_epoch,
        "wall_seconds": wall,
        "config": wanted,
    }
    atomic_write_text(result_path, json.dumps(record, indent=2))
    return _seed_result(plan, record, "resumed" if resume else "retrained" if stale else "trained")


def _quiet(_: str) -> None:
    """The claim's own "--overwrite: moved ..." line would name an option ablate has not got."""


def _resumable(plan: _Plan) -> bool:
    """An interrupted run of the same config: a checkpoint whose recorded config matches."""
    from idml.checkpoint import CheckpointError, read_state, resolve_checkpoint

    try:
        state = read_state(resolve_checkpoint(plan.run_dir))
    except (CheckpointError, FileNotFoundError, json.JSONDecodeError):
        return False
    return not config_difference(
        stored_config_dict(state.get("config", {})), config_to_dict(plan.cfg)
    )


def _seed_result(
    plan: _Plan,
    record: Mapping[str, Any],
    status: Literal["reused", "trained", "resumed", "retrained"],
) -> SeedResult:
    return SeedResult(
        seed=plan.seed,
        run_dir=plan.run_dir,
        final_metrics={k: float(v) for k, v in record.get("final_metrics", {}).items()},
        best_metrics={k: float(v) for k, v in record.get("best_metrics", {}).items()},
        wall_seconds=float(record.get("wall_seconds", math.nan)),
        status=status,
    )


def _cell_line(
    number: int,
    total: int,
    result: CellResult,
    select: Selection,
    metrics: Sequence[str] | None,
) -> str:
    counts = Counter(r.status for r in result.runs)
    keys = list(metrics or [])
    if not keys:
        keys = sorted({k for r in result.runs for k in r.metrics(select)}, key=metric_sort_key)
    shown = "  ".join(
        f"{_column(k)} {format_metric(k, *result.mean_std(k, select), percent_digits=1)}"
        for k in keys[:3]
    )
    wall = sum(r.wall_seconds for r in result.runs if not r.reused)
    statuses = ", ".join(
        f"{counts[s]} {s}" for s in ("reused", "trained", "resumed", "retrained") if counts[s]
    )
    runs = f"{len(result.runs)} run(s): {statuses}; {wall:.1f} s of training"
    return f"[{number}/{total}] {result.cell.name}: {shown} ({runs})"
