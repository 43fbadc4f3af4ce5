"""Rank counting: the position of every relevant reference in its query's ranked gallery.

For a query with relevant references of scores ``v_1 ≥ … ≥ v_R``, the position of the t-th one is

    pos_t = t + #{non-relevant references i : score_i ≥ v_t}

(relevant items above it take ``t − 1`` places; a relevant item tied with non-relevant ones comes
after them). So the search needs, per query and per ``v_t``, a count of the non-relevant scores at
or above it:

1. the band pass (:func:`fill_relevant_scores`) computes every ``v_t`` first, per block of
   label-sorted queries (their relevant references are one contiguous range): the listed pairs
   alone when they are few, else the range's thin tile;
2. each tile then adds its non-relevant scores to the counts, in one of three regimes:
   sparse candidates searched one by one in their query's sorted ``v`` (:func:`count_sparse`,
   the usual case), the same with one batched search per query row when candidates and classes
   are both many, or the whole tile counted at once (:func:`count_dense`) once candidates are a
   large share of it (large classes);
3. :func:`final_ranks` turns the counts into positions.

Every relevant pair's score comes from exactly one computation (the band), so ranks are
consistent whatever the tiling.
"""

from __future__ import annotations

import torch
from torch import Tensor

from idml.evaluation.search.candidates import pad_by_row
from idml.evaluation.search.layout import Layout, PreparedSearch, TileSide
from idml.evaluation.search.state import INF, QueryState

DENSE_CANDIDATE_FRACTION = 16
"""Count on the whole tile once more than 1/this of its scores are count candidates."""

FLAT_COUNT_MAX_ENTRIES = 1 << 22
"""Above this many ``candidates × relevant`` entries, :func:`count_sparse` searches per row."""

BAND_BLOCK = 256
"""Queries per band tile: thin blocks keep the band (block + class span wide) a small share of the
work."""


def fill_relevant_scores(
    state: QueryState, search: PreparedSearch, chunk: slice, block: int
) -> None:
    """Scores of every (query, relevant reference) pair of ``chunk``, sorted ascending per query
    into ``state.relevant_scores`` (run once, before the tiles: the counts compare against them).

    Each block of label-sorted queries has its relevant references in the contiguous range
    spanned by its classes. Where they are a small share of that band (many small classes, as in
    SOP), only the relevant pairs are computed (:meth:`PreparedSearch.pair_scores`); where they
    fill much of it (a few large classes), or the scores are a general metric, the band's tile is.
    """
    r_max, layout = state.relevant_scores.shape[1], search.layout
    for b0 in range(chunk.start, chunk.stop, block):
        b1 = min(b0 + block, chunk.stop)
        n_rel = layout.num_relevant[b0:b1]
        if not bool((n_rel > 0).any()):
            continue
        start, end = layout.relevant_start[b0:b1], layout.relevant_end[b0:b1]
        lo, hi = int(start.min()), int(end.max())
        t = torch.arange(r_max, device=n_rel.device).unsqueeze(0)
        col = start.unsqueeze(1) - lo + t
        if layout.same_set:
            # Skip the query's own position inside its class range.
            own = (torch.arange(b0, b1, device=n_rel.device) - start).unsqueeze(1)
            col = col + (t >= own).long()
        valid = t < n_rel.unsqueeze(1)
        rows, band = slice(b0, b1), slice(lo, hi)
        if search.pairs_cheaper(int(n_rel.sum()), (b1 - b0) * (hi - lo)):
            q_local, slot = valid.nonzero(as_tuple=True)
            values = torch.full((b1 - b0, r_max), INF, device=n_rel.device)
            values[q_local, slot] = search.pair_scores(rows, band, q_local, col[q_local, slot])
        else:
            tile = search.tile(rows, band)
            values = tile.gather(1, col.clamp(max=hi - lo - 1)).masked_fill(~valid, INF)
        state.relevant_scores[b0 - chunk.start : b1 - chunk.start] = values.sort(dim=1).values


def count_side(
    state: QueryState,
    layout: Layout,
    side: TileSide,
    candidates: tuple[Tensor, Tensor, Tensor],
    least: Tensor,
) -> None:
    """Add one tile side's non-relevant scores to the counts of its queries.

    ``candidates`` is the side's sparse list (``(query, reference, score)``, reaching at least
    ``least``, each query's smallest relevant score). Relevant references are ranked by their own
    band scores, so only the others are counted.
    """
    if len(candidates[2]) * DENSE_CANDIDATE_FRACTION > side.tile.numel():
        # Large classes: counting over the whole tile is cheaper than one by one.
        count_dense(state, layout, side)
        return
    count_candidates(state, layout, side, candidates, least)


def count_candidates(
    state: QueryState,
    layout: Layout,
    side: TileSide,
    candidates: tuple[Tensor, Tensor, Tensor],
    least: Tensor,
) -> None:
    """:func:`count_side` on the sparse list alone (the candidates' scores are exact even when
    the side's tile is a screening one)."""
    q_local, ref_local, values = candidates
    if q_local.numel() == 0:
        return
    ref_pos = side.ref0 + ref_local
    q_pos = side.query0 + q_local
    relevant = (ref_pos >= layout.relevant_start[q_pos]) & (ref_pos < layout.relevant_end[q_pos])
    keep = (values >= least[q_local]) & ~relevant
    if bool(keep.any()):
        count_sparse(state, side.query_rows, q_local[keep], values[keep])


def count_dense(state: QueryState, layout: Layout, side: TileSide) -> None:
    """Relevant-rank counting over every score of the tile (the large-class regime).

    Same rule as :func:`count_sparse`: each non-relevant score lands in the bucket "how many of
    its query's relevant scores it reaches"; relevant references (a contiguous range per query in
    label-sorted order) are masked out first.
    """
    scores = side.scores
    n_q, n_ref = scores.shape
    q_pos = torch.arange(side.query0, side.query0 + n_q, device=scores.device)
    start = layout.relevant_start[q_pos] - side.ref0
    end = layout.relevant_end[q_pos] - side.ref0
    lo, hi = max(int(start.min()), 0), min(int(end.max()), n_ref)
    if lo < hi:
        # A private contiguous copy: the tile is still needed unmasked by the top-k step.
        scores = scores.clone(memory_format=torch.contiguous_format)
        cols = torch.arange(lo, hi, device=scores.device)
        mask = (cols >= start.unsqueeze(1)) & (cols < end.unsqueeze(1))
        scores[:, lo:hi].masked_fill_(mask, -INF)
    else:
        scores = scores.contiguous()
    thresholds = state.relevant_scores[side.query_rows]
    width = int((thresholds < INF).sum(1).max())
    if width == 0:
        return
    thresholds = thresholds[:, :width].contiguous()
    bucket = torch.searchsorted(thresholds, scores, right=True)
    hist = torch.zeros((n_q, width + 1), dtype=torch.long, device=scores.device)
    hist.scatter_add_(1, bucket, torch.ones_like(bucket))
    state.counts[side.query_rows, :width] += hist[:, 1:].flip(1).cumsum(1).flip(1)


def count_sparse(state: QueryState, query_rows: Tensor, q_local: Tensor, values: Tensor) -> None:
    """Add, per query and per relevant score ``v``, how many of the given scores are ``≥ v``.

    ``q_local`` is sorted. Every non-relevant score falls in the bucket "how many of its query's
    relevant scores (sorted ascending) it reaches"; a reversed cumulative histogram per query turns
    buckets into counts.
    """
    rows, per_row = torch.unique_consecutive(q_local, return_counts=True)
    state_rows = query_rows[rows]
    thresholds = state.relevant_scores[state_rows]
    width = int((thresholds < INF).sum(1).max())
    thresholds = thresholds[:, :width].contiguous()
    which = torch.repeat_interleave(torch.arange(len(rows), device=values.device), per_row)
    if len(values) * width <= FLAT_COUNT_MAX_ENTRIES:
        # Few candidates (the usual case): search each one in its own query's sorted scores.
        bucket = torch.searchsorted(thresholds[which], values.unsqueeze(1), right=True).squeeze(1)
    else:
        # Many candidates and large classes: one batched search per query row.
        _, padded, _ = pad_by_row(q_local, values)
        padded_bucket = torch.searchsorted(thresholds, padded, right=True)
        starts = torch.cumsum(per_row, 0) - per_row
        slot = torch.arange(len(values), device=values.device) - starts[which]
        bucket = padded_bucket[which, slot]
    hist = torch.bincount(which * (width + 1) + bucket, minlength=len(rows) * (width + 1))
    hist = hist.view(len(rows), width + 1)
    reached = hist[:, 1:].flip(1).cumsum(1).flip(1)
    state.counts[state_rows, :width] += reached


def final_ranks(state: QueryState, num_relevant: Tensor) -> Tensor:
    """1-based positions ``pos_t = t + count(v_t)`` of the relevant items, ascending; pads are 0."""
    n, r_max = state.counts.shape
    if r_max == 0:
        return torch.zeros((n, 0), dtype=torch.long, device=state.counts.device)
    t = torch.arange(r_max, device=state.counts.device).unsqueeze(0)
    # counts are stored for scores in ascending order; the t-th most similar is at R - 1 - t.
    source = (num_relevant.unsqueeze(1) - 1 - t).clamp_min(0)
    ranks = (t + 1) + state.counts.gather(1, source)
    return ranks.masked_fill(t >= num_relevant.unsqueeze(1), 0)
