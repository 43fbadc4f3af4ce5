"""The exact blocked search: one pass over score tiles gives neighbour lists and relevant ranks.

Per chunk of label-sorted queries:

1. **band pass** — the score of every (query, relevant reference) pair, sorted per query
   (:func:`~idml.evaluation.search.ranks.fill_relevant_scores`);
2. **main pass** — for every tile (:func:`~idml.evaluation.search.layout.tiles`), on each of its
   sides: list the scores that reach the query's current k-th score or its least relevant score
   (:mod:`~idml.evaluation.search.candidates`), merge those above the k-th score into the top-k
   (:mod:`~idml.evaluation.search.topk`) and count the non-relevant ones against the relevant
   scores (:mod:`~idml.evaluation.search.ranks`); tiles run on worker threads
   (:mod:`~idml.evaluation.search.execution`);
3. **finish** — ranks ``pos_t = t + count(v_t)`` and the lists in original query order.

Queries are chunked only when ``queries × max relevant`` exceeds
:attr:`SearchExecution.max_rank_entries`; then each chunk's rows are scored against all references
(no symmetric saving).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from idml.embeddings import Embeddings
from idml.evaluation.scoring import MetricSpec, PairScorer, side_rows
from idml.evaluation.search import ranks, topk
from idml.evaluation.search.candidates import candidates
from idml.evaluation.search.execution import (
    BlockLocks,
    Progress,
    SearchExecution,
    run_tiles,
    search_workers,
)
from idml.evaluation.search.layout import (
    Layout,
    PreparedSearch,
    TileSide,
    exclude_self,
    make_layout,
    num_tiles,
)
from idml.evaluation.search.layout import tiles as tile_order
from idml.evaluation.search.results import NeighborLists, SearchOutput
from idml.evaluation.search.state import INF, QueryState


def exact_search(
    query: Tensor | Embeddings,
    query_labels: Tensor,
    k: int,
    reference: Tensor | Embeddings | None = None,
    reference_labels: Tensor | None = None,
    *,
    metric: MetricSpec | PairScorer = "cosine",
    normalize: bool = True,
    execution: SearchExecution | None = None,
) -> SearchOutput:
    """Exact k-nearest neighbours and relevant ranks of ``query`` against ``reference``.

    Args:
        query: ``(Q, d)`` embeddings, or :class:`~idml.embeddings.Embeddings` whose uncertainty
            embeddings a metric that uses them (ISM) ranks by. ``reference=None`` searches the set
            against itself (each query excluded from its own ranking by index).
        query_labels: ``(Q,)`` integer labels (relevance = same label).
        k: neighbours to return per query (0 for none; capped at the number of references).
        reference, reference_labels: a separate gallery ``(R, d)`` (or its
            :class:`~idml.embeddings.Embeddings`) and its labels.
        metric: ``"cosine"``, ``"euclidean"``, a :class:`~idml.metrics.Metric` (e.g. ISM) or a
            ready :class:`~idml.evaluation.scoring.PairScorer`.
        normalize: L2-normalise embeddings first (plain metrics).
        execution: how the search runs (block size, device, chunking, progress; ``None``: the
            defaults); it changes nothing in the result, see :class:`SearchExecution`.

    Returns:
        :class:`SearchOutput` with neighbour lists in original index order and rank chunks.
    """
    if k < 0:
        raise ValueError(f"k (number of neighbours) must be >= 0, got {k}")
    scorer = metric if isinstance(metric, PairScorer) else PairScorer.from_spec(metric, normalize)
    execution = execution if execution is not None else SearchExecution()
    dev = execution.device_for(side_rows(query)[0].device)
    block_size = execution.block_size_on(dev)
    same_set = reference is None
    q_labels = torch.as_tensor(query_labels).to(dev).long()
    r_labels = None if same_set else torch.as_tensor(reference_labels).to(dev).long()
    layout = make_layout(q_labels, r_labels)
    n_q = len(q_labels)
    n_r = n_q if same_set else len(r_labels)  # type: ignore[arg-type]
    k = min(k, n_r - (1 if same_set else 0))
    search = _prepare(scorer, layout, dev, query, reference)
    chunk_len, symmetric = _chunking(
        layout, block_size, execution.max_rank_entries, scorer.symmetric
    )
    bar = Progress(execution.progress, num_tiles(n_q, n_r, block_size, symmetric))

    out_scores = torch.full((n_q, k), -INF, device=dev)
    out_indices = torch.full((n_q, k), -1, dtype=torch.long, device=dev)
    output = SearchOutput(NeighborLists(out_indices, out_scores), symmetric=symmetric)
    for c0 in range(0, n_q, chunk_len):
        chunk = slice(c0, min(n_q, c0 + chunk_len))
        chunk_r_max = int(layout.num_relevant[chunk].max()) if chunk.stop > c0 else 0
        state = QueryState(chunk.stop - c0, k, chunk_r_max, dev)
        # 1. The band pass: every relevant score, before any tile counts against them.
        band = min(block_size, ranks.BAND_BLOCK)
        ranks.fill_relevant_scores(state, search, chunk, band)
        # 2. The main pass over the tiles.
        tiles = _TileSearch(state, search, chunk)
        for _ in run_tiles(
            list(tile_order(chunk, n_r, block_size, symmetric)), tiles.process, search_workers(dev)
        ):
            output.num_tiles += 1
            bar(1)
        # 3. Ranks, and the lists in original query order.
        query_ids = layout.query_order[chunk]
        if k > 0:
            out_scores[query_ids] = state.top_scores
            out_indices[query_ids] = state.top_indices.masked_fill(
                ~torch.isfinite(state.top_scores), -1
            )
        n_rel = layout.num_relevant[chunk]
        output.rank_chunks.append((query_ids, ranks.final_ranks(state, n_rel), n_rel))
    bar(0, close=True)
    return output


def _prepare(
    scorer: PairScorer,
    layout: Layout,
    dev: torch.device,
    query: Tensor | Embeddings,
    reference: Tensor | Embeddings | None,
) -> PreparedSearch:
    """Both sides in label-sorted order, prepared for the scorer (their uncertainty only for a
    scorer that uses it)."""
    keep_unc = scorer.uses_uncertainty
    q_rows, q_unc = side_rows(query)
    q_sorted = q_rows.to(dev)[layout.query_order]
    qu = q_unc.to(dev)[layout.query_order] if keep_unc and q_unc is not None else None
    if reference is None:
        return PreparedSearch(scorer, *scorer.prepare(q_sorted, qu), layout)
    ref_rows, ref_unc = side_rows(reference)
    # A gallery already in label order (always, for neighbours without labels) is used as it is:
    # reordering would copy the whole gallery at every call, however few the queries.
    in_order = layout.ref_in_order
    ru = None
    if keep_unc and ref_unc is not None:
        ru = ref_unc.to(dev)
        ru = ru if in_order else ru[layout.ref_order]
    ref_rows = ref_rows.to(dev)
    refs = scorer.prepare_reference(ref_rows if in_order else ref_rows[layout.ref_order], ru)
    return PreparedSearch(scorer, scorer.prepare_side(q_sorted, qu), refs, layout)


def _chunking(
    layout: Layout, block_size: int, max_rank_entries: int, scorer_symmetric: bool
) -> tuple[int, bool]:
    """Queries per chunk so that ``chunk × max relevant ≤ max_rank_entries``, and whether the
    search is symmetric (one chunk of a same-set search with a symmetric score)."""
    n_q = len(layout.query_order)
    r_max = int(layout.num_relevant.max()) if n_q else 0
    chunk_len = n_q if r_max == 0 else max(1, min(n_q, max_rank_entries // r_max))
    symmetric = layout.same_set and chunk_len >= n_q and scorer_symmetric
    if symmetric:
        return n_q, True
    if chunk_len < n_q:
        # Chunks that are whole multiples of the block keep tiles square.
        chunk_len = max(block_size, (chunk_len // block_size) * block_size)
    return max(chunk_len, 1), False


@dataclass
class _TileSearch:
    """The main pass over the tiles of one chunk: score a tile, then update the queries along
    each of its sides (see :func:`_update_side`)."""

    state: QueryState
    search: PreparedSearch
    chunk: slice
    locks: BlockLocks = field(default_factory=BlockLocks)

    def process(self, rows: slice, cols: slice, both: bool) -> None:
        """Top-k merge and relevant-rank counting for one tile: its rows, and its columns if
        ``both`` (a symmetric search's off-diagonal tile serves the queries on both sides)."""
        tile, layout = self.search.tile(rows, cols), self.search.layout
        if layout.same_set:
            exclude_self(tile, rows.start, cols.start)
        ref_ids = layout.ref_order  # sorted reference position -> original index
        sides = [TileSide.of(tile, False, rows, self.chunk, cols.start, ref_ids[cols])]
        if both:
            sides.append(TileSide.of(tile, True, cols, self.chunk, rows.start, ref_ids[rows]))
        for side in sides:
            # Row blocks of the chunk and column blocks of the reference set start at the same
            # positions in a symmetric search, so one lock per start covers both roles.
            with self.locks[side.query0]:
                _update_side(self.state, layout, side)


def _update_side(state: QueryState, layout: Layout, side: TileSide) -> None:
    """Fold one tile side into its queries' top-k lists and relevant-rank counts.

    Only scores at or above the query's k-th best (top-k) or its least relevant score (counts)
    can change anything; one thresholding pass lists both kinds of candidates.
    """
    theta = topk.admission_threshold(state, side)
    least = state.least_relevant[side.query_rows]
    found = candidates(side.tile, torch.minimum(theta, least), side.transposed)
    q_local, ref_local, values = found
    if state.k > 0:
        keep = values >= theta[q_local]
        if bool(keep.any()):
            ids = side.ref_ids[ref_local[keep]]
            topk.merge_sparse(state, side.query_rows, q_local[keep], ids, values[keep])
    ranks.count_side(state, layout, side, found, least)


def neighbors_only(
    query: Tensor | Embeddings,
    k: int,
    reference: Tensor | Embeddings | None = None,
    **kwargs: object,
) -> NeighborLists:
    """Exact k-nearest neighbours without labels (no ranks): a convenience over :func:`exact_search`.

    Example:
        >>> import torch
        >>> neighbors_only(torch.eye(3), k=1, metric="euclidean").indices.flatten().tolist()
        [1, 0, 0]
    """
    rows = side_rows(query)[0]
    n_q = rows.shape[0]
    labels = torch.arange(n_q, device=rows.device)
    ref_labels = None
    if reference is not None:
        # Distinct labels on both sides: nothing is relevant, only neighbours are computed.
        n_r = side_rows(reference)[0].shape[0]
        ref_labels = torch.arange(n_q, n_q + n_r, device=rows.device)
    return exact_search(query, labels, k, reference, ref_labels, **kwargs).neighbors  # type: ignore[arg-type]
