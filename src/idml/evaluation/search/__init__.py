"""Exact blocked retrieval: nearest neighbours and the rank of every relevant item, never N×N.

One pass over query × reference score tiles (``block × block``; see :mod:`idml.evaluation.scoring`)
produces two things at once:

1. the ``k`` nearest references of every query (:class:`NeighborLists`), and
2. the rank, in the query's full ranked gallery, of *every* relevant reference (same label), from
   which all retrieval metrics follow exactly (:mod:`idml.evaluation.retrieval_metrics`): Recall@K
   for any K, R-Precision, MAP@R, MAP over the whole gallery, MRR and precision–recall curves.

The package, one idea per module:

* :mod:`~idml.evaluation.search.exact` — :func:`exact_search`, the algorithm (band pass, main
  pass over tiles, finish);
* :mod:`~idml.evaluation.search.layout` — label-sorted order, relevant ranges, tiles;
* :mod:`~idml.evaluation.search.candidates` — sparse lists of the scores that can change a query;
* :mod:`~idml.evaluation.search.topk` — the running top-k merge;
* :mod:`~idml.evaluation.search.ranks` — relevant scores and the three rank-counting regimes;
* :mod:`~idml.evaluation.search.execution` — thread pool, per-block locks, progress, and
  :class:`SearchExecution`, the knobs of all that (block size, device, chunking, progress);
* :mod:`~idml.evaluation.search.faiss_backend` — :func:`faiss_search`, approximate;
* :mod:`~idml.evaluation.search.reference` — :func:`reference_search`, the dense specification.

When the query set *is* the reference set, scores are symmetric, so only tiles on and above the
diagonal are computed and each serves its rows and its columns: half the matrix products.

Conventions (those of the DML literature; Musgrave et al. 2020, "A Metric Learning Reality Check"):

* the query itself is excluded from its own ranking **by index** (an identical duplicate of the
  query is a legitimate neighbour);
* **ties**: in neighbour lists, equal scores are ordered by reference index, lower first (stable);
  in ranks (and so in every metric) a relevant item tied with non-relevant ones is ranked *after*
  them ("pessimistic" ranking) — identical or collapsed embeddings can never inflate a metric, and
  the result does not depend on the order of the data;
* memory is ``O(block² + N·(k + R_max))``; with very large classes (``N·R_max`` above
  :attr:`SearchExecution.max_rank_entries`) queries are processed in chunks and only the rows of each chunk are
  scored against all references (no symmetry saving).

Example:
    >>> import torch
    >>> x = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]])
    >>> labels = torch.tensor([0, 0, 1, 1])
    >>> out = exact_search(x, labels, k=2, execution=SearchExecution(block_size=3))
    >>> out.neighbors.indices.tolist()
    [[1, 3], [0, 3], [3, 1], [2, 1]]
    >>> [ranks.tolist() for _, ranks, _ in out.rank_chunks]
    [[[1], [1], [1], [1]]]
"""

from idml.evaluation.search.exact import exact_search, neighbor_search, neighbors_only
from idml.evaluation.search.execution import SearchExecution
from idml.evaluation.search.faiss_backend import faiss_search
from idml.evaluation.search.reference import reference_search
from idml.evaluation.search.results import NeighborLists, RankChunk, SearchOutput

__all__ = [
    "NeighborLists",
    "RankChunk",
    "SearchExecution",
    "SearchOutput",
    "exact_search",
    "faiss_search",
    "neighbor_search",
    "neighbors_only",
    "reference_search",
]
