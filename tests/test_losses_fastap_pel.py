"""FastAP (oracle: pytorch-metric-learning 2.9) and the PEL/HIB baseline (hand-computed references)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from pytorch_metric_learning import losses as pml_losses

from idml.embeddings import Embeddings
from idml.losses.fastap import FastAPLoss
from idml.losses.pel import (
    PELLoss,
    PELParams,
    SamplePairing,
    match_log_probabilities,
    match_probability,
)
from idml.metrics import CosineSimilarity, EuclideanDistance, IntrospectiveMetric
from idml.relations import LabelSets

DIM = 8
LABEL_CASES: dict[str, list[int]] = {
    "7x3": [c for c in range(7) for _ in range(3)],
    "4x5": [c for c in range(4) for _ in range(5)],
    # class 4 has a single image: an anchor without positives, left out of the mean.
    "unbalanced": [0, 1, 1, 1, 1, 1, 1, 3, 3, 4, 8, 8, 8],
}
SEEDS = [0, 1, 2]


# ======================================================================================== FastAP
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case", list(LABEL_CASES))
def test_fastap_matches_pytorch_metric_learning(case: str, seed: int) -> None:
    labels = torch.tensor(LABEL_CASES[case])
    x = torch.randn(
        len(labels), DIM, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )
    x_ours, x_oracle = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ours = FastAPLoss()(x_ours, labels)
    oracle = pml_losses.FastAPLoss(num_bins=10)(x_oracle, labels)
    ours.backward()
    oracle.backward()
    # float64 on both sides (measured: equal); rtol 1e-5 leaves room for another summation order of
    # the histogram on another CPU, and still fails a wrong bin width or count (> 1e-2).
    torch.testing.assert_close(ours, oracle, rtol=1e-5, atol=1e-10)
    torch.testing.assert_close(x_ours.grad, x_oracle.grad, rtol=1e-5, atol=1e-10)
    assert 0 < ours.item() < 1
    assert x_ours.grad is not None and x_ours.grad.abs().sum() > 0


def test_fastap_matches_pml_with_other_bin_counts() -> None:
    labels = torch.tensor(LABEL_CASES["4x5"])
    x = torch.randn(
        len(labels), DIM, generator=torch.Generator().manual_seed(9), dtype=torch.float64
    )
    for bins in (1, 3, 25):
        ours = FastAPLoss(num_bins=bins)(x, labels)
        oracle = pml_losses.FastAPLoss(num_bins=bins)(x, labels)
        # As above: float64 on both sides, 1e-5 for another histogram summation order.
        torch.testing.assert_close(ours, oracle, rtol=1e-5, atol=1e-10)


def test_fastap_hand_computed_with_mixed_image() -> None:
    """Three orthonormal images, every squared distance 2 (one bin, all tied).

    Set labels a={0}, b={1}, m={0, 1}: a ranks m (positive) tied with b → AP ½; likewise b; m's two
    positives are all its neighbours → AP 1. Loss 1 − (½ + ½ + 1)/3 = ⅓. With m={0} instead, b has no
    positive (left out) and a, m each have AP ½ → loss ½.
    """
    x = torch.eye(3, dtype=torch.float64)
    mixed = LabelSets(torch.tensor([[0, -1], [1, -1], [0, 1]]))
    # float64 hand values from a 3×3 histogram: a few roundings, rel 1e-12.
    assert FastAPLoss()(x, mixed).item() == pytest.approx(1 / 3, rel=1e-12)
    assert FastAPLoss()(x, torch.tensor([0, 1, 0])).item() == pytest.approx(0.5, rel=1e-12)


def test_fastap_without_any_positive_is_zero_with_a_graph() -> None:
    x = torch.randn(5, DIM, requires_grad=True)
    value = FastAPLoss()(x, torch.arange(5))
    assert value.item() == 0.0
    value.backward()
    assert x.grad is not None
    assert torch.equal(x.grad, torch.zeros_like(x))
    assert pml_losses.FastAPLoss()(x, torch.arange(5)).item() == 0.0


def test_fastap_with_cosine_metric_equals_squared_euclidean() -> None:
    """A similarity enters as 2·(1 − S), the squared distance of unit vectors."""
    labels = torch.tensor(LABEL_CASES["7x3"])
    x = torch.randn(
        len(labels), DIM, generator=torch.Generator().manual_seed(4), dtype=torch.float64
    )
    cosine = FastAPLoss(metric=CosineSimilarity())(x, labels)
    # float64: 2 − 2·cos vs the squared distance of unit vectors, a different formula of 8-term dot
    # products, a few ε ≈ 1e-15 in each distance: rel 1e-10.
    torch.testing.assert_close(cosine, FastAPLoss()(x, labels), rtol=1e-10, atol=1e-12)


def test_fastap_ism_zero_uncertainty_equals_plain() -> None:
    labels = torch.tensor(LABEL_CASES["4x5"])
    x = torch.randn(
        len(labels), DIM, generator=torch.Generator().manual_seed(5), dtype=torch.float64
    )
    x_plain, x_ism = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    plain = FastAPLoss()(x_plain, labels)
    ism_loss = FastAPLoss(metric=IntrospectiveMetric(EuclideanDistance(), gamma=0.0, tau=5.0))
    ism = ism_loss(Embeddings(x_ism, torch.zeros(len(labels), 4, dtype=torch.float64)), labels)
    plain.backward()
    ism.backward()
    # D_IN² = (√d)² equals the squared distance up to rounding: float64, a few ε on the loss, 1e-12;
    # the gradient passes through √ and back, which scales a rounding by (largest/smallest distance)
    # of ~20 terms: ≪ 1e-8.
    torch.testing.assert_close(ism, plain, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x_ism.grad, x_plain.grad, rtol=1e-8, atol=1e-12)


def test_fastap_ism_uncertainty_moves_toward_an_uninformed_ranking() -> None:
    """Large uncertainty makes every pair look identical (D_IN → 0): all land in the first bin, AP becomes
    the share of positives among the others, and the semantic gradient vanishes."""
    labels = torch.tensor(LABEL_CASES["4x5"])
    centres = F.normalize(torch.randn(4, DIM, generator=torch.Generator().manual_seed(6)), dim=1)
    x = (centres[labels] + 0.01 * torch.randn(len(labels), DIM)).double()  # well separated
    loss_fn = FastAPLoss(metric=IntrospectiveMetric(EuclideanDistance(), gamma=0.0, tau=5.0))
    direction = F.normalize(torch.randn(len(labels), 4, dtype=torch.float64), dim=1)

    values = [loss_fn(Embeddings(x, scale * direction), labels).item() for scale in (0.0, 1.0, 1e4)]
    uninformed = 1 - 4 / 19  # each anchor: 4 positives among 19 others
    assert values[0] < 0.05
    assert values[0] < values[1] < values[2]
    # A limit, not rounding: at ||u|| = 1e4 every D_IN is ~e^(−2000)·d = 0 in float64, so every pair
    # falls in the first bin and the loss is the float64 share 1 − 4/19; 1e-6 is a loose bound.
    assert values[2] == pytest.approx(uninformed, abs=1e-6)

    # On an unordered batch, the pull on the semantic embeddings fades as the uncertainty grows.
    x = torch.randn(
        len(labels), DIM, generator=torch.Generator().manual_seed(8), dtype=torch.float64
    )
    grad_norms = []
    for scale in (0.0, 1e4):
        leaf = x.clone().requires_grad_(True)
        loss_fn(Embeddings(leaf, scale * direction), labels).backward()
        assert leaf.grad is not None
        grad_norms.append(leaf.grad.norm().item())
    assert grad_norms[0] > 0.01
    # Not rounding: the factor e^(−2000) makes the gradient 0 in float64; 1e-3 just shows it faded.
    assert grad_norms[1] < 1e-3 * grad_norms[0]


def test_fastap_ism_gradients_are_finite_at_duplicates() -> None:
    labels = torch.tensor(LABEL_CASES["7x3"])
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(len(labels), DIM, generator=generator, dtype=torch.float64)
    x[1] = x[0]  # α = 0 off the diagonal
    u = torch.randn(len(labels), 4, generator=generator, dtype=torch.float64)
    u[2] = 0.0
    x.requires_grad_(True)
    u.requires_grad_(True)
    loss_fn = FastAPLoss(metric=IntrospectiveMetric(EuclideanDistance(), gamma=2.0, tau=5.0))
    value = loss_fn(Embeddings(x, u), labels)
    value.backward()
    assert torch.isfinite(value)
    assert x.grad is not None and u.grad is not None
    assert bool(torch.isfinite(x.grad).all()) and bool(torch.isfinite(u.grad).all())
    assert u.grad.abs().sum() > 0


def test_fastap_bad_input() -> None:
    with pytest.raises(ValueError, match="num_bins"):
        FastAPLoss(num_bins=0)
    with pytest.raises(ValueError, match="num_bins"):
        FastAPLoss(num_bins=2.5)  # type: ignore[arg-type]  # bad input: not an int
    with pytest.raises(ValueError, match="normalize"):
        FastAPLoss(metric=EuclideanDistance(normalize=False))
    x = torch.randn(4, DIM)
    with pytest.raises(ValueError, match="one label"):
        FastAPLoss()(x, torch.tensor([0, 0, 1]))
    x[1, 1] = float("inf")
    with pytest.raises(ValueError, match="NaN or inf"):
        FastAPLoss()(x, torch.tensor([0, 0, 1, 1]))


# =========================================================================================== PEL
def sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z))


def test_match_probability_hand_computed() -> None:
    """K = 2 one-dimensional samples: image 0 at {0, 2}, image 1 at {1, 0}; a = 1, b = 0.5."""
    samples = torch.tensor([[[0.0], [1.0]], [[2.0], [0.0]]], dtype=torch.float64)
    all_pairs = match_probability(samples, scale=1.0, bias=0.5)
    # image 0 vs 1, all four sample pairs: distances 1, 0, 1, 2
    expected_01 = (sigmoid(-0.5) + sigmoid(0.5) + sigmoid(-0.5) + sigmoid(-1.5)) / 4
    # image 0 vs itself: distances 0, 2, 2, 0
    expected_00 = (2 * sigmoid(0.5) + 2 * sigmoid(-1.5)) / 4
    # float64 means of ≤ 4 sigmoids, a few ε: rel 1e-12 (also below).
    assert all_pairs[0, 1].item() == pytest.approx(expected_01, rel=1e-12)
    assert all_pairs[1, 0].item() == pytest.approx(expected_01, rel=1e-12)
    assert all_pairs[0, 0].item() == pytest.approx(expected_00, rel=1e-12)
    matched = match_probability(samples, scale=1.0, bias=0.5, sample_pairing="matched")
    # matched pairs (k, k): distances 1 and 2
    assert matched[0, 1].item() == pytest.approx((sigmoid(-0.5) + sigmoid(-1.5)) / 2, rel=1e-12)
    assert matched[0, 0].item() == pytest.approx(sigmoid(0.5), rel=1e-12)


def test_match_log_probabilities_do_not_underflow() -> None:
    samples = torch.tensor([[[0.0], [1000.0]]], dtype=torch.float64)
    log_match, log_mismatch = match_log_probabilities(samples, scale=10.0, bias=0.0)
    assert log_match[0, 1].item() == pytest.approx(-10000.0, rel=1e-9)  # p = sigmoid(−10⁴)
    # float64 log(1 − sigmoid(−10⁴)) = log1p(−e^(−10⁴)) = 0 up to rounding; log(½) a few ε: 1e-12.
    assert log_mismatch[0, 1].item() == pytest.approx(0.0, abs=1e-12)
    assert log_mismatch[0, 0].item() == pytest.approx(math.log(0.5), rel=1e-12)


def reference_pel(
    mean: torch.Tensor,
    log_var: torch.Tensor,
    noise: torch.Tensor,
    label_sets: list[set[int]],
    scale: float,
    bias: float,
    kl_weight: float,
    sample_pairing: str = "all",
) -> float:
    """Scalar-loop reference of the PEL loss (K² or K sample pairs, balanced BCE, KL)."""
    num_samples, batch, dim = noise.shape
    # z[k][i] = μ_i + σ_i ⊙ ε_i^k with σ = exp(½·log σ²): the documented input convention.
    z = (mean + torch.exp(0.5 * log_var) * noise).tolist()
    pos, neg = [], []
    for i, j in itertools.permutations(range(batch), 2):
        if sample_pairing == "all":
            sample_pairs = list(itertools.product(range(num_samples), repeat=2))
        else:
            sample_pairs = [(k, k) for k in range(num_samples)]
        p = 0.0
        for k, k2 in sample_pairs:
            p += sigmoid(-scale * math.dist(z[k][i], z[k2][j]) + bias)
        p /= len(sample_pairs)
        if label_sets[i] & label_sets[j]:
            pos.append(-math.log(p))
        else:
            neg.append(-math.log(1 - p))
    parts = [sum(v) / len(v) for v in (pos, neg) if v]
    kl = 0.0
    for i in range(batch):
        for c in range(dim):
            var = math.exp(log_var[i, c].item())
            kl += 0.5 * (var + mean[i, c].item() ** 2 - 1 - log_var[i, c].item())
    return sum(parts) / len(parts) + kl_weight * kl / batch


@pytest.mark.parametrize("sample_pairing", ["all", "matched"])
@pytest.mark.parametrize("seed", SEEDS)
def test_pel_loss_equals_scalar_reference_with_set_labels(
    seed: int, sample_pairing: SamplePairing
) -> None:
    generator = torch.Generator().manual_seed(100 + seed)
    batch, dim, num_samples = 6, 3, 3
    mean = torch.randn(batch, dim, generator=generator, dtype=torch.float64)
    log_var = 0.5 * torch.randn(batch, dim, generator=generator, dtype=torch.float64)
    labels = LabelSets(torch.tensor([[0, -1], [0, -1], [1, -1], [2, -1], [0, 2], [1, 3]]))
    label_sets = [{0}, {0}, {1}, {2}, {0, 2}, {1, 3}]
    loss_fn = PELLoss(
        num_samples=num_samples,
        kl_weight=0.3,  # large, so that a wrong KL shows
        init_scale=0.7,
        init_bias=1.2,
        sample_pairing=sample_pairing,
        generator=torch.Generator().manual_seed(seed),
    ).double()
    value = loss_fn(Embeddings(mean, log_var), labels).item()
    noise = torch.randn(
        num_samples, batch, dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )
    # The parameters were created in float32: compare against the values actually stored.
    scale, bias = loss_fn.scale.item(), loss_fn.bias.item()
    # float32 storage of 0.7 and 1.2: rounding ≤ ε/2 ≈ 6e-8 relative (was rel 1e-6).
    assert (scale, bias) == pytest.approx((0.7, 1.2), rel=1e-7)
    expected = reference_pel(mean, log_var, noise, label_sets, scale, bias, 0.3, sample_pairing)
    # float64, the same noise: means over 8² sample pairs and the batch's pairs in another order,
    # ≲ 10³·ε ≈ 2e-13 relative: 1e-10.
    assert value == pytest.approx(expected, rel=1e-10)
    # Read as singletons, the mixed images' extra positives vanish and the value changes.
    loss_fn.generator = torch.Generator().manual_seed(seed)  # the same noise again
    singles = loss_fn(Embeddings(mean, log_var), labels.primary).item()
    # An inequality: losing the extra positives changes the value by far more than rel 1e-6.
    assert singles != pytest.approx(value, rel=1e-6)


def test_pel_generator_makes_the_loss_reproducible() -> None:
    mean = torch.randn(8, 4)
    log_var = torch.zeros(8, 4)
    labels = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    first = PELLoss(generator=torch.Generator().manual_seed(1))
    second = PELLoss(generator=torch.Generator().manual_seed(1))
    other = PELLoss(generator=torch.Generator().manual_seed(2))
    a = first(Embeddings(mean, log_var), labels)
    assert torch.equal(a, second(Embeddings(mean, log_var), labels))
    assert not torch.equal(a, other(Embeddings(mean, log_var), labels))
    assert not torch.equal(a, first(Embeddings(mean, log_var), labels))  # fresh noise each call


def test_pel_gradients_reach_mean_variance_and_match_parameters() -> None:
    generator = torch.Generator().manual_seed(3)
    mean = torch.randn(10, 5, generator=generator, requires_grad=True)
    log_var = (0.3 * torch.randn(10, 5, generator=generator)).requires_grad_(True)
    loss_fn = PELLoss(generator=generator)
    labels = LabelSets.from_labels(torch.arange(10) % 3).cat(
        LabelSets.mixed(torch.tensor([0, 1]), torch.tensor([2, 0]))
    )
    mixed_mean = torch.randn(2, 5, generator=generator)
    emb = Embeddings(torch.cat([mean, mixed_mean]), torch.cat([log_var, torch.zeros(2, 5)]))
    loss_fn(emb, labels).backward()
    for grad in (mean.grad, log_var.grad, loss_fn.log_scale.grad, loss_fn.bias.grad):
        assert grad is not None and bool(torch.isfinite(grad).all()) and grad.abs().sum() > 0
    # scale = exp(log_scale) with log_scale = log 8 in float32: exp∘log round-trips within 2 ulp.
    assert loss_fn.scale.item() == pytest.approx(PELParams().init_scale, rel=2.5e-7)
    assert [name for name, _ in loss_fn.named_parameters()] == ["log_scale", "bias"]


def test_pel_kl_term_has_the_documented_weight() -> None:
    mean, log_var = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    labels = torch.tensor([0, 0, 1, 1, 2, 2])
    with_kl = PELLoss(kl_weight=0.5, generator=torch.Generator().manual_seed(0)).double()
    without = PELLoss(kl_weight=0.0, generator=torch.Generator().manual_seed(0)).double()
    difference = (
        with_kl(Embeddings(mean, log_var), labels) - without(Embeddings(mean, log_var), labels)
    ).item()
    kl = 0.5 * (log_var.exp() + mean**2 - 1 - log_var).sum(1).mean().item()
    # float64, the same noise on both sides: the difference of two O(1) losses cancels the matching
    # terms up to a few ε ≈ 1e-15, and the KL is a 6×4 sum: rel 1e-10 of an O(1) KL.
    assert difference == pytest.approx(0.5 * kl, rel=1e-10)
    assert PELLoss().kl_weight == 1e-4 and PELLoss().num_samples == 8


def test_pel_bad_input() -> None:
    loss_fn = PELLoss()
    labels = torch.tensor([0, 0, 1])
    with pytest.raises(ValueError, match="log_variance"):
        loss_fn(torch.randn(3, 4), labels)
    with pytest.raises(ValueError, match="log_variance"):
        loss_fn(Embeddings(torch.randn(3, 4), torch.randn(3, 2)), labels)
    with pytest.raises(ValueError, match="NaN"):
        loss_fn(Embeddings(torch.randn(3, 4), torch.full((3, 4), float("nan"))), labels)
    with pytest.raises(ValueError, match="num_samples"):
        PELLoss(num_samples=0)
    with pytest.raises(ValueError, match="kl_weight"):
        PELLoss(kl_weight=-1.0)
    with pytest.raises(ValueError, match="init_scale"):
        PELLoss(init_scale=0.0)
    with pytest.raises(ValueError, match="sample_pairing"):
        PELLoss(sample_pairing="pairs")  # type: ignore[arg-type]  # bad input: not a SamplePairing
    with pytest.raises(ValueError, match="generator"):
        PELLoss(generator=0)  # type: ignore[arg-type]  # bad input: a seed, not a Generator
    with pytest.raises(ValueError, match="samples"):
        match_probability(torch.randn(3, 4), 1.0, 0.0)
