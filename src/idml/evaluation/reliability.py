"""Reliability of a probability of being right: equal-width bins, ECE and the reliability diagram.

Any prediction that comes with a probability ``p̂_i`` of being right (a classifier's top softmax
probability, a retrieval answer's calibrated confidence) is judged the same way (Naeini et al.
2015; Guo et al. 2017, eq. 2–3): the ``p̂_i`` go into ``M`` equal-width bins
``B_m = ((m−1)/M, m/M]`` (``B_1`` also holds 0), and

``ECE = Σ_m |B_m|/N · |acc(B_m) − conf(B_m)|``,

with ``acc`` the share of right predictions in the bin and ``conf`` its mean probability (``M = 15``
as in Guo et al. and the URL benchmark of Kirchhof et al. 2023). The per-bin pairs
``(conf(B_m), acc(B_m))`` are the reliability diagram: a calibrated probability's points lie on the
diagonal.

Example:
    >>> import torch
    >>> bins = probability_bins(torch.tensor([0.9, 0.9, 0.3, 0.7]), torch.tensor([1, 0, 0, 1]), 5)
    >>> bins.counts.tolist(), round(bins.ece, 4)
    ([0.0, 1.0, 0.0, 1.0, 2.0], 0.35)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class CalibrationBins:
    """Probabilities of being right in ``M`` equal-width bins ``B_m = ((m−1)/M, m/M]`` (float64).

    ``conf(B_m) = confidence_sum[m] / counts[m]`` and ``acc(B_m) = correct_sum[m] / counts[m]``
    (Guo et al. 2017, eq. 2–3); empty bins have no mean (NaN in :attr:`mean_confidence`).
    """

    edges: Tensor
    """``(M + 1,)``: ``0, 1/M, …, 1``."""
    counts: Tensor
    """``(M,)``: predictions per bin."""
    confidence_sum: Tensor
    """``(M,)``: sum of the bin's probabilities."""
    correct_sum: Tensor
    """``(M,)``: how many of the bin's predictions are right."""

    @property
    def mean_confidence(self) -> Tensor:
        """``conf(B_m)`` (NaN for an empty bin)."""
        return self.confidence_sum / self.counts

    @property
    def accuracy(self) -> Tensor:
        """``acc(B_m)`` (NaN for an empty bin)."""
        return self.correct_sum / self.counts

    @property
    def ece(self) -> float:
        """``Σ_m |B_m|/N · |acc(B_m) − conf(B_m)| = Σ_m |Σ_{B_m} 1[right] − Σ_{B_m} p̂| / N``."""
        total = max(int(self.counts.sum()), 1)
        return float((self.confidence_sum - self.correct_sum).abs().sum() / total)

    def to_dict(self) -> dict[str, list[float | None]]:
        """The reliability diagram as JSON-ready lists (``None`` for an empty bin's means)."""

        def clean(values: Tensor) -> list[float | None]:
            return [None if v != v else v for v in values.tolist()]

        return {
            "edges": self.edges.tolist(),
            "counts": self.counts.tolist(),
            "mean_confidence": clean(self.mean_confidence),
            "accuracy": clean(self.accuracy),
        }


def probability_bins(probability: Tensor, correct: Tensor, num_bins: int = 15) -> CalibrationBins:
    """``probability`` (``(N,)`` in ``[0, 1]``) in ``num_bins`` equal-width bins, with each bin's
    count of ``correct`` (``(N,)`` bool or 0/1) predictions (module docstring)."""
    if num_bins < 1:
        raise ValueError(f"num_bins must be >= 1, got {num_bins}")
    p = torch.as_tensor(probability).double().flatten()
    right = torch.as_tensor(correct).double().flatten()
    if p.shape != right.shape:
        raise ValueError(
            f"probability has {p.numel()} values but correct has {right.numel()}; pass one each"
        )
    if p.numel() and not bool(((p >= 0) & (p <= 1)).all()):
        raise ValueError(
            "probabilities must lie in [0, 1] (NaN excluded) to be binned; got values from "
            f"{float(p.min())} to {float(p.max())}"
        )
    # Bin m holds ((m−1)/M, m/M]: ceil(p·M) − 1, with p = 0 in the first bin.
    bins = (p * num_bins).ceil().long().clamp(1, num_bins) - 1
    return CalibrationBins(
        edges=torch.linspace(0.0, 1.0, num_bins + 1, dtype=torch.float64),
        counts=torch.bincount(bins, minlength=num_bins).double(),
        confidence_sum=torch.bincount(bins, weights=p, minlength=num_bins),
        correct_sum=torch.bincount(bins, weights=right, minlength=num_bins),
    )
