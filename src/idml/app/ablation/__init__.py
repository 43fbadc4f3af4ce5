"""Ablation grids: train every cell of a grid for several seeds and tabulate mean ± std.

A grid is a list of axes, ``key=v1,v2,…``. A key is either

* a **preset** named after the papers' ablations, whose values expand to several config overrides —
  ``metric=plain,ism,ism_dis`` and ``mixup=on,off`` (IDML paper, Wang et al. 2022: Table 2 for the
  components, Table 4 for the metric formulation), ``test_ism=on,off`` (its Table 5),
  ``batch_size=…`` (its Table 6), ``ssr=on,off`` (Fu et al. 2021), ``method=baseline,idml,ssr,
  idml_ssr`` — or an alias of one config key
  (``gamma`` → ``metric.gamma``, ``tau`` → ``metric.tau``, …; see :data:`PRESETS`). The values of
  ``metric``, ``mixup=on`` and ``method`` are the packaged method fragments (``method/ism``,
  ``method/idml``, …; :mod:`idml.app.config`, "Composition") written as overrides, so a grid cell and a
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

import json
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from idml.app.ablation._grid import (
    IGNORED_KEYS,
    PRESETS,
    AliasPreset,
    BatchSizePreset,
    Cell,
    ChoicePreset,
    GridAxis,
    Preset,
    canonical_value,
    describe_presets,
    expand_grid,
    parse_grid,
    split_values,
)
from idml.app.ablation._results import (
    AblationResult,
    CellResult,
    SeedResult,
    Selection,
    metric_column,
)
from idml.app.checkpoint import atomic_write_text
from idml.app.config import (
    Config,
    config_difference,
    config_to_dict,
    load_config,
    stored_config_dict,
)
from idml.app.metric_display import (
    format_metric,
    metric_sort_key,
)
from idml.app.preflight import check_run_config
from idml.app.run_folder import claim_run_folder, move_run_aside

__all__ = [
    "IGNORED_KEYS",
    "PRESETS",
    "RESULT_FILE",
    "AblationResult",
    "AliasPreset",
    "BatchSizePreset",
    "Cell",
    "CellResult",
    "ChoicePreset",
    "GridAxis",
    "Preset",
    "SeedResult",
    "Selection",
    "canonical_value",
    "describe_presets",
    "expand_grid",
    "parse_grid",
    "run_ablation",
    "split_values",
]

RESULT_FILE = "result.json"
"""Written into a seed folder when its run has finished; its presence marks the run as reusable."""


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
    from idml.app.training import Trainer

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
            done = [_run_one(plan, progress, Trainer, log) for plan in runs]
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
        with claim_run_folder(plan.run_dir, resume=False, overwrite=True) as moved:
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


def _resumable(plan: _Plan) -> bool:
    """An interrupted run of the same config: a checkpoint whose recorded config matches."""
    from idml.app.checkpoint import CheckpointError, read_state, resolve_checkpoint

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
        f"{metric_column(k)} {format_metric(k, *result.mean_std(k, select), percent_digits=1)}"
        for k in keys[:3]
    )
    wall = sum(r.wall_seconds for r in result.runs if not r.reused)
    statuses = ", ".join(
        f"{counts[s]} {s}" for s in ("reused", "trained", "resumed", "retrained") if counts[s]
    )
    runs = f"{len(result.runs)} run(s): {statuses}; {wall:.1f} s of training"
    return f"[{number}/{total}] {result.cell.name}: {shown} ({runs})"
