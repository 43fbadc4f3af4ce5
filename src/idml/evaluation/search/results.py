"""What a search returns: neighbour lists and the ranks of the relevant references."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor


@dataclass
class NeighborLists:
    """The ``k`` nearest references of each query.

    ``indices[q, i]`` is the reference index of the i-th nearest neighbour of query ``q`` (``-1``
    where fewer than ``k`` references exist); ``scores`` are the matching scores (larger = closer;
    see :class:`~idml.evaluation.scoring.PairScorer`, whose ``values`` turns them into similarities
    or distances).
    """

    indices: Tensor
    scores: Tensor

    @property
    def k(self) -> int:
        """Neighbours per query."""
        return int(self.indices.shape[1])


RankChunk = tuple[Tensor, Tensor, Tensor]
"""``(query_indices (n,), ranks (n, R_max), num_relevant (n,))``: 1-based ranks of the relevant
references of each query in ascending order; entries past ``num_relevant`` are 0."""


@dataclass
class SearchOutput:
    """Neighbour lists plus the relevant ranks, in chunks of queries (see :data:`RankChunk`)."""

    neighbors: NeighborLists
    rank_chunks: list[RankChunk] = field(default_factory=list)
    symmetric: bool = False
    num_tiles: int = 0
    kernels: str = "torch (fp32)"
    """Which products computed the scores (:meth:`~idml.evaluation.search.kernels.ScoreKernels.describe`)."""
