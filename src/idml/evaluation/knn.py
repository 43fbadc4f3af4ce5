"""Exact blocked retrieval: nearest neighbours and the rank of every relevant item, never N×N.

One pass over query × reference score tiles (``block × block``; see :mod:`idml.evaluation.scoring`)
produces two things at once:

1. the ``k`` nearest references of every query (:class:`NeighborLists`), and
2. the rank, in the query's full ranked gallery, of *every* relevant reference (same label), from
   which all retrieval metrics follow exactly (:mod:`idml.evaluation.retrieval_metrics`): Recall@K
   for any K, R-Precision, MAP@R, MAP over the whole gallery, MRR and precision–recall curves.

How the ranks are obtained without the N×N matrix. For a query with relevant references
``j_1..j_R`` (similarities ``v_1 ≥ … ≥ v_R``), the position of the t-th one in the ranked gallery is

    pos_t = t + #{non-relevant references i : score_i ≥ v_t}

(relevant items above it account for ``t − 1`` places). Because the data are processed in
label-sorted order, a query's relevant references form one contiguous range, so their scores
``v_t`` are computed first from one thin "band" tile per block of 256 queries. The main pass then
only has to count, per query and per ``v_t``, the non-relevant scores at or above it, and to merge
the scores at or above the query's current k-th best into its top-k. Both kinds of candidates are
rare: one thresholding pass per tile side lists them (NumPy on CPU), and they are handled as one
sparse list (a batched ``searchsorted`` of each score among its query's sorted ``v`` — relevant sets
are small — and a top-k merge on packed (score, index) keys). Every relevant pair's score comes
from exactly one computation, so ranks are consistent. On CPU, each intra-op thread takes whole
tiles (product and candidates, single-threaded) with a lock per query block; results do not depend
on the order in which tiles finish.

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
  ``max_rank_entries``) queries are processed in chunks and only the rows of each chunk are
  scored against all references (no symmetry saving).

Example:
    >>> import torch
    >>> x = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]])
    >>> out = exact_search(x, torch.tensor([0, 0, 1, 1]), k=2, block_size=3)
    >>> out.neighbors.indices.tolist()
    [[1, 3], [0, 3], [3, 1], [2, 1]]
    >>> [ranks.tolist() for _, ranks, _ in out.rank_chunks]
    [[[1], [1], [1], [1]]]
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed, wait
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from idml.evaluation.scoring import MetricSpec, PairScorer, PreparedSide

_INF = float("inf")
_DEFAULT_MAX_RANK_ENTRIES = 1 << 24


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


@dataclass
class _Layout:
    """Label-sorted views of queries and references and each query's relevant reference range."""

    query_order: Tensor  # sorted position -> original query index
    ref_order: Tensor  # sorted position -> original reference index
    relevant_start: Tensor  # per sorted query: first sorted reference of its class
    relevant_end: Tensor  # per sorted query: one past the last
    num_relevant: Tensor  # relevant references (self excluded)
    same_set: bool
    ref_in_order: bool = False  # separate references already in label order (ref_order = arange)


def _sort_order(labels: Tensor) -> tuple[Tensor, bool]:
    """Stable label order, and whether the labels were in order already (a gallery searched without
    labels always is): then no sort is needed, and callers skip the reordering copy."""
    if len(labels) < 2 or bool((labels[1:] >= labels[:-1]).all()):
        return torch.arange(len(labels), device=labels.device), True
    return torch.argsort(labels, stable=True), False


def _layout(query_labels: Tensor, ref_labels: Tensor | None) -> _Layout:
    same_set = ref_labels is None
    query_order, _ = _sort_order(query_labels)
    sorted_query_labels = query_labels[query_order]
    if same_set:
        ref_order, sorted_ref_labels, ref_in_order = query_order, sorted_query_labels, False
    else:
        assert ref_labels is not None
        ref_order, ref_in_order = _sort_order(ref_labels)
        sorted_ref_labels = ref_labels if ref_in_order else ref_labels[ref_order]
    start = torch.searchsorted(sorted_ref_labels, sorted_query_labels, right=False)
    end = torch.searchsorted(sorted_ref_labels, sorted_query_labels, right=True)
    num_relevant = end - start - (1 if same_set else 0)
    return _Layout(
        query_order, ref_order, start, end, num_relevant.clamp_min(0), same_set, ref_in_order
    )


class _QueryState:
    """Running top-k and relevant-rank counters of the queries of one chunk (sorted order)."""

    def __init__(self, n: int, k: int, r_max: int, device: torch.device) -> None:
        self.top_scores = torch.full((n, k), -_INF, device=device)
        self.top_indices = torch.full((n, k), -1, dtype=torch.long, device=device)
        # Relevant scores sorted ascending, padded with +inf (never reached by any score).
        self.relevant_scores = torch.full((n, r_max), _INF, device=device)
        self.counts = torch.zeros((n, r_max), dtype=torch.long, device=device)

    @property
    def kth_score(self) -> Tensor:
        return self.top_scores[:, -1]

    @property
    def least_relevant(self) -> Tensor:
        """The smallest relevant score per query (``+inf`` when it has none: never counted)."""
        if self.relevant_scores.shape[1] == 0:
            return self.relevant_scores.new_full((self.relevant_scores.shape[0],), _INF)
        return self.relevant_scores[:, 0]


def _merge_topk(
    state: _QueryState, rows: Tensor, candidates: Tensor, candidate_ids: Tensor
) -> None:
    """Merge a tile's candidates for ``rows`` into their running top-k lists.

    ``candidates`` is ``(m, c)`` (rows of the tile), ``candidate_ids`` the ``(c,)`` original
    reference indices of its columns. Order: score descending, reference index ascending on ties.
    """
    k = state.top_scores.shape[1]
    c = candidates.shape[1]
    take = min(k + 1, c)
    values, positions = candidates.topk(take, dim=1)
    if c > k:
        boundary = values[:, k - 1]
        tied = (values[:, k] == boundary) & (boundary > -_INF)
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
    _merge_sorted(state, rows, values, candidate_ids[positions])


def _exclude_self(tile: Tensor, row0: int, col0: int) -> None:
    """Set each query's own column to ``-inf`` (same-set search; by index, never by score)."""
    r, c = tile.shape
    lo, hi = max(row0, col0), min(row0 + r, col0 + c)
    if lo < hi:
        own = torch.arange(lo, hi, device=tile.device)
        tile[own - row0, own - col0] = -_INF


def _final_ranks(state: _QueryState, num_relevant: Tensor) -> Tensor:
    """1-based positions ``pos_t = t + count(v_t)`` of the relevant items, ascending; pads are 0."""
    n, r_max = state.counts.shape
    if r_max == 0:
        return torch.zeros((n, 0), dtype=torch.long, device=state.counts.device)
    t = torch.arange(r_max, device=state.counts.device).unsqueeze(0)
    # counts are stored for scores in ascending order; the t-th most similar is at R - 1 - t.
    source = (num_relevant.unsqueeze(1) - 1 - t).clamp_min(0)
    ranks = (t + 1) + state.counts.gather(1, source)
    return ranks.masked_fill(t >= num_relevant.unsqueeze(1), 0)


def exact_search(
    query: Tensor,
    query_labels: Tensor,
    k: int,
    reference: Tensor | None = None,
    reference_labels: Tensor | None = None,
    *,
    metric: MetricSpec | PairScorer = "cosine",
    normalize: bool = True,
    query_uncertainty: Tensor | None = None,
    reference_uncertainty: Tensor | None = None,
    block_size: int | None = None,
    device: torch.device | str | None = None,
    max_rank_entries: int = _DEFAULT_MAX_RANK_ENTRIES,
    progress: bool | Callable[[int], object] = False,
) -> SearchOutput:
    """Exact k-nearest neighbours and relevant ranks of ``query`` against ``reference``.

    Args:
        query: ``(Q, d)`` embeddings. ``reference=None`` searches the set against itself (each
            query excluded from its own ranking by index).
        query_labels: ``(Q,)`` integer labels (relevance = same label).
        k: neighbours to return per query (0 for none; capped at the number of references).
        reference, reference_labels: a separate gallery ``(R, d)`` and its labels.
        metric: ``"cosine"``, ``"euclidean"``, a :class:`~idml.metrics.Metric` (e.g. ISM) or a
            ready :class:`~idml.evaluation.scoring.PairScorer`.
        normalize: L2-normalise embeddings first (plain metrics).
        query_uncertainty, reference_uncertainty: uncertainty embeddings for ISM.
        block_size: tile side (default 2048 on CPU, 8192 on CUDA); memory is ``O(block²)``.
        device: where to compute (default: the device of ``query``).
        max_rank_entries: bound on ``queries × max relevant`` held at once; above it queries are
            chunked (and the symmetric saving is lost).
        progress: ``True`` for progress over tiles (:mod:`idml.progress`), or a callback
            receiving the tile count.

    Returns:
        :class:`SearchOutput` with neighbour lists in original index order and rank chunks.
    """
    if k < 0:
        raise ValueError(f"k (number of neighbours) must be >= 0, got {k}")
    scorer = metric if isinstance(metric, PairScorer) else PairScorer.from_spec(metric, normalize)
    dev = torch.device(device) if device is not None else query.device
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(dev)!r} requested but CUDA is not available; use 'cpu'")
    if block_size is None:
        block_size = 8192 if dev.type == "cuda" else 2048
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    same_set = reference is None
    q_labels = torch.as_tensor(query_labels).to(dev).long()
    r_labels = None if same_set else torch.as_tensor(reference_labels).to(dev).long()
    layout = _layout(q_labels, r_labels)
    n_q = len(q_labels)
    n_r = n_q if same_set else len(r_labels)  # type: ignore[arg-type]
    k = min(k, n_r - (1 if same_set else 0))

    q_sorted = query.to(dev)[layout.query_order]
    qu = None if query_uncertainty is None else query_uncertainty.to(dev)[layout.query_order]
    if same_set:
        queries, refs = scorer.prepare(q_sorted, qu)
    else:
        assert reference is not None
        queries = scorer.prepare_side(q_sorted, qu)
        ru = None
        # A gallery already in label order (always, for neighbours without labels) is used as it
        # is: reordering would copy the whole gallery at every call, however few the queries.
        in_order = layout.ref_in_order
        if reference_uncertainty is not None:
            ru = reference_uncertainty.to(dev)
            ru = ru if in_order else ru[layout.ref_order]
        ref_rows = reference.to(dev)
        refs = scorer.prepare_reference(ref_rows if in_order else ref_rows[layout.ref_order], ru)
    ref_ids = layout.ref_order  # sorted reference position -> original index

    r_max = int(layout.num_relevant.max()) if n_q else 0
    chunk_len = n_q if r_max == 0 else max(1, min(n_q, max_rank_entries // r_max))
    symmetric = same_set and chunk_len >= n_q and scorer.symmetric
    if symmetric:
        chunk_len = n_q
    elif chunk_len < n_q:
        # Chunks that are whole multiples of the block keep tiles square.
        chunk_len = max(block_size, (chunk_len // block_size) * block_size)

    n_blocks_r = math.ceil(n_r / block_size)
    if symmetric:
        n_blocks = math.ceil(n_q / block_size)
        total_tiles = n_blocks * (n_blocks + 1) // 2
    else:
        total_tiles = math.ceil(n_q / block_size) * n_blocks_r
    bar = _Progress(progress, total_tiles)

    out_scores = torch.full((n_q, max(k, 0)), -_INF, device=dev)
    out_indices = torch.full((n_q, max(k, 0)), -1, dtype=torch.long, device=dev)
    output = SearchOutput(NeighborLists(out_indices, out_scores), symmetric=symmetric)

    for c0 in range(0, n_q, chunk_len):
        chunk = slice(c0, min(n_q, c0 + chunk_len))
        n = chunk.stop - chunk.start
        chunk_r_max = int(layout.num_relevant[chunk].max()) if n else 0
        state = _QueryState(n, k, chunk_r_max, dev)
        # Thin query blocks keep the band (block + class span wide) a small fraction of the work.
        work = _TileWork(state, scorer, queries, refs, layout, chunk, ref_ids)
        work.fill_relevant_scores(min(block_size, 256))
        tiles = list(_tiles(chunk, n_r, block_size, symmetric))
        for _ in work.run(tiles, _search_workers(dev)):
            output.num_tiles += 1
            bar(1)
        query_ids = layout.query_order[chunk]
        if k > 0:
            finite = torch.isfinite(state.top_scores)
            out_scores[query_ids] = state.top_scores
            out_indices[query_ids] = torch.where(
                finite, state.top_indices, torch.full_like(state.top_indices, -1)
            )
        n_rel = layout.num_relevant[chunk]
        output.rank_chunks.append((query_ids, _final_ranks(state, n_rel), n_rel))
    bar(0, close=True)
    return output


def _tiles(
    chunk: slice, n_r: int, block: int, symmetric: bool
) -> Iterator[tuple[slice, slice, bool]]:
    """Tiles ``(rows, cols, serves_columns_too)`` in an order that visits references ascending."""
    for r0 in range(chunk.start, chunk.stop, block):
        rows = slice(r0, min(chunk.stop, r0 + block))
        first = r0 if symmetric else 0
        for c0 in range(first, n_r, block):
            cols = slice(c0, min(n_r, c0 + block))
            yield rows, cols, symmetric and c0 != r0


def _search_workers(device: torch.device) -> int:
    """Tiles processed at once: one per intra-op thread on CPU, one (the whole device) on CUDA."""
    return torch.get_num_threads() if device.type == "cpu" else 1


class _TileWork:
    """Computes tiles and folds them into the query state, sequentially or on a thread pool.

    On CPU each worker thread takes whole tiles, single-threaded: its own matrix product, then the
    candidate work. That has a higher throughput than one multi-threaded product followed by the
    (short, poorly parallel) candidate work, because the product scales poorly over threads and
    the candidate work not at all (``benchmarks/RESULTS.md``, Evaluation at SOP scale). A tile updates the queries of its
    row block (and of its column block when it serves both); a lock per block keeps two tiles
    from updating the same queries at once. Results do not depend on the order in which tiles
    finish: top-k merges keep the best ``k`` by (score, index) and counts add up.
    """

    def __init__(
        self,
        state: _QueryState,
        scorer: PairScorer,
        queries: PreparedSide,
        refs: PreparedSide,
        layout: _Layout,
        chunk: slice,
        ref_ids: Tensor,
    ) -> None:
        self.state, self.scorer, self.layout, self.chunk = state, scorer, layout, chunk
        self.queries, self.refs, self.ref_ids = queries, refs, ref_ids
        self._locks: dict[int, threading.Lock] = {}
        self._locks_guard = threading.Lock()

    def fill_relevant_scores(self, block: int) -> None:
        """Scores of every (query, relevant reference) pair of the chunk, sorted ascending per query
        (run once, before the tiles: the counts compare against them).

        Each block of label-sorted queries needs one thin tile: its relevant references are the
        contiguous range spanned by its classes.
        """
        r_max = self.state.relevant_scores.shape[1]
        for b0 in range(self.chunk.start, self.chunk.stop, block):
            b1 = min(b0 + block, self.chunk.stop)
            n_rel = self.layout.num_relevant[b0:b1]
            if not bool((n_rel > 0).any()):
                continue
            start, end = self.layout.relevant_start[b0:b1], self.layout.relevant_end[b0:b1]
            lo, hi = int(start.min()), int(end.max())
            band = self.scorer.tile(self.queries, self.refs, slice(b0, b1), slice(lo, hi))
            t = torch.arange(r_max, device=band.device).unsqueeze(0)
            col = start.unsqueeze(1) - lo + t
            if self.layout.same_set:
                # Skip the query's own position inside its class range.
                own = (torch.arange(b0, b1, device=band.device) - start).unsqueeze(1)
                col = col + (t >= own).long()
            valid = t < n_rel.unsqueeze(1)
            values = band.gather(1, col.clamp(max=hi - lo - 1))
            values = values.masked_fill(~valid, _INF)
            rows = slice(b0 - self.chunk.start, b1 - self.chunk.start)
            self.state.relevant_scores[rows] = values.sort(dim=1).values

    def run(self, tiles: list[tuple[slice, slice, bool]], workers: int) -> Iterator[None]:
        """Process ``tiles``, yielding once per finished tile (for progress)."""
        if workers <= 1 or len(tiles) <= 1:
            for rows, cols, both in tiles:
                self.process(rows, cols, both)
                yield
            return
        pool = _pool(workers)
        futures = [pool.submit(_single_threaded, self.process, *tile) for tile in tiles]
        try:
            for future in as_completed(futures):
                future.result()
                yield
        finally:
            for future in futures:
                future.cancel()
            wait(futures)

    def _lock(self, block_start: int) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(block_start, threading.Lock())

    def process(self, rows: slice, cols: slice, both: bool) -> None:
        """Top-k merge and relevant-rank counting for one tile: its rows, and its columns if
        ``both`` (a symmetric search's off-diagonal tile serves the queries on both sides)."""
        tile = self.scorer.tile(self.queries, self.refs, rows, cols)
        if self.layout.same_set:
            _exclude_self(tile, rows.start, cols.start)
        sides = [_TileSide.of(tile, False, rows, self.chunk, cols.start, self.ref_ids[cols])]
        if both:
            sides.append(_TileSide.of(tile, True, cols, self.chunk, rows.start, self.ref_ids[rows]))
        for side in sides:
            # Row blocks of the chunk and column blocks of the reference set start at the same
            # positions in a symmetric search, so one lock per start covers both roles.
            with self._lock(side.query0):
                _process_side(self.state, self.layout, side)


@dataclass(frozen=True)
class _TileSide:
    """The queries along one axis of a tile (its rows, or its columns when ``transposed``) against
    the references along the other."""

    tile: Tensor
    transposed: bool
    query0: int  # label-sorted position of the first query
    query_rows: Tensor  # the queries' rows in the chunk's state
    ref0: int  # label-sorted position of the first reference
    ref_ids: Tensor  # original indices of the references

    @staticmethod
    def of(
        tile: Tensor, transposed: bool, queries: slice, chunk: slice, ref0: int, ref_ids: Tensor
    ) -> _TileSide:
        rows = torch.arange(queries.start, queries.stop, device=tile.device) - chunk.start
        return _TileSide(tile, transposed, queries.start, rows, ref0, ref_ids)

    @property
    def scores(self) -> Tensor:
        """``(queries, references)`` view of the tile."""
        return self.tile.T if self.transposed else self.tile


_POOLS: dict[int, ThreadPoolExecutor] = {}


def _pool(workers: int) -> ThreadPoolExecutor:
    """A process-wide pool of ``workers`` threads for tile work."""
    if workers not in _POOLS:
        _POOLS[workers] = ThreadPoolExecutor(workers, thread_name_prefix="idml-search")
    return _POOLS[workers]


def _single_threaded(fn: Callable[..., None], *args: object) -> None:
    """Run ``fn`` with one intra-op thread (the setting is per thread under OpenMP and MKL)."""
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)
    fn(*args)


def _process_side(state: _QueryState, layout: _Layout, side: _TileSide) -> None:
    """Update the queries along one side of a tile.

    A query's running top-k changes only through scores ``≥`` its current k-th score, and its
    relevant ranks only through non-relevant scores ``≥`` its least relevant score. Both kinds of
    candidates are found in one thresholding pass over the tile; everything after that works on
    the sparse candidate list, unless the candidates are a large share of the tile (large
    classes), where counting over the whole tile is cheaper.
    """
    k = state.top_scores.shape[1]
    rows = side.query_rows
    theta = torch.full((len(rows),), _INF, device=side.tile.device)
    if k > 0:
        theta = state.kth_score[rows]
        fresh = theta == -_INF
        if bool(fresh.any()):
            # Lists not yet full: take the tile's top-k densely (first tiles of each query only).
            block = side.scores if bool(fresh.all()) else side.scores[fresh]
            _merge_topk(state, rows[fresh], block.contiguous(), side.ref_ids)
            theta = theta.masked_fill(fresh, _INF)
    least = state.least_relevant[rows]
    q_local, ref_local, values = _candidates(
        side.tile, torch.minimum(theta, least), side.transposed
    )
    # Large classes: count on the whole tile instead of handling most of its scores one by one;
    # only the top-k candidates are then used from the sparse list.
    dense = len(values) * _DENSE_CANDIDATE_FRACTION > side.tile.numel()
    if dense:
        _count_dense(state, layout, side)
    if k > 0:
        keep = values >= theta[q_local]
        if bool(keep.any()):
            ids = side.ref_ids[ref_local[keep]]
            _merge_sparse(state, rows, q_local[keep], ids, values[keep])
    if dense or q_local.numel() == 0:
        return
    # Relevant references are ranked by their own (band) scores: count only the others.
    ref_pos = side.ref0 + ref_local
    q_pos = side.query0 + q_local
    relevant = (ref_pos >= layout.relevant_start[q_pos]) & (ref_pos < layout.relevant_end[q_pos])
    keep = (values >= least[q_local]) & ~relevant
    if bool(keep.any()):
        _count_sparse(state, rows, q_local[keep], values[keep])


_DENSE_CANDIDATE_FRACTION = 16
"""Count on the whole tile once more than 1/this of its scores are count candidates."""


def _candidates(tile: Tensor, reach: Tensor, transposed: bool) -> tuple[Tensor, Tensor, Tensor]:
    """All ``(query, reference, score)`` with ``score ≥ reach[query]``, sorted by query.

    Queries are the rows of ``tile`` (its columns when ``transposed``); ``reach`` has one entry per
    query. One comparison pass in the tile's memory order, then the positions of the hits. On CPU
    this runs in NumPy (:func:`_candidates_numpy`), elsewhere in torch (:func:`_candidates_torch`);
    both return the same lists.
    """
    if tile.device.type == "cpu":
        return _candidates_numpy(tile, reach, transposed)
    return _candidates_torch(tile, reach, transposed)


def _candidates_torch(
    tile: Tensor, reach: Tensor, transposed: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`_candidates` with torch ops (any device)."""
    hit = tile >= (reach.unsqueeze(0) if transposed else reach.unsqueeze(1))
    major, minor = hit.nonzero(as_tuple=True)
    values = tile[major, minor]
    if not transposed:
        return major, minor, values
    order = minor.argsort(stable=True)
    return minor[order], major[order], values[order]


def _candidates_numpy(
    tile: Tensor, reach: Tensor, transposed: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`_candidates` on CPU with NumPy, whose vectorised compare and ``flatnonzero`` take a
    third of the time of torch's, and whose stable sort of small integer keys is a radix sort."""
    scores = tile.detach().numpy()
    bar = reach.numpy()
    flat = np.flatnonzero(scores >= (bar[None, :] if transposed else bar[:, None]))
    values = scores.reshape(-1)[flat]
    major, minor = np.divmod(flat, scores.shape[1])
    if transposed:
        narrow = np.int16 if scores.shape[1] <= np.iinfo(np.int16).max else np.int32
        order = np.argsort(minor.astype(narrow), kind="stable")
        major, minor, values = minor[order], major[order], values[order]
    return torch.from_numpy(major), torch.from_numpy(minor), torch.from_numpy(values)


def _count_dense(state: _QueryState, layout: _Layout, side: _TileSide) -> None:
    """Relevant-rank counting over every score of the tile (the large-class regime).

    Same rule as :func:`_count_sparse`: each non-relevant score lands in the bucket "how many of
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
        scores[:, lo:hi].masked_fill_(mask, -_INF)
    else:
        scores = scores.contiguous()
    thresholds = state.relevant_scores[side.query_rows]
    width = int((thresholds < _INF).sum(1).max())
    if width == 0:
        return
    thresholds = thresholds[:, :width].contiguous()
    bucket = torch.searchsorted(thresholds, scores, right=True)
    hist = torch.zeros((n_q, width + 1), dtype=torch.long, device=scores.device)
    hist.scatter_add_(1, bucket, torch.ones_like(bucket))
    state.counts[side.query_rows, :width] += hist[:, 1:].flip(1).cumsum(1).flip(1)


def _pad_by_row(
    q_local: Tensor, values: Tensor, extra: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Group a row-sorted sparse list into a padded ``(rows, max per row)`` matrix.

    Returns the distinct rows, the values padded with ``-inf`` and, if given, ``extra`` padded with
    the largest long (so pads sort after every real index).
    """
    rows, counts = torch.unique_consecutive(q_local, return_counts=True)
    width = int(counts.max())
    which = torch.repeat_interleave(torch.arange(len(rows), device=values.device), counts)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(len(values), device=values.device) - starts[which]
    padded = values.new_full((len(rows), width), -_INF)
    padded[which, slot] = values
    padded_extra = None
    if extra is not None:
        padded_extra = extra.new_full((len(rows), width), torch.iinfo(torch.long).max)
        padded_extra[which, slot] = extra
    return rows, padded, padded_extra


def _merge_sparse(
    state: _QueryState, query_rows: Tensor, q_local: Tensor, ids: Tensor, values: Tensor
) -> None:
    """Merge sparse candidates ``(query, reference id, score)`` into the running top-k lists."""
    rows, padded, padded_ids = _pad_by_row(q_local, values, ids)
    assert padded_ids is not None
    _merge_sorted(state, query_rows[rows], padded, padded_ids)


def _merge_sorted(state: _QueryState, rows: Tensor, values: Tensor, ids: Tensor) -> None:
    """Keep the best ``k`` of the running lists of ``rows`` and the candidates: score descending,
    reference index ascending on ties.

    One top-k on a 64-bit key — an order-preserving integer image of the float32 score (tiles
    are float32: :meth:`PairScorer.prepare` casts), then the reversed index — instead of two
    stable sorts of the merged rows.
    """
    k = state.top_scores.shape[1]
    merged_scores = torch.cat([state.top_scores[rows], values], dim=1)
    merged_ids = torch.cat([state.top_indices[rows], ids], dim=1)
    bits = merged_scores.float().view(torch.int32).long()
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    reversed_id = (1 << 31) - 1 - merged_ids.clamp(-1, (1 << 31) - 2)
    best = (ordered * (1 << 32) + reversed_id).topk(k, dim=1).indices
    state.top_scores[rows] = merged_scores.gather(1, best)
    state.top_indices[rows] = merged_ids.gather(1, best)


_FLAT_COUNT_MAX_ENTRIES = 1 << 22


def _count_sparse(state: _QueryState, query_rows: Tensor, q_local: Tensor, values: Tensor) -> None:
    """Add, per query and per relevant score ``v``, how many of the given scores are ``≥ v``.

    ``q_local`` is sorted. Every non-relevant score falls in the bucket "how many of its query's
    relevant scores (sorted ascending) it reaches"; a reversed cumulative histogram per query turns
    buckets into counts.
    """
    rows, per_row = torch.unique_consecutive(q_local, return_counts=True)
    state_rows = query_rows[rows]
    thresholds = state.relevant_scores[state_rows]
    width = int((thresholds < _INF).sum(1).max())
    thresholds = thresholds[:, :width].contiguous()
    which = torch.repeat_interleave(torch.arange(len(rows), device=values.device), per_row)
    if len(values) * width <= _FLAT_COUNT_MAX_ENTRIES:
        # Few candidates (the usual case): search each one in its own query's sorted scores.
        bucket = torch.searchsorted(thresholds[which], values.unsqueeze(1), right=True).squeeze(1)
    else:
        # Many candidates and large classes: one batched search per query row.
        _, padded, _ = _pad_by_row(q_local, values)
        padded_bucket = torch.searchsorted(thresholds, padded, right=True)
        starts = torch.cumsum(per_row, 0) - per_row
        slot = torch.arange(len(values), device=values.device) - starts[which]
        bucket = padded_bucket[which, slot]
    hist = torch.bincount(which * (width + 1) + bucket, minlength=len(rows) * (width + 1))
    hist = hist.view(len(rows), width + 1)
    reached = hist[:, 1:].flip(1).cumsum(1).flip(1)
    state.counts[state_rows, :width] += reached


class _Progress:
    """A progress bar or plain lines (:class:`idml.progress.Progress`), a user callback, or
    nothing, advanced once per tile."""

    def __init__(self, progress: bool | Callable[[int], object], total: int) -> None:
        self._bar = None
        self._callback: Callable[[int], object] | None = None
        if callable(progress):
            self._callback = progress
        elif progress:
            from idml.progress import Progress

            self._bar = Progress(total, "retrieval", unit="tile")

    def __call__(self, n: int, close: bool = False) -> None:
        if self._bar is not None:
            self._bar.update(n)
            if close:
                self._bar.close()
        elif self._callback is not None and n:
            self._callback(n)


def neighbors_only(
    query: Tensor,
    k: int,
    reference: Tensor | None = None,
    **kwargs: object,
) -> NeighborLists:
    """Exact k-nearest neighbours without labels (no ranks): a convenience over :func:`exact_search`.

    Example:
        >>> import torch
        >>> neighbors_only(torch.eye(3), k=1, metric="euclidean").indices.flatten().tolist()
        [1, 0, 0]
    """
    n_q = query.shape[0]
    labels = torch.arange(n_q, device=query.device)
    ref_labels = None
    if reference is not None:
        # Distinct labels on both sides: nothing is relevant, only neighbours are computed.
        ref_labels = torch.arange(n_q, n_q + reference.shape[0], device=query.device)
    return exact_search(query, labels, k, reference, ref_labels, **kwargs).neighbors  # type: ignore[arg-type]


def faiss_search(
    query: Tensor,
    k: int,
    reference: Tensor | None = None,
    *,
    metric: str = "cosine",
    normalize: bool = True,
    index_factory: str = "HNSW32",
    search_parameters: str | None = None,
) -> NeighborLists:
    """Approximate k-nearest neighbours with a faiss index (the optional ``faiss`` extra).

    For collections too large for exact search. ``index_factory`` is any faiss factory string
    (``"Flat"`` exact, ``"HNSW32"``, ``"IVF1024,Flat"``, ...); ``search_parameters`` are passed to
    ``faiss.ParameterSpace`` (e.g. ``"efSearch=128"`` or ``"nprobe=32"``). Cosine uses an
    inner-product index on normalised vectors, Euclidean an L2 index (score ``−||x − y||²``).
    With ``reference=None`` the set is searched against itself and each query's own index is
    removed from its list (by index; if the index missed it, the last neighbour is dropped). Tie
    order is faiss's.
    """
    try:
        import faiss
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ValueError(
            "the faiss backend needs the faiss package; `pip install idml[faiss]`"
        ) from err
    if metric not in ("cosine", "euclidean"):
        raise ValueError(f"faiss search supports metric 'cosine' or 'euclidean', got {metric!r}")
    if k < 1:
        raise ValueError(f"k (number of neighbours) must be >= 1, got {k}")
    same_set = reference is None
    ref = query if reference is None else reference
    if metric == "cosine" or normalize:
        query, ref = (
            torch.nn.functional.normalize(query.float(), dim=1),
            torch.nn.functional.normalize(ref.float(), dim=1),
        )
    q_np = query.detach().float().cpu().contiguous().numpy()
    r_np = ref.detach().float().cpu().contiguous().numpy()
    kind = faiss.METRIC_INNER_PRODUCT if metric == "cosine" else faiss.METRIC_L2
    index = faiss.index_factory(r_np.shape[1], index_factory, kind)
    if search_parameters:
        faiss.ParameterSpace().set_index_parameters(index, search_parameters)
    if not index.is_trained:
        index.train(r_np)
    index.add(r_np)
    extra = 1 if same_set else 0
    k_eff = min(k, len(r_np) - extra)
    if k_eff < 1:
        raise ValueError("the reference set has no item to return as a neighbour")
    distances, indices = index.search(q_np, k_eff + extra)
    scores = torch.from_numpy(distances)
    ids = torch.from_numpy(indices).long()
    if metric == "euclidean":
        scores = -scores
    if same_set:
        own = ids == torch.arange(len(ids)).unsqueeze(1)
        missing = ~own.any(1)
        own[missing, -1] = True
        keep = ~own
        ids = ids[keep].view(len(ids), k_eff)
        scores = scores[keep].view(len(ids), k_eff)
    scores = torch.where(ids < 0, torch.full_like(scores, -_INF), scores)
    return NeighborLists(ids, scores)
