"""α-query expansion and database-side augmentation (Radenović, Tolias & Chum 2019).

* **Database-side augmentation (DBA)**: every reference is replaced by the normalised weighted sum
  of itself and its ``n_d`` nearest other references, ``x'_g ∝ x_g + Σ_{j ≤ n_d} s(g, g_j)^α x_{g_j}``
  (from the gallery graph; computed once per gallery).
* **α-query expansion (αQE)**: the query is replaced by ``q' ∝ q + Σ_{i ≤ n_q} s(q, n_i)^α x'_{n_i}``
  over its ``n_q`` nearest (augmented) references, and re-scored: ``s'(q, g) = q' · x'_g``.

Negative similarities get weight 0 (``max(s, 0)^α``; α need not be an integer). Both are applied to
the query's shortlist only: the shortlist is re-scored with the augmented gallery (DBA), αQE takes
its top ``n_q`` from those scores, and the shortlist is re-ordered by ``s'``. The cost is
``O(Q·L·d)`` (plus ``O(R·n_d·d)`` once for DBA), next to the search's ``O(Q·R·d)``.

Example:
    >>> import torch
    >>> from idml.evaluation.search import NeighborLists
    >>> g = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.6, 0.8], [0.0, 1.0]])
    >>> q = torch.tensor([[0.9, 0.44]])
    >>> short = NeighborLists(torch.tensor([[1, 0, 2, 3]]), torch.tensor([[0.98, 0.9, 0.89, 0.44]]))
    >>> qe = QueryExpansion(query_neighbors=1, alpha=1.0)
    >>> qe.rerank(short, qe.prepare(g), queries=q).indices.tolist()
    [[1, 2, 0, 3]]
"""

from __future__ import annotations

from dataclasses import dataclass

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
"""Queries re-scored at once: ``CHUNK · L · d`` floats of gathered references at a time."""


@dataclass(frozen=True)
class QueryExpansion(Reranker):
    """αQE over ``query_neighbors`` and DBA over ``database_neighbors`` (module docstring).

    ``database_neighbors=0`` turns DBA off and ``query_neighbors=0`` αQE; ``shortlist`` is the
    length of the shortlist it is meant for.
    """

    query_neighbors: int = 2
    database_neighbors: int = 0
    alpha: float = 3.0
    shortlist: int = 100

    def __post_init__(self) -> None:
        check_counts(
            self,
            0,
            query_neighbors=self.query_neighbors,
            database_neighbors=self.database_neighbors,
        )
        check_counts(self, 1, shortlist=self.shortlist)
        if self.query_neighbors == 0 and self.database_neighbors == 0:
            raise ValueError("QueryExpansion: set query_neighbors or database_neighbors (both 0)")
        if not self.alpha >= 0:
            raise ValueError(f"QueryExpansion: alpha must be >= 0, got {self.alpha}")

    @property
    def gallery_depth(self) -> int:
        return self.database_neighbors

    @property
    def name(self) -> str:
        return (
            f"query_expansion(αQE {self.query_neighbors}, DBA {self.database_neighbors}, "
            f"α {self.alpha:g})"
        )

    def prepare(
        self, gallery: Tensor, gallery_neighbors: NeighborLists | None = None
    ) -> ExpansionGallery:
        """The unit gallery vectors and, with DBA, their augmented versions."""
        check_gallery(self, gallery, gallery_neighbors)
        x = unit_rows(gallery)
        augmented = x
        if self.database_neighbors > 0:
            assert gallery_neighbors is not None
            augmented = augment_database(x, gallery_neighbors, self.database_neighbors, self.alpha)
        return ExpansionGallery(x, augmented)

    def rerank(
        self, shortlist: NeighborLists, prepared: ExpansionGallery, queries: Tensor | None = None
    ) -> NeighborLists:
        check_queries(self, shortlist, prepared.vectors, queries)
        x = prepared.augmented
        # Queries are never augmented: in a same-set search they are the original vectors.
        q_all = prepared.vectors if queries is None else unit_rows(queries)
        indices = shortlist.indices.cpu().long()
        out_indices, out_scores = [], []
        for start in range(0, len(indices), CHUNK):
            ids = indices[start : start + CHUNK]
            q = q_all[start : start + CHUNK]
            refs = torch.index_select(x, 0, ids.clamp_min(0).flatten()).view(*ids.shape, -1)
            scores = _dots(refs, q).masked_fill(ids < 0, -torch.inf)
            if self.query_neighbors > 0:
                q = _expand(q, refs, scores, self.query_neighbors, self.alpha)
                scores = _dots(refs, q).masked_fill(ids < 0, -torch.inf)
            lists = reorder(ids, scores)
            out_indices.append(lists.indices)
            out_scores.append(lists.scores)
        if not out_indices:
            return NeighborLists(indices, shortlist.scores.cpu().float())
        return NeighborLists(torch.cat(out_indices), torch.cat(out_scores))


@dataclass(frozen=True)
class ExpansionGallery:
    """The gallery side of :class:`QueryExpansion`."""

    vectors: Tensor
    """``(R, d)`` unit gallery vectors (a same-set search's queries)."""
    augmented: Tensor
    """``(R, d)`` after DBA (``vectors`` itself without it): what queries are scored against."""


def augment_database(
    gallery: Tensor, gallery_neighbors: NeighborLists, neighbors: int, alpha: float
) -> Tensor:
    """DBA: ``x'_g ∝ x_g + Σ_{j ≤ n} max(s(g, g_j), 0)^α x_{g_j}`` for every reference (normalised
    rows of ``gallery``; ``gallery_neighbors`` exclude each reference itself)."""
    x = unit_rows(gallery)
    ids = gallery_neighbors.indices[:, :neighbors].cpu().long()
    weights = _weights(gallery_neighbors.scores[:, :neighbors].cpu().float(), ids, alpha)
    out = x.clone()
    for start in range(0, len(x), CHUNK):
        part = slice(start, start + CHUNK)
        out[part] += torch.einsum("bl,bld->bd", weights[part], x[ids[part].clamp_min(0)])
    return torch.nn.functional.normalize(out, dim=1)


def _expand(q: Tensor, refs: Tensor, scores: Tensor, neighbors: int, alpha: float) -> Tensor:
    """αQE of a chunk: ``q' ∝ q + Σ_{i ≤ n} max(s_i, 0)^α x_i`` over each query's ``n`` best
    shortlist entries by ``scores`` (ties by shortlist order)."""
    n = min(neighbors, scores.shape[1])
    top = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :n]
    top_scores = scores.gather(1, top)
    weights = _weights(top_scores, torch.where(torch.isfinite(top_scores), 0, -1), alpha)
    picked = refs.gather(1, top.unsqueeze(2).expand(-1, -1, refs.shape[2]))
    return torch.nn.functional.normalize(q + torch.einsum("bl,bld->bd", weights, picked), dim=1)


def _dots(refs: Tensor, q: Tensor) -> Tensor:
    """``(B, L)``: each query's dot product with each of its ``L`` gathered references."""
    return torch.bmm(refs, q.unsqueeze(2)).squeeze(2)


def _weights(scores: Tensor, ids: Tensor, alpha: float) -> Tensor:
    """``max(s, 0)^α``, 0 for missing neighbours (``ids < 0``)."""
    w = scores.clamp_min(0).pow(alpha)
    return torch.where(ids >= 0, w, torch.zeros_like(w))
