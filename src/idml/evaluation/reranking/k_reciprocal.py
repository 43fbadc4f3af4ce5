"""k-reciprocal re-ranking (Zhong, Zheng, Cao & Li, CVPR 2017) on the sparse neighbour graph.

With ``d(a, b) = ‖a − b‖² / 4 = (1 − cos(a, b)) / 2 ∈ [0, 1]`` between unit vectors and each
node's ranking starting with itself:

1. **k-reciprocal sets** ``R(p, k)``: the ``j`` among ``p``'s ``k + 1`` nearest (itself included)
   that also have ``p`` among their ``k + 1`` nearest;
2. **expansion** ``R*(p) = R(p, k1) ∪ R(j, ⌊k1/2⌉)`` for every ``j ∈ R(p, k1)`` whose half set
   shares more than two thirds of its members with ``R(p, k1)``;
3. **Gaussian-kernel vectors** ``V_p[c] = exp(−d(p, c)) / Σ_{c' ∈ R*(p)} exp(−d(p, c'))`` on
   ``R*(p)``, then **local query expansion** ``V_p ← mean of V over p's k2 nearest`` (itself
   included);
4. **Jaccard distance** ``d_J(p, g) = 1 − Σ_c min(V_p[c], V_g[c]) / Σ_c max(V_p[c], V_g[c])``, and
   the final distance ``d* = (1 − λ)·d_J + λ·d``; the score returned is ``1 − 2·d*`` (the cosine
   when ``λ = 1``).

Everything lives on the graph: ``V`` has at most ``|R*|`` entries per node (sparse), the Jaccard
sums run over the shared support of two sparse rows, and only the pairs of each query's shortlist
are scored. Two deliberate differences from the paper's code:

* it divides squared distances by each row's *largest* distance, which needs the whole row; here
  by their largest possible value 4 (unit vectors), a fixed scale of the kernel ``exp(−d)``;
* with a separate query set (``queries`` given) each query is re-ranked **on its own** against the
  gallery's graph (the paper puts all queries in one graph with the gallery, so one query's result
  depends on the others): query ``q`` is a new node whose ``k``-reciprocity with a reference ``j``
  holds when ``q`` would enter ``j``'s ``k + 1`` nearest, i.e. ``cos(q, j) ≥`` the score of ``j``'s
  ``k``-th nearest other reference (ties favour the query); the gallery's own sets are those of
  the gallery alone. When the queries *are* the gallery (``queries=None``, the usual
  test-set-against-itself protocol), this is exactly the paper's method on that set.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
import torch
from torch import Tensor

from idml.evaluation.reranking.base import (
    Reranker,
    check_counts,
    check_gallery,
    check_queries,
    reorder,
    unit_rows,
)
from idml.evaluation.search import NeighborLists

CHUNK = 128
"""Queries whose Jaccard distances are computed at once (a dense ``CHUNK × R`` row block)."""
NODE_CHUNK = 2048
"""Nodes whose reciprocal sets are computed at once."""


@dataclass(frozen=True)
class KReciprocal(Reranker):
    """k-reciprocal re-ranking with ``k1``, ``k2`` and ``λ`` (module docstring); the paper's
    defaults ``k1 = 20, k2 = 6, λ = 0.3``."""

    k1: int = 20
    k2: int = 6
    lambda_value: float = 0.3
    shortlist: int = 100

    def __post_init__(self) -> None:
        check_counts(self, 1, k1=self.k1, k2=self.k2, shortlist=self.shortlist)
        if self.k2 > self.k1 + 1:
            raise ValueError(
                f"KReciprocal: k2 ({self.k2}) averages over a node's k2 nearest, which must be "
                f"within its k1 + 1 = {self.k1 + 1}"
            )
        if not 0.0 <= self.lambda_value <= 1.0:
            raise ValueError(
                f"KReciprocal: lambda_value must lie in [0, 1], got {self.lambda_value}"
            )

    @property
    def gallery_depth(self) -> int:
        return self.k1

    @property
    def name(self) -> str:
        return f"k_reciprocal(k1 {self.k1}, k2 {self.k2}, λ {self.lambda_value:g})"

    def prepare(
        self, gallery: Tensor, gallery_neighbors: NeighborLists | None = None
    ) -> ReciprocalGallery:
        """The gallery's reciprocal sets and kernel vectors (steps 1–3 for every reference),
        computed once per gallery: ``O(R·k1³)`` time, ``O(R·|R*|·k2)`` memory."""
        check_gallery(self, gallery, gallery_neighbors)
        assert gallery_neighbors is not None
        x = unit_rows(gallery)
        n_r = len(x)
        k1 = min(self.k1, n_r - 1)
        half = round(k1 / 2)  # as the paper's np.around: half to even
        k2 = min(self.k2, k1 + 1)
        graph_ids = gallery_neighbors.indices[:, :k1].cpu().long()
        nodes = torch.arange(n_r)
        nbr = torch.cat([nodes.unsqueeze(1), graph_ids], dim=1)  # itself first
        full = _gallery_reciprocal(nbr, k1)
        halves = _gallery_reciprocal(nbr, half)
        kernel = sp.vstack(
            [
                _kernel_rows(
                    x,
                    nodes[start : start + NODE_CHUNK],
                    _expand(part, _gather_sets(halves, part)),
                    n_r,
                )
                for start, part in zip(range(0, n_r, NODE_CHUNK), torch.split(full, NODE_CHUNK))
            ],
            format="csr",
        )
        return ReciprocalGallery(
            x,
            gallery_neighbors.scores[:, :k1].cpu().float(),
            halves,
            kernel,
            _average_rows(kernel, nbr[:, :k2]),
            k1,
            half,
            k2,
        )

    def rerank(
        self, shortlist: NeighborLists, prepared: ReciprocalGallery, queries: Tensor | None = None
    ) -> NeighborLists:
        g = prepared
        check_queries(self, shortlist, g.vectors, queries)
        ids = shortlist.indices.cpu().long()
        scores = shortlist.scores.cpu().float()
        if queries is None:
            v_queries = g.expanded
        else:
            if shortlist.k < g.k1:
                raise ValueError(
                    f"{self.name}: a query's k-reciprocal set reads its {g.k1} nearest "
                    f"references, but the shortlists hold {shortlist.k}; search deeper"
                )
            q = unit_rows(queries)
            q_full = _query_reciprocal(ids, scores, g.graph_scores, g.k1)
            q_half = _query_reciprocal(ids, scores, g.graph_scores, g.half)
            cand_halves = _gather_sets(g.halves, q_full)
            # The query's own half set stands in at its own position (column 0).
            cand_halves[:, 0, : q_half.shape[1]] = q_half
            cand_halves[:, 0, q_half.shape[1] :] = -1
            q_expanded = torch.cat(
                [
                    _expand(f, c)
                    for f, c in zip(
                        torch.split(q_full, NODE_CHUNK), torch.split(cand_halves, NODE_CHUNK)
                    )
                ]
            )
            v_queries = _query_kernel_rows(q, g.vectors, q_expanded, len(g.vectors))
            v_queries = _average_query_rows(v_queries, g.kernel, ids[:, : g.k2 - 1], g.k2)
        jaccard = _jaccard(v_queries, g.expanded, ids)
        final = (1 - self.lambda_value) * jaccard + self.lambda_value * (1 - scores.double()) / 2
        return reorder(ids, 1 - 2 * final)


@dataclass(frozen=True)
class ReciprocalGallery:
    """The gallery side of :class:`KReciprocal` (what an index keeps)."""

    vectors: Tensor
    """``(R, d)`` unit gallery vectors."""
    graph_scores: Tensor
    """``(R, k1)`` each reference's nearest-other scores (its ``k``-th decides a query's
    reciprocity)."""
    halves: Tensor
    """``(R, ⌊k1/2⌉ + 1)`` each reference's ``R(·, ⌊k1/2⌉)`` (``-1``: not a member)."""
    kernel: sp.csr_matrix
    """``(R, R)`` the kernel vectors ``V`` before local query expansion."""
    expanded: sp.csr_matrix
    """``(R, R)`` after it (what Jaccard distances compare)."""
    k1: int
    half: int
    k2: int


# --------------------------------------------------------------------------- reciprocal sets
QUERY = -2
"""Marks a query node in a query's own sets (it is no reference)."""


def _gallery_reciprocal(nbr: Tensor, k: int) -> Tensor:
    """``(R, k + 1)`` ids of ``R(p, k)`` for every reference ``p`` (``-1``: not a member)."""
    forward = nbr[:, : k + 1]
    out = torch.full_like(forward, -1)
    for start in range(0, len(nbr), NODE_CHUNK):
        part = forward[start : start + NODE_CHUNK]
        me = torch.arange(start, start + len(part)).view(-1, 1, 1)
        backward = nbr[part.clamp_min(0)][:, :, : k + 1]
        member = (backward == me).any(-1) & (part >= 0)
        out[start : start + len(part)] = torch.where(member, part, -1)
    return out


def _query_reciprocal(ids: Tensor, scores: Tensor, graph_scores: Tensor, k: int) -> Tensor:
    """``(Q, k + 1)`` ids of ``R(q, k)`` of queries outside the gallery: the query itself
    (:data:`QUERY`) and each of its ``k`` nearest references ``j`` with ``cos(q, j) ≥`` ``j``'s
    ``k``-th score (module docstring)."""
    own = torch.full((len(ids), 1), QUERY, dtype=torch.long)
    if k == 0:
        return own
    forward, s = ids[:, :k], scores[:, :k]
    kth = graph_scores[forward.clamp_min(0), k - 1]
    member = (forward >= 0) & (s >= kth)
    return torch.cat([own, torch.where(member, forward, -1)], dim=1)


def _gather_sets(sets: Tensor, members: Tensor) -> Tensor:
    """``(B, m, w)``: the set (rows of ``sets``) of each member of ``members`` ``(B, m)``
    (all ``-1`` for a non-member or a query node)."""
    out = sets[members.clamp_min(0)]
    return out.masked_fill((members < 0).unsqueeze(2), -1)


def _expand(full: Tensor, candidate_halves: Tensor) -> Tensor:
    """``R*(p)``: ``R(p, k1)`` plus the half set of each member sharing more than two thirds of
    its members with ``R(p, k1)``; ``(B, m + m·w)`` ids, duplicates and non-members ``-1``."""
    present = candidate_halves != -1
    size = present.sum(-1)
    shared = (
        ((candidate_halves.unsqueeze(-1) == full.unsqueeze(1).unsqueeze(1)) & present.unsqueeze(-1))
        .any(-1)
        .sum(-1)
    )
    # |C ∩ R| > 2/3 |C| in integers.
    take = (3 * shared > 2 * size) & (full != -1)
    added = candidate_halves.masked_fill(~take.unsqueeze(-1), -1).flatten(1)
    members = torch.cat([full, added], dim=1)
    members = torch.sort(members, dim=1).values
    duplicate = torch.zeros_like(members, dtype=torch.bool)
    duplicate[:, 1:] = members[:, 1:] == members[:, :-1]
    return members.masked_fill(duplicate, -1)


# --------------------------------------------------------------------------- kernel vectors
def _kernel_rows(x: Tensor, nodes: Tensor, members: Tensor, n_r: int) -> sp.csr_matrix:
    """``V_p`` of references ``nodes`` over their expanded sets ``members``, ``(B, R)`` CSR."""
    rows, cols = torch.nonzero(members >= 0, as_tuple=True)
    refs = members[rows, cols]
    dist = _distances(x[nodes[rows]], x[refs])
    return _normalised_csr(rows, refs, dist, len(nodes), n_r)


def _query_kernel_rows(q: Tensor, x: Tensor, members: Tensor, n_r: int) -> sp.csr_matrix:
    """``V_q`` of queries outside the gallery over the references of their expanded sets; the
    query's own entry (distance 0) counts in the normalisation but, matching no reference, is
    dropped from the row."""
    rows, cols = torch.nonzero(members >= 0, as_tuple=True)
    refs = members[rows, cols]
    dist = _distances(q[rows], x[refs])
    own = torch.ones(len(q), dtype=torch.float64)  # exp(−0) for the query itself
    return _normalised_csr(rows, refs, dist, len(q), n_r, extra_mass=own)


def _distances(a: Tensor, b: Tensor) -> Tensor:
    """``(1 − a·b) / 2`` row by row (float64), in pieces of bounded memory."""
    out = torch.empty(len(a), dtype=torch.float64)
    step = 1 << 16
    for start in range(0, len(a), step):
        part = slice(start, start + step)
        out[part] = (1 - (a[part] * b[part]).sum(1).double()) / 2
    return out.clamp(0, 1)


def _normalised_csr(
    rows: Tensor,
    cols: Tensor,
    dist: Tensor,
    n_rows: int,
    n_cols: int,
    extra_mass: Tensor | None = None,
) -> sp.csr_matrix:
    """CSR of ``exp(−dist)`` normalised per row (plus ``extra_mass`` in the row sums)."""
    w = torch.exp(-dist)
    total = torch.zeros(n_rows, dtype=torch.float64).index_add_(0, rows, w)
    if extra_mass is not None:
        total = total + extra_mass
    values = (w / total[rows]).numpy()
    return sp.csr_matrix((values, (rows.numpy(), cols.numpy())), shape=(n_rows, n_cols))


def _average_rows(v: sp.csr_matrix, nearest: Tensor) -> sp.csr_matrix:
    """Local query expansion: row ``p`` becomes the mean of the rows of ``nearest[p]``."""
    rows, cols = torch.nonzero(nearest >= 0, as_tuple=True)
    counts = (nearest >= 0).sum(1).double()
    weights = (1.0 / counts[rows]).numpy()
    average = sp.csr_matrix(
        (weights, (rows.numpy(), nearest[rows, cols].numpy())), shape=(len(nearest), v.shape[0])
    )
    return (average @ v).tocsr()


def _average_query_rows(
    v_queries: sp.csr_matrix, v_gallery: sp.csr_matrix, nearest: Tensor, k2: int
) -> sp.csr_matrix:
    """Local query expansion of queries outside the gallery: the mean of their own row and those
    of their ``k2 − 1`` nearest references (``nearest``)."""
    if k2 <= 1:
        return v_queries
    rows, cols = torch.nonzero(nearest >= 0, as_tuple=True)
    pick = sp.csr_matrix(
        (np.ones(len(rows)), (rows.numpy(), nearest[rows, cols].numpy())),
        shape=(len(nearest), v_gallery.shape[0]),
    )
    counts = 1 + (nearest >= 0).sum(1).double().numpy()
    return (sp.diags(1.0 / counts) @ (v_queries + pick @ v_gallery)).tocsr()


# --------------------------------------------------------------------------- Jaccard distance
def _jaccard(v_queries: sp.csr_matrix, v_gallery: sp.csr_matrix, ids: Tensor) -> Tensor:
    """``d_J(q, g)`` for every shortlist pair ``(q, ids[q, l])`` (``1`` for pads).

    Rows of ``V`` sum to 1 (kernel rows are normalised and averaging keeps that), so
    ``Σ max = 2 − Σ min`` and ``d_J = 1 − m / (2 − m)`` with ``m = Σ_c min(V_q[c], V_g[c])``.
    """
    v_gallery = v_gallery.tocsr()
    indptr, indices, data = v_gallery.indptr, v_gallery.indices, v_gallery.data
    n_q, length = ids.shape
    out = np.ones((n_q, length))
    ids_np = ids.numpy()
    for start in range(0, n_q, CHUNK):
        block = v_queries[start : start + CHUNK].toarray()
        pairs = ids_np[start : start + CHUNK].reshape(-1)
        valid = np.flatnonzero(pairs >= 0)
        refs = pairs[valid]
        counts = indptr[refs + 1] - indptr[refs]
        pair_of = np.repeat(np.arange(len(valid)), counts)
        offsets = np.arange(len(pair_of)) - np.repeat(np.cumsum(counts) - counts, counts)
        pos = indptr[refs][pair_of] + offsets
        query_row = valid[pair_of] // length
        mins = np.minimum(block[query_row, indices[pos]], data[pos])
        shared = np.bincount(pair_of, weights=mins, minlength=len(valid))
        flat = out[start : start + CHUNK].reshape(-1)
        flat[valid] = 1 - shared / (2 - shared)
        out[start : start + CHUNK] = flat.reshape(-1, length)
    return torch.from_numpy(out)
