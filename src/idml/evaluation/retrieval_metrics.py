"""Retrieval metrics computed exactly from the ranks of the relevant items.

For a query with ``R`` relevant references (same label; itself excluded) at 1-based positions
``p_1 < p_2 < … < p_R`` of its ranked gallery (:mod:`idml.evaluation.search`), every metric of the
DML literature is a function of those positions (Musgrave et al. 2020, "A Metric Learning Reality Check",
whose definitions of R-Precision and MAP@R these follow):

* Recall@K     = ``1[p_1 ≤ K]`` (a same-class item among the K nearest; = pml's precision_at_1 at K=1)
* R-Precision  = ``#{t : p_t ≤ R} / R``
* MAP@R        = ``(1/R) Σ_{t : p_t ≤ R} t / p_t`` (divides by R, not by the hits)
* MAP          = ``(1/R) Σ_t t / p_t`` over the *whole* ranked gallery (average precision)
* MRR          = ``1 / p_1`` over the whole gallery (not truncated at some k)
* precision–recall, at rank cut-offs ``c``: precision ``#{t : p_t ≤ c} / c`` and recall
  ``#{t : p_t ≤ c} / R``; and at recall levels ``ρ`` (TREC 11-point interpolation):
  ``P_interp(ρ) = max_{t : t/R ≥ ρ} t / p_t``.

Queries with ``R = 0`` ("lone": alone in their class) are excluded from every mean and counted.
All per-query values are kept in float64 so the means match pytorch-metric-learning to ~1e-12.

Example (golden values: R = 3, ranked relevance ``[1, 0, 1, 0, 1]`` → positions 1, 3, 5):
    >>> import torch
    >>> m = per_query_metrics(torch.tensor([[1, 3, 5]]), torch.tensor([3]))
    >>> round(m["map@r"].item(), 6), round(m["r_precision"].item(), 6)  # (1 + 2/3)/3, 2/3
    (0.555556, 0.666667)
    >>> round(m["map"].item(), 6)  # (1 + 2/3 + 3/5)/3
    0.755556
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

DEFAULT_RECALL_LEVELS: tuple[float, ...] = tuple(i / 10 for i in range(11))
"""The 11 standard recall levels 0.0, 0.1, …, 1.0 of interpolated precision."""

PER_QUERY_KEYS: tuple[str, ...] = ("r_precision", "map@r", "map", "mrr")


def default_cutoffs(num_ranked: int) -> tuple[int, ...]:
    """Rank cut-offs 1, 2, 4, … below ``num_ranked``, then ``num_ranked`` itself.

    Example:
        >>> default_cutoffs(10)
        (1, 2, 4, 8, 10)
    """
    if num_ranked < 1:
        return ()
    cutoffs = [1 << i for i in range(max(1, num_ranked.bit_length())) if (1 << i) < num_ranked]
    return (*cutoffs, num_ranked)


def per_query_metrics(ranks: Tensor, num_relevant: Tensor) -> dict[str, Tensor]:
    """Per-query R-Precision, MAP@R, MAP, MRR and first-hit position from relevant ranks.

    Args:
        ranks: ``(n, R_max)`` 1-based positions of each query's relevant items, ascending; entries
            at or beyond ``num_relevant`` are ignored.
        num_relevant: ``(n,)`` number of relevant items ``R`` per query.

    Returns:
        float64 tensors ``(n,)`` keyed ``r_precision``, ``map@r``, ``map``, ``mrr`` (NaN where
        ``R = 0``) and the long tensor ``first_rank`` (0 where ``R = 0``).
    """
    n, r_max = ranks.shape
    num_relevant = num_relevant.to(ranks.device).long()
    big_r = num_relevant.unsqueeze(1).double()
    t = torch.arange(1, r_max + 1, device=ranks.device, dtype=torch.float64).unsqueeze(0)
    valid = t <= big_r
    pos = ranks.double().clamp_min(1.0)
    precision_at_hit = torch.where(valid, t / pos, torch.zeros_like(pos))
    within_r = valid & (pos <= big_r)
    denom = num_relevant.double()
    lone = num_relevant == 0
    safe = denom.clamp_min(1.0)
    nan = torch.full_like(denom, float("nan"))
    first = ranks[:, 0] if r_max else torch.zeros(n, dtype=torch.long, device=ranks.device)
    first = torch.where(lone, torch.zeros_like(first), first)
    out = {
        "r_precision": torch.where(lone, nan, within_r.sum(1).double() / safe),
        "map@r": torch.where(lone, nan, (precision_at_hit * within_r).sum(1) / safe),
        "map": torch.where(lone, nan, precision_at_hit.sum(1) / safe),
        "mrr": torch.where(lone, nan, 1.0 / first.double().clamp_min(1.0)),
        "first_rank": first,
    }
    return out


def pr_at_cutoffs(
    ranks: Tensor, num_relevant: Tensor, cutoffs: Sequence[int]
) -> tuple[Tensor, Tensor]:
    """Per-query precision and recall at rank cut-offs, each ``(n, len(cutoffs))`` float64."""
    n, r_max = ranks.shape
    c = torch.tensor(list(cutoffs), dtype=torch.long, device=ranks.device)
    t = torch.arange(r_max, device=ranks.device).unsqueeze(0)
    valid = t < num_relevant.unsqueeze(1)
    big = torch.iinfo(torch.long).max
    padded = torch.where(valid, ranks, torch.full_like(ranks, big)).contiguous()
    hits = torch.searchsorted(padded, c.expand(n, -1).contiguous(), right=True).double()
    precision = hits / c.double().unsqueeze(0)
    recall = hits / num_relevant.double().clamp_min(1.0).unsqueeze(1)
    return precision, recall


def interpolated_precision(ranks: Tensor, num_relevant: Tensor, levels: Sequence[float]) -> Tensor:
    """Per-query ``P_interp(ρ) = max_{t : t/R ≥ ρ} t/p_t`` at each recall level, ``(n, L)`` float64."""
    n, r_max = ranks.shape
    if r_max == 0:
        return torch.zeros((n, len(levels)), dtype=torch.float64, device=ranks.device)
    t = torch.arange(1, r_max + 1, device=ranks.device, dtype=torch.float64).unsqueeze(0)
    valid = t <= num_relevant.unsqueeze(1)
    precision = torch.where(valid, t / ranks.double().clamp_min(1.0), torch.zeros_like(t))
    # Best precision at this hit or any later one (suffix maximum).
    suffix_max = precision.flip(1).cummax(1).values.flip(1)
    rho = torch.tensor(list(levels), dtype=torch.float64, device=ranks.device).unsqueeze(0)
    r = num_relevant.double().unsqueeze(1)
    # Smallest hit count t with t/R ≥ ρ (the 1e-9 absorbs 0.3·10 = 3.0000000000000004).
    first_t = torch.ceil(rho * r - 1e-9).clamp(min=1).long()
    first_t = torch.minimum(first_t, num_relevant.clamp_min(1).unsqueeze(1)) - 1
    return suffix_max.gather(1, first_t.clamp(max=r_max - 1))


@dataclass
class PRCurve:
    """Precision–recall data averaged over the non-lone queries.

    ``cutoffs``: rank cut-offs ``c`` with mean ``precision_at_cutoff`` (hits in the top c / c) and
    mean ``recall_at_cutoff`` (hits in the top c / R). ``recall_levels``: levels ``ρ`` with mean
    interpolated precision ``max_{t/R ≥ ρ} t/p_t`` (the TREC 11-point curve by default).
    """

    cutoffs: list[int]
    precision_at_cutoff: list[float]
    recall_at_cutoff: list[float]
    recall_levels: list[float]
    interpolated_precision: list[float]

    @property
    def recall(self) -> list[float]:
        """Recall of the curve over the ranked gallery (at :attr:`cutoffs`), for plotting."""
        return self.recall_at_cutoff

    @property
    def precision(self) -> list[float]:
        """Precision of the curve over the ranked gallery (at :attr:`cutoffs`), for plotting."""
        return self.precision_at_cutoff

    def to_dict(self) -> dict[str, list[float] | list[int]]:
        """The curve data as a JSON-ready dict."""
        return {
            "cutoffs": self.cutoffs,
            "precision_at_cutoff": self.precision_at_cutoff,
            "recall_at_cutoff": self.recall_at_cutoff,
            "recall_levels": self.recall_levels,
            "interpolated_precision": self.interpolated_precision,
        }


@dataclass
class RankAccumulator:
    """Collects per-query metrics from chunks of ranks (queries in any order) and aggregates them.

    Args:
        num_queries: total number of queries.
        ks: the K of Recall@K.
        cutoffs: rank cut-offs of the precision–recall curve.
        recall_levels: recall levels of the interpolated precision curve.
        complete: ranks cover the whole gallery. ``False`` for ranks known only within the first
            ``known_depth`` neighbours (approximate search): MAP, MRR and cut-offs beyond it are
            then not reported.
        known_depth: how deep ranks are known when ``complete`` is false.
    """

    num_queries: int
    ks: tuple[int, ...]
    cutoffs: tuple[int, ...]
    recall_levels: tuple[float, ...] = DEFAULT_RECALL_LEVELS
    complete: bool = True
    known_depth: int = 0
    per_query: dict[str, Tensor] = field(init=False)
    _pr_sums: Tensor = field(init=False)
    _interp_sums: Tensor = field(init=False)
    _seen: Tensor = field(init=False)

    def __post_init__(self) -> None:
        n = self.num_queries
        self.per_query = {
            key: torch.full((n,), float("nan"), dtype=torch.float64) for key in PER_QUERY_KEYS
        }
        self.per_query["first_rank"] = torch.zeros(n, dtype=torch.long)
        self.per_query["num_relevant"] = torch.zeros(n, dtype=torch.long)
        if not self.complete:
            self.cutoffs = tuple(c for c in self.cutoffs if c <= self.known_depth)
        self._pr_sums = torch.zeros((2, len(self.cutoffs)), dtype=torch.float64)
        self._interp_sums = torch.zeros(len(self.recall_levels), dtype=torch.float64)
        self._seen = torch.zeros(n, dtype=torch.bool)

    def add(self, query_indices: Tensor, ranks: Tensor, num_relevant: Tensor) -> None:
        """Add one chunk: original query indices, their ranks ``(n, R_max)`` and ``R``."""
        query_indices = query_indices.cpu().long()
        if bool(self._seen[query_indices].any()):
            raise ValueError("a query was added twice to the rank accumulator")
        self._seen[query_indices] = True
        ranks, num_relevant = ranks.cpu().long(), num_relevant.cpu().long()
        values = per_query_metrics(ranks, num_relevant)
        for key in (*PER_QUERY_KEYS, "first_rank"):
            self.per_query[key][query_indices] = values[key]
        self.per_query["num_relevant"][query_indices] = num_relevant
        active = num_relevant > 0
        if not bool(active.any()):
            return
        ranks, num_relevant = ranks[active], num_relevant[active]
        if self.cutoffs:
            precision, recall = pr_at_cutoffs(ranks, num_relevant, self.cutoffs)
            self._pr_sums[0] += precision.sum(0)
            self._pr_sums[1] += recall.sum(0)
        if self.complete:
            self._interp_sums += interpolated_precision(
                ranks, num_relevant, self.recall_levels
            ).sum(0)

    # ------------------------------------------------------------------ results
    @property
    def lone(self) -> Tensor:
        """Boolean mask of the queries with no relevant reference."""
        return self.per_query["num_relevant"] == 0

    def recall_at(self, k: int) -> Tensor:
        """Per-query Recall@k as float64 (NaN for lone queries)."""
        first = self.per_query["first_rank"]
        hit = ((first >= 1) & (first <= k)).double()
        return torch.where(self.lone, torch.full_like(hit, float("nan")), hit)

    def per_query_values(self) -> dict[str, Tensor]:
        """Every reported metric per query (NaN for lone queries), in query order."""
        out = {f"recall@{k}": self.recall_at(k) for k in self.ks}
        out["r_precision"] = self.per_query["r_precision"]
        out["map@r"] = self.per_query["map@r"]
        if self.complete:
            out["map"] = self.per_query["map"]
            out["mrr"] = self.per_query["mrr"]
        else:
            first = self.per_query["first_rank"]
            within = (first >= 1) & (first <= self.known_depth)
            rr = torch.where(
                within, 1.0 / first.double().clamp_min(1), torch.zeros_like(first).double()
            )
            out[f"mrr@{self.known_depth}"] = torch.where(self.lone, torch.nan, rr)
        return out

    def means(self) -> dict[str, float]:
        """Each metric averaged over the non-lone queries."""
        keep = ~self.lone
        count = int(keep.sum())
        return {
            key: (float(values[keep].sum()) / count if count else math.nan)
            for key, values in self.per_query_values().items()
        }

    def per_class(self, labels: Tensor) -> dict[int, dict[str, float]]:
        """Per-class means of every metric over the class's non-lone queries, with counts.

        ``labels`` are the query labels in query order. Each entry also has ``num_queries`` and
        ``num_lone_queries``; a class whose queries are all lone has NaN metrics.
        """
        labels = labels.cpu().long()
        classes, inverse = torch.unique(labels, return_inverse=True)
        n_classes = len(classes)
        keep = ~self.lone
        counts = torch.bincount(inverse[keep], minlength=n_classes).double()
        totals = torch.bincount(inverse, minlength=n_classes)
        result: dict[int, dict[str, float]] = {int(c): {} for c in classes.tolist()}
        columns: dict[str, list[float]] = {}
        for key, values in self.per_query_values().items():
            sums = torch.zeros(n_classes, dtype=torch.float64)
            sums.index_add_(0, inverse[keep], values[keep])
            means = torch.where(counts > 0, sums / counts.clamp_min(1), torch.nan)
            columns[key] = means.tolist()
        tot, kept = totals.tolist(), counts.long().tolist()
        for i, c in enumerate(classes.tolist()):
            entry = {key: col[i] for key, col in columns.items()}
            entry["num_queries"] = tot[i]
            entry["num_lone_queries"] = tot[i] - kept[i]
            result[int(c)] = entry
        return result

    def pr_curve(self) -> PRCurve:
        """The precision–recall data averaged over non-lone queries."""
        count = max(1, int((~self.lone).sum()))
        return PRCurve(
            cutoffs=list(self.cutoffs),
            precision_at_cutoff=(self._pr_sums[0] / count).tolist(),
            recall_at_cutoff=(self._pr_sums[1] / count).tolist(),
            recall_levels=list(self.recall_levels) if self.complete else [],
            interpolated_precision=(self._interp_sums / count).tolist() if self.complete else [],
        )


def ranks_from_neighbors(
    neighbor_labels: Tensor, query_labels: Tensor, num_relevant: Tensor
) -> Tensor:
    """Relevant positions known from the first ``k`` neighbours (approximate search).

    Returns ``(n, max R)`` ranks, ascending; relevant items not among the ``k`` neighbours get
    positions past ``k`` (``k + 1, k + 2, …``), which keeps Recall@K (K ≤ k), R-Precision and
    MAP@R exact whenever ``k ≥ R``, and makes MAP and MRR lower bounds (not reported).
    """
    n, k = neighbor_labels.shape
    r_max = int(num_relevant.max()) if n else 0
    hit = neighbor_labels == query_labels.unsqueeze(1)
    positions = torch.arange(1, k + 1, device=neighbor_labels.device).expand(n, k)
    # Hits first in position order: sort positions with misses pushed to the end.
    big = torch.iinfo(torch.long).max
    hit_positions = torch.where(hit, positions, torch.full_like(positions, big)).sort(1).values
    width = max(r_max, 1)
    if k < width:
        pad = torch.full((n, width - k), big, dtype=torch.long, device=neighbor_labels.device)
        hit_positions = torch.cat([hit_positions, pad], dim=1)
    hit_positions = hit_positions[:, :width]
    # Unknown relevant items: placeholder positions after k, increasing.
    t = torch.arange(width, device=neighbor_labels.device).unsqueeze(0)
    n_hits = hit.sum(1, keepdim=True)
    placeholder = k + 1 + (t - n_hits)
    ranks = torch.where(t < n_hits, hit_positions, placeholder)
    ranks = torch.where(t < num_relevant.unsqueeze(1), ranks, torch.zeros_like(ranks))
    return ranks[:, :r_max]
