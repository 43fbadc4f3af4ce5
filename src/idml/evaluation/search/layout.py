"""Tiling and layout: label-sorted order, each query's relevant range, and the tiles to visit.

Queries and references are processed in stable label order, so the relevant references of a query
(same label) form one contiguous range ``[relevant_start, relevant_end)`` of sorted reference
positions. The score matrix is cut into ``block × block`` tiles; when the query set is the
reference set and the scores are symmetric, only the tiles on and above the diagonal are visited,
each serving its rows and its columns (:class:`TileSide`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from idml.evaluation.scoring import PairScorer, PreparedSide
from idml.evaluation.search.kernels import ScoreKernels, Screen, rescore_pairs
from idml.evaluation.search.state import INF


@dataclass
class Layout:
    """Label-sorted views of queries and references and each query's relevant reference range."""

    query_order: Tensor  # sorted position -> original query index
    ref_order: Tensor  # sorted position -> original reference index
    relevant_start: Tensor  # per sorted query: first sorted reference of its class
    relevant_end: Tensor  # per sorted query: one past the last
    num_relevant: Tensor  # relevant references (self excluded)
    same_set: bool
    ref_in_order: bool = False  # separate references already in label order (ref_order = arange)


@dataclass(frozen=True)
class PreparedSearch:
    """Both sides of a search in label-sorted order, prepared for the scorer that scores their
    tiles, and their layout: what every pass over the tiles reads.

    ``kernels`` compute the plain metrics' products (:mod:`~idml.evaluation.search.kernels`);
    ``screen``, when the kernels have one, gives reduced-precision tiles on which candidates are
    listed before :meth:`rescore` computes their exact scores.
    """

    scorer: PairScorer
    queries: PreparedSide
    refs: PreparedSide
    layout: Layout
    kernels: ScoreKernels = field(default_factory=ScoreKernels)
    screen: Screen | None = None

    @classmethod
    def create(
        cls,
        scorer: PairScorer,
        queries: PreparedSide,
        refs: PreparedSide,
        layout: Layout,
        kernels: ScoreKernels | None = None,
    ) -> PreparedSearch:
        """The search, with the screen of ``kernels`` when it has one and the scores are plain
        products (a general metric such as ISM is always computed exactly)."""
        kernels = kernels if kernels is not None else ScoreKernels()
        if kernels.screen is None or scorer.kind == "metric":
            return cls(scorer, queries, refs, layout, replace(kernels, screen=None, margin=0.0))
        screen = Screen.of(queries.vectors, refs.vectors, kernels)
        return cls(scorer, queries, refs, layout, kernels, screen)

    def tile(self, rows: slice, cols: slice) -> Tensor:
        """Scores between the sorted queries ``rows`` and the sorted references ``cols``."""
        return self.scorer.tile(self.queries, self.refs, rows, cols, self.kernels.product)

    PAIR_COST = 16
    """A listed pair costs about this many entries of a tile product (a sampled product of one
    pair per listed entry against a GEMM's blocked reuse; measured on CPU, 512-d fp32:
    ``rescore_pairs`` 4·10⁹ multiply-adds a second against 5·10¹⁰ for a 1024² tile)."""

    def pairs_cheaper(self, pairs: int, tile_entries: int) -> bool:
        """Whether :meth:`pair_scores` of ``pairs`` listed pairs costs less than the tile of
        ``tile_entries`` scores they lie in (plain products only: a general metric is scored by
        its tiles)."""
        return self.scorer.kind != "metric" and pairs * self.PAIR_COST < tile_entries

    def pair_scores(self, rows: slice, cols: slice, q_local: Tensor, ref_local: Tensor) -> Tensor:
        """Exact fp32 scores of the pairs ``(rows.start + q_local[j], cols.start + ref_local[j])``
        of sorted positions (``q_local`` ascending), computing nothing else; plain products only
        (:meth:`pairs_cheaper`)."""
        assert self.scorer.kind != "metric"
        return rescore_pairs(
            self.queries.vectors[rows], self.refs.vectors[cols], q_local, ref_local
        )

    def rescore(self, side: TileSide, q_local: Tensor, ref_local: Tensor) -> Tensor:
        """Exact fp32 scores of the pairs ``(q_local[j], ref_local[j])`` of one tile side
        (sorted by query), whatever the screen said of them."""
        rows, cols = self.queries.vectors, self.refs.vectors
        n_q, n_r = side.tile.shape[::-1] if side.transposed else side.tile.shape
        if side.transposed:  # the side's queries are the tile's columns: references' rows
            q_rows, r_rows = (
                cols[side.query0 : side.query0 + n_q],
                rows[side.ref0 : side.ref0 + n_r],
            )
        else:
            q_rows, r_rows = (
                rows[side.query0 : side.query0 + n_q],
                cols[side.ref0 : side.ref0 + n_r],
            )
        return rescore_pairs(q_rows, r_rows, q_local, ref_local)


def sort_order(labels: Tensor) -> tuple[Tensor, bool]:
    """Stable label order, and whether the labels were in order already (a gallery searched without
    labels always is): then no sort is needed, and callers skip the reordering copy."""
    if len(labels) < 2 or bool((labels[1:] >= labels[:-1]).all()):
        return torch.arange(len(labels), device=labels.device), True
    return torch.argsort(labels, stable=True), False


def make_layout(query_labels: Tensor, ref_labels: Tensor | None) -> Layout:
    """The layout of a search of ``query_labels`` against ``ref_labels`` (``None``: themselves)."""
    same_set = ref_labels is None
    query_order, _ = sort_order(query_labels)
    sorted_query_labels = query_labels[query_order]
    if same_set:
        ref_order, sorted_ref_labels, ref_in_order = query_order, sorted_query_labels, False
    else:
        assert ref_labels is not None
        ref_order, ref_in_order = sort_order(ref_labels)
        sorted_ref_labels = ref_labels.contiguous() if ref_in_order else ref_labels[ref_order]
    start = torch.searchsorted(sorted_ref_labels, sorted_query_labels, right=False)
    end = torch.searchsorted(sorted_ref_labels, sorted_query_labels, right=True)
    num_relevant = end - start - (1 if same_set else 0)
    return Layout(
        query_order, ref_order, start, end, num_relevant.clamp_min(0), same_set, ref_in_order
    )


def tiles(
    chunk: slice, n_r: int, block: int, symmetric: bool
) -> Iterator[tuple[slice, slice, bool]]:
    """Tiles ``(rows, cols, serves_columns_too)`` in an order that visits references ascending."""
    for r0 in range(chunk.start, chunk.stop, block):
        rows = slice(r0, min(chunk.stop, r0 + block))
        first = r0 if symmetric else 0
        for c0 in range(first, n_r, block):
            cols = slice(c0, min(n_r, c0 + block))
            yield rows, cols, symmetric and c0 != r0


def num_tiles(n_q: int, n_r: int, block: int, symmetric: bool) -> int:
    """How many tiles :func:`tiles` yields over all queries."""
    n_rows, n_cols = -(-n_q // block), -(-n_r // block)
    return n_rows * (n_rows + 1) // 2 if symmetric else n_rows * n_cols


def exclude_self(tile: Tensor, row0: int, col0: int) -> None:
    """Set each query's own column to ``-inf`` (same-set search; by index, never by score)."""
    r, c = tile.shape
    lo, hi = max(row0, col0), min(row0 + r, col0 + c)
    if lo < hi:
        own = torch.arange(lo, hi, device=tile.device)
        tile[own - row0, own - col0] = -INF


@dataclass(frozen=True)
class TileSide:
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
    ) -> TileSide:
        rows = torch.arange(queries.start, queries.stop, device=tile.device) - chunk.start
        return TileSide(tile, transposed, queries.start, rows, ref0, ref_ids)

    @property
    def scores(self) -> Tensor:
        """``(queries, references)`` view of the tile."""
        return self.tile.T if self.transposed else self.tile
