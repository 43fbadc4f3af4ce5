"""Is a difference between two methods beyond noise? Comparisons of runs over seeds.

A method "helps" only when it beats its baseline and the controls that isolate it by more than the
seed-to-seed noise, with the chance of a false claim controlled over a whole table. This module
gives the three pieces:

- :func:`compare_paired`: runs whose seeds share the initialisation and the batches (the same
  ``seed`` in two arms of one study) differ by the arm alone, so the per-seed differences
  ``d_s = b_s − a_s`` are what is tested: a paired t-test of ``E d = 0``, the mean difference with
  its t confidence interval ``d̄ ± t_{n−1, 1−α/2}·s_d/√n``, and Cohen's ``d_z = d̄ / s_d``.
- :func:`compare_welch`: unpaired runs (other seeds, other studies): Welch's t-test with the
  Welch–Satterthwaite degrees of freedom, the interval of ``b̄ − ā`` and Hedges' ``g`` (Cohen's
  ``d`` on the pooled standard deviation with the small-sample correction
  ``1 − 3/(4(n_a + n_b) − 9)``).
- :func:`compare_seeds`: the choice between the two for runs given by seed: paired when both
  sides ran the same seeds (matched by seed), Welch otherwise, no test with fewer than two runs a
  side.
- :func:`holm`: Holm's step-down adjustment of the p-values of a family (the cells of a table):
  the ``k``-th smallest of ``m`` p-values becomes ``max_{j ≤ k} min(1, (m − j + 1)·p_(j))``, which
  controls the family-wise error rate at ``α`` under any dependence (Holm 1979).

A difference is *significant* (▲/▼ in the project's tables) when its Holm-adjusted p-value is below
``α = 0.05``.

Example:
    >>> baseline = [77.1, 76.2, 78.0, 75.9, 77.4]
    >>> method = [78.0, 77.5, 78.8, 76.1, 78.9]
    >>> c = compare_paired(baseline, method)
    >>> round(c.difference, 2), c.n, c.paired
    (0.94, 5, True)
    >>> c.low < c.difference < c.high
    True
    >>> [round(p, 6) for p in holm([0.01, 0.04, 0.03])]  # 3·0.01, then 2·0.03, then max(0.06, 0.04)
    [0.03, 0.06, 0.06]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from scipy import stats

# One value per seed: a list, or the numpy array a study holds them in.
SeedValues = Sequence[float] | npt.NDArray[np.floating]

DEFAULT_ALPHA = 0.05
"""The family-wise error rate of a table's claims."""


@dataclass(frozen=True)
class Comparison:
    """Method ``b`` against reference ``a`` on one metric, over seeds.

    ``difference`` is ``mean(b) − mean(a)`` (for paired runs, the mean of the per-seed differences,
    which is the same number); ``low``/``high`` its confidence interval at ``confidence``;
    ``p_value`` the two-sided test of no difference; ``effect_size`` Cohen's ``d_z`` (paired) or
    Hedges' ``g`` (Welch). With fewer than two runs a side, or no spread at all, the test is
    undefined and ``p_value`` is NaN.
    """

    difference: float
    low: float
    high: float
    p_value: float
    effect_size: float
    n: int
    paired: bool
    confidence: float = 0.95

    def significant(self, adjusted_p: float | None = None, alpha: float = DEFAULT_ALPHA) -> bool:
        """Whether the (adjusted, when given) p-value is below ``alpha``."""
        p = self.p_value if adjusted_p is None else adjusted_p
        return bool(p < alpha)


def _values(name: str, values: SeedValues) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1:
        raise ValueError(
            f"{name} must be a flat sequence of per-seed values, got shape {array.shape}"
        )
    if not np.isfinite(array).all():
        raise ValueError(f"{name} holds a NaN or infinite value: {array.tolist()}")
    return array


def compare_paired(
    reference: SeedValues, method: SeedValues, confidence: float = 0.95
) -> Comparison:
    """Paired t-test of ``method − reference`` over seeds given in the same order (seed ``s`` of
    both arms shares its initialisation and batches)."""
    a, b = _values("reference", reference), _values("method", method)
    if a.shape != b.shape:
        raise ValueError(
            f"paired runs need one value per seed on both sides, got {a.size} and {b.size}"
        )
    d = b - a
    n = d.size
    mean = float(d.mean()) if n else math.nan
    sd = float(d.std(ddof=1)) if n > 1 else math.nan
    if n < 2 or sd == 0 or not math.isfinite(sd):
        return Comparison(mean, math.nan, math.nan, math.nan, math.nan, n, True, confidence)
    se = sd / math.sqrt(n)
    t = mean / se
    p = float(2 * stats.t.sf(abs(t), n - 1))
    half = float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * se
    return Comparison(mean, mean - half, mean + half, p, mean / sd, n, True, confidence)


def compare_welch(
    reference: SeedValues, method: SeedValues, confidence: float = 0.95
) -> Comparison:
    """Welch's t-test of ``mean(method) − mean(reference)`` for runs that are not paired."""
    a, b = _values("reference", reference), _values("method", method)
    na, nb = a.size, b.size
    diff = float(b.mean() - a.mean()) if na and nb else math.nan
    if na < 2 or nb < 2:
        return Comparison(
            diff, math.nan, math.nan, math.nan, math.nan, min(na, nb), False, confidence
        )
    va, vb = float(a.var(ddof=1)), float(b.var(ddof=1))
    se2 = va / na + vb / nb
    if se2 == 0:
        return Comparison(
            diff, math.nan, math.nan, math.nan, math.nan, min(na, nb), False, confidence
        )
    se = math.sqrt(se2)
    df = se2**2 / ((va / na) ** 2 / (na - 1) + (vb / nb) ** 2 / (nb - 1))
    p = float(2 * stats.t.sf(abs(diff / se), df))
    half = float(stats.t.ppf(0.5 + confidence / 2, df)) * se
    pooled = math.sqrt(((na - 1) * va + (nb - 1) * vb) / (na + nb - 2))
    g = (diff / pooled) * (1 - 3 / (4 * (na + nb) - 9)) if pooled > 0 else math.nan
    return Comparison(diff, diff - half, diff + half, p, g, min(na, nb), False, confidence)


def compare_seeds(
    reference: Sequence[tuple[int, float]],
    method: Sequence[tuple[int, float]],
    confidence: float = 0.95,
) -> Comparison | None:
    """``method`` against ``reference`` over their runs, each given as ``(seed, value)``.

    Paired (:func:`compare_paired`, seed matched with seed) when both sides hold exactly the same
    seeds, each once: the same ``seed`` shares the initialisation and the batches, so the arm is
    all that differs. Otherwise (other seeds, a seed run twice) Welch's test
    (:func:`compare_welch`). ``None`` when a side has fewer than two runs: there is no spread to
    test against.

    >>> compare_seeds([(0, 70.0), (1, 71.0)], [(1, 72.5), (0, 71.0)]).paired  # d = 1.0, 1.5
    True
    >>> compare_seeds([(0, 70.0), (1, 71.0)], [(0, 71.0), (2, 72.5)]).paired
    False
    >>> compare_seeds([(0, 70.0)], [(0, 71.0), (1, 72.5)]) is None
    True
    """
    if min(len(reference), len(method)) < 2:
        return None
    ref, other = dict(reference), dict(method)
    if len(ref) == len(reference) and len(other) == len(method) and ref.keys() == other.keys():
        seeds = sorted(ref)
        return compare_paired([ref[s] for s in seeds], [other[s] for s in seeds], confidence)
    return compare_welch([v for _, v in reference], [v for _, v in method], confidence)


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm-adjusted p-values, in the order given; NaN p-values (untestable cells) stay NaN and do
    not count in the family."""
    p = np.asarray(p_values, dtype=np.float64)
    adjusted = np.full(p.shape, math.nan)
    valid = np.flatnonzero(~np.isnan(p))
    m = valid.size
    running = 0.0
    for rank, index in enumerate(valid[np.argsort(p[valid], kind="stable")]):
        running = max(running, min(1.0, (m - rank) * float(p[index])))
        adjusted[index] = running
    return [float(v) for v in adjusted]
