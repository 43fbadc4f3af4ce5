"""The abstention threshold's guarantee, checked on synthetic exchangeable data.

Each repetition draws an ordering set and a testing set of ``n`` i.i.d. (confidence, right)
pairs from a model whose population precision ``prec(λ) = P(right | c ≥ λ)`` is known in closed
form (or by exact summation), certifies a threshold for precision ≥ ``target`` at risk δ = 0.1,
and records a violation when ``prec(λ̂) < target``. Learn then Test promises a violation
probability ≤ δ. Over ``R = 1000`` repetitions the violation count of a method that meets it is
at most Bin(1000, 0.1), whose upper 1e-4 quantile is 137: a correct method fails this test with
probability < 1e-4 (the seed is fixed, so it is deterministic here), while a method violating
the target 20 % of the time exceeds 137 with probability > 1 − 1e-15. A naive threshold (the
lowest with empirical precision ≥ target) is checked to exceed it, so the check can fail.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
import torch
from scipy.stats import binom

from idml.evaluation.confidence import candidate_thresholds, precision_threshold

REPETITIONS = 1000
DELTA = 0.1
LIMIT = int(binom.ppf(1 - 1e-4, REPETITIONS, DELTA))


class Model:
    """Confidences on [0, 1] and a chance of being right ``g(c)``: uniform confidences with the
    antiderivative ``G`` of ``g`` given, or equally likely discrete ``levels``."""

    def __init__(
        self,
        g: Callable[[np.ndarray], np.ndarray],
        antiderivative: Callable[[float], float] | None = None,
        levels: np.ndarray | None = None,
    ):
        self.g, self.antiderivative, self.levels = g, antiderivative, levels

    def draw(self, n: int, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        c = rng.random(n) if self.levels is None else rng.choice(self.levels, n)
        return torch.from_numpy(c), torch.from_numpy(rng.random(n) < self.g(c))

    def precision(self, lam: float) -> float:
        """``P(right | c ≥ λ)``, exactly: ``(G(1) − G(λ)) / (1 − λ)``, or the mean over levels."""
        if self.levels is not None:
            return float(self.g(self.levels[self.levels >= lam]).mean())
        if lam >= 1.0:
            return float(self.g(np.array(1.0)))
        assert self.antiderivative is not None
        return (self.antiderivative(1.0) - self.antiderivative(lam)) / (1.0 - lam)


def _smooth(c):
    return 0.5 + 0.5 * c**2


def _smooth_integral(c: float) -> float:
    return 0.5 * c + c**3 / 6


def _dip(c):
    return np.where(c > 0.97, 0.5, _smooth(c))


def _dip_integral(c: float) -> float:
    return _smooth_integral(min(c, 0.97)) + 0.5 * max(c - 0.97, 0.0)


MODELS = {
    # Monotone: prec(λ) = 1/2 + (1 + λ + λ²)/6, from 2/3 at λ = 0 to 1.
    "monotone": Model(_smooth, _smooth_integral),
    # Overconfident errors at the top: precision falls to 1/2 above 0.97.
    "non-monotone": Model(_dip, _dip_integral),
    # Eleven tied confidence levels (a discrete score).
    "discrete": Model(lambda c: 0.5 + 0.45 * c, levels=np.linspace(0.0, 1.0, 11)),
}


def _violations(model: Model, target: float, n: int, seed: int) -> tuple[int, float, int]:
    """(violations, mean coverage of the certified thresholds, naive violations)."""
    rng = np.random.default_rng(seed)
    bad = naive_bad = 0
    coverage = []
    for _ in range(REPETITIONS):
        c_order, right_order = model.draw(n, rng)
        c_test, right_test = model.draw(n, rng)
        candidates = candidate_thresholds(c_order, right_order, target, DELTA)
        chosen = precision_threshold(c_test, right_test, candidates, target, DELTA)
        if chosen.certified:
            coverage.append(chosen.calibration_coverage)
            bad += model.precision(chosen.threshold) < target
        naive_bad += model.precision(_naive(c_test, right_test, target)) < target
    return bad, float(np.mean(coverage)) if coverage else 0.0, naive_bad


def _naive(c: torch.Tensor, right: torch.Tensor, target: float) -> float:
    """The lowest threshold whose empirical precision on the set reaches the target."""
    order = torch.argsort(c, descending=True)
    precision = torch.cumsum(right[order].double(), 0) / torch.arange(1, len(c) + 1)
    ok = torch.nonzero(precision >= target).flatten()
    return float(c[order][ok[-1]]) if len(ok) else 1.0


@pytest.mark.parametrize(
    ("name", "target"),
    [("monotone", 0.8), ("monotone", 0.9), ("non-monotone", 0.8), ("discrete", 0.8)],
)
def test_precision_target_is_met_with_probability_one_minus_delta(name: str, target: float) -> None:
    bad, coverage, naive_bad = _violations(MODELS[name], target, 500, seed=7)
    assert bad <= LIMIT, f"{name}: {bad} violations in {REPETITIONS} (allowed {LIMIT})"
    # The check has teeth: the naive threshold misses the target far more often.
    assert naive_bad > LIMIT, f"{name}: the naive threshold violated only {naive_bad} times"
    # And the certified thresholds answer a useful share (not a vacuous "abstain on all").
    assert coverage > 0.1


def test_threshold_bookkeeping_by_hand() -> None:
    # Ten testing answers, most confident first; the candidates are fixed in advance.
    c = torch.tensor([0.95, 0.9, 0.85, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2], dtype=torch.float64)
    right = torch.tensor([1, 1, 1, 1, 1, 1, 0, 1, 0, 0], dtype=torch.bool)
    candidates = torch.tensor([0.9, 0.7, 0.5, 0.3], dtype=torch.float64)
    # Target 0.5 (α = 0.5): p(0.9) = P(Bin(2, ½) ≤ 0) = 1/4, p(0.7) = P(Bin(5, ½) ≤ 0) = 1/32,
    # p(0.5) = P(Bin(7, ½) ≤ 1) = 8/128, p(0.3) = P(Bin(9, ½) ≤ 2) = 46/512: all ≤ δ = 0.3.
    t = precision_threshold(c, right, candidates, target=0.5, delta=0.3)
    assert (t.threshold, t.calibration_coverage) == (0.3, 0.9)
    assert t.calibration_precision == pytest.approx(7 / 9, abs=1e-15)
    # δ = 0.05: the first candidate already fails (1/4), so nothing is certified …
    none = precision_threshold(c, right, candidates, target=0.5, delta=0.05)
    assert not none.certified and none.answer(torch.tensor([1.0])).tolist() == [False]
    # … while a sequence starting at 0.7 rejects 0.7 (1/32) and stops at 0.5 (8/128 > 0.05).
    t = precision_threshold(c, right, candidates[1:], target=0.5, delta=0.05)
    assert (t.threshold, t.calibration_coverage, t.calibration_precision) == (0.7, 0.5, 1.0)
    assert t.answer(torch.tensor([0.71, 0.69, math.nan])).tolist() == [True, False, False]


def test_candidates_start_where_precision_is_easiest_to_certify() -> None:
    c = torch.tensor([0.9, 0.8, 0.7, 0.6, 0.5, 0.4])
    right = torch.tensor([False, True, True, True, True, False])
    got = candidate_thresholds(c, right, target=0.5, delta=0.1)
    # p-values at 0.9 … 0.4: the smallest is at 0.5 (4 right of 5), so the sequence starts there.
    p = [binom.cdf(e, n, 0.5) for n, e in [(1, 1), (2, 1), (3, 1), (4, 1), (5, 1), (6, 2)]]
    assert int(np.argmin(p)) == 4
    assert got.tolist() == pytest.approx([0.5, 0.4])


def test_bad_arguments_are_explained() -> None:
    c, right = torch.rand(5), torch.ones(5, dtype=torch.bool)
    with pytest.raises(ValueError, match="target precision must lie in"):
        precision_threshold(c, right, torch.tensor([0.5]), target=1.0)
    with pytest.raises(ValueError, match="delta"):
        precision_threshold(c, right, torch.tensor([0.5]), target=0.9, delta=0.0)
    with pytest.raises(ValueError, match="strictly decreasing"):
        precision_threshold(c, right, torch.tensor([0.2, 0.5]), target=0.9)
    with pytest.raises(ValueError, match="4 values but correct has 5"):
        candidate_thresholds(c[:4], right, target=0.9)
