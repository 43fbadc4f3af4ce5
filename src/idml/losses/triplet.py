"""Triplet loss with semi-hard mining (Schroff et al. 2015, FaceNet, eq. 2–4; with ISM:
IDML, TPAMI, Eq. 10–11).

Example:
    >>> import torch
    >>> x = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.6, 0.8], [0.0, 1.0]])
    >>> loss = TripletLoss(margin=0.5)
    >>> # Each anchor: positive at D = 0.632, one semi-hard negative at 0.894; the other negative
    >>> # is hard (0.283) or outside the window (1.414). Loss 0.632 − 0.894 + 0.5.
    >>> round(loss(x, torch.tensor([0, 0, 1, 1])).item(), 4)
    0.238
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
from idml.miners import MinerArg, SemiHardMiner, resolve_miner
from idml.relations import LabelSets


class TripletParams(LossParams):
    """The triplet margin (also the semi-hard mining window)."""

    margin: float = Field(0.1, ge=0, allow_inf_nan=False, description="δ")


_DEFAULT = TripletParams()


class TripletLoss(MetricLoss):
    """Triplet loss over mined triplets (Schroff et al. 2015, eq. 2–3)::

        L = mean_{(a,p,n) ∈ T} [D_ap − D_an + δ]₊

    where ``T`` is the set of mined triplets: by default the semi-hard ones,
    ``D_ap < D_an < D_ap + δ`` (FaceNet eq. 4 and §3.2; :class:`~idml.miners.SemiHardMiner` with
    the same ``δ``), so every mined triplet has a positive loss. With ``miner=None`` ``T`` is every
    triplet with ``p`` a positive and ``n`` a negative of ``a``. For a similarity metric the
    mirrored hinge ``[S_an − S_ap + δ]₊`` is used. No triplet gives 0.

    Args:
        metric: the pluggable metric (default :class:`~idml.metrics.EuclideanDistance`).
        margin: ``δ ≥ 0``.
        miner: ``"default"`` (semi-hard with window ``δ``), another miner, or ``None`` (all triplets).

    Semi-hard mining checks each anchor–positive pair against the ``B`` candidates in bounded chunks
    (memory ``O(P·B)`` for ``P`` positive pairs); ``miner=None`` enumerates all valid triplets.
    """

    params = TripletParams
    repr_fields = ("margin", "miner")

    def __init__(
        self,
        metric: Metric | None = None,
        margin: float = _DEFAULT.margin,
        miner: MinerArg = "default",
    ) -> None:
        super().__init__(metric)
        if not (margin >= 0 and math.isfinite(margin)):
            raise ValueError(f"margin (δ) must be a finite number >= 0, got {margin}")
        self.margin = float(margin)
        if self.margin == 0 and isinstance(miner, str):
            raise ValueError(
                "margin (δ) = 0 leaves the semi-hard window D_ap < D_an < D_ap + δ empty; "
                "use margin > 0, or pass miner=None (all triplets) or another miner"
            )
        self.miner = resolve_miner(miner, SemiHardMiner(self.margin) if self.margin > 0 else None)

    def compute(self, embeddings: Embeddings, labels: LabelSets) -> Tensor:
        matrix = self.pairwise(embeddings)
        a, p, n = self.mined_triplets(matrix, labels, embeddings.dim)
        s = self.metric.oriented(matrix)
        terms = torch.relu(s[a, n] - s[a, p] + self.margin)
        # An empty selection sums to a graph-connected 0, so backward still works.
        return terms.sum() / max(terms.numel(), 1)
