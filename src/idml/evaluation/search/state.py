"""The running state of the queries of one chunk: top-k lists and relevant-rank counters."""

from __future__ import annotations

import torch
from torch import Tensor

INF = float("inf")


class QueryState:
    """Running top-k and relevant-rank counters of ``n`` queries (label-sorted order).

    ``top_scores``/``top_indices`` hold the best ``k`` (score, reference index) pairs seen so far,
    best first (``-inf``/``-1`` while fewer were seen). ``relevant_scores`` holds the scores of each
    query's relevant references, ascending and padded with ``+inf`` (never reached by any score);
    ``counts[q, j]`` counts the non-relevant scores seen that are ``≥ relevant_scores[q, j]``.
    """

    def __init__(self, n: int, k: int, r_max: int, device: torch.device) -> None:
        self.top_scores = torch.full((n, k), -INF, device=device)
        self.top_indices = torch.full((n, k), -1, dtype=torch.long, device=device)
        self.relevant_scores = torch.full((n, r_max), INF, device=device)
        self.counts = torch.zeros((n, r_max), dtype=torch.long, device=device)

    @property
    def k(self) -> int:
        return int(self.top_scores.shape[1])

    @property
    def kth_score(self) -> Tensor:
        return self.top_scores[:, -1]

    @property
    def least_relevant(self) -> Tensor:
        """The smallest relevant score per query (``+inf`` when it has none: never counted)."""
        if self.relevant_scores.shape[1] == 0:
            return self.relevant_scores.new_full((self.relevant_scores.shape[0],), INF)
        return self.relevant_scores[:, 0]
