"""FastAP: a differentiable average precision through soft histogram binning of distances.

Cakir et al. 2019 ("Deep Metric Learning to Rank", FastAP with linear histogram binning). Each
anchor ranks the rest of the batch by squared distance ``d ∈ [0, 4]`` (L2-normalised embeddings).
The range is cut into ``L`` bins with ``L + 1`` centres ``c_l = l·Δ``, ``Δ = 4/L``, and every
distance is spread over its two nearest centres by a triangular kernel
``δ(d, c_l) = max(0, 1 − |d − c_l| / Δ)``. With ``h⁺_l`` / ``h_l`` the soft counts of positives / of
all others in bin ``l`` and ``H⁺_l``, ``H_l`` their cumulative sums::

    FastAP_i = (1 / N⁺_i) Σ_l h⁺_l · H⁺_l / H_l          (terms with h⁺_l·H⁺_l = 0 are 0)
    L        = mean_{i : N⁺_i > 0} (1 − FastAP_i)

[default ``L`` = 10 bins]. This follows pytorch-metric-learning's ``FastAPLoss``: squared Euclidean
distance, bin centres ``0, Δ, …, 4``, anchors without positives left out of the mean, and a loss of 0
(with a graph) when no anchor has a positive.

Any metric works through :meth:`~idml.metrics.Metric.to_squared_distance` (``D_IN²`` with the
introspective metric, ``2·(1 − S)`` for a similarity). Set labels define the positives
(:meth:`~idml.relations.LabelSets.positive_mask`).

Example:
    >>> import torch
    >>> x = torch.tensor([[1.0, 0.0], [1.0, 0.0], [-1.0, 0.0], [-1.0, 0.0]])
    >>> FastAPLoss()(x, torch.tensor([0, 0, 1, 1])).item()  # every positive ranked first: AP = 1
    0.0
    >>> y = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    >>> FastAPLoss()(y, torch.tensor([0, 0, 1])).item()  # positive tied with a negative: AP = 1/2
    0.5
"""

from __future__ import annotations

from functools import partial

import torch
from pydantic import Field
from torch import Tensor

from idml.embeddings import Embeddings
from idml.losses.base import MetricLoss
from idml.losses.registry import LossParams
from idml.metrics import EuclideanDistance, Metric
from idml.relations import LabelSets

MAX_SQUARED_DISTANCE = 4.0
"""Largest squared distance between unit vectors: the upper end of the histogram."""


class FastAPParams(LossParams):
    """The number of histogram bins."""

    num_bins: int = Field(10, ge=1, description="histogram bins L (L + 1 centres)")


_DEFAULT = FastAPParams()


class FastAPLoss(MetricLoss):
    """FastAP (Cakir et al. 2019) with linear (triangular) histogram binning.

    Args:
        metric: squared Euclidean distance on L2-normalised embeddings by default; any metric that
            normalises its inputs works via :meth:`~idml.metrics.Metric.to_squared_distance`.
        num_bins: number of histogram bins ``L ≥ 1`` [10] (``L + 1`` bin centres).

    Raises:
        ValueError: if ``num_bins < 1`` or the metric does not L2-normalise (distances would leave
            the histogram range ``[0, 4]`` and silently stop contributing).
    """

    params = FastAPParams
    default_metric = partial(EuclideanDistance, power=2)
    repr_fields = ("num_bins",)

    def __init__(self, metric: Metric | None = None, num_bins: int = _DEFAULT.num_bins) -> None:
        super().__init__(metric)
        if isinstance(num_bins, bool) or int(num_bins) != num_bins or num_bins < 1:
            raise ValueError(f"num_bins must be an integer >= 1, got {num_bins}")
        if not self.metric.normalize:
            raise ValueError(
                "FastAPLoss bins squared distances in [0, 4] and needs a metric that L2-normalises "
                "its inputs; build the metric with normalize=True"
            )
        self.num_bins = int(num_bins)

    def histograms(
        self, squared: Tensor, positive: Tensor, negative: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Soft ``(B, L+1)`` histograms ``h⁺`` and ``h⁻`` of each anchor's positive / negative distances.

        The triangular kernel ``max(0, 1 − |d − c_l|/Δ)`` is non-zero only at the two centres around
        ``d``, where it equals ``1 − f`` and ``f`` with ``f = d/Δ − ⌊d/Δ⌋``; scattering those two weights
        costs ``O(B²)`` instead of evaluating every kernel (``O(B²·L)``), with the same value and
        gradient away from the centres themselves (a set of measure zero).
        """
        num_bins = self.num_bins
        position = (squared / (MAX_SQUARED_DISTANCE / num_bins)).clamp(0.0, num_bins)
        # The top edge d = 4 belongs to the last centre: lower neighbour L−1 with weight 0.
        lower = position.detach().floor().clamp_max(num_bins - 1)
        upper_weight = position - lower
        valid = (positive | negative).to(squared.dtype)
        # One scatter for both histograms: positives go to slots L+1.., negatives to 0..L.
        slot = lower.long() + (num_bins + 1) * positive.long()
        hist = squared.new_zeros(squared.shape[0], 2 * (num_bins + 1))
        hist = hist.scatter_add(1, slot, valid - upper_weight * valid)
        hist = hist.scatter_add(1, slot + 1, upper_weight * valid)
        return hist[:, num_bins + 1 :], hist[:, : num_bins + 1]

    def compute(self, embeddings: Embeddings, labels: LabelSets) -> Tensor:
        # One intersection matrix for both masks (positives exclude the anchor itself).
        related = labels.intersects()
        positive, negative = related.clone().fill_diagonal_(False), ~related
        num_positives = positive.sum(dim=1)
        has_positive = num_positives > 0
        if not bool(has_positive.any()):
            return embeddings.semantic.sum() * 0.0

        squared = self.metric.to_squared_distance(self.pairwise(embeddings))
        positive_hist, negative_hist = self.histograms(squared, positive, negative)

        positive_cumulative = positive_hist.cumsum(dim=1)
        total_cumulative = (positive_hist + negative_hist).cumsum(dim=1)
        numerator = positive_hist * positive_cumulative
        contributes = numerator > 0
        # where() on a safe denominator: a 0/0 in the discarded branch would still poison the gradient.
        safe_total = torch.where(contributes, total_cumulative, torch.ones_like(total_cumulative))
        precision_mass = torch.where(
            contributes, numerator / safe_total, torch.zeros_like(numerator)
        )

        average_precision = precision_mass.sum(dim=1)[has_positive] / num_positives[has_positive]
        return (1.0 - average_precision).mean()
