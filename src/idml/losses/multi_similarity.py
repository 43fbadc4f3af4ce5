"""Multi-similarity loss with pair mining (Wang et al. 2019, eq. 5–7; with ISM: IDML,
TPAMI, Eq. 12–13).

Example:
    >>> import torch
    >>> x = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.6, 0.8], [0.0, 1.0]])
    >>> loss = MultiSimilarityLoss()
    >>> # Anchors 1 and 2 mine their positive (S = 0.8) and their hardest negative (S = 0.96):
    >>> # ½·log(1 + e^{−0.6}) + log(1 + e^{23})/50 = 0.679 each; anchors 0 and 3 mine nothing.
    >>> round(loss(x, torch.tensor([0, 0, 1, 1])).item(), 4)
    0.3394
"""

from __future__ import annotations

import math

from pydantic import Field
from torch import Tensor

from idml.embeddings import Embeddings
from idml.losses.base import MetricLoss, masked_logsumexp
from idml.losses.registry import LossContext, LossParams
from idml.metrics import CosineSimilarity, Metric
from idml.miners import MinerArg, MultiSimilarityMiner, resolve_miner
from idml.relations import LabelSets


class MultiSimilarityParams(LossParams):
    """Multi-similarity scales and base, and the pair miner's margin."""

    alpha: float = Field(2.0, gt=0, allow_inf_nan=False, description="α, positive-pair scale")
    beta: float = Field(50.0, gt=0, allow_inf_nan=False, description="β, negative-pair scale")
    base: float = Field(0.5, allow_inf_nan=False, description="λ")
    epsilon: float = Field(0.1, ge=0, description="ε, the mining margin")


_DEFAULT = MultiSimilarityParams()


class MultiSimilarityLoss(MetricLoss):
    """Multi-similarity loss (Wang et al. 2019, eq. 7) on similarities, after pair mining (eq. 5–6)::

        L = mean_i [ (1/α)·log(1 + Σ_{k ∈ P_i} e^{−α(S_ik − λ)})
                   + (1/β)·log(1 + Σ_{k ∈ N_i} e^{β(S_ik − λ)}) ]

    ``P_i`` and ``N_i`` are anchor ``i``'s mined positive and negative pairs; the mean runs over all
    ``B`` anchors (an anchor with nothing mined contributes 0). ``S`` is cosine similarity by default
    or ISM's ``S_IN``. A distance metric gets the mirrored exponents ``α(D − λ)`` and ``β(λ − D)``.

    Args:
        metric: the pluggable metric (default :class:`~idml.metrics.CosineSimilarity`).
        alpha: ``α > 0``, the positive-pair scale.
        beta: ``β > 0``, the negative-pair scale.
        base: ``λ``, the similarity around which pairs are weighted.
        miner: ``"default"`` (:class:`~idml.miners.MultiSimilarityMiner` with ``ε = 0.1``), another
            miner, or ``None`` (every pair).
    """

    params = MultiSimilarityParams
    default_metric = CosineSimilarity
    repr_fields = ("alpha", "beta", "base", "miner")

    def __init__(
        self,
        metric: Metric | None = None,
        alpha: float = _DEFAULT.alpha,
        beta: float = _DEFAULT.beta,
        base: float = _DEFAULT.base,
        miner: MinerArg = "default",
    ) -> None:
        super().__init__(metric)
        for name, value in (("alpha", alpha), ("beta", beta)):
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive finite number, got {value}")
        if not math.isfinite(base):
            raise ValueError(f"base (λ) must be a finite number, got {base}")
        self.alpha, self.beta, self.base = float(alpha), float(beta), float(base)
        self.miner = resolve_miner(miner, MultiSimilarityMiner(_DEFAULT.epsilon))

    @classmethod
    def from_params(
        cls, params: MultiSimilarityParams, context: LossContext
    ) -> MultiSimilarityLoss:
        """The miner from ``epsilon``, the loss from the rest."""
        return cls(
            context.metric,
            alpha=params.alpha,
            beta=params.beta,
            base=params.base,
            miner=MultiSimilarityMiner(epsilon=params.epsilon),
        )

    def compute(self, embeddings: Embeddings, labels: LabelSets) -> Tensor:
        matrix = self.pairwise(embeddings)
        similarity = self.metric.is_similarity
        pos_mask, neg_mask = self.mined_pairs(matrix, labels, embeddings.dim).masks(len(labels))
        # Exponents written as "how far the pair is on the wrong side of λ", for either orientation.
        pos_exponent = (self.base - matrix) if similarity else (matrix - self.base)
        neg_exponent = (matrix - self.base) if similarity else (self.base - matrix)
        pos_terms = masked_logsumexp(self.alpha * pos_exponent, pos_mask, dim=1, add_one=True)
        neg_terms = masked_logsumexp(self.beta * neg_exponent, neg_mask, dim=1, add_one=True)
        return (pos_terms / self.alpha + neg_terms / self.beta).mean()
