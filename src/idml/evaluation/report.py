"""What an evaluation measured: :class:`EvaluationReport` and its :class:`RetrievalResult`."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from idml.evaluation.confidence.assessment import ConfidenceReport
from idml.evaluation.retrieval_metrics import PRCurve
from idml.evaluation.uncertainty import UncertaintySummary


@dataclass
class RetrievalResult:
    """Retrieval results: neighbour lists, metric means, per-query and per-class values.

    Attributes:
        ks: the K of Recall@K.
        metrics: metric name → mean over non-lone queries (``recall@K``, ``r_precision``,
            ``map@r``, ``map``, ``mrr``; approximate search reports ``mrr@k`` instead of the
            last two).
        per_query: metric name → ``(Q,)`` float64 values in query order (NaN for lone queries).
        per_class: class label → metric means over its non-lone queries, with ``num_queries`` and
            ``num_lone_queries``.
        pr_curve: precision–recall data (see :class:`~idml.evaluation.retrieval_metrics.PRCurve`).
        neighbor_indices: ``(Q, k)`` reference indices of the nearest neighbours (``-1`` = none).
        neighbor_values: ``(Q, k)`` their metric values: similarities, or distances when
            ``values_are_similarities`` is false (NaN = none).
        values_are_similarities: whether ``neighbor_values`` are similarities (else distances).
        num_queries, num_references: sizes; ``same_set`` when the set was searched against itself.
        lone_queries: indices of the queries with no relevant reference (excluded from metrics).
        metric_name: the ranking metric; ``backend``: ``"exact"`` or ``"faiss:<index>"``.
        query_rows: with query/gallery roles, the row of each query among the embeddings
            evaluated (``neighbor_indices`` are rows too); ``None`` otherwise.
    """

    ks: tuple[int, ...]
    metrics: dict[str, float]
    per_query: dict[str, Tensor]
    per_class: dict[int, dict[str, float]]
    pr_curve: PRCurve
    neighbor_indices: Tensor
    neighbor_values: Tensor
    values_are_similarities: bool
    num_queries: int
    num_references: int
    same_set: bool
    lone_queries: Tensor
    metric_name: str
    backend: str
    query_rows: Tensor | None = None

    @property
    def num_lone_queries(self) -> int:
        return int(self.lone_queries.numel())

    def to_dict(self, per_class: bool = False) -> dict[str, Any]:
        """A JSON-ready dict (no per-query arrays or neighbour lists; per-class on request)."""
        out: dict[str, Any] = {
            "metrics": {k: _clean(v) for k, v in self.metrics.items()},
            "num_queries": self.num_queries,
            "num_references": self.num_references,
            "same_set": self.same_set,
            "num_lone_queries": self.num_lone_queries,
            "ks": list(self.ks),
            "metric": self.metric_name,
            "backend": self.backend,
            "pr_curve": self.pr_curve.to_dict(),
        }
        if per_class:
            out["per_class"] = {
                str(c): {k: _clean(v) for k, v in row.items()} for c, row in self.per_class.items()
            }
        return out


@dataclass
class EvaluationReport:
    """Everything :func:`~idml.evaluation.evaluate_embeddings` measured."""

    retrieval: RetrievalResult
    nmi: float | None
    uncertainty: UncertaintySummary | None
    timings: dict[str, float] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    confidence: ConfidenceReport | None = None
    """How well each confidence score (and a calibrated confidence, when given) predicts a right
    top-1 neighbour, with each query's values
    (:class:`~idml.evaluation.confidence.assessment.ConfidenceReport`); ``None`` when not asked
    for."""
    uncertainty_levels: Tensor | None = None
    """``||u||`` of every query (``None`` without uncertainty embeddings)."""
    class_names: Sequence[str] | None = None
    """The name of each label ``0..C−1`` (the dataset's class names, e.g. an ``idml embed`` file's
    ``classes``), by which the per-class results are keyed; ``None``: by the label itself."""

    def class_keys(self) -> dict[int, str]:
        """What the per-class results call each class label: its name (with the label where two
        classes share a name), else the label."""
        labels = set(self.retrieval.per_class)
        if self.uncertainty is not None:
            labels |= set(self.uncertainty.per_class_mean)
        names = self.class_names
        if names is None:
            return {c: str(c) for c in labels}
        if labels and max(labels) >= len(names):
            raise ValueError(
                f"class_names names {len(names)} classes but the labels reach {max(labels)}; "
                "give one name per label 0..C−1"
            )
        counts = Counter(names)
        return {c: names[c] if counts[names[c]] == 1 else f"{names[c]} (label {c})" for c in labels}

    @property
    def per_class_keys(self) -> str:
        """What the per-class keys are, as the JSON (``per_class_keys``) and the table say."""
        return "labels" if self.class_names is None else "class names"

    @property
    def metrics(self) -> dict[str, float]:
        """Retrieval metric means, ``nmi`` (when computed), then the confidence metrics
        (``r_auroc_<score>``, ``aurc_<score>``, ``aurc_oracle``, selective R@1, and ECE and
        abstention outcomes of a calibrated confidence:
        :meth:`~idml.evaluation.confidence.assessment.ConfidenceReport.metrics`), in report order."""
        out = dict(self.retrieval.metrics)
        if self.nmi is not None:
            out["nmi"] = self.nmi
        if self.confidence is not None:
            out.update(self.confidence.metrics())
        return out

    @property
    def pr_curve(self) -> PRCurve:
        """The precision–recall data of the retrieval (see :class:`RetrievalResult`)."""
        return self.retrieval.pr_curve

    def to_dict(self, per_class: bool = False) -> dict[str, Any]:
        """A JSON-ready dict: metrics (with NMI), counts, PR curve, ``||u||``, the confidence's kind,
        reliability diagram and thresholds, timings, settings."""
        out = self.retrieval.to_dict(per_class)
        out["metrics"] = {k: _clean(v) for k, v in self.metrics.items()}
        if self.confidence is not None:
            out["confidence"] = self.confidence.to_dict()
        if self.uncertainty is not None:
            out["uncertainty"] = self.uncertainty.to_dict(per_class)
        if per_class:
            keys = self.class_keys()
            out["per_class_keys"] = self.per_class_keys
            out["per_class"] = {
                keys[c]: {k: _clean(v) for k, v in row.items()}
                for c, row in self.retrieval.per_class.items()
            }
            if self.uncertainty is not None:
                out["uncertainty"]["per_class_mean"] = {
                    keys[c]: v for c, v in self.uncertainty.per_class_mean.items()
                }
        out["timings_s"] = {k: round(v, 4) for k, v in self.timings.items()}
        out["settings"] = self.settings
        return out

    def to_json(self, per_class: bool = False, indent: int | None = 2) -> str:
        """The report as JSON (stable keys; NaN written as ``null``)."""
        return json.dumps(self.to_dict(per_class), indent=indent)

    def format_table(self, per_class: int = 0) -> str:
        """A readable report: a header line, the metric table, counts and ``||u||`` if known.

        ``per_class`` > 0 appends the that many classes with the lowest Recall@1.
        """
        r = self.retrieval
        against = "themselves" if r.same_set else f"{r.num_references:,} references"
        header = (
            f"{r.num_queries:,} queries against {against}; metric {r.metric_name}, "
            f"search {r.backend}"
        )
        lines = [header, "", self._metric_table()]
        lines.append("")
        lines.append(f"lone queries (alone in their class, excluded): {r.num_lone_queries:,}")
        if self.uncertainty is not None:
            u = self.uncertainty
            qs = ", ".join(f"q{round(q * 100):02d} {_fmt(v)}" for q, v in u.quantiles.items())
            lines.append(
                f"uncertainty ||u||: mean {_fmt(u.mean)}, std {_fmt(u.std)}, "
                f"min {_fmt(u.min)}, max {_fmt(u.max)}; {qs}"
            )
            if u.recall_at_1_by_quartile:
                parts = ", ".join(_fmt(v) for v in u.recall_at_1_by_quartile)
                lines.append(f"recall@1 by ||u|| quartile (least uncertain first): {parts}")
        if per_class > 0 and r.per_class:
            key = f"recall@{r.ks[0]}"
            rows = sorted(
                r.per_class.items(),
                key=lambda item: (math.inf if math.isnan(item[1][key]) else item[1][key], item[0]),
            )[:per_class]
            names = self.class_keys()
            lines.append("")
            lines.append(f"classes with the lowest {key} (by {self.per_class_keys[:-1]}):")
            lines += [
                f"  {names[c]}: {key} {_fmt(row[key])}, map@r {_fmt(row['map@r'])}, "
                f"{row['num_queries']} queries"
                for c, row in rows
            ]
        return "\n".join(lines)

    def _metric_table(self) -> str:
        metrics = self.metrics
        width = max(len(k) for k in metrics)
        lines = [f"{'metric'.ljust(width)}  value", f"{'-' * width}  ------"]
        # How NMI was computed (or that it was not) stands on the NMI row: the approximation
        # reads differently.
        method = self.settings.get("nmi_method")
        for key, value in metrics.items():
            note = f"  {method}" if key == "nmi" and method is not None else ""
            lines.append(f"{key.ljust(width)}  {_fmt(value)}{note}")
        if method is not None and "nmi" not in metrics:
            lines.append(f"{'nmi'.ljust(width)}  {method}")
        return "\n".join(lines)


def _fmt(value: float) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.4f}"


def _clean(value: float) -> float | None:
    return None if isinstance(value, float) and math.isnan(value) else value
