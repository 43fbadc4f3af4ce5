"""A calibrated confidence, ``P(top-1 right)``, fitted on held-out queries and stored as JSON.

:func:`fit_calibration` takes labelled calibration queries — in practice the *validation split of
the training classes* (classes the model did not train on, like the unseen test classes it will
meet) — and splits them at random in two halves:

* the **fit half** fits the calibrator (:class:`~idml.evaluation.confidence.logistic.LogisticCalibrator`
  by default, or :class:`~idml.evaluation.confidence.isotonic.IsotonicCalibrator`) on a few
  confidence scores;
* the **threshold half** keeps each query's calibrated confidence and whether it was right, from
  which :meth:`ConfidenceCalibration.threshold` certifies an abstention threshold for any target
  precision (:mod:`idml.evaluation.confidence.conformal`: its *testing set*). The guarantee needs
  a confidence function and candidate thresholds fixed before these queries are seen, hence the
  separate half; the candidates come from the fit half's calibrated confidences (the *ordering
  set*), which are kept too.

**File format** (:meth:`ConfidenceCalibration.save`, UTF-8 JSON, no code, no pickle)::

    {
      "format": "idml.confidence_calibration",
      "version": 1,
      "calibrator": {"kind": "logistic", "features": ["top1", "margin@10", ...],
                     "mean": [...], "scale": [...], "weights": [...], "bias": 0.3},
                 or {"kind": "isotonic", "features": ["agreement@10"],
                     "thresholds": [...], "probabilities": [...]},
      "ordering_set": {"confidence": [...], "correct": [true, false, ...]},   # the fit half
      "testing_set": {"confidence": [...], "correct": [...]},                 # the threshold half
      "provenance": {"...": "..."}    # free text: what the queries were, metric, re-ranking
    }

Feature names are score keys (:func:`~idml.evaluation.confidence.base.score_from_key`), so the
file says exactly which scores, at which ``k``, a search must provide.

Example:
    >>> import torch
    >>> from idml.evaluation.search import NeighborLists
    >>> g = torch.Generator().manual_seed(0)
    >>> scores = torch.rand(400, 2, generator=g).sort(1, descending=True).values
    >>> lists = NeighborLists(torch.randint(0, 50, (400, 2), generator=g), scores)
    >>> answers = AnswerNeighbors.from_search(lists, reference_labels=torch.arange(50) % 5)
    >>> right = torch.rand(400, generator=g) < scores[:, 0]
    >>> cal = fit_calibration(answers, right, features=(Top1Similarity(),))
    >>> p = cal.confidence(answers)
    >>> bool((p >= 0).all() and (p <= 1).all()), cal.kind
    (True, 'calibrated')
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from idml.evaluation.confidence.agreement import KnnAgreement
from idml.evaluation.confidence.answers import AnswerNeighbors
from idml.evaluation.confidence.base import ConfidenceScore
from idml.evaluation.confidence.conformal import (
    PrecisionThreshold,
    candidate_thresholds,
    precision_threshold,
)
from idml.evaluation.confidence.isotonic import IsotonicCalibrator
from idml.evaluation.confidence.logistic import LogisticCalibrator
from idml.evaluation.confidence.margin import LabelMargin
from idml.evaluation.confidence.top1 import Top1Similarity

FORMAT = "idml.confidence_calibration"
VERSION = 1

Calibrator = LogisticCalibrator | IsotonicCalibrator
CalibratorClass = type[LogisticCalibrator] | type[IsotonicCalibrator]
CALIBRATORS: Mapping[str, CalibratorClass] = {
    LogisticCalibrator.kind: LogisticCalibrator,
    IsotonicCalibrator.kind: IsotonicCalibrator,
}
"""Calibrator classes by their ``kind`` (what a calibration file names)."""

DEFAULT_FEATURES: tuple[ConfidenceScore, ...] = (
    Top1Similarity(),
    LabelMargin(10),
    KnnAgreement(10),
)
"""The scores the default logistic calibrator combines. Chosen on the demo study
(``benchmarks/study_confidence.py``, ``benchmarks/study/confidence_demo_*.md``): adding CSLS or
``−||u||`` did not raise the calibrated R-AUROC on the test classes, and without CSLS an index
needs no gallery self-search for the default confidence."""

MIN_EACH = 5
"""Right and wrong answers the fit half needs at least (:func:`fit_calibration`)."""

DEFAULT_FALLBACK: ConfidenceScore = Top1Similarity()
"""The confidence without a calibration: the top-1 similarity needs neither labels nor fitting."""


def score_matrix(answers: AnswerNeighbors, scores: Sequence[ConfidenceScore]) -> Tensor:
    """``(Q, len(scores))`` float64: column ``j`` is ``scores[j]`` of every query."""
    if not scores:
        raise ValueError("score_matrix needs at least one confidence score")
    return torch.stack([score(answers) for score in scores], dim=1)


@dataclass(frozen=True)
class LabelledConfidences:
    """Calibrated confidences of labelled queries and whether each top-1 answer was right."""

    confidence: Tensor
    """``(m,)`` float64."""
    correct: Tensor
    """``(m,)`` bool."""

    def __post_init__(self) -> None:
        if self.confidence.shape != self.correct.shape or self.confidence.dim() != 1:
            raise ValueError(
                f"confidence {tuple(self.confidence.shape)} and correct "
                f"{tuple(self.correct.shape)} must be two vectors of one length"
            )

    def to_dict(self) -> dict[str, list[Any]]:
        return {"confidence": self.confidence.tolist(), "correct": self.correct.tolist()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LabelledConfidences:
        return cls(
            torch.tensor([float(v) for v in data["confidence"]], dtype=torch.float64),
            torch.tensor([bool(v) for v in data["correct"]], dtype=torch.bool),
        )


@dataclass(frozen=True)
class ConfidenceCalibration:
    """A fitted calibrator and the two halves of its calibration queries (module docstring)."""

    calibrator: Calibrator
    ordering_set: LabelledConfidences
    """The fit half (its in-sample calibrated confidences): where candidate thresholds come from."""
    testing_set: LabelledConfidences
    """The threshold half: where thresholds are certified."""
    provenance: dict[str, str] = field(default_factory=dict)
    """Free text saying what the calibration queries were (written to the file as is)."""

    kind = "calibrated"
    """The ``confidence_kind`` of what :meth:`confidence` returns."""

    @property
    def features(self) -> tuple[ConfidenceScore, ...]:
        """The scores the calibrator reads (what a search must provide)."""
        return self.calibrator.features

    def confidence(self, answers: AnswerNeighbors) -> Tensor:
        """``(Q,)`` float64 ``P(top-1 right)`` of each query (NaN: no neighbour)."""
        return self.calibrator.predict(score_matrix(answers, self.features))

    def threshold(self, target: float, delta: float = 0.1) -> PrecisionThreshold:
        """The abstention threshold for precision ``≥ target`` with probability ``≥ 1 − δ``:
        candidates from the ordering set, certified on the testing set
        (:mod:`idml.evaluation.confidence.conformal`)."""
        ordering, testing = self.ordering_set, self.testing_set
        candidates = candidate_thresholds(ordering.confidence, ordering.correct, target, delta)
        return precision_threshold(testing.confidence, testing.correct, candidates, target, delta)

    # ------------------------------------------------------------------ file format
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "calibrator": self.calibrator.to_dict(),
            "ordering_set": self.ordering_set.to_dict(),
            "testing_set": self.testing_set.to_dict(),
            "provenance": dict(self.provenance),
        }

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], source: str = "calibration"
    ) -> ConfidenceCalibration:
        """Read the JSON form; ``source`` names the file in errors."""
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            raise ValueError(
                f'{source}: not an idml confidence calibration (expected "format": {FORMAT!r})'
            )
        if data.get("version") != VERSION:
            raise ValueError(
                f"{source}: calibration format version {data.get('version')!r} is not supported "
                f"(this idml reads version {VERSION}); fit it again with this version"
            )
        try:
            spec = data["calibrator"]
            calibrator_cls = CALIBRATORS.get(spec["kind"])
            if calibrator_cls is None:
                raise ValueError(
                    f"unknown calibrator kind {spec['kind']!r}; known: {', '.join(CALIBRATORS)}"
                )
            calibrator = calibrator_cls.from_dict(spec)
            ordering = LabelledConfidences.from_dict(data["ordering_set"])
            testing = LabelledConfidences.from_dict(data["testing_set"])
            provenance = {str(k): str(v) for k, v in dict(data.get("provenance", {})).items()}
            return cls(calibrator, ordering, testing, provenance)
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{source}: invalid confidence calibration: {error}") from error

    def save(self, path: str | Path) -> Path:
        """Write the calibration as JSON (module docstring) and return the path."""
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | Path) -> ConfidenceCalibration:
        """Read a calibration written by :meth:`save`."""
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ValueError(f"{path}: no such calibration file") from None
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not valid JSON ({error})") from None
        return cls.from_dict(data, str(path))


def fit_calibration(
    answers: AnswerNeighbors,
    correct: Tensor,
    features: Sequence[ConfidenceScore] = DEFAULT_FEATURES,
    calibrator: CalibratorClass = LogisticCalibrator,
    threshold_share: float = 0.5,
    seed: int = 0,
    provenance: Mapping[str, str] | None = None,
) -> ConfidenceCalibration:
    """Fit a calibrated confidence on labelled calibration queries (module docstring).

    Args:
        answers: the calibration queries' neighbour lists (from the same kind of search, with the
            same metric and re-ranking, as the queries it will score).
        correct: ``(Q,)`` bool, the query's top-1 neighbour has its class (queries with no
            neighbour are left out).
        features: the scores the calibrator combines (one for :class:`IsotonicCalibrator`).
        calibrator: :class:`LogisticCalibrator` (default) or :class:`IsotonicCalibrator`.
        threshold_share: share of the queries kept out of the fit for abstention thresholds.
        seed: seed of the random split.
        provenance: free text stored with the calibration.

    Raises:
        ValueError: fewer than :data:`MIN_EACH` right or wrong answers in the fit half, or an
            empty threshold half (the caller then keeps the label-free confidence, saying so).
    """
    if calibrator not in CALIBRATORS.values():
        known = ", ".join(c.__name__ for c in CALIBRATORS.values())
        raise ValueError(f"calibrator must be one of {known}, got {calibrator!r}")
    if not 0.0 < threshold_share < 1.0:
        raise ValueError(f"threshold_share must lie in (0, 1), got {threshold_share}")
    features = tuple(features)
    values = score_matrix(answers, features)
    right = torch.as_tensor(correct).bool().flatten()
    if len(right) != len(values):
        raise ValueError(
            f"correct has {len(right)} entries but there are {len(values)} calibration queries"
        )
    usable = torch.nonzero(~torch.isnan(values).any(1)).flatten()
    order = usable[torch.randperm(len(usable), generator=torch.Generator().manual_seed(seed))]
    n_threshold = round(threshold_share * len(order))
    fit_ids, threshold_ids = order[n_threshold:], order[:n_threshold]
    n_right = int(right[fit_ids].sum())
    if min(n_right, len(fit_ids) - n_right) < MIN_EACH or len(threshold_ids) == 0:
        raise ValueError(
            f"the calibration queries split into a fit half of {len(fit_ids)} usable queries "
            f"({n_right} right, {len(fit_ids) - n_right} wrong) and a threshold half of "
            f"{len(threshold_ids)}; fitting needs at least {MIN_EACH} right and {MIN_EACH} "
            "wrong answers in the fit half (fewer cannot say how the error rate depends on the "
            "scores): use more, or harder, calibration queries"
        )
    fitted = calibrator.fit(features, values[fit_ids], right[fit_ids])
    return ConfidenceCalibration(
        fitted,
        LabelledConfidences(fitted.predict(values[fit_ids]), right[fit_ids].clone()),
        LabelledConfidences(fitted.predict(values[threshold_ids]), right[threshold_ids].clone()),
        dict(provenance or {}),
    )


@dataclass(frozen=True)
class AnswerConfidence:
    """The confidence of each answer and what it is."""

    values: Tensor
    """``(Q,)`` float64 (NaN: no neighbour, no answer)."""
    kind: str
    """``"calibrated"`` (``P(top-1 right)``) or the key of the label-free score used instead."""


def answer_confidence(
    answers: AnswerNeighbors,
    calibration: ConfidenceCalibration | None = None,
    fallback: ConfidenceScore = DEFAULT_FALLBACK,
) -> AnswerConfidence:
    """The calibrated confidence when there is a calibration, else the ``fallback`` score (the
    top-1 similarity by default: it needs no labels and no fitting), saying which in ``kind``."""
    if calibration is not None:
        return AnswerConfidence(calibration.confidence(answers), calibration.kind)
    return AnswerConfidence(fallback(answers), fallback.key)
