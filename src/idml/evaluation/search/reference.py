"""The dense reference search: the specification of :func:`~idml.evaluation.search.exact_search`.

It scores the whole ``Q × R`` matrix at once and reads neighbours and ranks off sorted rows, so it
is only for small inputs (tests check the blocked engine against it). The rules it states:

* a same-set search excludes each query from its own ranking **by index**;
* neighbour lists are ordered by score descending, then reference index ascending;
* the rank of a relevant reference is its 1-based position when the gallery is ordered by score
  descending with non-relevant references first among equal scores ("pessimistic" ties).

Example:
    >>> import torch
    >>> x = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]])
    >>> out = reference_search(x, torch.tensor([0, 0, 1, 1]), k=2)
    >>> out.neighbors.indices.tolist(), out.rank_chunks[0][1].tolist()
    ([[1, 3], [0, 3], [3, 1], [2, 1]], [[1], [1], [1], [1]])
"""

from __future__ import annotations

import torch
from torch import Tensor

from idml.evaluation.scoring import MetricSpec, PairScorer
from idml.evaluation.search.results import NeighborLists, SearchOutput
from idml.evaluation.search.state import INF


def reference_search(
    query: Tensor,
    query_labels: Tensor,
    k: int,
    reference: Tensor | None = None,
    reference_labels: Tensor | None = None,
    *,
    metric: MetricSpec | PairScorer = "cosine",
    normalize: bool = True,
) -> SearchOutput:
    """Neighbours and relevant ranks from the full score matrix: the arguments and the output of
    :func:`~idml.evaluation.search.exact_search` (one rank chunk holding every query), less its
    uncertainty embeddings and its :class:`~idml.evaluation.search.SearchExecution`, which changes
    nothing in the result."""
    scorer = metric if isinstance(metric, PairScorer) else PairScorer.from_spec(metric, normalize)
    same_set = reference is None
    q_labels = torch.as_tensor(query_labels).long()
    r_labels = q_labels if same_set else torch.as_tensor(reference_labels).long()
    if reference is None:
        q_side, r_side = scorer.prepare(query)
    else:
        q_side, r_side = scorer.prepare_side(query), scorer.prepare_reference(reference)
    everything = slice(None)
    scores = scorer.tile(q_side, r_side, everything, everything)
    n_q, n_r = scores.shape
    ids = torch.arange(n_r).expand(n_q, n_r)
    # Each row's candidates: every reference but the query itself.
    keep = (
        ids != torch.arange(n_q).unsqueeze(1)
        if same_set
        else torch.ones_like(ids, dtype=torch.bool)
    )
    width = n_r - (1 if same_set else 0)
    cand_ids, cand_scores = ids[keep].view(n_q, width), scores[keep].view(n_q, width)
    relevant = r_labels[cand_ids] == q_labels.unsqueeze(1)

    # Neighbours: a stable sort by score keeps ties in index order.
    order = torch.sort(cand_scores, dim=1, descending=True, stable=True).indices[:, :k]
    top_scores = cand_scores.gather(1, order)
    top_ids = cand_ids.gather(1, order).masked_fill(~torch.isfinite(top_scores), -1)
    top_scores = top_scores.masked_fill(~torch.isfinite(top_scores), -INF)

    # Ranks: non-relevant first (stable), then by score: ties then keep relevant items last.
    by_relevance = torch.sort(relevant.long(), dim=1, stable=True).indices
    by_score = torch.sort(cand_scores.gather(1, by_relevance), dim=1, descending=True, stable=True)
    ranked_relevant = relevant.gather(1, by_relevance.gather(1, by_score.indices))
    num_relevant = relevant.sum(1)
    r_max = int(num_relevant.max()) if n_q else 0
    ranks = torch.zeros((n_q, r_max), dtype=torch.long)
    for q in range(n_q):
        positions = ranked_relevant[q].nonzero().flatten() + 1
        ranks[q, : len(positions)] = positions
    chunk = (torch.arange(n_q), ranks, num_relevant)
    return SearchOutput(NeighborLists(top_ids, top_scores), [chunk], symmetric=False)
