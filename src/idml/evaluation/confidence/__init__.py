"""How sure is a retrieval answer: confidence scores, a calibrated confidence, abstention, quality.

The answer to a query is the label of its nearest reference. This package scores that answer from
the search's top-k lists (never an ``N×N`` matrix; ``O(Q·k)`` next to the search's ``O(Q·R·d)``):

* **scores** (:data:`CONFIDENCE_SCORES`, one module each, larger = surer):
  :class:`Top1Similarity` (``top1``), :class:`LabelMargin` (``margin@k``), :class:`KnnAgreement`
  (``agreement@k``), :class:`HubnessCorrectedSimilarity` (``csls@k``, with
  :class:`ReferenceHubness`) and :class:`NegativeUncertaintyLevel` (``norm_u``), all reading an
  :class:`AnswerNeighbors`;
* **a calibrated confidence** ``P(top-1 right)``: :func:`fit_calibration` →
  :class:`ConfidenceCalibration` (a :class:`LogisticCalibrator` or :class:`IsotonicCalibrator` plus a
  held-out set for thresholds; JSON via ``save``/``load``), and :func:`answer_confidence`, which
  falls back to a label-free score without a calibration and says which (``kind``);
* **abstention with a guarantee**: :func:`candidate_thresholds` and :func:`precision_threshold`
  (Learn then Test) →
  :class:`PrecisionThreshold`;
* **quality** (the URL benchmark's measures, Kirchhof et al. 2023): :func:`r_auroc`, :func:`aurc`,
  :func:`oracle_aurc`, :func:`risk_coverage`, :func:`selective_accuracy`, and ECE / the reliability
  diagram in :mod:`idml.evaluation.reliability`; :func:`assess_confidence` (with
  :class:`ConfidenceSettings`) judges a set of answers into a :class:`ConfidenceReport`, which
  :func:`~idml.evaluation.evaluate_embeddings` adds to every evaluation.
"""

from idml.evaluation.confidence.agreement import KnnAgreement
from idml.evaluation.confidence.answers import AnswerNeighbors, ReferenceHubness
from idml.evaluation.confidence.assessment import (
    DEFAULT_SCORES,
    ConfidenceReport,
    ConfidenceSettings,
    ThresholdOutcome,
    assess_confidence,
    is_confidence_metric,
)
from idml.evaluation.confidence.base import (
    CONFIDENCE_SCORES,
    ConfidenceScore,
    register_score,
    score_from_key,
)
from idml.evaluation.confidence.calibration import (
    CALIBRATORS,
    DEFAULT_FALLBACK,
    DEFAULT_FEATURES,
    AnswerConfidence,
    Calibrator,
    CalibratorClass,
    ConfidenceCalibration,
    LabelledConfidences,
    answer_confidence,
    fit_calibration,
    score_matrix,
)
from idml.evaluation.confidence.conformal import (
    PrecisionThreshold,
    candidate_thresholds,
    precision_threshold,
)
from idml.evaluation.confidence.hubness import HubnessCorrectedSimilarity
from idml.evaluation.confidence.isotonic import IsotonicCalibrator
from idml.evaluation.confidence.logistic import LogisticCalibrator
from idml.evaluation.confidence.margin import LabelMargin
from idml.evaluation.confidence.quality import (
    ConfidenceQuality,
    aurc,
    error_auroc,
    oracle_aurc,
    r_auroc,
    rank_combination,
    risk_coverage,
    score_quality,
    selective_accuracy,
)
from idml.evaluation.confidence.top1 import Top1Similarity
from idml.evaluation.confidence.uncertainty_level import NegativeUncertaintyLevel

__all__ = [
    "CALIBRATORS",
    "CONFIDENCE_SCORES",
    "DEFAULT_FALLBACK",
    "DEFAULT_FEATURES",
    "DEFAULT_SCORES",
    "AnswerConfidence",
    "AnswerNeighbors",
    "Calibrator",
    "CalibratorClass",
    "ConfidenceCalibration",
    "ConfidenceQuality",
    "ConfidenceReport",
    "ConfidenceScore",
    "ConfidenceSettings",
    "HubnessCorrectedSimilarity",
    "IsotonicCalibrator",
    "KnnAgreement",
    "LabelMargin",
    "LabelledConfidences",
    "LogisticCalibrator",
    "NegativeUncertaintyLevel",
    "PrecisionThreshold",
    "ReferenceHubness",
    "ThresholdOutcome",
    "Top1Similarity",
    "answer_confidence",
    "assess_confidence",
    "aurc",
    "candidate_thresholds",
    "error_auroc",
    "fit_calibration",
    "is_confidence_metric",
    "oracle_aurc",
    "precision_threshold",
    "r_auroc",
    "rank_combination",
    "register_score",
    "risk_coverage",
    "score_from_key",
    "score_matrix",
    "score_quality",
    "selective_accuracy",
]
