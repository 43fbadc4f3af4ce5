"""How a metric key is shown in tables: its column name, its order and its unit.

idml stores every metric in its natural unit: retrieval and accuracy metrics (Recall@K, MAP@R,
NMI, top-k, ECE, AURC) as fractions in [0, 1], which the tables show in %, and the rest as they
are: NLL (``nll``) in nats, uncertainty levels ``u_*`` as the norm ``||u||``, AUROCs as
probabilities in [0, 1]. :func:`metric_unit` is the one place that says which is which; every
table (the report's comparison and seed tables, ablation tables, paper comparisons) formats
through :func:`format_metric` and :func:`metric_heading`.

Example:
    >>> format_metric("top1", 0.912), format_metric("nll", 0.35), metric_heading("nll")
    ('91.20', '0.350', 'NLL (nats)')
"""

from __future__ import annotations

import math
import re

PERCENT = "%"
NATS = "nats"
NORM = "||u||"
PLAIN = ""

_PERCENT_KEYS = frozenset(
    {"r_precision", "map@r", "map_at_r", "map", "mrr", "nmi", "ece"},
)
_PERCENT_PATTERN = re.compile(
    r"^(recall@\d+|mrr@\d+|top\d+|aurc(_.+)?|selective_recall@1_cov\d+|conformal_(precision|coverage)@.+)$"
)

_METRIC_LABELS = {
    "r_precision": "RP",
    "map@r": "MAP@R",
    "map_at_r": "MAP@R",
    "mrr": "MRR",
    "map": "MAP",
    "nmi": "NMI",
    "ece": "ECE",
    "nll": "NLL",
    "aurc": "AURC",
    "auroc": "AUROC",
}


def metric_unit(key: str) -> str:
    """The unit a metric is shown in: :data:`PERCENT` (a fraction shown ×100), :data:`NATS`
    (``nll``), :data:`NORM` (``u_*``, mean ``||u||``) or :data:`PLAIN` (AUROCs and unknown keys,
    shown as stored)."""
    if key in _PERCENT_KEYS or _PERCENT_PATTERN.match(key):
        return PERCENT
    if key == "nll":
        return NATS
    if key.startswith("u_"):
        return NORM
    return PLAIN


def metric_scale(key: str) -> float:
    """The factor from the stored value to the shown one: 100 for % metrics, else 1."""
    return 100.0 if metric_unit(key) == PERCENT else 1.0


def metric_label(key: str) -> str:
    """Paper-style column name: ``recall@1`` → ``R@1``, ``map@r`` → ``MAP@R``, ``nmi`` → ``NMI``,
    ``u_mixup`` → ``||u|| mixup``."""
    if key.startswith("recall@"):
        return "R@" + key.removeprefix("recall@")
    if key.startswith("u_"):
        return "||u|| " + key.removeprefix("u_")
    if key.startswith("r_auroc_"):
        return "R-AUROC " + key.removeprefix("r_auroc_")
    return _METRIC_LABELS.get(key, key)


def metric_heading(key: str) -> str:
    """Column heading with the unit where there is one to state: ``R@1 (%)``, ``NLL (nats)``;
    ``||u||`` levels and AUROCs carry their meaning in the label."""
    unit = metric_unit(key)
    label = metric_label(key)
    return f"{label} ({unit})" if unit in (PERCENT, NATS) else label


def format_metric(
    key: str, mean: float, std: float = math.nan, percent_digits: int = 2, digits: int = 3
) -> str:
    """``mean`` (± ``std`` when finite) in the metric's unit, without the unit: % metrics ×100
    with ``percent_digits`` decimals, the others as stored with ``digits`` decimals; "–" for NaN."""
    if math.isnan(mean):
        return "–"
    scale = metric_scale(key)
    places = percent_digits if scale != 1.0 else digits
    text = f"{mean * scale:.{places}f}"
    if not math.isnan(std):
        text += f" ± {std * scale:.{places}f}"
    return text


def format_delta(key: str, delta: float, percent_digits: int = 2, digits: int = 3) -> str:
    """A signed difference in the metric's unit (percentage points for % metrics); "" for NaN."""
    if math.isnan(delta):
        return ""
    scale = metric_scale(key)
    places = percent_digits if scale != 1.0 else digits
    return f"{delta * scale:+.{places}f}"


def metric_sort_key(key: str) -> tuple[int, float, str]:
    """Order of metric columns as in the papers: Recall@K by K, then RP, MAP@R, NMI; top-k by k,
    ECE, NLL, the ``||u||`` levels; then the rest."""
    if key.startswith("recall@"):
        k = key.removeprefix("recall@")
        return (0, float(k) if k.isdigit() else math.inf, key)
    if re.fullmatch(r"top\d+", key):
        return (4, float(key.removeprefix("top")), key)
    rank = {"r_precision": 1, "map@r": 2, "map_at_r": 2, "nmi": 3, "ece": 5, "nll": 6}.get(key, 8)
    if key.startswith("u_"):
        rank = 7
    return (rank, 0.0, key)


def format_metrics(title: str, metrics: dict[str, float]) -> str:
    """``title`` over a two-column table of metric values (as ``idml train`` prints them).

    >>> print(format_metrics("run", {"recall@1": 0.5}))
    run
      recall@1  0.5000
    """
    width = max((len(k) for k in metrics), default=6)
    lines = [title] + [f"  {k.ljust(width)}  {v:.4f}" for k, v in metrics.items()]
    return "\n".join(lines)
