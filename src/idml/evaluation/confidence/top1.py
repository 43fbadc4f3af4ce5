"""Top-1 similarity: the score of the nearest reference, ``c(q) = s(q, n_1)``.

The plain confidence of a nearest-neighbour answer (what ``idml search`` reported before there was
a calibrated one), and the baseline every other score is measured against. It needs no labels,
so it works on any index.

Example:
    >>> import torch
    >>> from idml.evaluation.search import NeighborLists
    >>> lists = NeighborLists(torch.tensor([[1, 2], [-1, -1]]), torch.tensor([[0.8, 0.3], [0.0, 0.0]]))
    >>> Top1Similarity()(AnswerNeighbors.from_search(lists)).tolist()
    [0.800000011920929, nan]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from idml.evaluation.confidence.answers import AnswerNeighbors
from idml.evaluation.confidence.base import ConfidenceScore, register_score


@register_score
@dataclass(frozen=True)
class Top1Similarity(ConfidenceScore):
    """``s(q, n_1)``, the search score of the nearest reference (cosine similarity for cosine)."""

    name: ClassVar[str] = "top1"

    def __call__(self, answers: AnswerNeighbors) -> Tensor:
        if answers.depth == 0:
            return torch.full((len(answers.indices),), torch.nan, dtype=torch.float64)
        top1 = answers.scores[:, 0]
        return torch.where(answers.answered, top1, torch.full_like(top1, torch.nan))
