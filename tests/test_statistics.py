"""idml.statistics against scipy's reference tests and hand-computed Holm adjustments."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from idml.statistics import compare_paired, compare_seeds, compare_welch, holm


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_paired_comparison_matches_scipy(seed: int) -> None:
    rng = np.random.default_rng(seed)
    a = rng.normal(70, 2, size=10)
    b = a + rng.normal(0.8, 1.0, size=10)
    c = compare_paired(a, b)
    ref = stats.ttest_rel(b, a)
    # float64 throughout; the only difference is the order of a handful of additions.
    assert c.p_value == pytest.approx(ref.pvalue, rel=1e-9)
    interval = ref.confidence_interval(0.95)
    assert (c.low, c.high) == pytest.approx((interval.low, interval.high), rel=1e-9)
    d = b - a
    assert c.difference == pytest.approx(d.mean(), rel=1e-12)
    assert c.effect_size == pytest.approx(d.mean() / d.std(ddof=1), rel=1e-12)
    assert c.paired and c.n == 10


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_welch_comparison_matches_scipy(seed: int) -> None:
    rng = np.random.default_rng(seed)
    a = rng.normal(70, 1, size=8)
    b = rng.normal(71, 3, size=12)  # unequal sizes and spreads: where Welch differs from Student
    c = compare_welch(a, b)
    ref = stats.ttest_ind(b, a, equal_var=False)
    assert c.p_value == pytest.approx(ref.pvalue, rel=1e-9)
    interval = ref.confidence_interval(0.95)
    assert (c.low, c.high) == pytest.approx((interval.low, interval.high), rel=1e-9)
    pooled = math.sqrt((7 * a.var(ddof=1) + 11 * b.var(ddof=1)) / 18)
    g = (b.mean() - a.mean()) / pooled * (1 - 3 / (4 * 20 - 9))
    assert c.effect_size == pytest.approx(g, rel=1e-12)
    assert not c.paired


def test_untestable_comparisons_say_so() -> None:
    same = compare_paired([1.0, 2.0, 3.0], [2.0, 3.0, 4.0])  # every difference is exactly 1
    assert same.difference == 1.0 and math.isnan(same.p_value)
    assert math.isnan(compare_paired([1.0], [2.0]).p_value)
    assert math.isnan(compare_welch([1.0], [2.0, 3.0]).p_value)
    with pytest.raises(ValueError, match="one value per seed"):
        compare_paired([1.0, 2.0], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="NaN"):
        compare_welch([1.0, math.nan], [1.0, 2.0])


def test_holm_by_hand() -> None:
    # m = 4 valid p-values (0.04, 0.001, 0.03, 0.2) and one untestable cell.
    adjusted = holm([0.04, 0.001, math.nan, 0.03, 0.2])
    # sorted: 0.001·4 = 0.004; 0.03·3 = 0.09; max(0.09, 0.04·2 = 0.08) = 0.09; max(0.09, 0.2) = 0.2
    assert adjusted[1] == pytest.approx(0.004)
    assert adjusted[3] == pytest.approx(0.09)
    assert adjusted[0] == pytest.approx(0.09)
    assert adjusted[4] == pytest.approx(0.2)
    assert math.isnan(adjusted[2])
    assert holm([0.9, 0.8]) == [1.0, 1.0]


def test_significance_follows_the_adjusted_p_value() -> None:
    c = compare_paired([70, 71, 69, 70, 72, 71], [72, 73, 71.5, 72, 74, 72.8])
    assert c.p_value < 0.05 and c.significant()
    assert not c.significant(adjusted_p=0.2)


def test_runs_by_seed_are_paired_only_on_the_same_seeds() -> None:
    reference = [(2, 70.0), (0, 71.5), (1, 69.0)]
    method = [(0, 72.0), (1, 70.5), (2, 71.0)]  # another order: matched by seed, not position
    paired = compare_seeds(reference, method)
    assert paired is not None and paired.paired
    by_seed = compare_paired([71.5, 69.0, 70.0], [72.0, 70.5, 71.0])
    assert paired == by_seed  # the same computation on the same seed-ordered values
    # Other seeds, or a seed run twice: the runs are not pairs, so Welch on every value.
    for other in ([(0, 72.0), (1, 70.5), (3, 71.0)], [(0, 72.0), (0, 70.5), (2, 71.0), (1, 70.0)]):
        unpaired = compare_seeds(reference, other)
        assert unpaired == compare_welch([v for _, v in reference], [v for _, v in other])
    # One run on a side: no spread to test against.
    assert compare_seeds(reference[:1], method) is None
    assert compare_seeds(reference, method[:1]) is None
