"""The re-ranker interface: re-order each query's shortlist of nearest references.

A re-ranker takes the first ``L`` neighbours of every query from the exact search (its
*shortlist*) and returns them re-ordered, with new scores (larger = closer), never computing an
``N×N`` matrix: what it needs beyond the shortlist is the gallery's own neighbour lists (its
*graph*, searched once per gallery; in a same-set evaluation the search's own lists) and the
embeddings. References outside the shortlist keep their places behind it, so a re-ranked list is
exactly the dense method's order *restricted to the shortlist* (the usual practice: Zhong et al.
re-rank the whole gallery only because their galleries are small). The gallery's part of the work
is done once (:meth:`Reranker.prepare`, what an index keeps), each query batch's part per call
(:meth:`Reranker.rerank`).

Re-rankers work on the cosine similarity of L2-normalised embeddings (the search's default).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import Tensor

from idml.evaluation.search import NeighborLists


class Reranker(ABC):
    """Re-orders shortlists (module docstring) in two steps: :meth:`prepare` the gallery once
    (what an index stores), then :meth:`rerank` any number of query batches against it."""

    shortlist: int
    """The shortlist length it is meant for (a search should return at least this many)."""

    @property
    def depth(self) -> int:
        """:attr:`shortlist`: how deep a search for this re-ranker should go."""
        return self.shortlist

    @property
    @abstractmethod
    def gallery_depth(self) -> int:
        """Neighbours of each reference it reads from the gallery graph (0: no graph needed)."""

    @property
    @abstractmethod
    def name(self) -> str:
        """A short description with its parameters, for reports."""

    @abstractmethod
    def prepare(self, gallery: Tensor, gallery_neighbors: NeighborLists | None = None) -> Any:
        """The gallery side, computed once per gallery.

        Args:
            gallery: ``(R, d)`` the references' embeddings (normalised here).
            gallery_neighbors: ``(R, ≥ gallery_depth)`` each reference's nearest *other*
                references (cosine scores), when :attr:`gallery_depth` > 0.
        """

    @abstractmethod
    def rerank(
        self, shortlist: NeighborLists, prepared: Any, queries: Tensor | None = None
    ) -> NeighborLists:
        """The shortlists re-ordered, with the re-ranker's scores.

        Args:
            shortlist: ``(Q, L)`` each query's nearest references (cosine scores), ``-1`` pads.
            prepared: what :meth:`prepare` returned for the gallery.
            queries: ``(Q, d)`` the queries' embeddings; ``None`` when the queries *are* the
                gallery (query ``i`` is reference ``i``, excluded from its own shortlist).
        """


def check_counts(reranker: object, minimum: int, **counts: int) -> None:
    """Raise a clear error unless every ``counts`` value is an integer ``≥ minimum``."""
    for key, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(
                f"{type(reranker).__name__}: {key} must be an integer >= {minimum}, got {value!r}"
            )


def unit_rows(x: Tensor) -> Tensor:
    """Float32 rows scaled to unit length (what cosine scores were computed on)."""
    return torch.nn.functional.normalize(torch.as_tensor(x).detach().float(), dim=1)


def check_gallery(
    reranker: Reranker, gallery: Tensor, gallery_neighbors: NeighborLists | None
) -> None:
    """Clear errors for a missing or too shallow gallery graph."""
    n_r = gallery.shape[0]
    if reranker.gallery_depth == 0:
        return
    need = min(reranker.gallery_depth, n_r - 1)
    if gallery_neighbors is None or gallery_neighbors.indices.shape[0] != n_r:
        raise ValueError(
            f"{reranker.name} needs the gallery's own neighbour lists ({need} per reference); "
            "search the gallery against itself"
        )
    if gallery_neighbors.k < need:
        raise ValueError(
            f"{reranker.name} reads {need} neighbours per reference but the gallery lists hold "
            f"{gallery_neighbors.k}; search the gallery deeper"
        )


def check_queries(
    reranker: Reranker, shortlist: NeighborLists, gallery: Tensor, queries: Tensor | None
) -> None:
    """Clear errors for shortlists or queries that do not fit the prepared gallery."""
    n_q = gallery.shape[0] if queries is None else queries.shape[0]
    if queries is not None and queries.shape[1] != gallery.shape[1]:
        raise ValueError(
            f"{reranker.name}: queries have dimension {queries.shape[1]} but the gallery has "
            f"{gallery.shape[1]}"
        )
    if shortlist.indices.shape[0] != n_q:
        raise ValueError(
            f"{reranker.name}: the shortlists cover {shortlist.indices.shape[0]} queries but "
            f"there are {n_q}"
        )


def reorder(indices: Tensor, scores: Tensor) -> NeighborLists:
    """Lists sorted by ``scores`` descending; ties keep their shortlist order; pads last."""
    scores = scores.masked_fill(indices < 0, -torch.inf)
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    return NeighborLists(indices.gather(1, order), scores.gather(1, order).float())
