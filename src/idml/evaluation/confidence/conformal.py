"""Abstention with a guarantee: a confidence threshold whose answers reach a target precision.

Answer a query only when its confidence ``c ≥ λ``. The *precision* of a threshold is the share of
right answers among the answered queries, ``prec(λ) = P(right | c ≥ λ)`` for a new query. Given a
labelled calibration set of ``n`` queries ``(c_i, right_i)``, :func:`precision_threshold` picks
``λ̂`` such that

    ``P( prec(λ̂) ≥ target ) ≥ 1 − δ``   (over the draw of the calibration set),

and, among thresholds it can certify, the one that answers the most calibration queries.

**Method** — Learn then Test (Angelopoulos, Bates, Candès, Jordan & Lei 2021) with exact binomial
p-values and fixed-sequence testing, on two independent sets of labelled queries:

1. **Candidates** (:func:`candidate_thresholds`, from the *ordering set*): a descending sequence
   of thresholds ``λ_1 > λ_2 > …`` — the ordering set's distinct confidences, starting at the one
   where its own binomial p-value (below) is smallest, i.e. where precision is easiest to
   certify. Fixed-sequence testing stops at its first failure, so the sequence must start at a
   threshold that answers enough queries at a high enough precision; the ordering set finds it.
2. **Tests** (:func:`precision_threshold`, on the *testing set*): each ``H_λ: prec(λ) < target``
   gets the p-value ``p(λ) = P(Bin(n_λ, α) ≤ e_λ)``, ``α = 1 − target``, where ``n_λ`` testing
   queries have ``c ≥ λ`` and ``e_λ`` of them are wrong (``p = 1`` when ``n_λ = 0``). Given
   ``n_λ``, those queries are independent draws from the law of queries with ``c ≥ λ``, so
   ``e_λ ~ Bin(n_λ, 1 − prec(λ))``; under ``H_λ`` the error rate exceeds ``α`` and, the binomial
   family being stochastically increasing, ``P(p(λ) ≤ u) ≤ u`` (the one-sided Clopper–Pearson
   test).
3. **Fixed-sequence testing**: walk the candidates in order, reject ``H_λ`` while ``p(λ) ≤ δ``,
   stop at the first failure; ``λ̂`` is the last rejected (``+inf``, abstain on everything, if the
   first already fails). For a sequence fixed before the testing set is seen, the probability of
   rejecting any true ``H_λ`` is at most ``δ`` (a false rejection needs a rejection at the first
   true null of the sequence, itself of probability ``≤ δ``), with no multiplicity correction and
   no assumption on how precision varies with ``λ``. This is why the candidates come from another
   set than the tests.

**Conditions** — the testing queries and the future queries are i.i.d. draws from one distribution
(or, by de Finetti's theorem, an infinite exchangeable sequence: the guarantee then holds for the
long-run precision of the answered future queries), and the confidence function and the candidates
are fixed independently of the testing queries (a calibrator fitted on the ordering set qualifies:
:class:`~idml.evaluation.confidence.calibration.ConfidenceCalibration` keeps the two halves apart).
A calibration set from other classes than the deployed gallery (held-out training classes for unseen
test classes) is *not* exchangeable with it; the guarantee is then a hope that
``benchmarks/study_confidence.py`` measures, not a theorem. ``prec`` is a population quantity: a
finite test set's precision scatters around it.

Example:
    >>> import torch
    >>> g = torch.Generator().manual_seed(0)
    >>> c = torch.rand(2, 2000, generator=g)
    >>> right = torch.rand(2, 2000, generator=g) < 0.5 + 0.5 * c  # P(right | c) = (1 + c) / 2
    >>> order = candidate_thresholds(c[0], right[0], target=0.9, delta=0.1)
    >>> t = precision_threshold(c[1], right[1], order, target=0.9, delta=0.1)
    >>> 0.6 < t.threshold < 0.75, t.calibration_precision >= 0.9  # prec(λ) = (3 + λ)/4 ≥ 0.9 from 0.6
    (True, True)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from scipy.stats import binom
from torch import Tensor


@dataclass(frozen=True)
class PrecisionThreshold:
    """A threshold ``λ̂`` certified to give precision ``≥ target`` with probability ``≥ 1 − δ``
    (module docstring), and what it does on its calibration set."""

    target: float
    delta: float
    threshold: float
    """Answer iff ``confidence ≥ threshold``; ``inf``: no threshold could be certified, abstain."""
    calibration_size: int
    """Calibration queries with a confidence (queries without any neighbour are left out)."""
    calibration_coverage: float
    """Share of the calibration queries answered at ``threshold``."""
    calibration_precision: float
    """Share of right answers among them (NaN when none is answered)."""

    @property
    def certified(self) -> bool:
        """Whether some threshold was certified (else every query abstains)."""
        return math.isfinite(self.threshold)

    def answer(self, confidence: Tensor) -> Tensor:
        """``(Q,)`` bool: which queries to answer (NaN confidences never are)."""
        return torch.as_tensor(confidence).double() >= self.threshold

    def to_dict(self) -> dict[str, float | int | None]:
        def clean(v: float) -> float | None:
            return None if not math.isfinite(v) else v

        return {
            "target": self.target,
            "delta": self.delta,
            "threshold": clean(self.threshold),
            "calibration_size": self.calibration_size,
            "calibration_coverage": self.calibration_coverage,
            "calibration_precision": clean(self.calibration_precision),
        }


def candidate_thresholds(
    confidence: Tensor, correct: Tensor, target: float, delta: float = 0.1
) -> Tensor:
    """The descending candidate thresholds for :func:`precision_threshold`, from an *ordering set*
    of labelled queries independent of the testing set (module docstring, step 1).

    Returns ``(L,)`` float64: the ordering set's distinct confidences from the one whose binomial
    p-value is smallest (the lowest such on ties) down to the smallest (empty without any query).
    """
    c, wrong = _sorted_answers(confidence, correct, target, delta)
    if len(c) == 0:
        return torch.zeros(0, dtype=torch.float64)
    ends, answered, errors = _levels(c, wrong)
    p_values = binom.cdf(errors, answered, 1.0 - target)
    start = len(p_values) - 1 - int(np.argmin(p_values[::-1]))  # the lowest of the minima
    return torch.from_numpy(c[ends[start:]].copy())


def precision_threshold(
    confidence: Tensor,
    correct: Tensor,
    candidates: Tensor,
    target: float,
    delta: float = 0.1,
) -> PrecisionThreshold:
    """The Learn-then-Test threshold for precision ``≥ target`` at risk ``δ`` (module docstring).

    Args:
        confidence: ``(n,)`` confidence of each *testing* query's answer (NaN: no answer; left
            out).
        correct: ``(n,)`` bool, the answer was right.
        candidates: descending thresholds to test in order, fixed independently of these queries
            (:func:`candidate_thresholds` of another set).
        target: the precision to reach, in ``(0, 1)``.
        delta: the allowed probability of missing it, in ``(0, 1)``.
    """
    c, wrong = _sorted_answers(confidence, correct, target, delta)
    n = len(c)
    lam = torch.as_tensor(candidates).double().flatten().numpy()
    if np.any(np.diff(lam) >= 0) or np.any(np.isnan(lam)):
        raise ValueError("candidate thresholds must be strictly decreasing (and not NaN)")
    # Answered at λ: the queries with c ≥ λ, a prefix of the descending order.
    answered = np.searchsorted(-c, -lam, side="right")
    errors = np.concatenate([[0], np.cumsum(wrong)])[answered]
    p_values = binom.cdf(errors, answered, 1.0 - target)
    failed = np.flatnonzero(p_values > delta)
    last = (failed[0] if len(failed) else len(lam)) - 1
    if last < 0 or n == 0:
        return PrecisionThreshold(target, delta, math.inf, n, 0.0, math.nan)
    return PrecisionThreshold(
        target,
        delta,
        float(lam[last]),
        n,
        float(answered[last] / n),
        float(1.0 - errors[last] / answered[last]),
    )


def _sorted_answers(
    confidence: Tensor, correct: Tensor, target: float, delta: float
) -> tuple[np.ndarray, np.ndarray]:
    """Checked arguments: the confidences (NaN left out) in descending order and ``wrong``."""
    if not 0.0 < target < 1.0:
        raise ValueError(f"target precision must lie in (0, 1), got {target}")
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta (the allowed failure probability) must lie in (0, 1), got {delta}")
    c = torch.as_tensor(confidence).double().flatten()
    right = torch.as_tensor(correct).bool().flatten()
    if c.shape != right.shape:
        raise ValueError(
            f"confidence has {c.numel()} values but correct has {right.numel()}; pass one each"
        )
    keep = ~torch.isnan(c)
    values, correct_np = c[keep].numpy(), right[keep].numpy()
    order = np.argsort(-values, kind="stable")
    return values[order], ~correct_np[order]


def _levels(c: np.ndarray, wrong: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each distinct confidence (descending): its last position, the queries answered at it
    and their errors."""
    ends = np.flatnonzero(np.append(c[1:] != c[:-1], True))
    return ends, ends + 1, np.cumsum(wrong)[ends]
