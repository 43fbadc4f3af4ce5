"""An alias of :mod:`idml.evaluation.search` for code that imports the engine as ``knn``."""

from idml.evaluation.search import (
    NeighborLists,
    RankChunk,
    SearchOutput,
    exact_search,
    faiss_search,
    neighbors_only,
)

__all__ = [
    "NeighborLists",
    "RankChunk",
    "SearchOutput",
    "exact_search",
    "faiss_search",
    "neighbors_only",
]
