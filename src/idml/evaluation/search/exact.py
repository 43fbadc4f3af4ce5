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

import threading
from dataclasses import dataclass, field

import torch
from torch import Tensor

from idml.embeddings import Embeddings
from idml.evaluation.scoring import MetricSpec, PairScorer, PreparedSide, side_rows
from idml.evaluation.search import ranks, topk
from idml.evaluation.search.candidates import candidates
from idml.evaluation.search.execution import (
    BlockLocks,
    Progress,
    SearchExecution,
    run_tiles,
    search_workers,
)
from idml.evaluation.search.kernels import (
    MEASURE_MIN_WORK,
    SCREEN_MIN_QUERIES,
    ScoreKernels,
    Screen,
    choose_kernels,
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
    n_r = n_q if r_labels is None else len(r_labels)
    k = min(k, n_r - (1 if same_set else 0))
    search = _prepare(scorer, layout, dev, query, reference, execution, block_size)
    chunk_len, symmetric = _chunking(
        layout, block_size, execution.max_rank_entries, scorer.symmetric
    )
    bar = Progress(execution.progress, num_tiles(n_q, n_r, block_size, symmetric))

    out_scores = torch.full((n_q, k), -INF, device=dev)
    out_indices = torch.full((n_q, k), -1, dtype=torch.long, device=dev)
    output = SearchOutput(
        NeighborLists(out_indices, out_scores),
        symmetric=symmetric,
        kernels=search.kernels.describe(),
    )
    for c0 in range(0, n_q, chunk_len):
        chunk = slice(c0, min(n_q, c0 + chunk_len))
        chunk_r_max = int(layout.num_relevant[chunk].max()) if chunk.stop > c0 else 0
        state = QueryState(chunk.stop - c0, k, chunk_r_max, dev)
        # 1. The band pass: every relevant score, before any tile counts against them.
        band = min(block_size, ranks.BAND_BLOCK)
        ranks.fill_relevant_scores(state, search, chunk, band)
        # 2. The main pass over the tiles.
        tiles = _TileSearch(state, search, chunk)
        workers = search_workers(dev)
        with search.kernels.threads(workers):
            for _ in run_tiles(
                list(tile_order(chunk, n_r, block_size, symmetric)), tiles.process, workers
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
    execution: SearchExecution,
    block_size: int,
) -> PreparedSearch:
    """Both sides in label-sorted order, prepared for the scorer (their uncertainty only for a
    scorer that uses it), with the score kernels chosen for this search (:func:`_kernels`)."""
    keep_unc = scorer.uses_uncertainty
    q_rows, q_unc = side_rows(query)
    q_sorted = q_rows.to(dev)[layout.query_order]
    qu = q_unc.to(dev)[layout.query_order] if keep_unc and q_unc is not None else None
    if reference is None:
        queries, refs = scorer.prepare(q_sorted, qu)
        kernels = _kernels(scorer, execution, dev, queries, refs, block_size)
        return PreparedSearch.create(scorer, queries, refs, layout, kernels)
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
    queries = scorer.prepare_side(q_sorted, qu)
    kernels = _kernels(scorer, execution, dev, queries, refs, block_size)
    return PreparedSearch.create(scorer, queries, refs, layout, kernels)


def _kernels(
    scorer: PairScorer,
    execution: SearchExecution,
    dev: torch.device,
    queries: PreparedSide,
    refs: PreparedSide,
    block_size: int,
) -> ScoreKernels:
    """The kernels of :attr:`SearchExecution.kernel`; ``"auto"`` measures only when the search
    is large enough for the choice to matter (:data:`MEASURE_MIN_WORK` multiply-adds) and its
    scores are plain products, and screens only a search of many queries
    (:data:`SCREEN_MIN_QUERIES`)."""
    requested = execution.kernel
    if scorer.kind == "metric":
        return ScoreKernels()
    n_q, dim = queries.vectors.shape
    work = n_q * refs.vectors.shape[0] * dim
    if requested == "auto" and work < MEASURE_MIN_WORK:
        return ScoreKernels()
    return choose_kernels(dev, dim, block_size, requested, screen=n_q >= SCREEN_MIN_QUERIES)


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
        ``both`` (a symmetric search's off-diagonal tile serves the queries on both sides).
        A screened search lists the candidates on the reduced-precision tile and re-scores them
        (:func:`_update_side_screened`)."""
        search = self.search
        tile = _Tile(search, rows, cols)
        for transposed in (False, True) if both else (False,):
            queries = cols if transposed else rows
            # Row blocks of the chunk and column blocks of the reference set start at the same
            # positions in a symmetric search, so one lock per start covers both roles.
            with self.locks[queries.start]:
                if search.screen is not None:
                    _update_side_screened(self.state, tile, transposed, self.chunk)
                else:
                    _update_side(self.state, search.layout, tile.side(transposed, self.chunk))


class _Tile:
    """One tile's scores: exact (computed on first use), and for a screened search the
    reduced-precision ones; self-pairs of a same-set search are ``-inf`` in both."""

    def __init__(self, search: PreparedSearch, rows: slice, cols: slice) -> None:
        self.search, self.rows, self.cols = search, rows, cols
        self._exact: Tensor | None = None
        self._lock = threading.Lock()
        self.screen: Tensor | None = None
        if search.screen is not None:
            self.screen = self._own(search.screen.tile(rows, cols))

    def _own(self, scores: Tensor) -> Tensor:
        if self.search.layout.same_set:
            exclude_self(scores, self.rows.start, self.cols.start)
        return scores

    def exact(self) -> Tensor:
        with self._lock:  # the two sides of a tile may ask at once
            if self._exact is None:
                self._exact = self._own(self.search.tile(self.rows, self.cols))
            return self._exact

    def side(self, transposed: bool, chunk: slice, screen: bool = False) -> TileSide:
        """The queries along the rows (or the columns, ``transposed``) of the exact (or screening)
        scores."""
        scores = self.screen if screen else self.exact()
        assert scores is not None
        ref_ids = self.search.layout.ref_order  # sorted reference position -> original index
        queries, refs = (self.cols, self.rows) if transposed else (self.rows, self.cols)
        return TileSide.of(scores, transposed, queries, chunk, refs.start, ref_ids[refs])


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


def _update_side_screened(state: QueryState, tile: _Tile, transposed: bool, chunk: slice) -> None:
    """:func:`_update_side` on a screened tile: candidates are listed on the reduced-precision
    scores with thresholds that no candidate can miss (:class:`~idml.evaluation.search.kernels.Screen`),
    re-scored exactly, and then treated as the exact search treats its candidates.

    A pair can matter only if its exact score reaches the query's k-th best ``θ`` or its least
    relevant score. A query whose top-k is still empty (its first tile) takes the tile's ``k``
    best: the k-th best screening score ``a_k`` bounds the tile's exact k-th best from below
    (``lower_bound(a_k)``), and so every pair of its exact top-k. When the candidates are a large
    share of the tile (large classes), the exact tile is computed and the side handled as in the
    exact search.
    """
    search, layout, screen = tile.search, tile.search.layout, tile.search.screen
    assert screen is not None
    side = tile.side(transposed, chunk, screen=True)
    rows = side.query_rows
    margin = screen.margins(tile.rows, tile.cols, transposed)
    least = state.least_relevant[rows]
    if state.k > 0:
        theta = state.kth_score[rows].clone()
        fresh = theta == -INF
        if bool(fresh.any()):
            scores = side.scores if bool(fresh.all()) else side.scores[fresh]
            # A column side's scores are a transposed view: top-k reads rows twice as fast.
            scores = scores.contiguous()
            take = min(state.k, scores.shape[1])
            kth = scores.topk(take, dim=1).values[:, -1].float()
            if take < state.k:  # fewer references than k: every one is a candidate
                kth = torch.full_like(kth, -INF)
            theta[fresh] = Screen.lower_bound(kth, margin[fresh])
    else:
        theta = torch.full_like(least, INF)
    reach = Screen.reach(torch.minimum(theta, least), margin)
    q_local, ref_local, screened = candidates(side.tile, reach, transposed)
    if len(screened) * ranks.DENSE_CANDIDATE_FRACTION > side.tile.numel():
        _update_side(state, layout, tile.side(transposed, chunk))
        return
    real = screened > -INF  # a same-set search's own pairs are excluded, never re-scored
    q_local, ref_local = q_local[real], ref_local[real]
    values = search.rescore(side, q_local, ref_local)
    if state.k > 0:
        keep = values >= theta[q_local]
        if bool(keep.any()):
            ids = side.ref_ids[ref_local[keep]]
            topk.merge_sparse(state, side.query_rows, q_local[keep], ids, values[keep])
    ranks.count_candidates(state, layout, side, (q_local, ref_local, values), least)


def neighbor_search(
    query: Tensor | Embeddings,
    k: int,
    reference: Tensor | Embeddings | None = None,
    *,
    metric: MetricSpec | PairScorer = "cosine",
    normalize: bool = True,
    execution: SearchExecution | None = None,
) -> SearchOutput:
    """Exact k-nearest neighbours without labels (no ranks are counted), with what computed the
    scores (:attr:`SearchOutput.kernels`): :func:`exact_search` where no reference is relevant to
    any query, so nothing below a query's k-th best score is ever listed."""
    rows = side_rows(query)[0]
    n_q = rows.shape[0]
    labels = torch.arange(n_q, device=rows.device)
    ref_labels = None
    if reference is not None:
        # Distinct labels on both sides: nothing is relevant, only neighbours are computed.
        n_r = side_rows(reference)[0].shape[0]
        ref_labels = torch.arange(n_q, n_q + n_r, device=rows.device)
    return exact_search(
        query,
        labels,
        k,
        reference,
        ref_labels,
        metric=metric,
        normalize=normalize,
        execution=execution,
    )


def neighbors_only(
    query: Tensor | Embeddings,
    k: int,
    reference: Tensor | Embeddings | None = None,
    *,
    metric: MetricSpec | PairScorer = "cosine",
    normalize: bool = True,
    execution: SearchExecution | None = None,
) -> NeighborLists:
    """Exact k-nearest neighbours without labels (no ranks): :func:`neighbor_search`'s lists.

    Example:
        >>> import torch
        >>> neighbors_only(torch.eye(3), k=1, metric="euclidean").indices.flatten().tolist()
        [1, 0, 0]
    """
    return neighbor_search(
        query, k, reference, metric=metric, normalize=normalize, execution=execution
    ).neighbors
