"""Plain metrics and the introspective similarity metric (ISM, IDML Eq. 4–6 and TPAMI Eq. 7)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from idml.metrics import (
    CosineSimilarity,
    EuclideanDistance,
    IntrospectiveMetric,
    ISMVariant,
    Metric,
)

# Tolerances here: every check runs in float64 (unit roundoff 1.1e-16) on expressions of a few
# dozen operations, so rounding, in any summation order a CPU's BLAS or thread count picks, stays
# below ~1e-14 relative. rel/rtol 1e-12 (about 10^4 ulps) therefore holds on any machine; 1e-9 and
# 1e-10 are used where a matrix product of 64-d rows is compared with an elementwise form (another
# summation order on each side, plus cancellation in Gram expansions ||x||² + ||y||² - 2x·y). atol
# 1e-12 .. 1e-15 covers entries that are exactly zero on one side. rtol=0, atol=0 means the same ops.
F64 = torch.float64
SQRT2 = math.sqrt(2.0)


def rand(*shape: int, seed: int = 0, scale: float = 1.0) -> Tensor:
    return scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def ism(base: str, **kwargs: object) -> IntrospectiveMetric:
    plain: Metric = EuclideanDistance() if base == "distance" else CosineSimilarity()
    return IntrospectiveMetric(plain, **kwargs)  # type: ignore[arg-type]


ALL_CONFIGS = [
    {"base": base, "power": power, "variant": variant, "gamma": gamma}
    for base in ("distance", "similarity")
    for power in (1, 2)
    for variant in ("soft", "strict", "dissimilar")
    for gamma in (0.0, 2.0)
]


def config_id(cfg: dict) -> str:
    return f"{cfg['base']}-p{cfg['power']}-{cfg['variant']}-g{cfg['gamma']}"


def build(cfg: dict) -> IntrospectiveMetric:
    return ism(cfg["base"], gamma=cfg["gamma"], power=cfg["power"], variant=cfg["variant"])


# ------------------------------------------------------------------------------ plain metrics
def test_euclidean_matches_cdist_on_normalised_embeddings() -> None:
    x, y = rand(6, 5, seed=1), rand(4, 5, seed=2)
    expected = torch.cdist(F.normalize(x, dim=1), F.normalize(y, dim=1))
    # float64, 5-dim: a Gram expansion vs cdist's direct differences errs by ~ε·|x|²/d ≈ 1e-15 for
    # these O(1) distances; rtol 1e-10, atol 1e-12 (float64 defaults of 1e-7 were far looser).
    rtol, atol = 1e-10, 1e-12
    torch.testing.assert_close(EuclideanDistance()(x, y), expected, rtol=rtol, atol=atol)
    torch.testing.assert_close(
        EuclideanDistance(power=2)(x, y), expected.pow(2), rtol=rtol, atol=atol
    )
    torch.testing.assert_close(
        EuclideanDistance(normalize=False)(x, y), torch.cdist(x, y), rtol=rtol, atol=atol
    )


def test_cosine_matches_torch() -> None:
    x, y = rand(6, 5, seed=1), rand(4, 5, seed=2)
    expected = F.cosine_similarity(x[:, None, :], y[None, :, :], dim=2)
    # float64 5-term dot products of normalised rows, in another order than torch's: a few ε.
    torch.testing.assert_close(CosineSimilarity()(x, y), expected, rtol=1e-12, atol=1e-14)
    assert CosineSimilarity.is_similarity and not EuclideanDistance.is_similarity


@pytest.mark.parametrize("metric", [EuclideanDistance(), CosineSimilarity()], ids=["l2", "cos"])
def test_plain_pairwise_and_paired_agree(metric: Metric) -> None:
    x, y = rand(7, 5, seed=3), rand(7, 5, seed=4)
    # float64, row-wise vs matrix kernels for 5-dim rows: a few ε (distances via a Gram expansion
    # ~ε/d): rtol 1e-10, atol 1e-12.
    torch.testing.assert_close(
        metric.paired(x, y), torch.diagonal(metric(x, y)), rtol=1e-10, atol=1e-12
    )


def test_plain_distance_gradient_is_finite_at_zero_distance() -> None:
    x = rand(4, 3, seed=5)
    x = torch.cat([x, x[:1]]).requires_grad_(True)  # a duplicate row
    EuclideanDistance()(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


# ------------------------------------------------------------------------------ dD/dα
@pytest.mark.parametrize("gamma", [0.0, 0.5, 3.0])
@pytest.mark.parametrize("tau", [1.0, 5.0])
def test_derivative_in_alpha_is_g_of_y(gamma: float, tau: float) -> None:
    """dD_IN/dα = e^{−y}(1 + y), y = (β + γ)/(τα) (IDML, TPAMI Eq. 19–20), by autograd with α a leaf."""
    metric = ism("distance", gamma=gamma, tau=tau)
    alpha = torch.tensor([0.05, 0.3, 0.9, 1.4, 1.99], dtype=F64).repeat(4).requires_grad_(True)
    beta = torch.tensor([0.0, 0.2, 1.0, 4.0], dtype=F64).repeat_interleave(5)
    d = metric.weaken(alpha, alpha, beta)
    (grad,) = torch.autograd.grad(d.sum(), alpha)
    y = (beta + gamma) / (tau * alpha.detach())
    # float64 closed forms: an exp and a few products apart, a few ε: rtol 1e-12.
    torch.testing.assert_close(grad, torch.exp(-y) * (1 + y), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(d.detach(), alpha.detach() * torch.exp(-y), rtol=1e-12, atol=0)
    assert (grad > 0).all() and (grad <= 1).all()
    certain = (beta + gamma) == 0
    assert (grad[certain] == 1).all() and (grad[~certain] < 1).all()


def test_derivative_in_alpha_with_power_two() -> None:
    """Power 2: y = (β² + γ)/(τα²), so dD/dα = e^{−y}(1 + 2y)."""
    metric = ism("distance", gamma=0.4, tau=5.0, power=2)
    alpha = torch.tensor([0.2, 0.7, 1.3], dtype=F64, requires_grad=True)
    beta = torch.tensor([0.5, 0.1, 2.0], dtype=F64)
    (grad,) = torch.autograd.grad(metric.weaken(alpha, alpha, beta).sum(), alpha)
    y = (beta**2 + 0.4) / (5.0 * alpha.detach() ** 2)
    # float64 closed form, a few roundings: rtol 1e-12.
    torch.testing.assert_close(grad, torch.exp(-y) * (1 + 2 * y), rtol=1e-12, atol=0)


def test_gradient_shrinks_as_uncertainty_grows() -> None:
    metric = ism("distance", gamma=0.0)
    alpha = torch.full((6,), 0.8, dtype=F64, requires_grad=True)
    beta = torch.tensor([0.0, 0.1, 0.5, 1.0, 3.0, 10.0], dtype=F64)
    (grad,) = torch.autograd.grad(metric.weaken(alpha, alpha, beta).sum(), alpha)
    assert (grad.diff() < 0).all()


# ------------------------------------------------------------------------------ reduction
@pytest.mark.parametrize("base", ["distance", "similarity"])
@pytest.mark.parametrize("variant", ["soft", "dissimilar"])
def test_zero_bias_and_zero_uncertainty_is_exactly_the_plain_metric(
    base: str, variant: str
) -> None:
    for dtype in (torch.float32, F64):
        x, y = rand(9, 6, seed=6).to(dtype), rand(5, 6, seed=7).to(dtype)
        metric = ism(base, gamma=0.0, variant=variant)
        plain = metric.base
        assert torch.equal(metric(x), plain(x))
        assert torch.equal(metric(x, ux=torch.zeros(9, 3, dtype=dtype)), plain(x))
        assert torch.equal(
            metric(x, y, torch.zeros(9, 3, dtype=dtype), torch.zeros(5, 3, dtype=dtype)),
            plain(x, y),
        )
        assert torch.equal(metric(x, y), plain(x, y))  # proxies: no uncertainty on either side
        zeros = torch.zeros(5, 3, dtype=dtype)
        assert torch.equal(metric.paired(x[:5], y, zeros, zeros), plain.paired(x[:5], y))


# ------------------------------------------------------------------------------ β = ||u_i + u_j||
def test_beta_adds_uncertainty_vectors_before_the_norm() -> None:
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=F64)
    opposite = torch.tensor([[1.0, 0.0], [-1.0, 0.0]], dtype=F64)  # ||u_i + u_j|| = 0, norms sum 2
    aligned = torch.tensor([[1.0, 0.0], [1.0, 0.0]], dtype=F64)  # ||u_i + u_j|| = 2
    metric = ism("distance", gamma=0.0, tau=5.0)
    # float64 hand values (an exp and a square root): a few ε, rel 1e-12.
    assert metric(x, ux=opposite)[0, 1].item() == pytest.approx(SQRT2, rel=1e-12)
    assert metric(x, ux=aligned)[0, 1].item() == pytest.approx(
        SQRT2 * math.exp(-2.0 / (5.0 * SQRT2)), rel=1e-12
    )
    # Same with a separate reference side, and row-aligned.
    # float64, a square root of a 2-term sum: a few ε, rel 1e-12 (approx's default 1e-6 was loose).
    assert metric(x[:1], x[1:], opposite[:1], opposite[1:]).item() == pytest.approx(
        SQRT2, rel=1e-12
    )
    assert metric.paired(x[:1], x[1:], opposite[:1], opposite[1:]).item() == pytest.approx(
        SQRT2, rel=1e-12
    )


def test_one_sided_uncertainty_uses_that_side_only() -> None:
    x, p = rand(3, 4, seed=8), rand(2, 4, seed=9)
    ux = rand(3, 5, seed=10)
    metric = ism("similarity", gamma=0.0)
    alpha = torch.cdist(F.normalize(x, dim=1), F.normalize(p, dim=1))
    cos = F.normalize(x, dim=1) @ F.normalize(p, dim=1).T
    beta = ux.norm(dim=1, keepdim=True)
    expected = 1 - (1 - cos) * torch.exp(-beta / (5.0 * alpha))
    # float64, the same formula through another kernel (cosines of a few-dim dot products, an exp):
    # ≲ 10ε relative; rtol 1e-10, atol 1e-12.
    torch.testing.assert_close(metric(x, p, ux, None), expected, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------------ monotonicity
@pytest.mark.parametrize("base", ["distance", "similarity"])
def test_value_moves_toward_alike_as_joint_uncertainty_grows(base: str) -> None:
    x = rand(2, 6, seed=11)
    direction = rand(2, 4, seed=12)
    metric = ism(base, gamma=0.0)
    values = torch.stack(
        [metric(x, ux=t * direction)[0, 1] for t in (0.0, 0.1, 0.5, 1.0, 2.0, 5.0)]
    )
    if base == "distance":
        assert (values.diff() < 0).all() and (values > 0).all()
    else:
        assert (values.diff() > 0).all() and (values < 1).all()


# ------------------------------------------------------------------------------ α = 0
@pytest.mark.parametrize("cfg", ALL_CONFIGS, ids=config_id)
def test_finite_value_and_gradient_at_zero_distance(cfg: dict) -> None:
    base = rand(5, 6, seed=13)
    sem = torch.cat([base, base[:2]]).requires_grad_(True)  # rows 5, 6 duplicate rows 0, 1
    unc = rand(7, 4, seed=14).requires_grad_(True)
    metric = build(cfg)
    for value in (metric(sem, ux=unc), metric.paired(sem[:2], sem[5:], unc[:2], unc[5:])):
        assert torch.isfinite(value).all()
        grads = torch.autograd.grad(value.sum(), [sem, unc], allow_unused=True)
        assert all(g is None or torch.isfinite(g).all() for g in grads)
    matrix = metric(sem, ux=unc).detach()
    if cfg["variant"] == "soft":  # D → 0 and S → 1 as α → 0
        target = 1.0 if cfg["base"] == "similarity" else 0.0
        # Not rounding: α of a duplicate pair is ~√ε·|x| ≈ 1e-8 in float64 and floored at 10⁻⁶, so
        # |D| and |1 − S| stay below 10⁻⁶.
        assert torch.diagonal(matrix).sub(target).abs().max() < 1e-6
        assert (matrix[0, 5] - target).abs() < 1e-6


def test_finite_gradient_at_zero_distance_without_any_uncertainty() -> None:
    x = rand(3, 4, seed=15)
    sem = torch.cat([x, x]).requires_grad_(True)
    for base in ("distance", "similarity"):
        (grad,) = torch.autograd.grad(ism(base, gamma=0.0)(sem).sum(), sem)
        assert torch.isfinite(grad).all()


# ------------------------------------------------------------------------------ bounds
@pytest.mark.parametrize("gamma", [0.0, 3.0])
def test_similarity_form_never_exceeds_one(gamma: float) -> None:
    x = rand(40, 8, seed=16)
    x[1] = x[0] * 3.0  # cosine exactly 1 up to rounding
    for scale in (0.01, 1.0, 100.0):
        s = ism("similarity", gamma=gamma)(x, ux=rand(40, 8, seed=17, scale=scale))
        c = CosineSimilarity()(x)
        assert (s <= 1).all()
        assert (s >= c - 1e-12).all()  # uncertainty only pulls toward 1


@settings(max_examples=200, deadline=None)
@given(
    alpha=st.floats(1e-4, 2.0),
    beta=st.floats(0.0, 50.0),
    gamma=st.floats(0.0, 5.0),
    tau=st.floats(0.05, 20.0),
    cosine=st.floats(-1.0, 1.0),
)
def test_ism_bounds_property(
    alpha: float, beta: float, gamma: float, tau: float, cosine: float
) -> None:
    a = torch.tensor([alpha], dtype=F64, requires_grad=True)
    b = torch.tensor([beta], dtype=F64)
    dist = ism("distance", gamma=gamma, tau=tau)
    d = dist.weaken(a, a, b)
    (g,) = torch.autograd.grad(d.sum(), a)
    assert 0.0 <= d.item() <= alpha
    assert 0.0 <= g.item() <= 1.0
    c = torch.tensor([cosine], dtype=F64)
    s = ism("similarity", gamma=gamma, tau=tau).weaken(c, torch.tensor([alpha], dtype=F64), b)
    assert cosine - 1e-15 <= s.item() <= 1.0
    s_dis = ism("similarity", gamma=gamma, tau=tau, variant="dissimilar").weaken(
        c, torch.tensor([alpha], dtype=F64), b
    )
    assert -1.0 <= s_dis.item() <= cosine + 1e-15


# ------------------------------------------------------------------------------ hand cases
# x_i = e1, x_j = e2 (α = √2, C = 0); u_i = (0.3, 0), u_j = (0, 0.4): β = 0.5 (not 0.7).
HAND_X = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=F64)
HAND_U = torch.tensor([[0.3, 0.0], [0.0, 0.4]], dtype=F64)
Y1 = (0.5 + 0.1) / (5.0 * SQRT2)  # power 1, γ = 0.1, τ = 5
Y2 = (0.25 + 0.1) / (5.0 * 2.0)  # power 2


@pytest.mark.parametrize(
    ("base", "kwargs", "expected"),
    [
        ("distance", {"power": 1}, SQRT2 * math.exp(-Y1)),
        ("distance", {"power": 2}, SQRT2 * math.exp(-Y2)),
        ("similarity", {"power": 1}, 1 - math.exp(-Y1)),
        ("similarity", {"power": 2}, 1 - math.exp(-Y2)),
        ("distance", {"variant": "dissimilar"}, 2 - (2 - SQRT2) * math.exp(-Y1)),
        ("similarity", {"variant": "dissimilar"}, -1 + math.exp(-Y1)),
        # strict: α − β − γ = 1.414 − 0.6 > 0 keeps the plain value ...
        ("distance", {"variant": "strict"}, SQRT2),
        ("similarity", {"variant": "strict"}, 0.0),
        # ... and with power 2 α² − β² − γ = 2 − 0.25 − 0.1 > 0 as well.
        ("distance", {"variant": "strict", "power": 2}, SQRT2),
    ],
)
def test_hand_computed_variants(base: str, kwargs: dict, expected: float) -> None:
    metric = ism(base, gamma=0.1, tau=5.0, **kwargs)
    # float64 hand values (an exp, a square root, a few products): rel 1e-12; abs 1e-15 for zeros.
    assert metric(HAND_X, ux=HAND_U)[0, 1].item() == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert metric.paired(HAND_X[:1], HAND_X[1:], HAND_U[:1], HAND_U[1:]).item() == pytest.approx(
        expected, rel=1e-12, abs=1e-15
    )


def test_strict_variant_drops_pairs_inside_the_uncertainty() -> None:
    # γ = 1: α − β − γ = 1.414 − 1.5 < 0, so the pair counts as identical (D = 0, S = 1).
    assert ism("distance", gamma=1.0, variant="strict")(HAND_X, ux=HAND_U)[0, 1].item() == 0.0
    assert ism("similarity", gamma=1.0, variant="strict")(HAND_X, ux=HAND_U)[0, 1].item() == 1.0
    # power 2: α² − β² − γ = 2 − 0.25 − 1.8 < 0 while power 1 keeps it (1.414 − 0.5 − 1.8 < 0 too).
    assert ism("distance", gamma=1.8, variant="strict", power=2)(HAND_X, ux=HAND_U)[0, 1] == 0.0
    assert ism("distance", gamma=1.7, variant="strict", power=2)(HAND_X, ux=HAND_U)[
        0, 1
    ].item() == pytest.approx(SQRT2, rel=1e-12)  # float64 √2 via a 2-term sum: a few ε


def test_similarity_delta_on_raw_vectors_when_not_normalised() -> None:
    x = torch.tensor([[2.0, 0.0]], dtype=F64)
    p = torch.tensor([[0.0, 3.0]], dtype=F64)
    u = torch.tensor([[0.5, 0.0]], dtype=F64)
    metric = ism("similarity", gamma=0.0, tau=5.0, delta_normalized=False)
    expected = 1 - math.exp(-0.5 / (5.0 * math.sqrt(13.0)))  # δ = ||(2, −3)||, C = 0
    # float64 hand value, one exp and a square root: rel 1e-12.
    assert metric(x, p, u, None).item() == pytest.approx(expected, rel=1e-12)


# ------------------------------------------------------------------------------ paired vs pairwise
@pytest.mark.parametrize("cfg", ALL_CONFIGS, ids=config_id)
def test_pairwise_and_paired_agree(cfg: dict) -> None:
    x, y = rand(8, 6, seed=18), rand(8, 6, seed=19)
    ux, uy = rand(8, 3, seed=20), rand(8, 3, seed=21)
    metric = build(cfg)
    # float64, row-wise vs matrix kernels of 6-dim rows, through an exp of up to ~(β/α)·ε: rtol 1e-9.
    torch.testing.assert_close(
        metric.paired(x, y, ux, uy), torch.diagonal(metric(x, y, ux, uy)), rtol=1e-9, atol=1e-12
    )
    torch.testing.assert_close(
        metric.paired(x, y, ux, None), torch.diagonal(metric(x, y, ux, None)), rtol=1e-9, atol=1e-12
    )


def test_direction_flags() -> None:
    assert ism("similarity").is_similarity and not ism("distance").is_similarity
    assert ism("distance").more_similar(torch.tensor(0.1), torch.tensor(0.2))
    assert ism("similarity").worst_value == float("-inf")
    assert ISMVariant("strict") is ISMVariant.STRICT


# ------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    ("factory", "match"),
    [
        (lambda: ism("distance", gamma=-1.0), "gamma"),
        (lambda: ism("distance", tau=0.0), "tau"),
        (lambda: ism("distance", power=3), "power"),
        (lambda: EuclideanDistance(power=3), "power"),
        (lambda: IntrospectiveMetric(EuclideanDistance(power=2)), "power=1"),
        (lambda: IntrospectiveMetric(ism("distance")), "plain metric"),
        (lambda: ism("distance", variant="fuzzy"), "fuzzy"),
    ],
)
def test_bad_configuration_raises(factory: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        factory()  # type: ignore[operator]


# ------------------------------------------------------------------------------ gradients
# IntrospectiveMetric computes β = ||u_i + u_j|| from a Gram matrix and the weakening on whole
# matrices, with clamps at α = 0 and β = 0. These tests hold it against finite differences
# (gradcheck, float64) and against the ISM formulas written directly on explicitly enumerated pairs.
FORMS = [
    (similarity, variant, power, gamma)
    for similarity in (False, True)
    for variant in ("soft", "dissimilar")
    for power in (1, 2)
    for gamma in (0.0, 0.5)
]


def form_id(form: tuple) -> str:
    similarity, variant, power, gamma = form
    return f"{'sim' if similarity else 'dist'}-{variant}-p{power}-g{gamma}"


def reference_weaken(
    plain: Tensor,
    alpha: Tensor,
    beta: Tensor,
    similarity: bool,
    variant: str,
    gamma: float,
    tau: float,
    power: int,
) -> Tensor:
    """``t + (P − t)·exp(−(β^p + γ)/(τ·max(α, 10⁻⁶)^p))`` with autograd ops."""
    y = (beta**power + gamma) / (tau * alpha.clamp_min(1e-6) ** power)
    # The limit at full uncertainty: soft forms go to "alike", ISM-Dis to "unlike" (d_max = 2).
    limits = {("soft", False): 0.0, ("soft", True): 1.0, ("dissimilar", False): 2.0}
    target = limits.get((variant, similarity), -1.0)
    return target + (plain - target) * torch.exp(-y)


def form_metric(form: tuple, tau: float = 5.0) -> IntrospectiveMetric:
    similarity, variant, power, gamma = form
    return ism(
        "similarity" if similarity else "distance",
        gamma=gamma,
        tau=tau,
        power=power,
        variant=variant,
    )


def weakening_case(
    form: tuple, rows: int, cols: int, seed: int, certain_pairs: bool = False
) -> tuple[Callable[..., Tensor], tuple[Tensor, ...]]:
    """``metric.weaken`` of one ISM form (τ = 0.7) and float64 leaf inputs for autograd checks:
    ``(cos, α, β)`` for the similarity form; ``(α, β)`` for the distance form, which weakens α
    itself, so both of its paths meet in one gradient. ``certain_pairs`` zeroes two β."""
    similarity, *_ = form
    metric = form_metric(form, tau=0.7)
    alpha = 0.05 + 2 * torch.rand(
        rows, cols, dtype=F64, generator=torch.Generator().manual_seed(seed)
    )
    beta = 3 * rand(rows, cols, seed=seed + 1).abs()
    if certain_pairs:
        beta[0, :2] = 0.0
    alpha.requires_grad_(True)
    beta.requires_grad_(True)
    if similarity:
        cosine = (
            2 * torch.rand(rows, cols, dtype=F64, generator=torch.Generator().manual_seed(seed + 2))
            - 1
        )
        return metric.weaken, (cosine.requires_grad_(True), alpha, beta)
    return (lambda a, b: metric.weaken(a, a, b)), (alpha, beta)


@pytest.mark.parametrize("form", FORMS, ids=form_id)
def test_weakening_backward_passes_gradcheck(form: tuple) -> None:
    weaken, inputs = weakening_case(form, 4, 5, seed=22, certain_pairs=True)
    assert torch.autograd.gradcheck(weaken, inputs)
    # One-sided uncertainty broadcasts β over the columns.
    metric = form_metric(form, tau=0.7)
    alpha, beta = inputs[-2:]
    column = beta[:, :1].detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: metric.weaken(a, a, b), (alpha, column))


@pytest.mark.parametrize("form", FORMS, ids=form_id)
def test_weakening_matches_the_autograd_formula_including_the_alpha_floor(form: tuple) -> None:
    similarity, variant, power, gamma = form
    metric = form_metric(form)
    # α at, below and just above the 10⁻⁶ floor, where the clamp passes no gradient.
    alpha = torch.tensor([0.0, 5e-7, 1e-6, 1.1e-6, 0.01, 0.4, 1.3, 2.0], dtype=F64)
    beta = torch.tensor([0.0, 0.0, 1e-7, 0.2, 0.0, 0.7, 2.5, 1e-3], dtype=F64)
    plain = torch.linspace(-0.9, 0.95, 8, dtype=F64) if similarity else alpha
    upstream = torch.linspace(-1.0, 2.0, 8, dtype=F64)
    results = []
    for weaken in (metric.weaken, reference_weaken):
        a, b = alpha.clone().requires_grad_(True), beta.clone().requires_grad_(True)
        p = plain.clone().requires_grad_(True) if similarity else a
        args = (similarity, variant, gamma, 5.0, power) if weaken is reference_weaken else ()
        value = weaken(p, a, b, *args)
        grads = torch.autograd.grad(value, (p, a, b) if similarity else (a, b), upstream)
        results.append((value, *grads))
    # float64 elementwise formulas (ours vs the reference weaken), values and gradients a few ε apart.
    for ours, expected in zip(*results):
        torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-15)


def pairwise_reference(
    form: tuple,
    x: Tensor,
    y: Tensor,
    ux: Tensor | None,
    uy: Tensor | None,
    rows: Tensor,
    cols: Tensor,
) -> Tensor:
    """ISM values of the listed pairs ``(x[rows], y[cols])`` from row differences, not Gram matrices."""
    similarity, variant, power, gamma = form
    xs, ys = F.normalize(x, dim=1)[rows], F.normalize(y, dim=1)[cols]
    alpha = (xs - ys).norm(dim=1)
    joint = (ux[rows] if ux is not None else 0) + (uy[cols] if uy is not None else 0)
    beta = joint.norm(dim=1) if isinstance(joint, Tensor) else torch.zeros_like(alpha)
    plain = (xs * ys).sum(1) if similarity else alpha
    return reference_weaken(plain, alpha, beta, similarity, variant, gamma, 5.0, power)


def all_pairs_of(rows: int, cols: int) -> tuple[Tensor, Tensor]:
    grid = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    return grid[0].reshape(-1), grid[1].reshape(-1)


@pytest.mark.parametrize("form", FORMS, ids=form_id)
def test_pairwise_ism_gradients_match_the_pair_by_pair_formula(form: tuple) -> None:
    """Self pairs (one uncertainty tensor on both sides), cross pairs and one-sided uncertainty, all gradients."""
    metric = form_metric(form)
    x, y = rand(7, 6, seed=24), rand(5, 6, seed=25)
    ux, uy = rand(7, 4, seed=26, scale=0.5), rand(5, 4, seed=27, scale=0.5)
    self_weights = rand(7, 7, seed=28)
    self_weights.fill_diagonal_(0.0)  # α_ii = 0 has no derivative; the diagonal is tested above
    cross_weights = rand(7, 5, seed=29)

    def compare(ours: Callable[..., Tensor], reference: Callable[..., Tensor], *inputs: Tensor):
        results = []
        for run in (ours, reference):
            leaves = [t.clone().requires_grad_(True) for t in inputs]
            value = run(*leaves)
            results.append((value, *torch.autograd.grad(value, leaves)))
        # float64, Gram-matrix vs pair-by-pair values of 6-dim rows and their gradients: sums of
        # ≤ 7·6 terms in other orders, amplified ~1/α through distances: rtol 1e-10, atol 1e-12.
        for mine, expected in zip(*results):
            torch.testing.assert_close(mine, expected, rtol=1e-10, atol=1e-12)

    pairs = self_weights.nonzero(as_tuple=True)
    compare(
        lambda a, ua: (metric(a, ux=ua) * self_weights).sum(),
        lambda a, ua: (pairwise_reference(form, a, a, ua, ua, *pairs) * self_weights[pairs]).sum(),
        x,
        ux,
    )
    pairs = all_pairs_of(7, 5)
    compare(
        lambda a, b, ua, ub: (metric(a, b, ua, ub) * cross_weights).sum(),
        lambda a, b, ua, ub: (
            pairwise_reference(form, a, b, ua, ub, *pairs) * cross_weights[pairs]
        ).sum(),
        x,
        y,
        ux,
        uy,
    )
    compare(
        lambda a, b, ua: (metric(a, b, ua, None) * cross_weights).sum(),
        lambda a, b, ua: (
            pairwise_reference(form, a, b, ua, None, *pairs) * cross_weights[pairs]
        ).sum(),
        x,
        y,
        ux,
    )


@pytest.mark.parametrize("form", FORMS[:4], ids=form_id)
def test_pairwise_ism_passes_gradcheck_between_distinct_sets(form: tuple) -> None:
    metric = form_metric(form)
    inputs = tuple(
        t.requires_grad_(True)
        for t in (
            rand(4, 5, seed=31),
            rand(3, 5, seed=32),
            rand(4, 3, seed=33),
            rand(3, 3, seed=34),
        )
    )
    assert torch.autograd.gradcheck(metric, inputs)


def test_joint_uncertainty_matches_broadcast_norms_and_gradcheck() -> None:
    from idml.metrics import pairwise_uncertainty

    u, v = rand(6, 4, seed=35).requires_grad_(True), rand(5, 4, seed=36).requires_grad_(True)
    weights = rand(6, 5, seed=37)
    for left, right, w in ((u, u, rand(6, 6, seed=38)), (u, v, weights)):
        ours = pairwise_uncertainty(left, right, len(left), len(right), left)
        expected = (left[:, None, :] + right[None, :, :]).norm(dim=2)
        # float64 norms of 4-dim sums (Gram form vs direct): ~ε·|u|²/β ≈ 1e-15; also for gradients.
        torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-14)
        leaves = (u,) if right is left else (u, v)
        torch.testing.assert_close(
            torch.autograd.grad((ours * w).sum(), leaves),
            torch.autograd.grad((expected * w).sum(), leaves),
            rtol=1e-12,
            atol=1e-14,
        )
    assert torch.autograd.gradcheck(lambda a: pairwise_uncertainty(a, a, 6, 6, a), (u,))
    assert torch.autograd.gradcheck(lambda a, b: pairwise_uncertainty(a, b, 6, 5, a), (u, v))


def test_one_sided_uncertainty_norm_matches_torch_and_gradcheck() -> None:
    from idml.metrics import pairwise_uncertainty

    u = rand(6, 4, seed=39)
    u[2] = 0.0  # a zero row: β = 0 with a zero gradient, as torch's norm
    u.requires_grad_(True)
    w = rand(6, 5, seed=40)
    for side in ("rows", "columns"):
        if side == "rows":
            ours = pairwise_uncertainty(u, None, 6, 5, u)
            expected = u.norm(dim=1, keepdim=True).expand(6, 5)
            weight = w
        else:
            ours = pairwise_uncertainty(None, u, 5, 6, u)
            expected = u.norm(dim=1).unsqueeze(0).expand(5, 6)
            weight = w.T
        # Exact: one side absent, both are the same u.norm(dim=1) broadcast.
        torch.testing.assert_close(ours, expected, rtol=0, atol=0)
        (got,) = torch.autograd.grad((ours * weight).sum(), u)
        (want,) = torch.autograd.grad((expected * weight).sum(), u)
        # float64 gradients of weighted sums of ≤ 6 norms, in another order: a few ε.
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
        assert torch.equal(got[2], torch.zeros(4, dtype=F64))
    nonzero = rand(6, 4, seed=41).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a: pairwise_uncertainty(a, None, 6, 3, a), (nonzero,))
    assert torch.autograd.gradcheck(lambda a: pairwise_uncertainty(None, a, 3, 6, a), (nonzero,))


def test_joint_uncertainty_is_zero_with_zero_gradient_for_opposite_vectors() -> None:
    from idml.metrics import pairwise_uncertainty

    u = torch.tensor([[0.3, -0.4], [-0.3, 0.4], [1.0, 0.0]], dtype=F64, requires_grad=True)
    beta = pairwise_uncertainty(u, u, 3, 3, u)
    assert beta[0, 1].item() == 0.0 and beta[1, 0].item() == 0.0
    only_zero_pair = torch.zeros(3, 3, dtype=F64)
    only_zero_pair[0, 1] = 1.0
    (grad,) = torch.autograd.grad((beta * only_zero_pair).sum(), u)
    assert torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.parametrize("form", FORMS, ids=form_id)
def test_weakening_is_twice_differentiable(form: tuple) -> None:
    """Plain autograd all the way: second derivatives (e.g. a gradient penalty) are exact too."""
    weaken, inputs = weakening_case(form, 3, 4, seed=44)
    assert torch.autograd.gradgradcheck(weaken, inputs)


def composite_ism(form: tuple, x: Tensor, u: Tensor) -> Tensor:
    """The self-pair ISM matrix from autograd ops alone: Gram expansions, double-``where`` square
    roots, ``δ = √max(2 − 2C, 10⁻¹²)`` and the clamped exponent (the semantics at α = 0 and β = 0)."""
    similarity, variant, power, gamma = form

    def safe_sqrt(sq: Tensor) -> Tensor:
        positive = sq.clamp_min(0) > 1e-12
        return torch.where(positive, torch.where(positive, sq, 1.0).sqrt(), 0.0)

    unit = F.normalize(x, dim=1)
    cosine = unit @ unit.T
    norms = u.pow(2).sum(1)
    beta = safe_sqrt(norms[:, None] + norms[None, :] + 2 * u @ u.T)
    if similarity:
        alpha = (2 - 2 * cosine).clamp_min(1e-12).sqrt()
        return reference_weaken(cosine, alpha, beta, similarity, variant, gamma, 5.0, power)
    alpha = safe_sqrt(2 - 2 * cosine)
    return reference_weaken(alpha, alpha, beta, similarity, variant, gamma, 5.0, power)


@pytest.mark.parametrize("form", FORMS, ids=form_id)
def test_self_pair_matrix_matches_the_composite_at_zero_distance_and_zero_uncertainty(
    form: tuple,
) -> None:
    """Duplicate rows (α = 0 off the diagonal too) and opposite uncertainties (β = 0), gradients
    over the whole matrix, the diagonal included."""
    base = rand(5, 6, seed=39)
    x = torch.cat([base, base[:2]])
    u = rand(7, 4, seed=40, scale=0.5)
    u[4] = -u[3]  # β_34 = 0
    weights = rand(7, 7, seed=41)
    results = []
    for run in (
        lambda a, ua: form_metric(form)(a, ux=ua),
        lambda a, ua: composite_ism(form, a, ua),
    ):
        leaves = [x.clone().requires_grad_(True), u.clone().requires_grad_(True)]
        value = run(*leaves)
        results.append((value, *torch.autograd.grad((value * weights).sum(), leaves)))
    for ours, expected in zip(*results):
        assert torch.isfinite(ours).all()
        # float64, matrix ISM vs the composite, with α = 0 and β = 0 entries on the clamps:
        # rtol 1e-10, atol 1e-12.
        torch.testing.assert_close(ours, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("base", ["distance", "similarity"])
def test_gradient_reaches_the_uncertainty_alone_when_the_semantic_side_is_frozen(base: str) -> None:
    """Only u requires a gradient (e.g. a frozen backbone): self pairs, the diagonal included."""
    metric = ism(base, gamma=0.5)
    x = rand(5, 3, seed=42)
    u = rand(5, 2, seed=43).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda uu: metric(x, ux=uu), (u,))


def test_safe_norm_from_squares_zeroes_tiny_and_negative_squares_with_zero_gradient() -> None:
    from idml.metrics import safe_norm_from_squares

    squared = torch.tensor([-1e-3, 0.0, 1e-13, 1e-12, 4e-12, 0.25, 9.0], dtype=F64)
    squared.requires_grad_(True)
    root = safe_norm_from_squares(squared)
    expected = torch.tensor([0.0, 0.0, 0.0, 0.0, 2e-6, 0.5, 3.0], dtype=F64)
    # float64 square roots are correctly rounded; with the input's own rounding ≤ ε ≈ 2.2e-16: 1e-15.
    torch.testing.assert_close(root.detach(), expected, rtol=1e-15, atol=0)
    (grad,) = torch.autograd.grad(root, squared, torch.ones_like(root))
    # d√s/ds = 1/(2√s) above 10⁻¹², else 0.
    expected_grad = torch.tensor([0.0, 0.0, 0.0, 0.0, 2.5e5, 1.0, 1 / 6], dtype=F64)
    # float64 1/(2√s): two roundings and the input's: rtol 1e-12.
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=0)
    assert torch.autograd.gradcheck(
        safe_norm_from_squares, (squared[-2:].detach().requires_grad_(),)
    )
