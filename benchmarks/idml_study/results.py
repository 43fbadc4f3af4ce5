"""A grid's finished runs as the study reads them (each seed's ``result.json`` and
``mechanism.json``), and the means and ``mean ± std`` cells drawn from them.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def mean_of(records: Sequence[dict[str, Any]], get: Any) -> float:
    """Mean of ``get(record)`` over the records where it is not ``None``."""
    return mean([v for v in (get(r) for r in records) if v is not None])


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def fmt(values: Sequence[float], scale: float = 100.0) -> str:
    if not values:
        return "–"
    m = mean(values)
    if len(values) < 2:
        return f"{scale * m:.1f}"
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))
    return f"{scale * m:.1f} ± {scale * sd:.1f}"


def run_files(arm_folder: Path, name: str) -> list[Path]:
    """``name`` in each seed's run folder of an arm — not in the ``seedN.replaced-…`` folders a
    re-run set aside (a run retrained after its config changed keeps the old one there)."""
    return sorted(
        path
        for path in arm_folder.glob(f"s*/cells/base/seed*/{name}")
        if re.fullmatch(r"seed\d+", path.parent.name)
    )


def seed_results(arm_folder: Path) -> dict[int, dict[str, Any]]:
    """``{seed: {"metrics": …, "mechanism": … | None}}`` of an arm's finished runs."""
    out = {}
    for result in run_files(arm_folder, "result.json"):
        record = json.loads(result.read_text())
        mech = result.parent / "mechanism.json"
        out[int(record["seed"])] = {
            "metrics": record["final_metrics"],
            "mechanism": json.loads(mech.read_text()) if mech.is_file() else None,
        }
    return out


def final_metrics(folder: Path, seeds: int) -> dict[str, list[float]]:
    runs = seed_results(folder)
    keys = ("recall@1", "map@r", "nmi")
    return {
        k: [runs[s]["metrics"][k] for s in sorted(runs) if k in runs[s]["metrics"]] for k in keys
    }


Runs = dict[int, dict[str, Any]]
"""An arm's finished runs by seed (:func:`seed_results`)."""
