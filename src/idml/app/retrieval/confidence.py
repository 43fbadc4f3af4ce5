"""The confidence of a retrieval answer and when to abstain: :class:`AnswerPolicy` decides both.

The answer to a query is its nearest gallery item (in a labelled gallery: that item's label). Its
``confidence`` is

* **calibrated** (``confidence_kind: "calibrated"``), ``P(top-1 right)``, when a calibration
  applies to the index — fitted for the index's model and under the same re-ranking
  (:func:`idml.app.calibration.find_calibration`): a logistic (or isotonic) model of the top-1
  similarity, the margin to the nearest other label and the k-NN label agreement
  (:mod:`idml.evaluation.confidence`), fitted on held-out classes;
* otherwise the label-free **top-1 similarity** (``"top1"``): the cosine similarity of the nearest
  item (with re-ranking, the re-ranker's score of it), which is not a probability. The answer's
  ``note`` says why there is no calibration.

**Abstention.** ``answered`` is ``false`` when the confidence is below a cut-off: ``min_confidence``
(any kind), or the threshold certified for ``target_precision`` (calibrated only): among the
answered queries the precision is at least the target with probability ``1 − δ`` when the
calibration queries and the queries searched are exchangeable (Learn then Test,
:mod:`idml.evaluation.confidence.conformal`; calibration classes other than the gallery's make that
a hope that ``benchmarks/study_confidence.py`` measures, not a theorem). A threshold that cannot be
certified on the calibration's queries abstains on everything, and says so.

The query's ``||u||`` is reported beside the confidence as what it measurably is: a per-image
signal of how hard the *input* is (it rises on blurred, low-resolution and mixed images); it does
not predict a wrong nearest neighbour (R-AUROC ≈ 0.5, ``benchmarks/RESULTS.md``), so the default
calibration does not read it.

Example:
    >>> import torch
    >>> from idml.evaluation.confidence import AnswerNeighbors
    >>> from idml.evaluation.search import NeighborLists
    >>> lists = NeighborLists(torch.tensor([[0, 1], [1, 0]]), torch.tensor([[0.9, 0.2], [0.4, 0.3]]))
    >>> policy = AnswerPolicy(min_confidence=0.5)
    >>> confidence, answered = policy.score(AnswerNeighbors.from_search(lists))
    >>> policy.kind, confidence.tolist(), answered.tolist()
    ('top1', [0.8999999761581421, 0.4000000059604645], [True, False])
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from idml.app.calibration import FoundCalibration
from idml.evaluation.confidence import (
    DEFAULT_FALLBACK,
    AnswerNeighbors,
    ConfidenceCalibration,
    PrecisionThreshold,
    answer_confidence,
)

NO_CALIBRATION_NOTE = (
    "no calibration applies: the confidence is the top-1 cosine similarity (label-free "
    "fallback), not a probability"
)
"""What an answer says without a calibration when the reason would reveal a server path."""
CALIBRATED_NOTE = "calibrated confidence: P(top-1 right), fitted on held-out labelled queries"


@dataclass(frozen=True)
class AnswerPolicy:
    """How each answer's confidence is computed and when it abstains (module docstring).

    Build one with :meth:`create`; the default scores by the top-1 similarity and answers every
    query that has a neighbour.
    """

    calibration: ConfidenceCalibration | None = None
    note: str = NO_CALIBRATION_NOTE
    """Where the calibration came from, or why there is none."""
    min_confidence: float | None = None
    """Abstain below this confidence (of either kind)."""
    threshold: PrecisionThreshold | None = None
    """Abstain below the threshold certified for a target precision (calibrated only)."""

    @classmethod
    def create(
        cls,
        found: FoundCalibration | None = None,
        *,
        min_confidence: float | None = None,
        target_precision: float | None = None,
        delta: float = 0.1,
    ) -> AnswerPolicy:
        """The policy of a search: ``found`` (:func:`~idml.app.calibration.find_calibration`),
        and at most one of ``min_confidence`` and ``target_precision`` (risk ``delta``).

        Raises:
            ValueError: both cut-offs, a cut-off that is not a finite number, a target outside
                ``(0, 1)``, or a target precision without a calibration.
        """
        calibration = None if found is None else found.calibration
        note = NO_CALIBRATION_NOTE if found is None else found.note
        if min_confidence is not None and target_precision is not None:
            raise ValueError(
                "give --min-confidence or --target-precision, not both: each sets the cut-off "
                "below which a query abstains"
            )
        if min_confidence is not None and not math.isfinite(min_confidence):
            raise ValueError(f"--min-confidence must be a finite number, got {min_confidence}")
        threshold = None
        if target_precision is not None:
            if calibration is None:
                raise ValueError(
                    "--target-precision needs a calibrated confidence, and none applies here ("
                    f"{note}); fit one with `idml calibrate RUN_OR_EXPORT --images LABELLED "
                    "[--index INDEX]`, or use --min-confidence on the top-1 similarity"
                )
            threshold = calibration.threshold(target_precision, delta)
        return cls(calibration, note, min_confidence, threshold)

    @property
    def kind(self) -> str:
        """``confidence_kind`` of every answer: ``"calibrated"`` or ``"top1"``."""
        return self.calibration.kind if self.calibration is not None else DEFAULT_FALLBACK.key

    @property
    def depth(self) -> int:
        """Neighbours per query the confidence reads."""
        scores = self.calibration.features if self.calibration is not None else (DEFAULT_FALLBACK,)
        return max(score.depth for score in scores)

    @property
    def hubness_k(self) -> int | None:
        """The ``k`` of the gallery's hubness the confidence reads (``None``: none)."""
        if self.calibration is None:
            return None
        ks = [k for score in self.calibration.features if (k := score.hubness_k) is not None]
        return min(ks) if ks else None

    @property
    def needs_uncertainty(self) -> bool:
        """Whether the confidence reads the query's ``||u||``."""
        return self.calibration is not None and any(
            score.needs_uncertainty for score in self.calibration.features
        )

    @property
    def cutoff(self) -> float | None:
        """Answer iff ``confidence ≥ cutoff`` (``None``: every query with a neighbour;
        ``inf``: none, no threshold could be certified)."""
        if self.threshold is not None:
            return self.threshold.threshold
        return self.min_confidence

    def score(self, answers: AnswerNeighbors) -> tuple[Tensor, Tensor]:
        """``(confidence (Q,) float64, answered (Q,) bool)`` of each query's answer; a query
        without any neighbour has a NaN confidence and is never answered."""
        confidence = answer_confidence(answers, self.calibration).values
        if self.calibration is None:
            # Cosines of unit vectors in float32 can exceed 1 by a rounding step.
            confidence = confidence.clamp(-1.0, 1.0)
        answered = answers.answered & ~torch.isnan(confidence)
        if self.cutoff is not None:
            answered &= confidence >= self.cutoff
        return confidence, answered

    def describe(self, reveal_paths: bool = True) -> dict[str, Any]:
        """How answers are scored, for ``idml search --json`` and ``idml serve``'s ``/info``
        (``reveal_paths=False``: without the server's folders)."""
        note = self.note
        if not reveal_paths:
            note = CALIBRATED_NOTE if self.calibration is not None else NO_CALIBRATION_NOTE
        out: dict[str, Any] = {
            "confidence_kind": self.kind,
            "note": note,
            "abstain_below": _finite_or_none(self.cutoff),
        }
        if self.calibration is not None:
            out["calibrator"] = self.calibration.calibrator.kind
            out["features"] = [score.key for score in self.calibration.features]
            out["calibration_queries"] = len(self.calibration.testing_set.correct) + len(
                self.calibration.ordering_set.correct
            )
        if self.min_confidence is not None:
            out["min_confidence"] = self.min_confidence
        if self.threshold is not None:
            certified = self.threshold.to_dict()
            out["target_precision"] = {**certified, "certified": self.threshold.certified}
            if not self.threshold.certified:
                out["note"] = (
                    f"{out['note']}; no threshold reaches precision {self.threshold.target:g} at "
                    f"δ = {self.threshold.delta:g} on the calibration's "
                    f"{self.threshold.calibration_size} threshold queries, so every query abstains"
                )
        return out


def _finite_or_none(value: float | None) -> float | None:
    return None if value is None or math.isinf(value) else float(value)
