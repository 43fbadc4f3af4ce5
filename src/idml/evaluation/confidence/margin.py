"""Label margin: how far the top-1 reference stands above the nearest reference of another label.

``c(q) = s(q, n_1) − max{ s(q, n_j) : j ≤ k, y(n_j) ≠ y(n_1) }``

A query whose nearest references of two labels are about as close is ambiguous, whatever the
absolute similarity. Only the first ``k`` neighbours are read: when all of them share the top-1's
label, the ``k``-th score stands in for the unknown best other-label score (which can only be
lower), so the margin is then a lower bound of the margin over the whole gallery — the same
definition on every gallery size, and exact whenever another label appears within ``k``.
It needs the gallery's labels, not the query's.

Example:
    >>> import torch
    >>> from idml.evaluation.search import NeighborLists
    >>> lists = NeighborLists(torch.tensor([[0, 1, 2]]), torch.tensor([[0.9, 0.7, 0.4]]))
    >>> answers = AnswerNeighbors.from_search(lists, reference_labels=torch.tensor([5, 5, 6]))
    >>> [round(v, 4) for v in LabelMargin(k=3)(answers).tolist()]  # 0.9 − 0.4
    [0.5]
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
class LabelMargin(NeighbourScore):
    """Top-1 score minus the best score of another label among the first ``k`` (module docstring)."""

    name: ClassVar[str] = "margin"

    needs_labels: ClassVar[bool] = True

    def __call__(self, answers: AnswerNeighbors) -> Tensor:
        labels = answers.need_labels(self.key)[:, : self.k]
        answers.need_depth(self.k, self.key)
        scores = answers.scores[:, : self.k]
        n = len(scores)
        if scores.shape[1] == 0:
            return torch.full((n,), torch.nan, dtype=torch.float64)
        present = labels >= 0
        other = present & (labels != labels[:, :1])
        best_other = torch.where(other, scores, torch.full_like(scores, -torch.inf)).amax(1)
        # The last neighbour present bounds every other-label score not in the list.
        last = (present.sum(1) - 1).clamp_min(0)
        bound = scores.gather(1, last.unsqueeze(1)).squeeze(1)
        margin = scores[:, 0] - torch.where(other.any(1), best_other, bound)
        return torch.where(answers.answered, margin, torch.full_like(margin, torch.nan))
