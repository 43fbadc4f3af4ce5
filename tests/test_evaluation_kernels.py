"""The score kernels of the exact search (idml.evaluation.search.kernels): the bf16 screen's bounds,
the measured choice, and results identical to the exact kernels on data the screen cannot tell
apart."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import idml.evaluation.search.kernels as kernels_module
from idml.evaluation import SearchExecution, SearchOutput, exact_search
from idml.evaluation.search.kernels import (
    EXACT_KERNELS,
    KernelName,
    ScoreKernels,
    Screen,
    choose_kernels,
    rescore_pairs,
    screen_margin,
)

pytestmark = pytest.mark.numerics


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 37.0])
def test_screen_bounds_hold_for_every_pair(seed: int, scale: float) -> None:
    # Rows of very different norms (the Euclidean augmented rows are not unit vectors): every
    # pair's exact fp32 score must lie above lower_bound(screened) and its screened score above
    # reach(exact), the two facts the screened search rests on.
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(64, 200, generator=g) * scale * torch.rand(64, 1, generator=g)
    r = torch.randn(96, 200, generator=g) * torch.rand(96, 1, generator=g)
    screen = Screen.of(q, r, ScoreKernels("torch", "bf16"))
    screened = screen.tile(slice(None), slice(None))
    exact = q @ r.T
    for transposed in (False, True):
        margin = screen.margins(slice(None), slice(None), transposed)
        a, e = (screened.T, exact.T) if transposed else (screened, exact)
        assert bool((Screen.lower_bound(a, margin[:, None]) <= e).all())
        assert bool((a >= Screen.reach(e, margin[:, None])).all())


def test_screen_margin_of_unit_vectors() -> None:
    # 3u + u² + γ-terms for u = 2⁻⁸, d = 512: the worst case the module docstring derives.
    u, gamma = 2.0**-8, 512 * 2.0**-24
    assert screen_margin(512) == pytest.approx(3 * u + u * u + 3 * gamma, rel=1e-3)


def test_rescore_pairs_is_the_dot_product_of_each_listed_pair() -> None:
    g = torch.Generator().manual_seed(3)
    q, r = torch.randn(5, 7, generator=g), torch.randn(4, 7, generator=g)
    qi, ri = torch.tensor([0, 0, 2, 4, 4, 4]), torch.tensor([3, 1, 0, 0, 2, 3])
    expected = (q[qi].double() * r[ri].double()).sum(1).float()
    # fp32 sums of 7 products of numbers of size ~1: |error| ≲ 7·2⁻²⁴·Σ|qr| ≈ 1e-5 at most.
    torch.testing.assert_close(rescore_pairs(q, r, qi, ri), expected, atol=1e-5, rtol=0)
    assert rescore_pairs(q, r, qi[:0], ri[:0]).shape == (0,)


@pytest.mark.parametrize("same_set", [True, False])
def test_screen_separates_near_duplicates_bfloat16_cannot(same_set: bool) -> None:
    # Rows of 11-bit numbers k/1024 with near-duplicates one or two steps apart: bfloat16 (8 bits)
    # rounds them, so the screen sees ties and errors, while every fp32 score of the Euclidean
    # search is exact (multiples of 2⁻²⁰ below 2⁴: integers below 2²⁴). The screened search must
    # give exactly the lists, ties included, and ranks of the unscreened one.
    rng = np.random.default_rng(0)
    base = rng.integers(-1000, 1000, (10, 16))
    steps = np.repeat(base, 7, axis=0) + rng.integers(-2, 3, (70, 16))
    x = torch.from_numpy(steps.astype(np.float32) / 1024)
    labels = torch.from_numpy(rng.integers(0, 6, 70))
    query, query_labels = (x, labels) if same_set else (x[:25], labels[:25])
    gallery, gallery_labels = (None, None) if same_set else (x[25:], labels[25:])

    def search(kernel: KernelName) -> SearchOutput:
        execution = SearchExecution(block_size=16, kernel=kernel)
        return exact_search(
            query,
            query_labels,
            9,
            gallery,
            gallery_labels,
            metric="euclidean",
            normalize=False,
            execution=execution,
        )

    exact, screened = search("torch"), search("bf16")
    assert "screened by bf16" in screened.kernels
    assert torch.equal(screened.neighbors.indices, exact.neighbors.indices)
    assert torch.equal(screened.neighbors.scores, exact.neighbors.scores)
    for (q1, r1, n1), (q2, r2, n2) in zip(screened.rank_chunks, exact.rank_chunks):
        assert torch.equal(q1, q2) and torch.equal(r1, r2) and torch.equal(n1, n2)


def test_auto_measures_once_and_names_its_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels_module, "_CHOSEN", {})
    monkeypatch.setattr(kernels_module, "MEASURE_SIDE", 64)
    chosen = choose_kernels(torch.device("cpu"), 32, 512)
    assert chosen.exact in EXACT_KERNELS
    assert set(chosen.timings) >= {"torch", "openblas"}
    assert chosen.exact in chosen.describe() and "measured" in chosen.describe()
    assert choose_kernels(torch.device("cpu"), 32, 512) is chosen  # cached per process


def test_the_screen_is_chosen_only_for_a_large_enough_gain(monkeypatch: pytest.MonkeyPatch) -> None:
    timings = {"torch": 1.0, "openblas": 0.5, "bf16": 0.5 / kernels_module.SCREEN_MIN_GAIN}
    monkeypatch.setattr(kernels_module, "_CHOSEN", {})
    monkeypatch.setattr(kernels_module, "_time_kernels", lambda names, q, r: dict(timings))
    chosen = choose_kernels(torch.device("cpu"), 16, 64)
    assert (chosen.exact, chosen.screen) == ("openblas", "bf16")
    timings["bf16"] *= 1.01
    monkeypatch.setattr(kernels_module, "_CHOSEN", {})
    assert choose_kernels(torch.device("cpu"), 16, 64).screen is None


def test_small_searches_and_metrics_are_not_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object) -> None:
        raise AssertionError("measured")

    monkeypatch.setattr(kernels_module, "_measure_and_choose", fail)
    x = torch.randn(50, 8)
    out = exact_search(x, torch.arange(50) % 5, 3)
    assert out.kernels == "torch (fp32)"


def test_bad_kernel_names_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="kernel must be one of"):
        SearchExecution(kernel="mkl")  # type: ignore[arg-type]
    monkeypatch.setattr(kernels_module, "_available", lambda name, device: name != "faiss")
    with pytest.raises(ValueError, match=r"'faiss' is not available.*install faiss-cpu"):
        choose_kernels(torch.device("cpu"), 8, 8, requested="faiss")
