"""Top-k merge: fold a tile's scores into each query's running best ``k``.

Order: score descending, reference index ascending on ties, so the lists do not depend on the
order in which tiles are merged. A query's first tiles (while its list is not yet full) are merged
densely (:func:`merge_dense`); later ones only through the sparse candidates at or above its k-th
score (:func:`merge_sparse`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from idml.evaluation.search.candidates import pad_by_row
from idml.evaluation.search.layout import TileSide
from idml.evaluation.search.state import INF, QueryState


def admission_threshold(state: QueryState, side: TileSide) -> Tensor:
    """Per query of ``side``: the least score that can still enter its top-k (``+inf``: none).

    Queries whose lists are not yet full take the tile's top-k densely here first; their threshold
    is then ``+inf``, as the tile has nothing more to give them.
    """
    rows = side.query_rows
    if state.k == 0:
        return torch.full((len(rows),), INF, device=side.tile.device)
    theta = state.kth_score[rows]
    fresh = theta == -INF
    if bool(fresh.any()):
        block = side.scores if bool(fresh.all()) else side.scores[fresh]
        merge_dense(state, rows[fresh], block.contiguous(), side.ref_ids)
        theta = theta.masked_fill(fresh, INF)
    return theta


def merge_dense(state: QueryState, rows: Tensor, candidates: Tensor, candidate_ids: Tensor) -> None:
    """Merge a tile's candidates for ``rows`` into their running top-k lists.

    ``candidates`` is ``(m, c)`` (rows of the tile), ``candidate_ids`` the ``(c,)`` original
    reference indices of its columns.
    """
    k = state.k
    c = candidates.shape[1]
    take = min(k + 1, c)
    values, positions = candidates.topk(take, dim=1)
    if c > k:
        boundary = values[:, k - 1]
        tied = (values[:, k] == boundary) & (boundary > -INF)
        if bool(tied.any()):
            # topk picks arbitrarily among equal scores at the k-th place: choose by index instead.
            tied_rows = tied.nonzero().flatten()
            block = candidates[tied_rows]
            b = boundary[tied_rows].unsqueeze(1)
            ids = candidate_ids.expand_as(block)
            # Key: -1 for scores above the boundary (all kept), the index for ties, +max otherwise.
            key = torch.where(block == b, ids, torch.full_like(ids, torch.iinfo(torch.long).max))
            key = key.masked_fill(block > b, -1)
            exact_positions = key.topk(k, dim=1, largest=False).indices
            positions = positions[:, :k].clone()
            positions[tied_rows] = exact_positions
            values = candidates.gather(1, positions)
        else:
            values, positions = values[:, :k], positions[:, :k]
    merge_sorted(state, rows, values, candidate_ids[positions])


def merge_sparse(
    state: QueryState, query_rows: Tensor, q_local: Tensor, ids: Tensor, values: Tensor
) -> None:
    """Merge sparse candidates ``(query, reference id, score)`` into the running top-k lists."""
    rows, padded, padded_ids = pad_by_row(q_local, values, ids)
    assert padded_ids is not None
    merge_sorted(state, query_rows[rows], padded, padded_ids)


def merge_sorted(state: QueryState, rows: Tensor, values: Tensor, ids: Tensor) -> None:
    """Keep the best ``k`` of the running lists of ``rows`` and the candidates.

    One top-k on a 64-bit key — an order-preserving integer image of the float32 score (tiles
    are float32: :meth:`PairScorer.prepare` casts), then the reversed index — instead of two
    stable sorts of the merged rows.
    """
    k = state.k
    merged_scores = torch.cat([state.top_scores[rows], values], dim=1)
    merged_ids = torch.cat([state.top_indices[rows], ids], dim=1)
    bits = merged_scores.float().view(torch.int32).long()
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    reversed_id = (1 << 31) - 1 - merged_ids.clamp(-1, (1 << 31) - 2)
    best = (ordered * (1 << 32) + reversed_id).topk(k, dim=1).indices
    state.top_scores[rows] = merged_scores.gather(1, best)
    state.top_indices[rows] = merged_ids.gather(1, best)
