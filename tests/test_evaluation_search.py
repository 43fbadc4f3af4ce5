"""Exact blocked search and every retrieval metric against a brute-force numpy reference.

The reference ranks each query's whole gallery with one float64 sort, using the documented tie
rules: neighbour lists by (score descending, index ascending); ranks for metrics "pessimistic"
(a relevant item tied with non-relevant ones comes after them). Metrics are then computed from the
definitions over the 0/1 relevance list, not from positions as the library does.
"""

from __future__ import annotations

import math
from typing import Literal, TypedDict

import numpy as np
import pytest
import torch

import idml.evaluation.search.candidates as candidates_module
import idml.evaluation.search.ranks as ranks_module
from idml.embeddings import Embeddings
from idml.evaluation import (
    EvaluationSettings,
    RankAccumulator,
    SearchExecution,
    SearchOutput,
    evaluate_embeddings,
    exact_search,
)
from idml.evaluation.retrieval_metrics import default_cutoffs
from idml.evaluation.search import reference_search
from idml.evaluation.search.kernels import KernelName
from idml.evaluation.search.layout import PreparedSearch
from synthetic import clustered

pytestmark = pytest.mark.numerics  # compares numbers across runs/processes/implementations

LEVELS = tuple(i / 10 for i in range(11))

try:
    import faiss  # noqa: F401

    KERNELS: list[KernelName] = ["torch", "openblas", "faiss", "bf16"]
except ImportError:  # pragma: no cover - depends on the environment
    KERNELS = ["torch", "openblas", "bf16"]
"""Every score kernel must give the brute force's lists and ranks (``bf16``: screened, then
re-scored exactly)."""

MetricName = Literal["cosine", "euclidean"]


class MetricArgs(TypedDict):
    """The metric keywords shared by :func:`brute_force` and :func:`ours`."""

    metric: MetricName
    normalize: bool


class Reference(TypedDict):
    """What :func:`brute_force` computes."""

    neighbors: list[list[int]]
    means: dict[str, float]
    lone: list[int]
    pr_precision: np.ndarray
    pr_recall: np.ndarray
    interp: np.ndarray


# ----------------------------------------------------------------------------- reference
def reference_scores(
    q: np.ndarray, r: np.ndarray, metric: MetricName, normalize: bool
) -> np.ndarray:
    q, r = q.astype(np.float64), r.astype(np.float64)
    if metric == "cosine" or normalize:
        q = q / np.linalg.norm(q, axis=1, keepdims=True)
        r = r / np.linalg.norm(r, axis=1, keepdims=True)
    if metric == "cosine":
        return q @ r.T
    return -((q[:, None, :] - r[None, :, :]) ** 2).sum(-1)


def brute_force(
    q: np.ndarray,
    q_labels: np.ndarray,
    r: np.ndarray | None = None,
    r_labels: np.ndarray | None = None,
    *,
    k: int,
    ks: tuple[int, ...],
    cutoffs: tuple[int, ...],
    metric: MetricName = "cosine",
    normalize: bool = True,
) -> Reference:
    same = r is None
    if r is None:
        r, r_labels = q, q_labels
    assert r_labels is not None, "a separate gallery needs its labels"
    s = reference_scores(q, r, metric, normalize)
    idx = np.arange(len(r))
    out: dict[str, list] = {key: [] for key in ("neighbors", "rp", "mapr", "map", "mrr", "first")}
    out.update({f"r@{kk}": [] for kk in ks})
    pr_p, pr_r, interp, lone = [], [], [], []
    for i in range(len(q)):
        keep = idx != i if same else np.ones(len(r), dtype=np.bool_)
        cand, sc = idx[keep], s[i, keep]
        rel = r_labels[cand] == q_labels[i]
        # neighbour order: score desc, index asc
        out["neighbors"].append(cand[np.lexsort((cand, -sc))][:k].tolist())
        # metric order: score desc, non-relevant before relevant on ties
        order = np.lexsort((cand, rel, -sc))
        relevance = rel[order].astype(float)
        big_r = int(relevance.sum())
        if big_r == 0:
            lone.append(i)
            continue
        hits = np.cumsum(relevance)
        prec = hits / np.arange(1, len(relevance) + 1)
        out["rp"].append(relevance[:big_r].sum() / big_r)
        out["mapr"].append((prec[:big_r] * relevance[:big_r]).sum() / big_r)
        out["map"].append((prec * relevance).sum() / big_r)
        first = int(np.argmax(relevance)) + 1
        out["first"].append(first)
        out["mrr"].append(1.0 / first)
        for kk in ks:
            out[f"r@{kk}"].append(float(relevance[:kk].any()))
        pr_p.append([hits[c - 1] / c for c in cutoffs])
        pr_r.append([hits[c - 1] / big_r for c in cutoffs])
        recall = hits / big_r
        interp.append([prec[recall >= rho - 1e-12].max() for rho in LEVELS])
    means = {key: float(np.mean(v)) for key, v in out.items() if key not in ("neighbors", "first")}
    return {
        "neighbors": out["neighbors"],
        "means": means,
        "lone": lone,
        "pr_precision": np.mean(pr_p, 0),
        "pr_recall": np.mean(pr_r, 0),
        "interp": np.mean(interp, 0),
    }


def ours(
    q: np.ndarray,
    q_labels: np.ndarray,
    r: np.ndarray | None = None,
    r_labels: np.ndarray | None = None,
    *,
    k: int,
    ks: tuple[int, ...],
    cutoffs: tuple[int, ...],
    block_size: int,
    metric: MetricName = "cosine",
    normalize: bool = True,
    max_rank_entries: int = 1 << 24,
    kernel: KernelName = "torch",
) -> tuple[SearchOutput, RankAccumulator]:
    out = exact_search(
        torch.from_numpy(q),
        torch.from_numpy(q_labels),
        k,
        None if r is None else torch.from_numpy(r),
        None if r_labels is None else torch.from_numpy(r_labels),
        metric=metric,
        normalize=normalize,
        execution=SearchExecution(
            block_size=block_size, max_rank_entries=max_rank_entries, kernel=kernel
        ),
    )
    acc = RankAccumulator(len(q), ks, cutoffs)
    for chunk in out.rank_chunks:
        acc.add(*chunk)
    return out, acc


def assert_matches(
    ref: Reference, out: SearchOutput, acc: RankAccumulator, ks: tuple[int, ...]
) -> None:
    got = [[i for i in row if i >= 0] for row in out.neighbors.indices.tolist()]
    assert got == ref["neighbors"]
    means = acc.means()
    expected = ref["means"]
    # Identical neighbour lists (checked above), hence identical per-query values; both means are
    # float64 sums of ≤ a few hundred values ≤ 1 in different orders, ≲ n·ε ≈ 1e-14: 1e-12.
    for kk in ks:
        assert means[f"recall@{kk}"] == pytest.approx(expected[f"r@{kk}"], abs=1e-12)
    assert means["r_precision"] == pytest.approx(expected["rp"], abs=1e-12)
    assert means["map@r"] == pytest.approx(expected["mapr"], abs=1e-12)
    assert means["map"] == pytest.approx(expected["map"], abs=1e-12)
    assert means["mrr"] == pytest.approx(expected["mrr"], abs=1e-12)
    assert acc.lone.nonzero().flatten().tolist() == ref["lone"]
    curve = acc.pr_curve()
    # The same float64 averages of per-query fractions, as for the means: 1e-12.
    np.testing.assert_allclose(curve.precision_at_cutoff, ref["pr_precision"], atol=1e-12)
    np.testing.assert_allclose(curve.recall_at_cutoff, ref["pr_recall"], atol=1e-12)
    np.testing.assert_allclose(curve.interpolated_precision, ref["interp"], atol=1e-12)


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("block_size", [1, 3, 7, 16, 1000])
@pytest.mark.parametrize("metric", ["cosine", "euclidean"])
def test_same_set_matches_brute_force_across_block_boundaries(
    block_size: int, metric: MetricName, kernel: KernelName
) -> None:
    # 37 is prime: no block size divides it, so every run has a ragged last block.
    x, y = clustered(37, 6, 5, 1.0, seed=block_size)
    ks, cutoffs = (1, 2, 5, 40), default_cutoffs(36)
    ref = brute_force(x, y, k=6, ks=ks, cutoffs=cutoffs, metric=metric)
    out, acc = ours(
        x, y, k=6, ks=ks, cutoffs=cutoffs, block_size=block_size, metric=metric, kernel=kernel
    )
    assert out.symmetric
    assert_matches(ref, out, acc, ks)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("block_size", [2, 5, 64])
def test_separate_query_and_gallery_matches_brute_force(
    block_size: int, kernel: KernelName
) -> None:
    q, qy = clustered(23, 5, 6, 1.0, seed=1)
    g, gy = clustered(41, 5, 6, 1.0, seed=1)  # same seed: same class centres
    qy[0] = 99  # a query whose class is absent from the gallery: lone
    ks, cutoffs = (1, 3, 8), (1, 2, 10, 41)
    ref = brute_force(q, qy, g, gy, k=4, ks=ks, cutoffs=cutoffs)
    out, acc = ours(q, qy, g, gy, k=4, ks=ks, cutoffs=cutoffs, block_size=block_size, kernel=kernel)
    assert not out.symmetric
    assert ref["lone"] == [0]
    assert_matches(ref, out, acc, ks)


@pytest.mark.parametrize("max_rank_entries", [1, 20, 70])
def test_chunked_queries_give_the_same_results(max_rank_entries: int) -> None:
    # Large classes relative to the state budget force the chunked, non-symmetric path.
    x, y = clustered(40, 3, 4, 1.5, seed=7)
    ks, cutoffs = (1, 4), default_cutoffs(39)
    ref = brute_force(x, y, k=5, ks=ks, cutoffs=cutoffs)
    out, acc = ours(
        x, y, k=5, ks=ks, cutoffs=cutoffs, block_size=6, max_rank_entries=max_rank_entries
    )
    assert not out.symmetric
    assert len(out.rank_chunks) > 1
    assert_matches(ref, out, acc, ks)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dense_fraction", [0, 10**9])
@pytest.mark.parametrize("same_set", [True, False])
def test_sparse_and_dense_counting_agree_with_brute_force(
    dense_fraction: int, same_set: bool, kernel: KernelName, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 0: always list candidates sparsely; 10**9: count on whole tiles whenever any score qualifies.
    monkeypatch.setattr(ranks_module, "DENSE_CANDIDATE_FRACTION", dense_fraction)
    x, y = clustered(70, 4, 5, 1.5, seed=11)
    ks, cutoffs = (1, 3), (1, 5, 50)
    if same_set:
        ref = brute_force(x, y, k=4, ks=ks, cutoffs=cutoffs)
        out, acc = ours(x, y, k=4, ks=ks, cutoffs=cutoffs, block_size=9, kernel=kernel)
    else:
        ref = brute_force(x[:20], y[:20], x[20:], y[20:], k=4, ks=ks, cutoffs=cutoffs)
        out, acc = ours(
            x[:20], y[:20], x[20:], y[20:], k=4, ks=ks, cutoffs=cutoffs, block_size=9, kernel=kernel
        )
    assert_matches(ref, out, acc, ks)


@pytest.mark.parametrize("pair_cost", [0, 10**9])
@pytest.mark.parametrize("metric", ["cosine", "euclidean"])
@pytest.mark.parametrize("same_set", [True, False])
def test_relevant_scores_by_listed_pairs_or_by_band_tiles_agree_with_brute_force(
    pair_cost: int, metric: MetricName, same_set: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 0: every band block's relevant scores come from the listed pairs alone; 10**9: from the
    # band's tile. Class sizes from 1 to 12 put both small and large classes in a block.
    monkeypatch.setattr(PreparedSearch, "PAIR_COST", pair_cost)
    rng = np.random.default_rng(5)
    y = np.repeat(np.arange(12), np.arange(1, 13))
    x = rng.standard_normal((12, 6))[y] + 0.8 * rng.standard_normal((len(y), 6))
    x = x.astype(np.float32)
    ks, cutoffs = (1, 3), (1, 5, 30)
    kw: MetricArgs = {"metric": metric, "normalize": metric == "cosine"}
    if same_set:
        ref = brute_force(x, y, k=4, ks=ks, cutoffs=cutoffs, **kw)
        out, acc = ours(x, y, k=4, ks=ks, cutoffs=cutoffs, block_size=7, **kw)
    else:
        ref = brute_force(x[::2], y[::2], x[1::2], y[1::2], k=4, ks=ks, cutoffs=cutoffs, **kw)
        out, acc = ours(
            x[::2], y[::2], x[1::2], y[1::2], k=4, ks=ks, cutoffs=cutoffs, block_size=7, **kw
        )
    assert_matches(ref, out, acc, ks)


def test_batched_count_path_for_many_candidates(monkeypatch: pytest.MonkeyPatch) -> None:
    # Force the padded searchsorted path that large classes with many candidates take.
    monkeypatch.setattr(ranks_module, "FLAT_COUNT_MAX_ENTRIES", 0)
    x, y = clustered(45, 3, 3, 3.0, seed=3)
    ks, cutoffs = (1, 2), default_cutoffs(44)
    ref = brute_force(x, y, k=3, ks=ks, cutoffs=cutoffs)
    out, acc = ours(x, y, k=3, ks=ks, cutoffs=cutoffs, block_size=8)
    assert_matches(ref, out, acc, ks)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("block_size", [2, 5, 50])
def test_ties_and_duplicate_vectors_follow_the_documented_rules(
    block_size: int, dtype: type[np.floating], kernel: KernelName
) -> None:
    # Integer vectors, Euclidean, no normalisation: every score is an exact integer, so ties are
    # real ties in float32 and float64 alike; many rows are exact duplicates of each other.
    # float64 input is scored in float32 like everything else; ties must survive the cast.
    rng = np.random.default_rng(0)
    x = rng.integers(-1, 2, (30, 2)).astype(dtype)
    y = rng.integers(0, 3, 30)
    kw: MetricArgs = {"metric": "euclidean", "normalize": False}
    ks, cutoffs = (1, 2, 4), default_cutoffs(29)
    ref = brute_force(x, y, k=7, ks=ks, cutoffs=cutoffs, **kw)
    out, acc = ours(x, y, k=7, ks=ks, cutoffs=cutoffs, block_size=block_size, kernel=kernel, **kw)
    assert_matches(ref, out, acc, ks)


def test_tie_rules_on_a_hand_made_example() -> None:
    # Query 0 at the origin; references 1..4 all at distance 1 (a four-way tie).
    x = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0]])
    labels = torch.tensor([0, 1, 0, 1, 2])
    out = exact_search(
        x, labels, 3, metric="euclidean", normalize=False, execution=SearchExecution(block_size=2)
    )
    # Neighbour lists: equal scores in index order.
    assert out.neighbors.indices[0].tolist() == [1, 2, 3]
    # Ranks: query 0's only relevant item (2) is tied with 1, 3, 4 -> ranked after all of them.
    ranks = {int(q): (r[:n].tolist()) for q, r, n in zip(*out.rank_chunks[0])}
    assert ranks[0] == [4]


def test_collapsed_embeddings_score_worst_not_best() -> None:
    # Every embedding identical: pessimistic ties give the chance-free worst case.
    x = torch.ones(12, 4)
    labels = torch.arange(12) % 4
    report = evaluate_embeddings(x, labels, EvaluationSettings(ks=(1, 8), nmi=False))
    assert report.metrics["recall@1"] == 0.0
    # Each query has 9 other-class items, all ranked before its 2 relevant ones (ranks 10, 11).
    assert report.metrics["recall@8"] == 0.0
    assert report.metrics["map@r"] == 0.0
    # float64 means of 12 identical per-query values ≤ 1: ≲ 12ε ≈ 3e-15, so 1e-12 as elsewhere in
    # this file (approx's default rel 1e-6 was far looser).
    assert report.metrics["mrr"] == pytest.approx(1 / 10, abs=1e-12)
    assert report.metrics["map"] == pytest.approx((1 / 10 + 2 / 11) / 2, abs=1e-12)


def test_duplicate_of_the_query_is_a_neighbour_self_is_excluded_by_index() -> None:
    x = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    labels = torch.tensor([0, 1, 0, 1])
    out = exact_search(x, labels, 3, execution=SearchExecution(block_size=1))
    assert out.neighbors.indices.tolist() == [[1, 2, 3], [0, 2, 3], [3, 0, 1], [2, 0, 1]]


def test_k_larger_than_class_and_gallery() -> None:
    x, y = clustered(9, 3, 3, 0.5, seed=2)
    out = exact_search(
        torch.from_numpy(x), torch.from_numpy(y), 50, execution=SearchExecution(block_size=4)
    )
    assert out.neighbors.k == 8  # capped at the other 8 items
    assert sorted(out.neighbors.indices[0].tolist()) == list(range(1, 9))
    report = evaluate_embeddings(x, y, EvaluationSettings(ks=(1, 5, 100), nmi=False))
    assert report.metrics["recall@100"] == 1.0


def test_lone_queries_are_excluded_and_counted() -> None:
    x, y = clustered(20, 4, 3, 0.5, seed=5)
    y[[3, 11]] = [50, 51]  # two singletons
    report = evaluate_embeddings(x, y, EvaluationSettings(ks=(1,), nmi=False))
    assert report.retrieval.lone_queries.tolist() == [3, 11]
    assert math.isnan(report.retrieval.per_query["map@r"][3].item())
    assert report.retrieval.per_class[50]["num_lone_queries"] == 1
    ref = brute_force(x, y, k=1, ks=(1,), cutoffs=(1,))
    # Same neighbours as the brute force; float64 means of ≤ 20 values ≤ 1 in different orders: 1e-12.
    assert report.metrics["map@r"] == pytest.approx(ref["means"]["mapr"], abs=1e-12)


def test_per_class_breakdown_matches_per_query_means() -> None:
    x, y = clustered(30, 3, 4, 1.2, seed=9)
    report = evaluate_embeddings(x, y, EvaluationSettings(ks=(1, 2), nmi=False))
    per_query = report.retrieval.per_query
    for c, row in report.retrieval.per_class.items():
        mask = torch.from_numpy(y == c)
        assert row["num_queries"] == int(mask.sum())
        # float64 per-class means of ≤ 30 per-query values ≤ 1, summed in another order: 1e-12.
        for key in ("recall@1", "r_precision", "map@r", "map", "mrr"):
            assert row[key] == pytest.approx(float(per_query[key][mask].mean()), abs=1e-12)


def test_introspective_ranking_matches_a_dense_ism_matrix() -> None:
    from idml.metrics import CosineSimilarity, IntrospectiveMetric

    torch.manual_seed(0)
    x, u = torch.randn(25, 6), torch.randn(25, 4)
    labels = torch.randint(0, 4, (25,))
    ism = IntrospectiveMetric(CosineSimilarity(), gamma=0.5, tau=2.0)
    out = exact_search(
        Embeddings(x, u), labels, 24, metric=ism, execution=SearchExecution(block_size=4)
    )
    dense = ism(x, ux=u).double()
    dense.fill_diagonal_(-math.inf)
    expected = torch.sort(dense, dim=1, descending=True, stable=True).indices[:, :24]
    assert out.neighbors.indices.tolist() == expected.tolist()
    report = evaluate_embeddings(
        x, labels, EvaluationSettings(nmi=False), uncertainty=u, introspective_metric=ism
    )
    plain = evaluate_embeddings(x, labels, EvaluationSettings(nmi=False))
    assert report.retrieval.metric_name.startswith("introspective")
    assert report.metrics != plain.metrics


@pytest.mark.parametrize("n_classes", [1, 3])
def test_neighbors_only_and_gallery_smaller_than_k(n_classes: int) -> None:
    q = torch.randn(5, 3)
    g = torch.randn(2, 3)
    out = exact_search(q, torch.zeros(5, dtype=torch.long), 4, g, torch.arange(2) % n_classes)
    assert out.neighbors.k == 2
    scores = torch.nn.functional.normalize(q, dim=1) @ torch.nn.functional.normalize(g, dim=1).T
    assert out.neighbors.indices.tolist() == scores.argsort(1, descending=True).tolist()


def test_asymmetric_user_metric_takes_the_one_sided_path() -> None:
    from idml.metrics import Metric

    class Bilinear(Metric):
        """score(x, y) = x W yᵀ with a non-symmetric W: score(a, b) != score(b, a)."""

        is_similarity = True

        def __init__(self, weight: torch.Tensor) -> None:
            super().__init__(normalize=False)
            self.weight = weight

        def forward(self, x, y=None, ux=None, uy=None):
            y = x if y is None else y
            return x @ self.weight @ y.T

    torch.manual_seed(1)
    x, labels = torch.randn(30, 4), torch.randint(0, 4, (30,))
    metric = Bilinear(torch.randn(4, 4))
    out = exact_search(x, labels, 5, metric=metric, execution=SearchExecution(block_size=7))
    assert not out.symmetric
    dense = metric(x).double().fill_diagonal_(-math.inf)
    expected = torch.sort(dense, dim=1, descending=True, stable=True).indices[:, :5]
    assert out.neighbors.indices.tolist() == expected.tolist()


def test_search_execution_is_checked_when_made() -> None:
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        SearchExecution(block_size=0)
    assert SearchExecution().block_size_on(torch.device("cpu")) == 2048
    assert SearchExecution().device_for(torch.device("cpu")) == torch.device("cpu")


def test_progress_callback_counts_every_tile() -> None:
    seen: list[int] = []
    x, y = clustered(50, 5, 4, 1.0, seed=0)
    out = exact_search(
        torch.from_numpy(x),
        torch.from_numpy(y),
        3,
        execution=SearchExecution(block_size=16, progress=seen.append),
    )
    assert (
        sum(seen) == out.num_tiles == 10
    )  # 4 blocks: 4 + 3 + 2 + 1 tiles on and above the diagonal


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("shape", [(7, 5), (64, 300), (300, 64)])
def test_numpy_and_torch_candidate_paths_agree(shape: tuple[int, int], transposed: bool) -> None:
    # The torch path is what CUDA runs; on CPU both must list the same (query, ref, score) triples
    # in the same order, with ties at the threshold included and -inf never listed.
    gen = torch.Generator().manual_seed(sum(shape))
    tile = torch.randn(shape, generator=gen).round(decimals=1)
    tile[0, 0] = -math.inf
    n_queries = shape[1] if transposed else shape[0]
    reach = torch.randn(n_queries, generator=gen).round(decimals=1)
    reach[0] = -100.0  # a query reaching every finite score
    expected = candidates_module.candidates_torch(tile, reach, transposed)
    got = candidates_module.candidates_numpy(tile, reach, transposed)
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g)
    q, r, v = got
    assert bool((v >= reach[q]).all()) and bool(torch.isfinite(v).all())
    dense = tile.T if transposed else tile
    assert int((q == 0).sum()) == dense.shape[1] - 1  # all but the -inf score
    assert len(q) == int((dense >= reach.unsqueeze(1)).sum())
    assert torch.equal(dense[q, r], v)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("positive", [True, False])
@pytest.mark.parametrize("shape", [(7, 5), (64, 300), (300, 64)])
def test_bfloat16_candidates_list_every_score_that_reaches_its_threshold(
    shape: tuple[int, int], positive: bool, transposed: bool
) -> None:
    # A screen's bf16 tile, listed on its bits against thresholds rounded down to bf16 (all
    # positive), or through the float32 path (a threshold ≤ 0): every score ≥ its query's
    # threshold is listed, in the float32 listing's order, and anything more lies below the
    # threshold by less than one bf16 step of it.
    gen = torch.Generator().manual_seed(sum(shape) + positive)
    tile = torch.randn(shape, generator=gen).to(torch.bfloat16)
    tile[0, 0] = -math.inf
    n_queries = shape[1] if transposed else shape[0]
    reach = torch.rand(n_queries, generator=gen) * 2 + 1e-3
    if not positive:
        reach[1] = -0.5
    reach[-1] = tile.float().max() + 1  # a query reaching nothing
    exact = candidates_module.candidates_numpy(tile.float(), reach, transposed)
    q, r, v = candidates_module.candidates(tile, reach, transposed)
    assert v.dtype == torch.float32
    dense = (tile.T if transposed else tile).float()
    assert torch.equal(dense[q, r], v)
    assert bool((q[1:] >= q[:-1]).all())  # sorted by query
    listed = set(zip(q.tolist(), r.tolist(), strict=True))
    assert set(zip(exact[0].tolist(), exact[1].tolist(), strict=True)) <= listed
    extra = v < reach[q]
    assert bool((v[extra] >= reach[q[extra]] - reach[q[extra]].abs() * 2.0**-7).all())
    if not positive:  # the float32 path lists exactly
        assert not bool(extra.any())


# ----------------------------------------------------------------------------- dense specification
def ranks_by_query(out) -> dict[int, list[int]]:
    """Query index → its relevant ranks, from any chunking of the output."""
    got: dict[int, list[int]] = {}
    for query_ids, ranks, num_rel in out.rank_chunks:
        for q, row, n in zip(query_ids.tolist(), ranks.tolist(), num_rel.tolist(), strict=True):
            got[q] = row[:n]
    return got


def gaps_in_float64(q: np.ndarray, r: np.ndarray, same_set: bool) -> np.ndarray:
    """Per query, the smallest gap between two of its cosine scores (float64, self excluded)."""
    qn = q / np.linalg.norm(q, axis=1, keepdims=True)
    rn = r / np.linalg.norm(r, axis=1, keepdims=True)
    s = qn.astype(np.float64) @ rn.astype(np.float64).T
    if same_set:
        np.fill_diagonal(s, np.inf)
    s = np.sort(s, axis=1)[:, : s.shape[1] - (1 if same_set else 0)]
    return np.diff(s, axis=1).min(axis=1)


@pytest.mark.parametrize("block_size", [1, 4, 16, 100])
@pytest.mark.parametrize("same_set", [True, False])
def test_blocked_engine_equals_the_dense_reference_on_random_data(
    block_size: int, same_set: bool
) -> None:
    # Float scores: tiles of different shapes may round a score differently in the last bit, so
    # the comparison is exact wherever no two scores of a query are that close in float64.
    rng = np.random.default_rng(block_size)
    q = rng.standard_normal((23 if not same_set else 41, 6)).astype(np.float32)
    r = q if same_set else rng.standard_normal((57, 6)).astype(np.float32)
    q_labels = torch.from_numpy(rng.integers(0, 5, len(q)))
    r_labels = q_labels if same_set else torch.from_numpy(rng.integers(0, 5, len(r)))
    query = torch.from_numpy(q)
    gallery, gallery_labels = (None, None) if same_set else (torch.from_numpy(r), r_labels)
    ours = exact_search(
        query,
        q_labels,
        7,
        gallery,
        gallery_labels,
        execution=SearchExecution(block_size=block_size),
    )
    spec = reference_search(query, q_labels, 7, gallery, gallery_labels)
    clear = gaps_in_float64(q, r, same_set) > 1e-5
    assert clear.sum() > len(q) // 2
    ours_ranks, spec_ranks = ranks_by_query(ours), ranks_by_query(spec)
    for i in np.flatnonzero(clear).tolist():
        assert ours.neighbors.indices[i].tolist() == spec.neighbors.indices[i].tolist()
        assert ours_ranks[i] == spec_ranks[i]
    torch.testing.assert_close(ours.neighbors.scores, spec.neighbors.scores, atol=1e-5, rtol=0)


@pytest.mark.parametrize("block_size", [1, 3, 5, 64])
@pytest.mark.parametrize("shape", [(30, None), (11, 26), (26, 11)])
def test_blocked_engine_equals_the_dense_reference_with_ties(
    block_size: int, shape: tuple[int, int | None]
) -> None:
    # Small integer vectors and the unnormalised squared Euclidean score: every score is an exact
    # integer on any tiling, so the many ties must be broken exactly as the specification says.
    n_q, n_r = shape
    gen = torch.Generator().manual_seed(block_size * 100 + n_q)
    q = torch.randint(0, 3, (n_q, 3), generator=gen).float()
    q_labels = torch.randint(0, 4, (n_q,), generator=gen)
    args: tuple = (q, q_labels, 6)
    if n_r is not None:
        r = torch.cat([q[:4], torch.randint(0, 3, (n_r - 4, 3), generator=gen).float()])
        args += (r, torch.randint(0, 4, (n_r,), generator=gen))
    ours = exact_search(
        *args, metric="euclidean", normalize=False, execution=SearchExecution(block_size=block_size)
    )
    spec = reference_search(*args, metric="euclidean", normalize=False)
    assert torch.equal(ours.neighbors.indices, spec.neighbors.indices)
    assert torch.equal(ours.neighbors.scores, spec.neighbors.scores)
    assert ranks_by_query(ours) == ranks_by_query(spec)
