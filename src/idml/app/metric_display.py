"""How a metric key is shown in tables: its column name, its order and its unit.

idml stores every metric in its natural unit: retrieval, accuracy and confidence metrics
(Recall@K, MAP@R, NMI, top-k, ECE, R-AUROC and AUROC, AURC) as fractions in [0, 1], which the
tables show in % (so one page reads in one unit: R-AUROC 91.2 beside R@1 67.2, 50 = chance), and
the rest as they are: NLL (``nll``) in nats, uncertainty levels ``u_*`` as the norm ``||u||``.
:func:`metric_unit` is the one place that says which is which, and :func:`metric_direction` which
side is better; every table (the report's comparison, confidence and seed tables, ablation tables,
paper comparisons) formats through :func:`format_metric` and :func:`metric_heading`.

Numbers are shown with the precision their spread needs (:func:`decimals_for`): ``||u||`` levels
of a trained head often differ in the third significant digit (0.02003 … 0.02008), which two
decimals would show as one value.

Example:
    >>> format_metric("top1", 0.912), format_metric("nll", 0.35), metric_heading("nll")
    ('91.20', '0.350', 'NLL (nats)')
    >>> decimals_for([0.02003, 0.02008]), decimals_for([0.5, 0.71])
    (6, 3)
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping

PERCENT = "%"
NATS = "nats"
NORM = "||u||"
PLAIN = ""

_PERCENT_KEYS = frozenset(
    {"r_precision", "map@r", "map_at_r", "map", "mrr", "nmi", "ece"},
)
_PERCENT_PATTERN = re.compile(
    r"^(recall@\d+|mrr@\d+|top\d+|(r_)?auroc(_.+)?|aurc(_.+)?|selective_recall@1_cov\d+"
    r"|conformal_(precision|coverage)@.+)$"
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
    "r_auroc": "R-AUROC",
}

_CONFIDENCE_SCORES = {
    "top1": "top-1",
    "top1_cos": "top-1 cos",
    "max_prob": "max prob",
    "norm_u": "−||u||",
    "calibrated": "calibrated",
    "combined": "combined",
    "oracle": "oracle",
}
"""Short names of the confidence scores of ``r_auroc_<score>`` / ``auroc_<score>`` /
``aurc_<score>`` columns (other scores, e.g. ``margin@10``, show their key)."""


def metric_unit(key: str) -> str:
    """The unit a metric is shown in: :data:`PERCENT` (a fraction shown ×100: retrieval,
    accuracy, ECE, (R-)AUROC, AURC, abstention), :data:`NATS` (``nll``), :data:`NORM` (``u_*``,
    mean ``||u||``) or :data:`PLAIN` (unknown keys, shown as stored)."""
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
    ``u_mixup`` → ``||u|| mixup``, ``conformal_precision@0.9`` → ``precision at target 0.9``."""
    if key.startswith("recall@"):
        return "R@" + key.removeprefix("recall@")
    if key.startswith("u_"):
        return "||u|| " + key.removeprefix("u_")
    for kind, label in (("r_auroc_", "R-AUROC"), ("auroc_", "AUROC"), ("aurc_", "AURC")):
        if key.startswith(kind):
            score = key.removeprefix(kind)
            return f"{label} {_CONFIDENCE_SCORES.get(score, score)}"
    # Abstention columns: words that wrap, so many of them fit a table's width.
    if key.startswith("selective_recall@1_cov"):
        return f"selective R@1 at {key.removeprefix('selective_recall@1_cov')}% coverage"
    for kind in ("precision", "coverage"):
        if key.startswith(f"conformal_{kind}@"):
            return f"{kind} at target {key.removeprefix(f'conformal_{kind}@')}"
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


def decimals_for(values: Iterable[float], minimum: int = 3, maximum: int = 6) -> int:
    """Decimals that show ``values`` apart and each to three significant digits: one more than
    the order of their spread (0.02003 … 0.02008: 6), at least three significant digits of the
    largest (0.0201: 4), between ``minimum`` and ``maximum``."""
    finite = [abs(float(v)) for v in values if math.isfinite(float(v))]
    if not finite:
        return minimum
    decimals = minimum
    largest = max(finite)
    if largest > 0:
        decimals = max(decimals, 2 - math.floor(math.log10(largest)))
    spread = max(finite) - min(finite) if len(finite) > 1 else 0.0
    if spread > 0:
        decimals = max(decimals, 1 - math.floor(math.log10(spread)))
    return min(decimals, maximum)


def column_decimals(key: str, values: Iterable[float]) -> dict[str, int]:
    """The ``digits`` keyword of :func:`format_metric` / :func:`format_delta` for a column of
    ``key`` holding ``values`` (as stored): % metrics keep two decimals, the others
    (``||u||``, AUROC, NLL) get :func:`decimals_for` their values."""
    if metric_unit(key) == PERCENT:
        return {}
    return {"digits": decimals_for(values)}


def table_decimals(columns: Mapping[str, Iterable[float]]) -> dict[str, dict[str, int]]:
    """:func:`column_decimals` of each column of a table (metric key → its values); the ``||u||``
    columns (clean, Mixup, low resolution …) are read against each other, so they share the
    precision of all their values."""
    values = {key: list(v) for key, v in columns.items()}
    levels = [v for key, vs in values.items() if metric_unit(key) == NORM for v in vs]
    return {
        key: column_decimals(key, levels if metric_unit(key) == NORM else vs)
        for key, vs in values.items()
    }


METRIC_FAMILIES = (
    "retrieval",
    "classification",
    "uncertainty",
    "auroc",
    "aurc",
    "abstention",
    "other",
)
"""Columns that belong together, in report order: retrieval (Recall@K, RP, MAP@R, MAP, MRR, NMI),
classification (top-k, ECE, NLL), ``||u||`` levels, the confidence scores' AUROC (wrong-answer
detection) and AURC (risk–coverage), abstention (selective R@1 at a coverage; precision and
coverage of the thresholds certified for target precisions), the rest."""

_RETRIEVAL = frozenset({"r_precision", "map@r", "map_at_r", "map", "mrr", "nmi"})


def metric_family(key: str) -> str:
    """The :data:`METRIC_FAMILIES` entry of a metric key."""
    if key.startswith(("recall@", "mrr@")) or key in _RETRIEVAL:
        return "retrieval"
    if re.fullmatch(r"top\d+", key) or key in ("ece", "nll"):
        return "classification"
    if key.startswith("u_"):
        return "uncertainty"
    if key.startswith(("auroc", "r_auroc")):
        return "auroc"
    if key.startswith("aurc"):
        return "aurc"
    if key.startswith(("selective_recall", "conformal_")):
        return "abstention"
    return "other"


HIGHER_IS_BETTER = 1
LOWER_IS_BETTER = -1
NO_BETTER_SIDE = 0

_LOWER_IS_BETTER = re.compile(r"^(aurc(_.+)?|ece|nll)$")


def metric_direction(key: str) -> int:
    """Which side of a metric is better: :data:`LOWER_IS_BETTER` for the risk–coverage area
    (``aurc_*``), the calibration error (``ece``) and the negative log-likelihood (``nll``);
    :data:`NO_BETTER_SIDE` for the ``||u||`` levels (``u_*``, a measurement of the images, not a
    quality) and keys this module does not know; :data:`HIGHER_IS_BETTER` for the rest (Recall@K,
    RP, MAP@R, MAP, MRR, NMI, top-k, (R-)AUROC, selective R@1, conformal precision and coverage).

    >>> metric_direction("recall@1"), metric_direction("aurc_top1"), metric_direction("u_mixup")
    (1, -1, 0)
    """
    if _LOWER_IS_BETTER.match(key):
        return LOWER_IS_BETTER
    if key.startswith("u_") or metric_unit(key) == PLAIN:
        return NO_BETTER_SIDE
    return HIGHER_IS_BETTER


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
    for kind, kind_rank in (("auroc_", 9), ("aurc_", 10)):
        if key.startswith(kind):
            # By score, as the report's confidence table lists them; the oracle AURC last.
            scores = list(_CONFIDENCE_SCORES)
            score = key.removeprefix(kind)
            return (kind_rank, float(scores.index(score)) if score in scores else 99.0, key)
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
