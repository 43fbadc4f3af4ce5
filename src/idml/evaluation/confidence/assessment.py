"""Judge the confidence of a set of retrieval answers: :func:`assess_confidence` → :class:`ConfidenceReport`.

For every query that has an answer and a class present in the gallery (lone queries are left out,
as from every retrieval metric), with ``right`` = its top-1 neighbour has its class:

* R-AUROC and AURC of every score of :class:`ConfidenceSettings` (and of the calibrated
  confidence when there is a calibration), with the oracle AURC;
* selective R@1 of *the* confidence (calibrated, else the fallback score) at each coverage;
* for a calibrated confidence: ECE in 15 bins with the reliability diagram, and for each target
  precision the certified threshold (:meth:`~idml.evaluation.confidence.calibration.ConfidenceCalibration.threshold`)
  with the precision and coverage it reaches on these queries.

Metric keys (:meth:`ConfidenceReport.metrics`): ``r_auroc_<score>``, ``aurc_<score>``,
``aurc_oracle``, ``selective_recall@1_cov<coverage %>``, ``ece``,
``conformal_precision@<target>`` and ``conformal_coverage@<target>``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from idml.evaluation.confidence.agreement import KnnAgreement
from idml.evaluation.confidence.answers import AnswerNeighbors
from idml.evaluation.confidence.base import ConfidenceScore
from idml.evaluation.confidence.calibration import (
    DEFAULT_FALLBACK,
    DEFAULT_FEATURES,
    CalibratorClass,
    ConfidenceCalibration,
    answer_confidence,
    fit_calibration,
)
from idml.evaluation.confidence.conformal import PrecisionThreshold
from idml.evaluation.confidence.hubness import HubnessCorrectedSimilarity
from idml.evaluation.confidence.logistic import LogisticCalibrator
from idml.evaluation.confidence.margin import LabelMargin
from idml.evaluation.confidence.quality import (
    ConfidenceQuality,
    oracle_aurc,
    score_quality,
    selective_accuracy,
)
from idml.evaluation.confidence.top1 import Top1Similarity
from idml.evaluation.confidence.uncertainty_level import NegativeUncertaintyLevel
from idml.evaluation.reliability import CalibrationBins, probability_bins

CONFIDENCE_METRIC_PREFIXES = (
    "r_auroc_",
    "aurc_",
    "selective_recall@",
    "ece",
    "conformal_precision@",
    "conformal_coverage@",
)
"""The prefixes of every metric key :meth:`ConfidenceReport.metrics` writes."""


def is_confidence_metric(key: str) -> bool:
    """Whether a metric key (as :meth:`ConfidenceReport.metrics` writes it) is about confidence
    rather than retrieval (for tables and figures that show them apart).

    >>> [is_confidence_metric(k) for k in ("r_auroc_top1", "aurc_oracle", "recall@1", "ece")]
    [True, True, False, True]
    """
    return key.startswith(CONFIDENCE_METRIC_PREFIXES)


DEFAULT_SCORES: tuple[ConfidenceScore, ...] = (
    Top1Similarity(),
    LabelMargin(10),
    KnnAgreement(5),
    KnnAgreement(10),
    HubnessCorrectedSimilarity(10),
    NegativeUncertaintyLevel(),
)
"""The scores an evaluation reports (``norm_u`` only for queries with an uncertainty head)."""


@dataclass(frozen=True)
class ConfidenceSettings:
    """What :func:`assess_confidence` reports (validated on construction).

    Attributes:
        scores: the confidence scores to judge; one that needs ``||u||`` is skipped for queries
            without it (a model without an uncertainty head).
        fallback: the confidence without a calibration (its selective R@1 is reported).
        coverages: coverage levels of selective R@1, in ``(0, 1]``.
        precision_targets: target precisions of the abstention thresholds, in ``(0, 1)``.
        delta: the allowed probability that a threshold misses its target.
        ece_bins: equal-width bins of ECE and the reliability diagram.
    """

    scores: Sequence[ConfidenceScore] = DEFAULT_SCORES
    fallback: ConfidenceScore = DEFAULT_FALLBACK
    coverages: Sequence[float] = (0.5, 0.8, 0.9)
    precision_targets: Sequence[float] = (0.8, 0.9, 0.95)
    delta: float = 0.1
    ece_bins: int = 15

    def __post_init__(self) -> None:
        object.__setattr__(self, "scores", tuple(self.scores))
        object.__setattr__(self, "coverages", tuple(float(c) for c in self.coverages))
        object.__setattr__(
            self, "precision_targets", tuple(float(t) for t in self.precision_targets)
        )
        for score in (*self.scores, self.fallback):
            if not isinstance(score, ConfidenceScore):
                raise ValueError(
                    f"confidence scores must be ConfidenceScore instances (see "
                    f"idml.evaluation.confidence.score_from_key), got {score!r}"
                )
        if any(not 0.0 < c <= 1.0 for c in self.coverages):
            raise ValueError(f"coverages must lie in (0, 1], got {list(self.coverages)}")
        if any(not 0.0 < t < 1.0 for t in self.precision_targets):
            raise ValueError(
                f"precision_targets must lie in (0, 1), got {list(self.precision_targets)}"
            )
        if not 0.0 < self.delta < 1.0:
            raise ValueError(f"delta must lie in (0, 1), got {self.delta}")
        if self.ece_bins < 1:
            raise ValueError(f"ece_bins must be >= 1, got {self.ece_bins}")

    def depth(
        self, with_uncertainty: bool = True, calibration: ConfidenceCalibration | None = None
    ) -> int:
        """Neighbours per query the scores, the fallback and a calibration's features read."""
        return max(s.depth for s in self.usable(with_uncertainty, calibration))

    def hubness_k(
        self, with_uncertainty: bool = True, calibration: ConfidenceCalibration | None = None
    ) -> int | None:
        """The ``k`` of the references' hubness the scores (and a calibration) need (``None``:
        none).

        Raises:
            ValueError: two scores need hubness at different ``k``.
        """
        ks = {
            s.hubness_k
            for s in self.usable(with_uncertainty, calibration)
            if s.hubness_k is not None
        }
        if len(ks) > 1:
            raise ValueError(f"confidence scores need hubness at several k {sorted(ks)}; use one")
        return ks.pop() if ks else None

    def usable(
        self, with_uncertainty: bool, calibration: ConfidenceCalibration | None = None
    ) -> tuple[ConfidenceScore, ...]:
        """The scores (and the fallback) computable with or without ``||u||``, and a
        calibration's features (which it needs in any case)."""
        scores = tuple(
            s for s in (*self.scores, self.fallback) if with_uncertainty or not s.needs_uncertainty
        )
        return scores + (() if calibration is None else calibration.features)


@dataclass(frozen=True)
class ThresholdOutcome:
    """A certified abstention threshold and what it did on the evaluated queries."""

    threshold: PrecisionThreshold
    precision: float
    """Share of right answers among the answered evaluated queries (NaN: none answered)."""
    coverage: float
    """Share of the evaluated queries answered."""

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.threshold.to_dict(),
            "precision": _clean(self.precision),
            "coverage": self.coverage,
        }


@dataclass
class ConfidenceReport:
    """How well the confidence of a set of answers predicts a right top-1 (module docstring)."""

    kind: str
    """``confidence_kind`` of *the* confidence: ``"calibrated"`` or the fallback score's key."""
    answers: AnswerNeighbors
    """Each query's neighbour lists as the scores read them (to fit a calibration on)."""
    values: dict[str, Tensor]
    """Score key (and ``"calibrated"``) → ``(Q,)`` float64 per query, in query order (NaN: no
    answer)."""
    correct: Tensor
    """``(Q,)`` float64: 1 if the top-1 neighbour has the query's class, 0 if not, NaN for queries
    left out (no answer, or alone in their class)."""
    quality: dict[str, ConfidenceQuality]
    oracle_aurc: float
    selective_recall: dict[float, float]
    """Coverage → R@1 of the most confident answers (by *the* confidence)."""
    reliability: CalibrationBins | None = None
    """ECE bins of the calibrated confidence (``None`` without a calibration)."""
    thresholds: dict[float, ThresholdOutcome] = field(default_factory=dict)
    """Target precision → certified threshold and its outcome (calibrated only)."""

    @property
    def confidence(self) -> Tensor:
        """``(Q,)`` *the* confidence of each answer (of kind :attr:`kind`)."""
        return self.values[self.kind]

    def fit_calibration(
        self,
        features: Sequence[ConfidenceScore] = DEFAULT_FEATURES,
        calibrator: CalibratorClass = LogisticCalibrator,
        **options: Any,
    ) -> ConfidenceCalibration:
        """Fit a calibrated confidence on these answers — the counted queries (with an answer
        and a class in the gallery) — by :func:`~idml.evaluation.confidence.fit_calibration`
        (``options``: its ``threshold_share``, ``seed``, ``provenance``). Meant for an
        evaluation of *held-out* classes, e.g. the validation split of the training classes."""
        counted = ~torch.isnan(self.correct)
        return fit_calibration(
            self.answers.take(counted), self.correct[counted] == 1, features, calibrator, **options
        )

    def metrics(self) -> dict[str, float]:
        """Flat metrics in report order (module docstring for the keys)."""
        out: dict[str, float] = {}
        for name, quality in self.quality.items():
            out[f"r_auroc_{name}"] = quality.auroc
            out[f"aurc_{name}"] = quality.aurc
        out["aurc_oracle"] = self.oracle_aurc
        for coverage, value in self.selective_recall.items():
            out[f"selective_recall@1_cov{round(100 * coverage)}"] = value
        if self.reliability is not None:
            out["ece"] = self.reliability.ece
        for target, outcome in self.thresholds.items():
            out[f"conformal_precision@{target:g}"] = outcome.precision
            out[f"conformal_coverage@{target:g}"] = outcome.coverage
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the kind, the reliability diagram and the thresholds (metrics are in the
        evaluation report's ``metrics``)."""
        out: dict[str, Any] = {"confidence_kind": self.kind}
        if self.reliability is not None:
            out["reliability_diagram"] = self.reliability.to_dict()
        if self.thresholds:
            out["thresholds"] = {f"{t:g}": o.to_dict() for t, o in self.thresholds.items()}
        return out


def assess_confidence(
    answers: AnswerNeighbors,
    query_labels: Tensor,
    lone: Tensor,
    settings: ConfidenceSettings | None = None,
    calibration: ConfidenceCalibration | None = None,
) -> ConfidenceReport | None:
    """Judge the confidence of ``answers`` (module docstring); ``None`` when no query counts.

    Args:
        answers: each query's neighbour lists, with the gallery's labels (and hubness when a score
            needs it, ``||u||`` when the queries have it).
        query_labels: ``(Q,)`` class of each query.
        lone: ``(Q,)`` bool, the query's class has no other reference (left out).
        settings: what to report (default :class:`ConfidenceSettings`).
        calibration: a fitted calibrated confidence (fitted on other queries).
    """
    s = ConfidenceSettings() if settings is None else settings
    neighbor_labels = answers.need_labels("the evaluation's top-1 correctness")
    if answers.depth == 0:
        return None
    labels = torch.as_tensor(query_labels).cpu().long()
    counted = answers.answered & ~torch.as_tensor(lone).cpu().bool()
    right = neighbor_labels[:, 0] == labels
    correct = torch.where(counted, right.double(), torch.full((len(labels),), math.nan))
    if not bool(counted.any()):
        return None
    with_u = answers.uncertainty_level is not None
    values = {score.key: score(answers) for score in s.usable(with_u)}
    chosen = answer_confidence(answers, calibration, s.fallback)
    values[chosen.kind] = chosen.values
    wrong = ~right[counted]
    scored = [x.key for x in s.scores if with_u or not x.needs_uncertainty]
    if calibration is not None:
        scored.append(chosen.kind)
    quality = score_quality(wrong, {k: values[k][counted] for k in dict.fromkeys(scored)})
    confidence = chosen.values[counted]
    selective = {c: selective_accuracy(confidence, wrong, c) for c in s.coverages}
    report = ConfidenceReport(
        chosen.kind, answers, values, correct, quality, oracle_aurc(wrong), selective
    )
    if calibration is not None:
        report.reliability = probability_bins(confidence, ~wrong, s.ece_bins)
        for target in s.precision_targets:
            threshold = calibration.threshold(target, s.delta)
            answered = threshold.answer(confidence)
            n_answered = int(answered.sum())
            precision = float((~wrong[answered]).double().mean()) if n_answered else math.nan
            report.thresholds[target] = ThresholdOutcome(
                threshold, precision, n_answered / len(confidence)
            )
    return report


def _clean(value: float) -> float | None:
    return None if isinstance(value, float) and math.isnan(value) else value
