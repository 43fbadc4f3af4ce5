"""Negative uncertainty level: ``c(q) = −||u_q||``, IDML's per-image uncertainty as a confidence.

IDML (Wang et al. 2022) learns an uncertainty embedding ``u`` whose norm rises on ambiguous inputs
(mixed, occluded, low-resolution images). It is a property of the *query image* alone, not of the
answer: it does not see how close the gallery's labels are, and measured as a predictor of a wrong
top-1 neighbour it sits near chance (``benchmarks/RESULTS.md``). It is reported as the input
signal it is, and offered to a calibrator, which keeps it only if it helps.

Example:
    >>> import torch
    >>> from idml.evaluation.search import NeighborLists
    >>> lists = NeighborLists(torch.tensor([[0], [0]]), torch.tensor([[0.9], [0.8]]))
    >>> answers = AnswerNeighbors.from_search(lists, uncertainty_level=torch.tensor([0.5, 2.0]))
    >>> NegativeUncertaintyLevel()(answers).tolist()
    [-0.5, -2.0]
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
class NegativeUncertaintyLevel(ConfidenceScore):
    """``−||u_q||`` of the query (NaN for a query without any neighbour)."""

    name: ClassVar[str] = "norm_u"

    needs_uncertainty: ClassVar[bool] = True

    def __call__(self, answers: AnswerNeighbors) -> Tensor:
        level = answers.need_uncertainty(self.key)
        return torch.where(answers.answered, -level, torch.full_like(level, torch.nan))
