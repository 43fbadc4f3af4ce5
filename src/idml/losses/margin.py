"""Margin loss with distance-weighted sampling (Wu et al. 2017, "Sampling Matters", eq. 3–4;
with ISM: IDML, TPAMI, Eq. 9).

Example:
    >>> import torch
    >>> x = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.6, 0.8], [0.0, 1.0]])
    >>> loss = MarginLoss(miner=None)  # every triplet, no sampling
    >>> # Positives (D = 0.632) are inside ω − ξ = 1.0: no cost. Non-zero negative terms:
    >>> # four at D = 0.894 (0.506 each), two at D = 0.283 (1.117 each); divided by 6.
    >>> round(loss(x, torch.tensor([0, 0, 1, 1])).item(), 4)
    0.7094
"""

from __future__ import annotations

import math

import torch
from pydantic import Field, model_validator
from torch import Tensor, nn

from idml.embeddings import Embeddings
from idml.losses.base import MetricLoss
from idml.losses.registry import LossContext, LossParams
from idml.metrics import Metric
from idml.miners import (
    DistanceWeightedMiner,
    MinerArg,
    resolve_miner,
)
from idml.relations import LabelSets


class MarginParams(LossParams):
    """Margin loss hyper-parameters and its distance-weighted sampling's cut-offs."""

    margin: float = Field(0.2, ge=0, allow_inf_nan=False, description="ξ, the band's half-width")
    boundary: float = Field(1.2, gt=0, allow_inf_nan=False, description="initial boundary ω")
    learn_boundary: bool = Field(False, description="learn one ω per class")
    cutoff: float = Field(0.5, gt=0, description="sampling: lower clamp of the distance")
    nonzero_loss_cutoff: float = Field(
        1.4, description="sampling: negatives at or beyond this distance are never drawn"
    )

    @model_validator(mode="after")
    def _cutoffs(self) -> MarginParams:
        if not self.cutoff < self.nonzero_loss_cutoff:
            raise ValueError(
                f"need cutoff < nonzero_loss_cutoff, got cutoff={self.cutoff} and "
                f"nonzero_loss_cutoff={self.nonzero_loss_cutoff}"
            )
        return self


_DEFAULT = MarginParams()


class MarginLoss(MetricLoss):
    """Margin loss (Wu et al. 2017, eq. 3) over triplets from distance-weighted sampling (§4).

    Each mined triplet ``(a, p, n)`` contributes a positive and a negative pair term,
    ``[ξ + y_ij(D_ij − ω_a)]₊`` with ``y = +1`` for ``(a, p)`` and ``−1`` for ``(a, n)``::

        L = (Σ_T [ξ + D_ap − ω_a]₊ + [ξ − D_an + ω_a]₊) / (#non-zero pair terms)

    The divisor counts the pair terms that are ``> 0`` (0 terms give ``L = 0``), the same averaging
    as pytorch-metric-learning's ``MarginLoss`` (its ``DivisorReducer``). The boundary ``ω`` is one
    number or, with ``num_classes``, one per class (the paper's ``β^(class)``); ``learn_boundary``
    makes it a parameter. With per-class boundaries the anchor's boundary is
    ``ω_a = mean_{c ∈ L_a} ω_c`` over the anchor's label set ``L_a``: ``ω_{l_a}`` for an ordinary image
    (as in the paper), the average of both source classes for a Mixup image. The paper's
    regulariser ``ν·ω`` is not included (it is 0 by default in the reference implementations).

    The loss works on distances; a similarity metric's ``S`` is mapped to the chord distance
    ``√(2 − 2S)`` (:meth:`~idml.metrics.Metric.to_distance`), exact for cosine on the unit sphere, so ``ξ`` and
    ``ω`` keep their meaning with every metric, including both forms of ISM.

    Args:
        metric: the pluggable metric (default :class:`~idml.metrics.EuclideanDistance`).
        margin: ``ξ ≥ 0``, the half-width of the band around the boundary.
        boundary: initial ``ω`` (> 0).
        learn_boundary: make ``ω`` a learnable :class:`torch.nn.Parameter`.
        num_classes: one boundary per class (labels must lie in ``0..num_classes-1``).
        miner: ``"default"`` (:class:`~idml.miners.DistanceWeightedMiner` with cutoff 0.5 and
            non-zero-loss cutoff 1.4), another miner, or ``None`` (every triplet).
    """

    boundary: Tensor
    params = MarginParams

    def __init__(
        self,
        metric: Metric | None = None,
        margin: float = _DEFAULT.margin,
        boundary: float = _DEFAULT.boundary,
        learn_boundary: bool = _DEFAULT.learn_boundary,
        num_classes: int | None = None,
        miner: MinerArg = "default",
    ) -> None:
        super().__init__(metric)
        if not (margin >= 0 and math.isfinite(margin)):
            raise ValueError(f"margin (ξ) must be a finite number >= 0, got {margin}")
        if not (boundary > 0 and math.isfinite(boundary)):
            raise ValueError(f"boundary (ω) must be a finite number > 0, got {boundary}")
        if num_classes is not None and num_classes < 1:
            raise ValueError(f"num_classes must be >= 1 or None, got {num_classes}")
        self.margin = float(margin)
        self.num_classes = num_classes
        shape = (num_classes or 1,)
        if learn_boundary:
            self.boundary = nn.Parameter(torch.full(shape, float(boundary)))
        else:
            # float64 keeps a fixed ω exact; it is cast to the embeddings' dtype when used.
            self.register_buffer(
                "boundary", torch.full(shape, float(boundary), dtype=torch.float64)
            )
        self.miner = resolve_miner(
            miner, DistanceWeightedMiner(_DEFAULT.cutoff, _DEFAULT.nonzero_loss_cutoff)
        )

    @classmethod
    def from_params(cls, params: MarginParams, context: LossContext) -> MarginLoss:
        """The sampler from the cut-offs; one boundary per class when it is learned."""
        return cls(
            context.metric,
            margin=params.margin,
            boundary=params.boundary,
            learn_boundary=params.learn_boundary,
            num_classes=context.num_classes if params.learn_boundary else None,
            miner=DistanceWeightedMiner(params.cutoff, params.nonzero_loss_cutoff),
        )

    def extra_repr(self) -> str:
        return (
            f"margin={self.margin}, boundary_shape={tuple(self.boundary.shape)}, "
            f"learn_boundary={isinstance(self.boundary, nn.Parameter)}, miner={self.miner}"
        )

    def anchor_boundary(self, labels: LabelSets) -> Tensor:
        """``ω_a`` per batch element, shape ``(B,)``: the mean boundary over its label set."""
        if self.num_classes is None:
            return self.boundary.expand(len(labels))
        member = labels.membership(self.num_classes).to(self.boundary.dtype)
        return (member @ self.boundary) / member.sum(dim=1)

    def compute(self, embeddings: Embeddings, labels: LabelSets) -> Tensor:
        distance = self.metric.to_distance(self.pairwise(embeddings))
        a, p, n = self.mined_triplets(distance, labels, embeddings.dim, similarity=False)
        omega = self.anchor_boundary(labels).to(distance.dtype)[a]
        pos_terms = torch.relu(self.margin + distance[a, p] - omega)
        neg_terms = torch.relu(self.margin - distance[a, n] + omega)
        active = (pos_terms > 0).sum() + (neg_terms > 0).sum()
        return (pos_terms.sum() + neg_terms.sum()) / active.clamp_min(1)
