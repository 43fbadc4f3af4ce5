"""Uncertainty-generating augmentations: Mixup with set labels and the degradations of
Wang et al. 2022, Table 3 (low resolution, blur, occlusion)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torchvision.transforms.v2 import functional as TF

from idml.augment import (
    AugmentationPipeline,
    AugmentedBatch,
    Degradation,
    GaussianBlur,
    LowResolution,
    Mixup,
    MixupMode,
    Occlusion,
    UncertaintyAugmentation,
    apply_augmentations,
    sample_beta,
)
from idml.embeddings import Embeddings
from idml.relations import PAD, LabelSets


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _images(b: int = 8, c: int = 3, size: int = 12, seed: int = 0) -> torch.Tensor:
    # Strictly inside (0, 1) so that any change (erasing to 0, blurring) is visible.
    return 0.05 + 0.9 * torch.rand(b, c, size, size, generator=_gen(seed + 100))


# --------------------------------------------------------------------------- Mixup
def test_beta_sampling_matches_the_distribution() -> None:
    for alpha in (1.0, 0.2, 4.0):
        draws = sample_beta(alpha, 40_000, _gen(1))
        assert bool(((draws >= 0) & (draws <= 1)).all())
        assert abs(float(draws.mean()) - 0.5) < 0.01
        # Var of Beta(a, a) is 1 / (4(2a + 1)).
        assert abs(float(draws.var()) - 1 / (4 * (2 * alpha + 1))) < 0.005
    with pytest.raises(ValueError, match="alpha"):
        sample_beta(0.0, 3)


def test_mixup_pixels_and_set_labels() -> None:
    images, labels = _images(6), torch.tensor([0, 1, 2, 3, 4, 5])
    batch = Mixup()(images, labels, _gen(3))
    info = batch.mixup
    assert info is not None and info.mode is MixupMode.SET
    assert batch.images.shape == (12, 3, 12, 12)
    assert torch.equal(batch.images[:6], images)  # originals untouched and first
    assert torch.equal(batch.mixed, torch.tensor([False] * 6 + [True] * 6))
    assert not bool(batch.degraded.any())
    # Fraction 1: every image is a first source once, partners form a permutation.
    assert torch.equal(info.index_a, torch.arange(6))
    assert torch.equal(info.index_b.sort().values, torch.arange(6))
    assert bool(((info.lam >= 0) & (info.lam <= 1)).all())
    assert len(set(info.lam.tolist())) == 6  # one λ per mixed image in set mode
    for k in range(6):
        a, b, lam = int(info.index_a[k]), int(info.index_b[k]), info.lam[k]
        assert torch.equal(batch.images[6 + k], lam * images[a] + (1 - lam) * images[b])
        row = {int(v) for v in batch.labels.labels[6 + k] if v != PAD}
        assert row == {int(labels[a]), int(labels[b])}
        assert int(info.labels_a[k]) == int(labels[a]) and int(info.labels_b[k]) == int(labels[b])
    originals = batch.labels.labels[:6]
    assert torch.equal(originals[:, 0], labels) and bool((originals[:, 1:] == PAD).all())
    assert float(batch.images.min()) >= 0 and float(batch.images.max()) <= 1 + 1e-6


def test_mixed_image_is_positive_to_both_sources() -> None:
    images, labels = _images(4), torch.tensor([0, 1, 2, 3])
    batch = Mixup(num_mixed=4)(images, labels, _gen(5))
    info = batch.mixup
    assert info is not None
    positives = batch.labels.positive_mask()
    for k in range(4):
        assert bool(positives[4 + k, info.index_a[k]]) and bool(positives[4 + k, info.index_b[k]])
        others = set(range(4)) - {int(info.index_a[k]), int(info.index_b[k])}
        assert not any(bool(positives[4 + k, j]) for j in others)


def test_mixup_same_class_partner_gives_a_singleton() -> None:
    batch = Mixup()(_images(5), torch.full((5,), 7), _gen(0))
    assert bool((batch.labels.labels[:, 0] == 7).all())
    assert bool((batch.labels.labels[:, 1:] == PAD).all())
    assert batch.labels.is_single


def test_mixup_is_deterministic_given_a_generator() -> None:
    images, labels = _images(8), torch.arange(8) % 3
    first = Mixup(fraction=0.5)(images, labels, _gen(11))
    second = Mixup(fraction=0.5)(images, labels, _gen(11))
    other = Mixup(fraction=0.5)(images, labels, _gen(12))
    assert torch.equal(first.images, second.images)
    assert torch.equal(first.labels.labels, second.labels.labels)
    assert first.mixup is not None and second.mixup is not None and other.mixup is not None
    assert torch.equal(first.mixup.lam, second.mixup.lam)
    assert not torch.equal(first.mixup.lam, other.mixup.lam)


@pytest.mark.parametrize(
    ("fraction", "count"), [(0.0, 0), (0.25, 2), (0.5, 4), (0.3125, 3), (1.0, 8)]
)
def test_mixup_fraction(fraction: float, count: int) -> None:
    batch = Mixup(fraction=fraction)(_images(8), torch.arange(8), _gen(0))
    assert batch.images.shape[0] == 8 + count and int(batch.mixed.sum()) == count
    assert batch.mixup is not None and batch.mixup.index_a.unique().numel() == count


def test_mixup_options_and_errors() -> None:
    images, labels = _images(4), torch.arange(4)
    assert Mixup(num_mixed=3)(images, labels, _gen(0)).images.shape[0] == 7
    with pytest.raises(ValueError, match="num_mixed=5"):
        Mixup(num_mixed=5)(images, labels, _gen(0))
    with pytest.raises(ValueError, match="fraction"):
        Mixup(fraction=1.5)
    with pytest.raises(ValueError, match="alpha"):
        Mixup(alpha=0.0)
    with pytest.raises(ValueError, match="'set' or 'interpolate'"):
        Mixup(mode="sets")
    with pytest.raises(ValueError, match="shared_lambda"):
        Mixup(mode=MixupMode.INTERPOLATE, shared_lambda=False)
    shared = Mixup(shared_lambda=True)(images, labels, _gen(0)).mixup
    assert shared is not None and shared.lam.unique().numel() == 1
    with pytest.raises(ValueError, match="labels has 3 entries"):
        Mixup()(images, labels[:3], _gen(0))
    already_mixed = LabelSets.mixed(torch.tensor([0, 1, 2, 3]), torch.tensor([1, 2, 3, 0]))
    with pytest.raises(ValueError, match="once per batch"):
        Mixup()(images, already_mixed, _gen(0))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        Mixup()(images * 255, labels, _gen(0))


def test_interpolate_mode_loss_matches_the_official_formula() -> None:
    images, labels = _images(4), torch.tensor([0, 1, 2, 3])
    batch = Mixup(mode=MixupMode.INTERPOLATE)(images, labels, _gen(2))
    info = batch.interpolate
    assert info is not None and info.lam.unique().numel() == 1
    emb = Embeddings(torch.randn(8, 5, generator=_gen(9)))
    calls: list[tuple[int, tuple[int, ...]]] = []

    def toy_loss(e: Embeddings, sets: LabelSets) -> torch.Tensor:
        calls.append((len(e), tuple(sets.primary.tolist())))
        return e.semantic.sum() * (1 + sets.primary.float().sum())

    value = batch.loss(toy_loss, emb)
    lam = float(info.lam[0])
    orig, mixed = emb.semantic[:4], emb.semantic[4:]
    expected = (
        orig.sum() * (1 + labels.sum())
        + lam * mixed.sum() * (1 + info.labels_a.sum())
        + (1 - lam) * mixed.sum() * (1 + info.labels_b.sum())
    )
    # float32 sums of 4×5 embedding entries, grouped differently on the two sides: a few ε relative,
    # inside assert_close's float32 defaults (rtol 1.3e-6, atol 1e-5).
    torch.testing.assert_close(value, expected)
    assert len(calls) == 3
    # Set mode: a single loss call over the whole batch with its label sets.
    set_batch = Mixup()(images, labels, _gen(2))
    assert set_batch.interpolate is None
    calls.clear()
    set_batch.loss(toy_loss, emb)
    assert calls == [(8, tuple(set_batch.labels.primary.tolist()))]


# --------------------------------------------------------------------------- degradations
DEGRADATIONS = [
    lambda f: LowResolution(fraction=f, factor=3.0),
    lambda f: GaussianBlur(fraction=f, sigma=(0.5, 1.5)),
    lambda f: Occlusion(fraction=f),
    lambda f: Occlusion(fraction=f, fill="noise"),
]


@pytest.mark.parametrize("make", DEGRADATIONS)
@pytest.mark.parametrize(("fraction", "count"), [(0.0, 0), (0.25, 2), (0.5, 4), (1.0, 8)])
def test_degradation_changes_exactly_the_chosen_rows(
    make: Callable[[float], Degradation], fraction: float, count: int
) -> None:
    images, labels = _images(8), torch.arange(8)
    augmentation: Degradation = make(fraction)
    batch = augmentation(images, labels, _gen(4))
    assert batch.images.shape == images.shape
    changed = (batch.images != images).flatten(1).any(dim=1)
    assert torch.equal(changed, batch.degraded)
    assert int(changed.sum()) == count
    assert not bool(batch.mixed.any()) and batch.mixup is None
    assert torch.equal(batch.labels.labels, LabelSets.from_labels(labels).labels)
    assert float(batch.images.min()) >= 0 and float(batch.images.max()) <= 1
    assert torch.equal(images, _images(8))  # input not modified in place
    again = augmentation(images, labels, _gen(4))
    assert torch.equal(again.images, batch.images)


def test_low_resolution_removes_the_finest_detail() -> None:
    checker = ((torch.arange(16)[:, None] + torch.arange(16)[None, :]) % 2).float()
    images = checker.expand(2, 3, 16, 16).clone()
    out = LowResolution(fraction=1.0, factor=2.0)(images, torch.arange(2), _gen(0)).images
    # Not rounding: the anti-aliased filter renormalises its weights at the border, which leaves up
    # to ~0.010 of the checker there (0.5 ± 0.5 inside would be a surviving checker); 0.02 is twice
    # that.
    torch.testing.assert_close(out, torch.full_like(out, 0.5), atol=0.02, rtol=0)
    flat = torch.full((1, 1, 16, 16), 0.3)
    # float32 bilinear resampling of a constant: interpolation weights sum to 1 up to a few ε,
    # inside the float32 defaults (rtol 1.3e-6, atol 1e-5).
    torch.testing.assert_close(LowResolution(1.0, 4.0)(flat, torch.arange(1)).images, flat)


def test_blur_matches_torchvision_away_from_borders() -> None:
    images = _images(3, 3, 24)
    sigma = 1.5
    out = GaussianBlur(fraction=1.0, sigma=sigma)(images, torch.arange(3), _gen(0)).images
    radius = math.ceil(3 * sigma)
    reference = TF.gaussian_blur(images, kernel_size=[2 * radius + 1] * 2, sigma=[sigma, sigma])
    inner = (..., slice(radius, -radius), slice(radius, -radius))
    # float32 values in (0, 1), weights summing to 1: our two separable 11-tap passes vs
    # torchvision's 11×11 kernel sum in different orders, ~√121·ε ≈ 1.3e-6 typical; 1e-5 allows ~8×
    # that.
    torch.testing.assert_close(out[inner], reference[inner], atol=1e-5, rtol=0)


def test_blur_draws_sigma_per_image() -> None:
    impulse = torch.zeros(2, 1, 21, 21)
    impulse[:, :, 10, 10] = 1.0
    first = GaussianBlur(1.0, sigma=(0.5, 3.0))(impulse, torch.arange(2), _gen(1)).images
    peaks = first[:, 0, 10, 10]
    # An inequality: σ drawn from [0.5, 3] moves the peak by far more than the default rel 1e-6.
    assert float(peaks[0]) != pytest.approx(float(peaks[1]))
    torch.testing.assert_close(first.sum(dim=(1, 2, 3)), torch.ones(2))  # mass preserved


def test_occlusion_erases_one_rectangle_of_the_requested_area() -> None:
    images = _images(6, 3, 16)
    out = Occlusion(fraction=1.0, area=0.25, ratio=(1.0, 1.0), fill=0.0)(
        images, torch.arange(6), _gen(2)
    ).images
    erased = (out == 0).all(dim=1)  # (B, H, W)
    for k in range(6):
        rows = erased[k].any(dim=1).nonzero().flatten()
        cols = erased[k].any(dim=0).nonzero().flatten()
        assert int(erased[k].sum()) == 64  # 0.25 · 16² as an 8 × 8 square
        assert int(rows[-1] - rows[0] + 1) == 8 and int(cols[-1] - cols[0] + 1) == 8
    keep = ~erased[:, None].expand_as(out)
    assert torch.equal(out[keep], images[keep])
    with pytest.raises(ValueError, match="fill"):
        Occlusion(fill=2.0)
    with pytest.raises(ValueError, match="area"):
        Occlusion(area=1.5)


def test_degradation_errors() -> None:
    with pytest.raises(ValueError, match="fraction"):
        GaussianBlur(fraction=-0.1)
    with pytest.raises(ValueError, match="factor"):
        LowResolution(factor=1.0)
    with pytest.raises(ValueError, match="sigma"):
        GaussianBlur(sigma=(2.0, 1.0))
    with pytest.raises(ValueError, match="shape"):
        GaussianBlur()(torch.rand(3, 8, 8), torch.arange(3))


# --------------------------------------------------------------------------- composition
def test_composition_tracks_altered_rows() -> None:
    images, labels = _images(8), torch.arange(8) % 4
    steps: list[UncertaintyAugmentation] = [Occlusion(fraction=0.5), Mixup(fraction=0.25)]
    assert all(isinstance(s, UncertaintyAugmentation) for s in steps)
    batch = apply_augmentations(images, labels, steps, _gen(6))
    assert batch.images.shape[0] == 10
    assert torch.equal(batch.mixed, torch.tensor([False] * 8 + [True] * 2))
    assert int(batch.degraded[:8].sum()) == 4 and not bool(batch.degraded[8:].any())
    assert torch.equal(batch.altered, batch.mixed | batch.degraded)
    assert batch.mixup is not None
    # Mixup indices refer to the occluded batch it received.
    info = batch.mixup
    lam = info.lam.view(-1, 1, 1, 1)
    base = batch.images[:8]
    # float32 blend λ·a + (1-λ)·b of values in [0, 1], one or two roundings apart between the
    # library and this formula: ~2ε, inside the float32 defaults (rtol 1.3e-6, atol 1e-5).
    torch.testing.assert_close(
        batch.images[8:], lam * base[info.index_a] + (1 - lam) * base[info.index_b]
    )
    pipeline = AugmentationPipeline(tuple(steps))
    assert torch.equal(pipeline(images, labels, _gen(6)).images, batch.images)
    with pytest.raises(ValueError, match="Mixup"):
        apply_augmentations(images, labels, [Mixup(), Mixup()], _gen(0))
    unchanged = apply_augmentations(images, labels, [], _gen(0))
    assert isinstance(unchanged, AugmentedBatch) and torch.equal(unchanged.images, images)
    assert not bool(unchanged.altered.any())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_augmentations_on_cuda_with_a_cpu_generator() -> None:
    images, labels = _images(8), torch.arange(8)
    steps = [LowResolution(0.5), GaussianBlur(0.5), Occlusion(0.5), Mixup(0.5)]
    cpu = apply_augmentations(images, labels, steps, _gen(8))
    gpu = apply_augmentations(images.cuda(), labels.cuda(), steps, _gen(8))
    assert gpu.images.device.type == "cuda" and gpu.labels.device.type == "cuda"
    # float32 values in [0, 1] after resample, blur and mixup: CUDA and CPU kernels sum the
    # ≤121-term filters in different orders, ~√121·ε per filter; 1e-5 absolute.
    torch.testing.assert_close(gpu.images.cpu(), cpu.images, atol=1e-5, rtol=0)
    assert torch.equal(gpu.mixed.cpu(), cpu.mixed) and torch.equal(gpu.degraded.cpu(), cpu.degraded)


def test_a_batch_is_checked_once_however_the_augmentations_are_composed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The range check is a reduction with a host sync on GPU: once per training batch, not once
    # per augmentation and once more per composite.
    import idml.augment.batch as batch_module

    calls: list[torch.Tensor] = []
    real = batch_module.check_images

    def counted(x: torch.Tensor) -> None:
        calls.append(x)
        real(x)

    monkeypatch.setattr(batch_module, "check_images", counted)
    images, labels = torch.rand(8, 3, 8, 8), torch.arange(8) % 4
    steps = (Mixup(fraction=0.5), GaussianBlur(fraction=0.5), LowResolution(fraction=0.5))
    g = torch.Generator().manual_seed(0)
    out = AugmentationPipeline(steps)(images, labels, g)
    assert len(calls) == 1 and out.images.shape[0] == 12
    calls.clear()
    apply_augmentations(images, labels, list(steps), g)
    assert len(calls) == 1
    with pytest.raises(ValueError, match=r"\[0, 1\]"):  # and the one check still refuses
        AugmentationPipeline(steps)(images * 255, labels, g)
