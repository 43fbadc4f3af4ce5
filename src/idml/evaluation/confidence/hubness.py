"""Hubness-corrected similarity: CSLS (Conneau et al. 2018) of the query and its top-1 reference.

``c(q) = CSLS(q, n_1) = 2·s(q, n_1) − r(q) − r(n_1)``, with ``r(x)`` the mean score of ``x`` to its
``k`` nearest references (for a reference, its ``k`` nearest *other* references:
:class:`~idml.evaluation.confidence.answers.ReferenceHubness`).

Why this correction: in high dimensions some references (hubs) are the nearest neighbour of many
queries of every class (Radovanović et al. 2010), so a high similarity to a hub says less than the
same similarity to an isolated reference; subtracting ``r(n_1)`` discounts it. ``r(q)`` puts every
query on its own scale: a query in a dense region has high similarities to everything, and only
how far its top-1 stands above its own neighbourhood is evidence. CSLS is the standard form of both
corrections (it fixed hubness in nearest-neighbour word translation, where the same failure hits),
needs no labels and no fitting, and reads only what the search already has: ``r(q)`` from the
query's list and ``r(n_1)`` from the gallery's own lists (searched once per gallery; in a
same-set evaluation they are the search's lists). Conneau et al. take ``r(n_1)`` over the
*queries* nearest to ``n_1``; the gallery stands in for the query distribution here, which is
exact when the queries are the gallery. Measured as a predictor of a right top-1 it is mixed
(``benchmarks/study/confidence_demo_*.md``: above the top-1 similarity for some models, below for
others, about as good as ``s(q, n_1) − r(n_1)`` alone), so it is reported and offered to
calibrators, not used by default.

Example:
    >>> import torch
    >>> from idml.evaluation.search import NeighborLists
    >>> gallery = NeighborLists(torch.tensor([[1], [0]]), torch.tensor([[0.5], [0.5]]))
    >>> hub = ReferenceHubness.from_neighbors(gallery, k=1)
    >>> query = NeighborLists(torch.tensor([[0]]), torch.tensor([[0.75]]))
    >>> HubnessCorrectedSimilarity(k=1)(AnswerNeighbors.from_search(query, hubness=hub)).tolist()
    [0.25]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from idml.evaluation.confidence.answers import AnswerNeighbors, ReferenceHubness, _finite_mean
from idml.evaluation.confidence.base import NeighbourScore, register_score

__all__ = ["HubnessCorrectedSimilarity", "ReferenceHubness"]


@register_score
@dataclass(frozen=True)
class HubnessCorrectedSimilarity(NeighbourScore):
    """``2·s(q, n_1) − r(q) − r(n_1)`` over ``k`` neighbours (module docstring)."""

    name: ClassVar[str] = "csls"

    @property
    def hubness_k(self) -> int | None:
        return self.k

    def __call__(self, answers: AnswerNeighbors) -> Tensor:
        hubness = answers.need_hubness(self.k, self.key)
        answers.need_depth(self.k, self.key)
        n = len(answers.indices)
        if answers.depth == 0:
            return torch.full((n,), torch.nan, dtype=torch.float64)
        own = _finite_mean(answers.scores[:, : self.k])
        top1 = answers.indices[:, 0]
        hub = hubness.values[top1.clamp_min(0)]
        csls = 2 * answers.scores[:, 0] - own - hub
        return torch.where(answers.answered, csls, torch.full_like(csls, torch.nan))
