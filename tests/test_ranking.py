"""Tests of SSR (Fu et al. 2021): graded transforms, ranking head, ranking loss, module."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pydantic
import pytest
import torch
import torchvision.transforms.v2.functional as TF
from sklearn.datasets import load_digits
from torch import Tensor, nn

from idml.ranking import (
    GradedTransformConfig,
    GradedTransforms,
    GradedViewParams,
    RankingHead,
    RankingLoss,
    SelfSupervisedRanking,
    SSRConfig,
    TaskGate,
    order_accuracy,
    positive_loss,
    sort_loss,
    view_similarities,
)

# --------------------------------------------------------------------------- fixtures / helpers


@pytest.fixture(scope="module")
def digits() -> Tensor:
    """200 sklearn digits, upscaled to 32×32, as 3-channel images tinted per image (so saturation acts)."""
    raw = torch.tensor(load_digits().images[:200] / 16.0, dtype=torch.float32).unsqueeze(1)
    up = torch.nn.functional.interpolate(raw, size=32, mode="bilinear", align_corners=False)
    tint = torch.rand(200, 3, 1, 1, generator=torch.Generator().manual_seed(3)) * 0.6 + 0.4
    background = torch.rand(200, 3, 1, 1, generator=torch.Generator().manual_seed(4)) * 0.3
    return (background + up.clamp(0, 1) * (tint - background)).clamp(0, 1)


def numpy_ranking(
    s_matrix: np.ndarray, scale: float, margin: float, boundary: float
) -> tuple[float, float]:
    """Reference L_sort, L_pos with plain numpy sums (Fu et al. 2021, eq. 14 and 16)."""
    gaps = s_matrix[:, 1:] - s_matrix[:, :-1] + margin
    sort = np.log(1.0 + np.exp(scale * gaps).sum(axis=1)) / scale
    pos = np.log(1.0 + np.exp(-scale * (s_matrix - boundary)).sum(axis=1)) / scale
    return float(sort.mean()), float(pos.mean())


def identity_params(m: int, n: int) -> GradedViewParams:
    f64 = torch.float64
    return GradedViewParams(
        crop_centres=torch.zeros(m, n, 2, dtype=f64),
        crop_half_sizes=torch.ones(m, n, 2, dtype=f64),
        corner_offsets=torch.zeros(m, n, 4, 2, dtype=f64),
        jitter_factors=torch.ones(m, n, 3, dtype=f64),
    )


def mean_distance_per_level(views: Tensor) -> list[float]:
    """Mean absolute pixel difference of view n from the original, averaged over images."""
    return (views[:, 1:] - views[:, :1]).abs().mean(dim=(0, 2, 3, 4)).tolist()


# --------------------------------------------------------------------------- ranking loss


def test_losses_hand_computed() -> None:
    # s = 1, α = 0, β = 0.5. Row 1: all gaps 0 → L_sort = log(1 + 2), L_pos = log(1 + 3).
    # Row 2: S_2 − S_1 = −ln 2 → e^{−ln 2} = 1/2, S_3 − S_2 = 0 → 1: L_sort = log(2.5);
    # L_pos terms e^{−ln 2}, 1, 1 → log(3.5).
    ln2 = math.log(2.0)
    similarities = torch.tensor([[0.5, 0.5, 0.5], [0.5 + ln2, 0.5, 0.5]], dtype=torch.float64)
    out = RankingLoss(scale=1.0, margin=0.0, boundary=0.5, pos_weight=2.0)(similarities)
    expected_sort = (math.log(3.0) + math.log(2.5)) / 2
    expected_pos = (math.log(4.0) + math.log(3.5)) / 2
    # float64 hand values: logsumexps of 3-4 terms, a few ε: rel 1e-12 (also below).
    assert out.sort.item() == pytest.approx(expected_sort, rel=1e-12)
    assert out.pos.item() == pytest.approx(expected_pos, rel=1e-12)
    assert out.loss.item() == pytest.approx(expected_sort + 2.0 * expected_pos, rel=1e-12)
    # The 1/s factor: at s = 2 with the same exponents halved, each term is halved.
    halved = torch.tensor([[0.5, 0.5, 0.5], [0.5 + ln2 / 2, 0.5, 0.5]], dtype=torch.float64)
    assert sort_loss(halved, scale=2.0, margin=0.0).item() == pytest.approx(
        expected_sort / 2, rel=1e-12
    )  # float64, the same few roundings: rel 1e-12 (approx's default 1e-6 was loose)


def test_losses_match_numpy_reference_with_defaults() -> None:
    rng = np.random.default_rng(0)
    s_matrix = rng.uniform(-0.2, 1.0, size=(7, 4))
    out = RankingLoss()(torch.tensor(s_matrix))
    sort, pos = numpy_ranking(s_matrix, scale=12.0, margin=0.05, boundary=0.5)
    # float64, logsumexp vs numpy's plain log(1 + Σ exp) over ≤ 4 terms and a mean of 7: exponents
    # up to 12·1.25 carry 12·ε each, ≲ 1e-14 relative: rel 1e-12.
    assert out.sort.item() == pytest.approx(sort, rel=1e-12)
    assert out.pos.item() == pytest.approx(pos, rel=1e-12)
    assert out.loss.item() == pytest.approx(sort + pos, rel=1e-12)
    assert torch.equal(out.similarities, torch.tensor(s_matrix))


def test_sort_loss_vanishes_for_well_ordered_views_and_grows_when_two_swap() -> None:
    ordered = torch.tensor([[0.95, 0.8, 0.65, 0.5], [0.9, 0.7, 0.55, 0.3]], dtype=torch.float64)
    values = [sort_loss(ordered, scale=s, margin=0.05).item() for s in (12.0, 50.0, 200.0, 1000.0)]
    assert all(b < a for a, b in itertools.pairwise(values))  # → 0 as s grows
    # Not rounding: at s = 1000 every term is ≤ e^{−100}, L_sort ≈ 3·e^{−100}/1000 ≈ 1e-46 (or 0
    # once 1 + x rounds to 1).
    assert values[-1] < 1e-30
    swapped = ordered[:, [1, 0, 2, 3]]
    for s in (12.0, 200.0):
        assert sort_loss(swapped, s, 0.05).item() > sort_loss(ordered, s, 0.05).item() + 0.05
    # As s → ∞ the smooth maximum tends to the hinge of the worst violation (eq. 13 per image):
    # row 1 violation 0.95 − 0.8 + 0.05 = 0.2, row 2 0.9 − 0.7 + 0.05 = 0.25. The other terms are
    # ≤ e^{−300} of the worst, so the smooth maximum equals the hinge to float64 rounding of the
    # gaps (a few ε): rel 1e-12 (was abs 1e-3).
    assert sort_loss(swapped, 1000.0, 0.05).item() == pytest.approx(0.225, rel=1e-12)


def test_sort_loss_counts_the_margin() -> None:
    # Views ordered by less than the margin still cost, and more than by the margin.
    tight = torch.tensor([[0.9, 0.88, 0.86]])
    # Not rounding: two tied violations of 0.03 make the smooth maximum 0.03 + log(2)/1000
    # ≈ 0.03069; abs 1e-3 covers that 6.9e-4 (float32 rounding of the gaps adds ~1e-8).
    assert sort_loss(tight, 1000.0, margin=0.05).item() == pytest.approx(0.03, abs=1e-3)
    # Not rounding: ≈ 2·e^{−20}/1000 ≈ 4e-12, or 0 where 1 + x rounds to 1 in float32.
    assert sort_loss(tight, 1000.0, margin=0.0).item() < 1e-6


def test_positive_loss_limits() -> None:
    above = torch.tensor([[0.9, 0.8, 0.7, 0.6]])
    # Not rounding: every term is ≤ e^{−100}, L_pos ≈ e^{−100}/1000 ≈ 4e-47 (or 0 in float32).
    assert positive_loss(above, scale=1000.0, boundary=0.5).item() < 1e-30
    below = torch.tensor([[0.9, 0.8, 0.3, 0.6]])
    # The other terms are ≤ e^{−300} of e^{200}, so L_pos is 0.2 up to float32 rounding: fl(0.3)
    # (≤ 1.5e-8, ×1000 in an exponent of 200: 7.5e-8 relative) and two more roundings, ≲ 2ε ≈ 2.4e-7
    # relative: rel 1e-6 (was abs 1e-3).
    assert positive_loss(below, scale=1000.0, boundary=0.5).item() == pytest.approx(0.2, rel=1e-6)


def test_gradients_match_eq15_and_have_the_right_sign() -> None:
    torch.manual_seed(0)
    scale, margin, boundary = 12.0, 0.05, 0.5
    s_matrix = torch.rand(5, 4, dtype=torch.float64, requires_grad=True)
    sort = sort_loss(s_matrix, scale, margin)
    (grad_sort,) = torch.autograd.grad(sort, s_matrix)
    # Fu et al. 2021 eq. 15: ∂L/∂S_{m,n} = (h_{m,n−1} − h_{m,n}) / (1 + Σ_j h_{m,j}), no s; /M for the mean.
    s_np = s_matrix.detach().numpy()
    h = np.exp(scale * (s_np[:, 1:] - s_np[:, :-1] + margin))
    h_padded = np.concatenate([np.zeros((5, 1)), h, np.zeros((5, 1))], axis=1)
    expected = (h_padded[:, :-1] - h_padded[:, 1:]) / (1.0 + h.sum(axis=1, keepdims=True)) / 5
    # float64, autograd's chain through logsumexp vs the closed form: exps of 12·gap (12·ε·|gap|
    # each) and 3-term sums, ~1e-14 relative; entries where h_{n−1} ≈ h_n cancel err by
    # ≲ ε·h/(1 + Σh)/5 < 1e-16 absolute: rtol 1e-10, atol 1e-15.
    np.testing.assert_allclose(grad_sort.numpy(), expected, rtol=1e-10, atol=1e-15)
    # Raising the similarity of the weakest view lowers L_sort, raising the strongest view's raises it.
    assert bool((grad_sort[:, 0] < 0).all()) and bool((grad_sort[:, -1] > 0).all())
    # Only differences matter: 0 analytically; float64 sum of 20 entries ≤ 0.2, ≲ 20·ε·0.2 ≈ 1e-15.
    assert grad_sort.sum().item() == pytest.approx(0.0, abs=1e-12)
    (grad_pos,) = torch.autograd.grad(positive_loss(s_matrix, scale, boundary), s_matrix)
    assert bool((grad_pos < 0).all())  # every view is pulled up toward the original


def test_gradient_step_reduces_a_violated_order() -> None:
    s_matrix = torch.tensor([[0.6, 0.8, 0.7, 0.75]], requires_grad=True)
    loss = RankingLoss()(s_matrix).loss
    (grad,) = torch.autograd.grad(loss, s_matrix)
    stepped = (s_matrix - 0.05 * grad).detach()
    assert RankingLoss()(stepped).loss.item() < loss.item()
    assert order_accuracy(stepped).item() >= order_accuracy(s_matrix.detach()).item()


def test_a_view_embedding_of_zeros_gets_a_bounded_gradient() -> None:
    """A blank view (pretrained Lite0 maps a white image to zero features) can reach the ranking
    loss as a zero vector: its similarity is 0 and its gradient is the incoming one's size, not
    10¹² times it (``F.normalize`` at a zero vector)."""
    embeddings = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0))
    embeddings[1, 2] = 0.0
    embeddings.requires_grad_(True)
    similarities = view_similarities(embeddings)
    assert similarities[1, 1].item() == 0.0
    RankingLoss()(similarities).loss.backward()
    assert embeddings.grad is not None
    assert torch.isfinite(embeddings.grad).all()
    # |∂L/∂S| ≤ 1 and the original's unit vector has norm 1, so a view's gradient is at most ~1.
    assert embeddings.grad[1, 2].abs().max() < 10


def test_loss_from_view_embeddings_equals_loss_from_similarities() -> None:
    # Views at known angles θ_n from the original in a plane: S_{m,n} = cos θ_n exactly.
    angles = torch.tensor([[0.0, 0.3, 0.5, 0.9], [0.0, 0.6, 0.2, 1.2]], dtype=torch.float64)
    planar = torch.stack([angles.cos(), angles.sin(), torch.zeros_like(angles)], dim=-1)
    lengths = torch.tensor([1.0, 3.0, 0.5, 2.0], dtype=torch.float64).view(1, 4, 1)
    embeddings = planar * lengths  # unnormalised: the loss normalises
    # float64: normalising 3-dim rows and a 3-term dot product vs cos θ, a few ε on values
    # ≥ cos 1.2 ≈ 0.36: rtol 1e-12 (assert_close's float64 defaults, 1e-7, were loose).
    torch.testing.assert_close(
        view_similarities(embeddings), angles[:, 1:].cos(), rtol=1e-12, atol=0
    )
    loss = RankingLoss()
    from_embeddings, from_similarities = loss(embeddings), loss(angles[:, 1:].cos())
    # float64: similarities a few ε apart and |∂L/∂S| ≤ 1, so the losses (~0.1..0.2) differ by
    # ≲ 10ε: rtol 1e-12 (was the float64 defaults, 1e-7).
    torch.testing.assert_close(from_embeddings.loss, from_similarities.loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(from_embeddings.sort, from_similarities.sort, rtol=1e-12, atol=0)


def test_order_accuracy() -> None:
    s_matrix = torch.tensor([[0.9, 0.8, 0.7, 0.6], [0.9, 0.95, 0.7, 0.8]])
    # float32 mean of six 0/1 values: an exact count divided by 6, ≤ ε/2 ≈ 6e-8 from the double;
    # approx's default rel 1e-6 covers it (also below).
    assert order_accuracy(s_matrix).item() == pytest.approx(4 / 6)
    # Gaps 0.1, 0.1, 0.1 and −0.05, 0.25, −0.1: four of six exceed 0.09, one exceeds 0.2.
    assert order_accuracy(s_matrix, margin=0.09).item() == pytest.approx(4 / 6)
    assert order_accuracy(s_matrix, margin=0.2).item() == pytest.approx(1 / 6)


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (torch.rand(5), "similarities .M, N. or view embeddings"),
        (torch.rand(2, 3, 4, 5), "similarities .M, N. or view embeddings"),
        (torch.rand(3, 1, 8), "N \\+ 1 views"),
        (torch.tensor([[0.5, float("nan")]]), "NaN"),
        (torch.ones(2, 3, dtype=torch.long), "floating"),
        (torch.rand(0, 3), "M, N >= 1"),
    ],
)
def test_ranking_loss_rejects_bad_input(bad: Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RankingLoss()(bad)


def test_ranking_loss_rejects_bad_hyper_parameters() -> None:
    with pytest.raises(ValueError, match="scale"):
        RankingLoss(scale=0.0)
    with pytest.raises(ValueError, match="pos_weight"):
        RankingLoss(pos_weight=-1.0)
    with pytest.raises(ValueError, match="margin"):
        RankingLoss(margin=float("nan"))


# --------------------------------------------------------------------------- ranking head


def test_ranking_head_is_unit_norm_mlp() -> None:
    torch.manual_seed(0)
    head = RankingHead(in_dim=24)
    features = torch.randn(6, 24) * 5
    z = head(features)
    assert z.shape == (6, 128) and head.out_dim == 128
    # float32 norm of normalised 128-dim rows: a few ε, inside assert_close's float32 defaults
    # (rtol 1.3e-6, atol 1e-5).
    torch.testing.assert_close(z.norm(dim=1), torch.ones(6))
    assert [type(layer) for layer in head.layers] == [nn.Linear, nn.ReLU, nn.Linear]
    first, last = head.layers[0], head.layers[2]
    assert isinstance(first, nn.Linear) and isinstance(last, nn.Linear)
    assert first.out_features == 512
    # Independent reference: the same weights applied by hand.
    hidden = torch.relu(features @ first.weight.T + first.bias)
    raw = hidden @ last.weight.T + last.bias
    # float32: matmul + bias vs nn.Linear's addmm (512- and 24-term dot products, possibly blocked
    # differently: ~√512·ε relative), then a normalisation; inside the float32 defaults.
    torch.testing.assert_close(z, raw / raw.norm(dim=1, keepdim=True))
    with pytest.raises(ValueError, match="in_dim"):
        head(torch.randn(6, 23))
    with pytest.raises(ValueError, match="hidden"):
        RankingHead(8, hidden=0)


# --------------------------------------------------------------------------- graded transforms


def test_t0_is_identity_and_shape(digits: Tensor) -> None:
    images = digits[:6]
    for config in (
        GradedTransformConfig(),
        GradedTransformConfig(num_levels=2, nested_crops=True, shared_draws=True),
        GradedTransformConfig(interpolation="bicubic", fill=0.5),
    ):
        views = GradedTransforms(config)(images, torch.Generator().manual_seed(0))
        assert views.shape == (6, config.num_levels + 1, 3, 32, 32)
        assert torch.equal(views[:, 0], images)
        assert views.min() >= 0.0 and views.max() <= 1.0
        assert not torch.equal(views[:, 1], images)


def test_identity_params_give_the_input_back(digits: Tensor) -> None:
    images = digits[:3]
    views = GradedTransforms().apply_params(images, identity_params(3, 4))
    for n in range(5):
        assert torch.equal(views[:, n], images)


def test_determinism_with_a_generator(digits: Tensor) -> None:
    transforms = GradedTransforms()
    images = digits[:8]
    first = transforms(images, torch.Generator().manual_seed(7))
    again = transforms(images, torch.Generator().manual_seed(7))
    other = transforms(images, torch.Generator().manual_seed(8))
    assert torch.equal(first, again)
    # Not rounding: other draws give other views (allclose's 1e-5 is moot).
    assert not torch.allclose(first[:, 1:], other[:, 1:])


def test_default_magnitudes() -> None:
    levels = GradedTransformConfig().levels()
    # Exact: levels() rounds to 12 decimals, and Python's round is correctly rounded, so each value
    # is the double nearest the decimal, i.e. the literal's (approx's default rel 1e-6 was loose).
    assert levels.crop_area == (0.85, 0.7, 0.55, 0.4)
    assert levels.perspective == (0.1, 0.2, 0.3, 0.4)
    assert levels.brightness == levels.contrast == levels.saturation == (0.1, 0.2, 0.3, 0.4)
    doubled = GradedTransformConfig(strength=0.5, level_strengths=(1.0, 2.0, 4.0, 6.0)).levels()
    assert doubled.crop_area == (0.925, 0.85, 0.7, 0.55)
    params = GradedTransforms().sample_params(50, torch.Generator().manual_seed(0))
    # Crop side = √(kept area); jitter factors exactly 1 ± j_n with both signs drawn.
    expected_half = torch.tensor([0.85, 0.7, 0.55, 0.4], dtype=torch.float64).sqrt()
    # Exact: the same doubles through IEEE sqrt, which is correctly rounded on every CPU.
    assert torch.equal(params.crop_half_sizes[..., 0], expected_half.expand(50, 4))
    deviation = (params.jitter_factors - 1.0).abs()
    # float64: 1 ± j is rounded once (≤ ε/2 ≈ 1.1e-16 absolute) and subtracting 1 is then exact
    # (Sterbenz): atol 1e-15, rtol 0 (the float64 defaults, 1e-7, were loose).
    torch.testing.assert_close(
        deviation,
        torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64).view(1, 4, 1).expand(50, 4, 3),
        rtol=0,
        atol=1e-15,
    )
    assert bool((params.jitter_factors > 1).any()) and bool((params.jitter_factors < 1).any())
    # Perspective corners move inward by at most p_n of the half-size.
    inward = -torch.tensor(
        [[-1.0, -1.0], [1.0, -1.0], [1.0, 1.0], [-1.0, 1.0]], dtype=torch.float64
    )
    along = params.corner_offsets * inward
    assert bool((along >= 0).all())
    assert bool(
        (along <= torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64).view(1, 4, 1, 1)).all()
    )


@pytest.mark.parametrize(
    "config",
    [
        GradedTransformConfig(),
        GradedTransformConfig(nested_crops=True, shared_draws=True),
        GradedTransformConfig(
            perspective_step=0.0, brightness_step=0.0, contrast_step=0.0, saturation_step=0.0
        ),
        GradedTransformConfig(
            crop_area_step=0.0, brightness_step=0.0, contrast_step=0.0, saturation_step=0.0
        ),
        GradedTransformConfig(crop_area_step=0.0, perspective_step=0.0),
    ],
    ids=["all", "nested-shared", "crop-only", "perspective-only", "jitter-only"],
)
def test_strength_grows_with_the_level(digits: Tensor, config: GradedTransformConfig) -> None:
    views = GradedTransforms(config)(digits, torch.Generator().manual_seed(0))
    distances = [0.0, *mean_distance_per_level(views)]
    assert distances[1] > 0.005
    for n in range(1, len(distances)):
        assert distances[n] > distances[n - 1] * 1.05, distances


def test_non_nested_crops_stay_inside_the_image() -> None:
    params = GradedTransforms().sample_params(500, torch.Generator().manual_seed(1))
    low = params.crop_centres - params.crop_half_sizes
    high = params.crop_centres + params.crop_half_sizes
    assert bool((low >= -1).all()) and bool((high <= 1).all())
    # Positions vary per level when not nested (independent draws; allclose's 1e-5 is moot).
    assert not torch.allclose(params.crop_centres[:, 0], params.crop_centres[:, 1])


def test_nested_crops_nest() -> None:
    config = GradedTransformConfig(
        nested_crops=True,
        perspective_step=0.0,
        brightness_step=0.0,
        contrast_step=0.0,
        saturation_step=0.0,
    )
    transforms = GradedTransforms(config)
    params = transforms.sample_params(100, torch.Generator().manual_seed(2))
    low = params.crop_centres - params.crop_half_sizes
    high = params.crop_centres + params.crop_half_sizes
    assert bool((low >= -1).all()) and bool((high <= 1).all())
    assert bool((low[:, 1:] >= low[:, :-1]).all()) and bool((high[:, 1:] <= high[:, :-1]).all())
    # Pixel-level: in an image whose channels are the x and y coordinates, the coordinates seen in
    # view n + 1 lie within those seen in view n.
    size = 48
    ramp = torch.linspace(0.0, 1.0, size)
    coords = torch.stack(
        [ramp.expand(size, size), ramp.view(size, 1).expand(size, size), torch.zeros(size, size)]
    )
    views = transforms.apply_params(coords.expand(100, 3, size, size), params)
    seen_low = views[:, :, :2].amin(dim=(-2, -1))
    seen_high = views[:, :, :2].amax(dim=(-2, -1))
    # 1e-6: float32 bilinear reads of a [0, 1] ramp carry a few ε (~4e-7); equal extremes (both
    # views clamped at an edge of the ramp) are exact.
    assert bool((seen_low[:, 1:] >= seen_low[:, :-1] - 1e-6).all())
    assert bool((seen_high[:, 1:] <= seen_high[:, :-1] + 1e-6).all())
    # The span seen shrinks with the side √a_n of the crop.
    span = (seen_high - seen_low)[:, 1:, 0].mean(0)
    expected = torch.tensor([0.85, 0.7, 0.55, 0.4]).sqrt()
    # Not rounding: pixel-centre samples of the ramp i/47 span exactly the crop side h; only the
    # border clamp can cut a sample that falls within half a pixel outside the outer centres, which
    # only the largest crop (|centre| ≤ 1 − h₁) can do, by ≤ (1 − √0.85)/47 ≈ 1.7e-3 in all.
    # atol 2e-3 (was 0.03) is that bound plus float32 rounding (~1e-6).
    torch.testing.assert_close(span, expected, atol=2e-3, rtol=0)


def test_shared_draws_scale_one_direction() -> None:
    params = GradedTransforms(GradedTransformConfig(shared_draws=True)).sample_params(
        20, torch.Generator().manual_seed(0)
    )
    ratio = params.corner_offsets[:, 1:] / params.corner_offsets[:, :1].where(
        params.corner_offsets[:, :1] != 0, torch.ones(1, dtype=torch.float64)
    )
    expected = torch.tensor([2.0, 3.0, 4.0], dtype=torch.float64).view(1, 3, 1, 1)
    # float64: (u·p_n)/(u·p_1) is three roundings and p_n/p_1 itself is not exactly n (0.3/0.1):
    # ≲ 2ε ≈ 4e-16 relative: rtol 1e-14 (was the float64 defaults, 1e-7).
    torch.testing.assert_close(ratio, expected.expand_as(ratio), rtol=1e-14, atol=0)
    signs = (params.jitter_factors - 1.0).sign()
    assert bool((signs == signs[:, :1]).all())


def test_crop_matches_torchvision_resized_crop(digits: Tensor) -> None:
    images = digits[:2]
    boxes = [(3, 5, 20, 24), (0, 0, 28, 17)]  # (top, left, height, width) in pixels
    params = identity_params(2, 4)
    for m, (top, left, height, width) in enumerate(boxes):
        centre = [(left + width / 2) / 16 - 1, (top + height / 2) / 16 - 1]
        params.crop_centres[m, 0] = torch.tensor(centre)
        params.crop_half_sizes[m, 0] = torch.tensor([width / 32, height / 32])
    views = GradedTransforms().apply_params(images, params)
    for m, (top, left, height, width) in enumerate(boxes):
        reference = TF.resized_crop(images[m], top, left, height, width, [32, 32], antialias=False)
        # torchvision crops first, so samples within half a pixel outside the box repeat the box's
        # edge; ours read the real pixels there. Compare where the sample lies inside the box.
        rows = (torch.arange(32) + 0.5) * height / 32 - 0.5
        cols = (torch.arange(32) + 0.5) * width / 32 - 0.5
        inside_rows = (rows >= 0) & (rows <= height - 1)
        inside_cols = (cols >= 0) & (cols <= width - 1)
        keep = inside_rows[:, None] & inside_cols[None, :]
        assert keep.sum() >= 28 * 28
        # float32 bilinear: grid_sample's and interpolate's source positions are computed by other
        # formulas, each ~ε·32 ≈ 4e-6 pixel off at worst; times pixel steps ≤ 1 and a few roundings
        # of the blend, ≲ 5e-6 on values in [0, 1]: atol 1e-5.
        torch.testing.assert_close(views[m, 1][:, keep], reference[:, keep], atol=1e-5, rtol=0)


def test_perspective_matches_torchvision(digits: Tensor) -> None:
    image = digits[5]
    size = 32
    # torchvision treats corner coordinates as pixel-edge positions, so (0, 0)–(32, 32) is the frame.
    start = [[0, 0], [size, 0], [size, size], [0, size]]
    end = [[3, 2], [29, 5], [27, 30], [2, 28]]
    reference = TF.perspective(image, start, end)  # zero fill
    params = identity_params(1, 4)
    params.corner_offsets[0, 0] = (torch.tensor(end) - torch.tensor(start)).double() * 2 / size
    views = GradedTransforms(GradedTransformConfig(fill=0.0)).apply_params(
        image.unsqueeze(0), params
    )
    # float32 bilinear: torchvision evaluates the homography on its grid in float32 (a few roundings
    # of coordinates up to 32 pixels, ~1e-5 pixel), ours in float64 before one cast: times pixel
    # steps ≤ 1, ≲ 5e-6 on values in [0, 1]: atol 1e-5.
    torch.testing.assert_close(views[0, 1], reference, atol=1e-5, rtol=0)
    # Outside the distorted quadrilateral the view holds the fill value.
    outside = TF.perspective(torch.ones(1, size, size), start, end)[0] == 0.0
    assert outside.sum() > 50
    filled = GradedTransforms(GradedTransformConfig(fill=0.5)).apply_params(
        image.unsqueeze(0), params
    )
    assert bool((filled[0, 1][:, outside] == 0.5).all())


def test_color_jitter_matches_torchvision(digits: Tensor) -> None:
    images = digits[:3]
    factors = torch.tensor([[1.3, 0.7, 1.4], [0.6, 1.2, 0.8], [1.1, 1.1, 0.0]], dtype=torch.float64)
    params = identity_params(3, 4)
    params.jitter_factors[:, 2] = factors
    views = GradedTransforms().apply_params(images, params)
    for m in range(3):
        b, c, s = factors[m].tolist()
        reference = TF.adjust_saturation(
            TF.adjust_contrast(TF.adjust_brightness(images[m], b), c), s
        )
        # float32 values in [0, 1]: our mean grey Σ w_c·mean(x_c) vs torchvision's mean of the grey
        # image (1024-term sums grouped differently, ≲ 10ε typical), lerp vs blend (~2ε), then
        # clamps (1-Lipschitz): ≲ 2e-6; atol 1e-5.
        torch.testing.assert_close(views[m, 3], reference, atol=1e-5, rtol=0)


def test_grey_images_are_supported(digits: Tensor) -> None:
    grey = digits[:4, :1]
    views = GradedTransforms()(grey, torch.Generator().manual_seed(0))
    assert views.shape == (4, 5, 1, 32, 32)
    assert torch.equal(views[:, 0], grey)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"strength": 2.0}, "crop_areas / crop_area_step: level 4 gives crop_area"),
        ({"perspective_step": 0.2}, "perspective_scales / perspective_step: level 3"),
        ({"crop_areas": (0.9, 0.95, 0.5, 0.4)}, "level 2 is weaker than level 1"),
        ({"crop_areas": (0.9, 0.8)}, "crop_areas must have one value per level"),
        (
            {"level_strengths": (1.0, 1.0, 2.0, 3.0)},
            "level_strengths must be positive and strictly increasing",
        ),
        (
            {
                "crop_area_step": 0.0,
                "perspective_step": 0.0,
                "brightness_step": 0.0,
                "contrast_step": 0.0,
                "saturation_step": 0.0,
            },
            "level 1 is no stronger than level 0",
        ),
        (
            {
                "brightness_magnitudes": (0.1, 0.2, 0.2, 0.3),
                "crop_area_step": 0.0,
                "perspective_step": 0.0,
                "contrast_step": 0.0,
                "saturation_step": 0.0,
            },
            "level 3 is no stronger than level 2",
        ),
        ({"num_levels": 0}, r"num_levels\s+Input should be greater than or equal to 1"),
        ({"strength": -1.0}, r"strength\s+Input should be greater than 0"),
        ({"fill": 2.0}, r"fill\s+Input should be less than or equal to 1"),
        ({"interpolation": "lanczos"}, "interpolation"),
    ],
)
def test_config_rejects_bad_values(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GradedTransformConfig(**kwargs)  # type: ignore[arg-type]


def test_config_accepts_lists_and_stays_hashable() -> None:
    config = GradedTransformConfig(num_levels=2, crop_areas=[0.8, 0.5])  # type: ignore[arg-type]
    assert config.crop_areas == (0.8, 0.5)
    assert hash(config) == hash(GradedTransformConfig(num_levels=2, crop_areas=(0.8, 0.5)))


@pytest.mark.parametrize(
    ("images", "match"),
    [
        (torch.rand(2, 3, 8, 8) * 2 - 0.5, "un-normalised floats in \\[0, 1\\]"),
        (torch.rand(2, 4, 8, 8), "1 or 3 channels"),
        (torch.rand(3, 8, 8), "\\(batch, channels, height, width\\)"),
        (torch.randint(0, 255, (2, 3, 8, 8), dtype=torch.uint8), "255"),
    ],
)
def test_transforms_reject_bad_images(images: Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GradedTransforms()(images)


def test_params_shape_is_checked(digits: Tensor) -> None:
    with pytest.raises(ValueError, match=r"params.crop_centres must have shape"):
        GradedTransforms().apply_params(digits[:2], identity_params(3, 4))


def test_configs_nest_in_pydantic_models() -> None:
    class Experiment(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        ssr: SSRConfig = SSRConfig()

    parsed = Experiment.model_validate(
        {"ssr": {"p_task": 0.5, "transforms": {"num_levels": 3, "crop_areas": [0.9, 0.7, 0.5]}}}
    )
    assert parsed.ssr.p_task == 0.5 and parsed.ssr.transforms.crop_areas == (0.9, 0.7, 0.5)
    assert parsed.ssr.num_images == 20 and parsed.ssr.weight == 0.8 and parsed.ssr.scale == 12.0
    with pytest.raises(pydantic.ValidationError, match="no_such_key"):
        Experiment.model_validate({"ssr": {"transforms": {"no_such_key": 1}}})
    with pytest.raises(pydantic.ValidationError, match="p_task"):
        Experiment.model_validate({"ssr": {"p_task": 1.5}})
    with pytest.raises(pydantic.ValidationError, match="task_draw"):
        Experiment.model_validate({"ssr": {"task_draw": "sometimes"}})


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"num_images": 0}, "num_images"),
        ({"hidden_dim": True}, "hidden_dim"),
        ({"out_dim": 2.0}, "out_dim"),
        ({"scale": 0.0}, "scale"),
        ({"margin": math.inf}, "margin"),
        ({"weight": -0.1}, "weight"),
        ({"pos_weight": False}, "pos_weight"),
        ({"p_task": 1.5}, "p_task"),
        ({"update": "sometimes"}, "update"),
        ({"source": "elsewhere"}, "source"),
        ({"transforms": {"num_levels": True}}, "num_levels"),
        ({"transforms": {"crop_areas": (0.9, "x", 0.5, 0.4)}}, "crop_areas"),
        ({"no_such_key": 1}, "no_such_key"),
    ],
)
def test_ssr_config_errors_name_the_key(kwargs: dict[str, object], key: str) -> None:
    with pytest.raises(ValueError, match=key):
        SSRConfig(**kwargs)  # type: ignore[arg-type]


def test_run_config_errors_name_the_ssr_key() -> None:
    from idml.app.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"^ssr\.task\.num_images: .*greater than or equal to 1"):
        load_config(None, ["ssr.task.num_images=0"])
    with pytest.raises(ConfigError, match="valid keys here: boundary, hidden_dim"):
        load_config(None, ["ssr.task.nums=3"])
    assert load_config(None, ["ssr.task.scale=8"]).ssr.task.scale == 8.0


# --------------------------------------------------------------------------- SSR module


class CountingBackbone(nn.Module):
    """A tiny CNN feature extractor that records the batch sizes it sees."""

    def __init__(self, channels: int = 3, feature_dim: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(channels, 8, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(8, feature_dim, 3, stride=2, padding=1),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.calls: list[int] = []

    def forward(self, images: Tensor) -> Tensor:
        self.calls.append(images.shape[0])
        return self.net(images)


def test_module_runs_one_backbone_forward_and_trains_only_its_head(digits: Tensor) -> None:
    torch.manual_seed(0)
    backbone = CountingBackbone()
    ssr = SelfSupervisedRanking(feature_dim=16, config=SSRConfig(hidden_dim=32, out_dim=8))
    out = ssr.loss(backbone, digits[:5], torch.Generator().manual_seed(0))
    assert backbone.calls == [5 * 5]
    assert out.similarities.shape == (5, 4)
    # float32 sum of the two terms (weight 1) vs the same sum in double: one rounding, ≤ ε/2,
    # inside approx's default rel 1e-6.
    assert out.loss.item() == pytest.approx(out.sort.item() + out.pos.item())
    out.loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in backbone.parameters())
    assert all(p.grad is not None for p in ssr.head.parameters())
    assert {id(p) for p in ssr.parameters()} == {id(p) for p in ssr.head.parameters()}
    assert ssr.weight == 0.8 and ssr.num_levels == 4


def test_module_rejects_a_wrong_features_fn(digits: Tensor) -> None:
    ssr = SelfSupervisedRanking(feature_dim=16)
    with pytest.raises(ValueError, match="features_fn must map 15 images"):
        ssr.loss(lambda x: torch.zeros(3, 16), digits[:3])
    with pytest.raises(ValueError, match="RankingHead with in_dim"):
        ssr.loss(lambda x: torch.zeros(x.shape[0], 7), digits[:3])


def test_select_images(digits: Tensor) -> None:
    ssr = SelfSupervisedRanking(feature_dim=4, config=SSRConfig(num_images=20))
    chosen = ssr.select_images(digits[:50], torch.Generator().manual_seed(0))
    assert chosen.shape == (20, 3, 32, 32)
    flat = digits[:50].flatten(1)
    matches = (chosen.flatten(1)[:, None] == flat[None]).all(-1)
    assert bool((matches.sum(1) >= 1).all())  # each chosen image comes from the batch
    assert len({int(i) for i in matches.float().argmax(1)}) == 20  # without replacement
    assert torch.equal(ssr.select_images(digits[:7]), digits[:7])


def test_task_gate() -> None:
    assert not any(TaskGate(0.0)() for _ in range(50))
    assert all(TaskGate(1.0)() for _ in range(50))
    gate = TaskGate(0.8, generator=torch.Generator().manual_seed(0))
    share = sum(gate() for _ in range(4000)) / 4000
    # Statistical: Binomial(4000, 0.8)/4000 has standard error √(0.16/4000) ≈ 0.0063; abs 0.03 is
    # 4.7 standard errors (the generator is seeded, so the test is deterministic).
    assert share == pytest.approx(0.8, abs=0.03)
    epoch_gate = TaskGate(0.5, per="epoch", generator=torch.Generator().manual_seed(1))
    decisions = []
    for _ in range(40):
        epoch_gate.new_epoch()
        calls = {epoch_gate() for _ in range(10)}
        assert len(calls) == 1  # one decision per epoch
        decisions.append(calls.pop())
    assert 0 < sum(decisions) < 40
    with pytest.raises(ValueError, match="p_task"):
        TaskGate(1.2)


def test_ranking_task_learns_to_order_views(digits: Tensor) -> None:
    """A few optimisation steps on digits separate the views' similarities by the margin α_r."""
    torch.manual_seed(0)
    small = torch.nn.functional.interpolate(digits, size=16, mode="bilinear", align_corners=False)
    backbone = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
    )
    ssr = SelfSupervisedRanking(128, SSRConfig(num_images=32, hidden_dim=64, out_dim=16))
    optimiser = torch.optim.Adam([*backbone.parameters(), *ssr.parameters()], lr=3e-3)
    generator = torch.Generator().manual_seed(0)

    def evaluate() -> tuple[float, float]:
        with torch.no_grad():
            out = ssr.loss(backbone, small[160:], torch.Generator().manual_seed(99))
        return out.loss.item(), order_accuracy(out.similarities, margin=0.05).item()

    loss_before, ordered_before = evaluate()
    for _ in range(30):
        out = ssr.loss(backbone, ssr.select_images(small[:160], generator), generator)
        optimiser.zero_grad()
        out.loss.backward()
        optimiser.step()
    loss_after, ordered_after = evaluate()
    assert loss_after < 0.9 * loss_before
    assert ordered_before < 0.1 and ordered_after > 0.5


def test_ssr_module_moves_between_devices_and_dtypes() -> None:
    """nn.Module.to() must work (a method named ``_apply`` once shadowed torch's own)."""
    from idml.ranking import SelfSupervisedRanking

    module = SelfSupervisedRanking(feature_dim=8).to("cpu").double()
    assert next(module.parameters()).dtype == torch.float64
