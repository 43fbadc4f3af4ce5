"""k-NN label agreement: the share of the first ``k`` neighbours that have the top-1's label.

``c(q) = (1/m) Σ_{j ≤ m} 1[y(n_j) = y(n_1)]``, ``m = min(k, neighbours present)``

A top-1 answer confirmed by the query's other near neighbours is more likely right than one
contradicted by them (a k-NN vote's consensus). It takes ``k + 1`` values at most (``1/k … 1``),
so it ties often; a calibrator combines it with a continuous score. It needs the gallery's labels.

Example:
    >>> import torch
    >>> from idml.evaluation.search import NeighborLists
    >>> lists = NeighborLists(torch.tensor([[0, 1, 2, 3]]), torch.tensor([[0.9, 0.8, 0.7, 0.6]]))
    >>> answers = AnswerNeighbors.from_search(lists, reference_labels=torch.tensor([1, 2, 1, 1]))
    >>> KnnAgreement(k=4)(answers).tolist()
    [0.75]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from idml.evaluation.confidence.answers import AnswerNeighbors
from idml.evaluation.confidence.base import NeighbourScore, register_score


@register_score
@dataclass(frozen=True)
class KnnAgreement(NeighbourScore):
    """Share of the first ``k`` neighbours labelled like the top-1 (module docstring)."""

    name: ClassVar[str] = "agreement"

    needs_labels: ClassVar[bool] = True

    def __call__(self, answers: AnswerNeighbors) -> Tensor:
        labels = answers.need_labels(self.key)[:, : self.k]
        answers.need_depth(self.k, self.key)
        if labels.shape[1] == 0:
            return torch.full((len(labels),), torch.nan, dtype=torch.float64)
        present = labels >= 0
        agree = (present & (labels == labels[:, :1])).sum(1).double()
        share = agree / present.sum(1).clamp_min(1).double()
        return torch.where(answers.answered, share, torch.full_like(share, torch.nan))
