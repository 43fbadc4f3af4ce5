"""Re-ranking against dense references: k-reciprocal (Zhong et al. 2017) and αQE / DBA
(Radenović et al. 2019) computed on full N×N matrices with Python loops, the sparse shortlist
versions of :mod:`idml.evaluation.reranking` must return the same orders.

Both sides rank by the same float32 score matrix (the graph and shortlists are built from it), so
neighbour sets agree exactly. Kernel weights are float32 dot products on one side and float64 on
the other (≤ 1e-7 apart on unit vectors, a few 1e-7 after the sums and quotients of ≤ 100 terms),
so re-ranked scores are compared at 1e-5, and an order is accepted when the reference's final
distances along it never decrease by more than 1e-6: Jaccard distances tie exactly when two
references share the same kernel entries with a query, and rounding then picks the order.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from idml.evaluation.reranking import KReciprocal, QueryExpansion
from idml.evaluation.search import NeighborLists, neighbors_only

QUERY = -1  # the query node of the per-query reference


def ranking(scores: torch.Tensor) -> list[list[int]]:
    """Each row's columns by score descending, index ascending on ties."""

    def order(row: torch.Tensor) -> list[int]:
        return sorted(range(len(row)), key=lambda j: (-float(row[j]), j))

    return [order(scores[r]) for r in range(scores.shape[0])]


def graph_of(scores: torch.Tensor, depth: int) -> NeighborLists:
    """Each row's ``depth`` best other columns of a same-set score matrix (itself excluded)."""
    order = [[j for j in row if j != i][:depth] for i, row in enumerate(ranking(scores))]
    ids = torch.tensor(order)
    return NeighborLists(ids, scores.gather(1, ids))


def lists_of(scores: torch.Tensor, depth: int) -> NeighborLists:
    ids = torch.tensor([row[:depth] for row in ranking(scores)])
    return NeighborLists(ids, scores.gather(1, ids))


# --------------------------------------------------------------------------- k-reciprocal
def _kernel_row(members: list, dist_to: dict) -> dict:
    w = {c: math.exp(-dist_to[c]) for c in members}
    total = sum(w.values())
    return {c: v / total for c, v in w.items()}


def _jaccard(a: dict, b: dict) -> float:
    keys = set(a) | set(b)
    low = sum(min(a.get(c, 0.0), b.get(c, 0.0)) for c in keys)
    high = sum(max(a.get(c, 0.0), b.get(c, 0.0)) for c in keys)
    return 1 - low / high


def _mean_rows(rows: list[dict]) -> dict:
    out: dict = {}
    for row in rows:
        for c, v in row.items():
            out[c] = out.get(c, 0.0) + v / len(rows)
    return out


def _gallery_vectors(x64: torch.Tensor, s32: torch.Tensor, k1: int, k2: int):
    """The paper's steps 1–3 on the gallery alone: ranks (itself first), R(·, k), V after QE."""
    n = len(x64)
    dist = ((1 - x64 @ x64.T) / 2).clamp(0, 1)
    rank = [[i] + [j for j in row if j != i] for i, row in enumerate(ranking(s32))]

    def recip(i: int, k: int) -> list[int]:
        return [j for j in rank[i][: k + 1] if i in rank[j][: k + 1]]

    half = round(k1 / 2)
    v = []
    for i in range(n):
        r = recip(i, k1)
        members = list(r)
        for j in r:
            c = recip(j, half)
            if len(set(c) & set(r)) > 2 / 3 * len(c):
                members += c
        v.append(_kernel_row(sorted(set(members)), {c: float(dist[i, c]) for c in members}))
    v_qe = [_mean_rows([v[j] for j in rank[i][:k2]]) for i in range(n)]
    return rank, recip, v, v_qe, dist


def dense_k_reciprocal_same_set(x, k1, k2, lam, depth):
    """Zhong et al.'s method on the set against itself: each shortlist's final distances."""
    x64 = F.normalize(x.double(), dim=1)
    s32 = F.normalize(x.float(), dim=1) @ F.normalize(x.float(), dim=1).T
    rank, _, _, v_qe, dist = _gallery_vectors(x64, s32, k1, k2)
    out = []
    for i in range(len(x)):
        short = rank[i][1 : depth + 1]
        out.append(
            {g: (1 - lam) * _jaccard(v_qe[i], v_qe[g]) + lam * float(dist[i, g]) for g in short}
        )
    return out, s32


def dense_k_reciprocal_queries(q, x, k1, k2, lam, depth):
    """Each query alone as a new node of the gallery's graph (the module's definition): its
    reciprocity with a reference j is checked by inserting it into j's ranking (ties favour it).
    Returns each shortlist's final distances."""
    x64 = F.normalize(x.double(), dim=1)
    q64 = F.normalize(q.double(), dim=1)
    g32 = F.normalize(x.float(), dim=1)
    s32 = g32 @ g32.T
    qs32 = F.normalize(q.float(), dim=1) @ g32.T
    _, recip, v, v_qe, _ = _gallery_vectors(x64, s32, k1, k2)
    half = round(k1 / 2)
    qd = ((1 - q64 @ x64.T) / 2).clamp(0, 1)
    out = []
    for p in range(len(q)):
        q_rank = [QUERY, *ranking(qs32[p : p + 1])[0]]

        def position_of_query(j: int, p: int = p) -> int:
            # j's ranking with the query inserted: itself, then everything strictly closer.
            return 1 + sum(
                1 for g in range(len(x)) if g != j and float(s32[j, g]) > float(qs32[p, j])
            )

        def q_recip(k: int, q_rank: list = q_rank) -> list:
            return [QUERY] + [j for j in q_rank[1 : k + 1] if position_of_query(j) <= k]

        r = q_recip(k1)
        members = list(r)
        for j in r:
            c = q_recip(half) if j == QUERY else recip(j, half)
            if len(set(c) & set(r)) > 2 / 3 * len(c):
                members += c
        members = sorted(set(members))
        v_q = _kernel_row(members, {c: 0.0 if c == QUERY else float(qd[p, c]) for c in members})
        v_q_qe = _mean_rows([v_q, *(v[g] for g in q_rank[1:k2])])
        short = q_rank[1 : depth + 1]
        out.append(
            {g: (1 - lam) * _jaccard(v_q_qe, v_qe[g]) + lam * float(qd[p, g]) for g in short}
        )
    return out, s32, qs32


def assert_reranked_like(got: NeighborLists, finals: list[dict]) -> None:
    """``got`` holds each shortlist in an order of non-decreasing reference distance (up to 1e-6:
    module docstring), with scores ``1 − 2·d*``."""
    for row, scores, final in zip(got.indices.tolist(), got.scores.tolist(), finals):
        assert sorted(row) == sorted(final)
        d = [final[g] for g in row]
        assert all(b >= a - 1e-6 for a, b in itertools.pairwise(d)), (row, d)
        assert scores == pytest.approx([1 - 2 * v for v in d], abs=1e-5)


@pytest.mark.parametrize(
    ("seed", "k1", "k2", "lam"), [(0, 6, 3, 0.3), (1, 5, 1, 0.0), (2, 8, 4, 0.7)]
)
def test_k_reciprocal_same_set_matches_the_dense_method(seed, k1, k2, lam) -> None:
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(40) % 5
    x = torch.randn(40, 6, generator=g) + 1.5 * F.one_hot(labels, 6).float()
    depth = 15
    expected, s32 = dense_k_reciprocal_same_set(x, k1, k2, lam, depth)
    graph = graph_of(s32, depth)
    rr = KReciprocal(k1, k2, lam, depth)
    got = rr.rerank(graph, rr.prepare(x, graph))
    assert_reranked_like(got, expected)
    # λ = 1 is the plain cosine order, with cosine scores.
    cosine = KReciprocal(k1, k2, 1.0, depth)
    plain = cosine.rerank(graph, cosine.prepare(x, graph))
    assert plain.indices.tolist() == graph.indices.tolist()
    torch.testing.assert_close(plain.scores, graph.scores, atol=1e-5, rtol=0)


@pytest.mark.parametrize("seed", [0, 1])
def test_k_reciprocal_for_separate_queries_matches_the_dense_definition(seed) -> None:
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(45) % 5
    x = torch.randn(45, 6, generator=g) + 1.5 * F.one_hot(labels, 6).float()
    q = torch.randn(12, 6, generator=g) + 1.5 * F.one_hot(torch.arange(12) % 5, 6).float()
    k1, k2, lam, depth = 6, 3, 0.3, 20
    expected, s32, qs32 = dense_k_reciprocal_queries(q, x, k1, k2, lam, depth)
    rr = KReciprocal(k1, k2, lam, depth)
    got = rr.rerank(lists_of(qs32, depth), rr.prepare(x, graph_of(s32, k1)), queries=q)
    assert_reranked_like(got, expected)


def test_k_reciprocal_on_the_exact_search_lists() -> None:
    """The shortlists and graph straight from the blocked exact search (random data: no ties)."""
    g = torch.Generator().manual_seed(3)
    labels = torch.arange(60) % 6
    x = torch.randn(60, 8, generator=g) + 1.2 * F.one_hot(labels, 8).float()
    lists = neighbors_only(x, 20)
    expected, _ = dense_k_reciprocal_same_set(x, 10, 4, 0.3, 20)
    rr = KReciprocal(10, 4, 0.3, 20)
    assert_reranked_like(rr.rerank(lists, rr.prepare(x, lists)), expected)


# --------------------------------------------------------------------------- αQE / DBA
def dense_query_expansion(q, x, s_short, qe, dba, alpha, depth, same_set):
    """αQE and DBA with dense vectors, re-ordering the shortlists ranked by ``s_short``."""
    x64 = F.normalize(x.double(), dim=1)
    q64 = x64 if same_set else F.normalize(q.double(), dim=1)
    s32 = F.normalize(x.float(), dim=1) @ F.normalize(x.float(), dim=1).T
    rank = [[j for j in row if j != i] for i, row in enumerate(ranking(s32))]
    xa = x64.clone()
    if dba:
        for i in range(len(x)):
            xa[i] = x64[i] + sum(
                max(float(s32[i, j]), 0.0) ** alpha * x64[j] for j in rank[i][:dba]
            )
        xa = F.normalize(xa, dim=1)
    out = []
    for p, row in enumerate(ranking(s_short)):
        short = [j for j in row if not (same_set and j == p)][:depth]
        s = {g: float(q64[p] @ xa[g]) for g in short}
        if qe:
            top = sorted(short, key=lambda g: (-s[g], short.index(g)))[:qe]
            qq = F.normalize(q64[p] + sum(max(s[g], 0.0) ** alpha * xa[g] for g in top), dim=0)
            s = {g: float(qq @ xa[g]) for g in short}
        out.append(sorted(short, key=lambda g: (-s[g], short.index(g))))
    return out


@pytest.mark.parametrize(
    ("qe", "dba", "alpha", "same_set"),
    [c for c in itertools.product((0, 2), (0, 3), (3.0,), (True, False)) if c[0] or c[1]]
    + [(1, 1, 0.0, False)],
)
def test_query_expansion_matches_the_dense_method(qe, dba, alpha, same_set) -> None:
    g = torch.Generator().manual_seed(qe + 2 * dba)
    x = torch.randn(50, 6, generator=g) + 1.5 * F.one_hot(torch.arange(50) % 5, 6).float()
    q = torch.randn(9, 6, generator=g)
    depth = 12
    g32 = F.normalize(x.float(), dim=1)
    s_short = g32 @ g32.T if same_set else F.normalize(q.float(), dim=1) @ g32.T
    expected = dense_query_expansion(q, x, s_short, qe, dba, alpha, depth, same_set)
    shortlist = graph_of(s_short, depth) if same_set else lists_of(s_short, depth)
    rr = QueryExpansion(qe, dba, alpha, depth)
    prepared = rr.prepare(x, graph_of(g32 @ g32.T, max(dba, 1)))
    got = rr.rerank(shortlist, prepared, None if same_set else q)
    assert got.indices.tolist() == expected


def test_rerankers_explain_bad_input() -> None:
    x = torch.randn(10, 4)
    lists = neighbors_only(x, 3)
    with pytest.raises(ValueError, match="needs the gallery's own neighbour lists"):
        KReciprocal(k1=3, k2=2).prepare(x)
    with pytest.raises(ValueError, match="reads 5 neighbours per reference"):
        KReciprocal(k1=5, k2=2).prepare(x, lists)
    deeper = KReciprocal(k1=4, k2=2)
    with pytest.raises(ValueError, match="shortlists hold 3; search deeper"):
        deeper.rerank(lists, deeper.prepare(x, neighbors_only(x, 4)), x)
    with pytest.raises(ValueError, match="k2"):
        KReciprocal(k1=3, k2=6)
    with pytest.raises(ValueError, match="both 0"):
        QueryExpansion(0, 0)
    with pytest.raises(ValueError, match="cover 3 queries but there are 10"):
        QueryExpansion(1).rerank(
            NeighborLists(lists.indices[:3], lists.scores[:3]), QueryExpansion(1).prepare(x)
        )
