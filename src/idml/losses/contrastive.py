"""Contrastive loss (Hadsell, Chopra and LeCun 2006, eq. 4; with ISM: IDML, TPAMI, Eq. 8).

Example:
    >>> import torch
    >>> x = torch.tensor([[1.0, 0.0], [0.6, 0.8], [0.0, 1.0]])
    >>> loss = ContrastiveLoss(pos_margin=0.0, neg_margin=0.5)
    >>> # positives (0, 1): D = √0.8 ≈ 0.894; negatives at D = 0.632 and √2 are beyond the margin.
    >>> round(loss(x, torch.tensor([0, 0, 1])).item(), 4)
    0.8944
"""

from __future__ import annotations

import math

import torch
from pydantic import Field
from torch import Tensor

from idml.embeddings import Embeddings
from idml.losses.base import MetricLoss
from idml.losses.registry import LossParams
from idml.metrics import Metric
from idml.miners import Miner, resolve_miner
from idml.relations import LabelSets

DISTANCE_MARGINS = (0.0, 0.5)
"""Default ``(m_pos, m_neg)`` for a distance metric: positives pulled to 0, negatives pushed past 0.5."""
SIMILARITY_MARGINS = (1.0, 1.0 - 0.5**2 / 2)
"""Default ``(m_pos, m_neg)`` for a similarity metric: the distance defaults mapped to cosine
similarity on the unit sphere, ``S = 1 − D²/2``, i.e. ``(1.0, 0.875)``."""


class ContrastiveParams(LossParams):
    """Contrastive margins (``None``: the metric's defaults, :data:`DISTANCE_MARGINS` or
    :data:`SIMILARITY_MARGINS`)."""

    pos_margin: float | None = Field(None, allow_inf_nan=False, description="m_pos")
    neg_margin: float | None = Field(None, allow_inf_nan=False, description="m_neg")


_DEFAULT = ContrastiveParams()


class ContrastiveLoss(MetricLoss):
    """Contrastive loss over pairs (Hadsell et al. 2006, eq. 4, with a positive margin).

    For a distance metric ``D`` (Euclidean or the distance form of ISM, ``D_IN``)::

        L = mean_{(i,j) ∈ P} [D_ij − m_pos]₊ + mean_{(i,j) ∈ N} [m_neg − D_ij]₊

    with ``P`` the positive pairs (label sets intersect, ``i ≠ j``) and ``N`` the negative pairs, each
    counted in both orders. For a similarity metric ``S`` (cosine or ISM's ``S_IN``) the mirrored form
    is used::

        L = mean_{P} [m_pos − S_ij]₊ + mean_{N} [S_ij − m_neg]₊

    A mean over an empty set is 0. Margins left at ``None`` take the metric's defaults: ``(0, 0.5)``
    for a distance and ``(1, 0.875)`` for a similarity, the same boundaries on the unit
    sphere (``S = 1 − D²/2``), so switching the metric does not change what the loss asks for.

    Args:
        metric: the pluggable metric (default :class:`~idml.metrics.EuclideanDistance`).
        pos_margin: ``m_pos``: positives closer than this (more similar) cost nothing.
        neg_margin: ``m_neg``: negatives farther than this (less similar) cost nothing. The two
            may meet but not cross (``m_pos ≤ m_neg`` for a distance, ``≥`` for a similarity):
            crossed, a positive and a negative pair between them would both cost nothing.
        miner: optional pair miner; the means then run over the mined pairs (``None``: all pairs).
    """

    params = ContrastiveParams
    repr_fields = ("pos_margin", "neg_margin", "miner")

    def __init__(
        self,
        metric: Metric | None = None,
        pos_margin: float | None = _DEFAULT.pos_margin,
        neg_margin: float | None = _DEFAULT.neg_margin,
        miner: Miner | None = None,
    ) -> None:
        super().__init__(metric)
        defaults = SIMILARITY_MARGINS if self.metric.is_similarity else DISTANCE_MARGINS
        self.pos_margin = float(defaults[0] if pos_margin is None else pos_margin)
        self.neg_margin = float(defaults[1] if neg_margin is None else neg_margin)
        for name, value in (("pos_margin", self.pos_margin), ("neg_margin", self.neg_margin)):
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}")
        similarity = self.metric.is_similarity
        crossing = self.pos_margin - self.neg_margin
        if (-crossing if similarity else crossing) > 0:
            # Crossed margins leave a band where a positive and a negative pair both cost nothing:
            # the loss can reach 0 without separating them.
            kind, order = ("similarity", "≥") if similarity else ("distance", "≤")
            raise ValueError(
                f"pos_margin {self.pos_margin:g} and neg_margin {self.neg_margin:g} cross for a "
                f"{kind} ({type(self.metric).__name__}): a positive and a negative pair at a "
                f"{kind} between them would both cost nothing; choose pos_margin {order} "
                "neg_margin (loss.pos_margin, loss.neg_margin)"
            )
        self.miner = resolve_miner(miner, None)

    def compute(self, embeddings: Embeddings, labels: LabelSets) -> Tensor:
        matrix = self.pairwise(embeddings)
        pairs = self.mined_pairs(matrix, labels, embeddings.dim)
        pos = matrix[pairs.anchor_pos, pairs.positive]
        neg = matrix[pairs.anchor_neg, pairs.negative]
        if self.metric.is_similarity:
            pos_terms = torch.relu(self.pos_margin - pos)
            neg_terms = torch.relu(neg - self.neg_margin)
        else:
            pos_terms = torch.relu(pos - self.pos_margin)
            neg_terms = torch.relu(self.neg_margin - neg)
        # An empty selection sums to a graph-connected 0, so backward still works.
        return pos_terms.sum() / max(pos_terms.numel(), 1) + neg_terms.sum() / max(
            neg_terms.numel(), 1
        )
