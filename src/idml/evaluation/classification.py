"""Classification metrics: top-k accuracy, expected calibration error and negative log-likelihood.

- Top-k accuracy: the share of images whose true class is among the ``k`` largest logits (ties
  broken by ``torch.topk``, i.e. by index).
- Expected calibration error (Naeini et al. 2015; Guo et al. 2017, eq. 3): the confidences
  ``p̂_i = max_c softmax(z_i)_c`` are put into ``M`` equal-width bins ``B_m = ((m−1)/M, m/M]`` and
  ``ECE = Σ_m |B_m|/N · |acc(B_m) − conf(B_m)|``, with ``acc`` the bin's accuracy and ``conf``
  its mean confidence (``M = 15`` as in Guo et al.).
  The per-bin pairs ``(conf(B_m), acc(B_m))`` drawn against each other are the reliability
  diagram (Guo et al. 2017, Fig. 1; DeGroot & Fienberg 1983): a calibrated classifier's bars lie on
  the diagonal. :func:`calibration_bins` computes both, so ECE and the diagram share one binning.
- NLL: the mean cross-entropy ``−log softmax(z_i)_{y_i}``, in nats.
- Confusion matrix: ``M[t, p]`` = number of images of true class ``t`` predicted as ``p``.

Example:
    >>> import torch
    >>> logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 2.0, 1.0], [0.0, 1.0, 2.0]])
    >>> topk_accuracy(logits, torch.tensor([0, 2, 0]), ks=(1, 2))
    {1: 0.3333333333333333, 2: 0.6666666666666666}
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


def _check(logits: Tensor, labels: Tensor) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must have shape (images, classes), got {tuple(logits.shape)}")
    if labels.shape != (logits.shape[0],):
        raise ValueError(
            f"labels must have shape ({logits.shape[0]},) (one per row of logits), got "
            f"{tuple(labels.shape)}"
        )
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= logits.shape[1]):
        raise ValueError(
            f"labels must lie in 0..{logits.shape[1] - 1} (the classifier's classes), got "
            f"{int(labels.min())}..{int(labels.max())}"
        )


def topk_accuracy(logits: Tensor, labels: Tensor, ks: Sequence[int] = (1, 5)) -> dict[int, float]:
    """``{k: share of rows whose label is among the k largest logits}``; ``k`` must not exceed C."""
    _check(logits, labels)
    if not ks:
        return {}
    if any(k < 1 or k > logits.shape[1] for k in ks):
        raise ValueError(f"top-k: every k must lie in 1..{logits.shape[1]} (classes), got {ks}")
    top = logits.topk(max(ks), dim=1).indices
    hit = top == labels[:, None]
    return {k: float(hit[:, :k].any(dim=1).double().mean()) for k in ks}


@dataclass(frozen=True)
class CalibrationBins:
    """Softmax confidences in ``M`` equal-width bins ``B_m = ((m−1)/M, m/M]`` (float64 tensors).

    ``conf(B_m) = confidence_sum[m] / counts[m]`` and ``acc(B_m) = correct_sum[m] / counts[m]``
    (Guo et al. 2017, eq. 2–3); empty bins have no mean (NaN in :attr:`mean_confidence`).
    """

    edges: Tensor
    """``(M + 1,)``: ``0, 1/M, …, 1``."""
    counts: Tensor
    """``(M,)``: images per bin."""
    confidence_sum: Tensor
    """``(M,)``: sum of the bin's confidences ``max_c softmax(z_i)_c``."""
    correct_sum: Tensor
    """``(M,)``: how many of the bin's images are classified right."""

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
        """``Σ_m |B_m|/N · |acc(B_m) − conf(B_m)| = Σ_m |Σ_{B_m} 1[ŷ=y] − Σ_{B_m} p̂| / N``."""
        total = max(int(self.counts.sum()), 1)
        return float((self.confidence_sum - self.correct_sum).abs().sum() / total)


def calibration_bins(logits: Tensor, labels: Tensor, num_bins: int = 15) -> CalibrationBins:
    """The confidences ``max_c softmax(z_i)_c`` of the rows of ``logits`` in ``num_bins``
    equal-width bins, with each bin's correct count (module docstring)."""
    _check(logits, labels)
    if num_bins < 1:
        raise ValueError(f"num_bins must be >= 1, got {num_bins}")
    probs = torch.softmax(logits.double(), dim=1)
    confidence, predicted = probs.max(dim=1)
    correct = (predicted == labels).double()
    # Bin m holds confidences in ((m−1)/M, m/M]; a confidence is > 0, so ceil(p·M) − 1 ∈ [0, M).
    bins = (confidence * num_bins).ceil().long().clamp(1, num_bins) - 1
    return CalibrationBins(
        edges=torch.linspace(0.0, 1.0, num_bins + 1, dtype=torch.float64),
        counts=torch.bincount(bins, minlength=num_bins).double(),
        confidence_sum=torch.bincount(bins, weights=confidence, minlength=num_bins),
        correct_sum=torch.bincount(bins, weights=correct, minlength=num_bins),
    )


def expected_calibration_error(logits: Tensor, labels: Tensor, num_bins: int = 15) -> float:
    """ECE of the softmax confidences in ``num_bins`` equal-width bins (module docstring)."""
    return calibration_bins(logits, labels, num_bins).ece


def confusion_matrix(predicted: Tensor, labels: Tensor, num_classes: int) -> Tensor:
    """``(C, C)`` int64 counts ``M[t, p]`` of images of true class ``t`` predicted as ``p``.

    >>> confusion_matrix(torch.tensor([0, 1, 1]), torch.tensor([0, 0, 1]), 2).tolist()
    [[1, 1], [0, 1]]
    """
    predicted, labels = torch.as_tensor(predicted).long(), torch.as_tensor(labels).long()
    if predicted.shape != labels.shape or predicted.dim() != 1:
        raise ValueError(
            f"predicted and labels must be two (N,) tensors, got {tuple(predicted.shape)} and "
            f"{tuple(labels.shape)}"
        )
    for name, values in (("predicted", predicted), ("labels", labels)):
        if values.numel() and (int(values.min()) < 0 or int(values.max()) >= num_classes):
            raise ValueError(f"{name} must lie in 0..{num_classes - 1}, got {values.tolist()[:8]}")
    flat = torch.bincount(labels * num_classes + predicted, minlength=num_classes * num_classes)
    return flat.reshape(num_classes, num_classes)


def negative_log_likelihood(logits: Tensor, labels: Tensor) -> float:
    """Mean ``−log softmax(z_i)_{y_i}``."""
    _check(logits, labels)
    return float(F.cross_entropy(logits.double(), labels.long()))


def classification_metrics(
    logits: Tensor, labels: Tensor, ks: Sequence[int] = (1, 5), num_bins: int = 15
) -> dict[str, float]:
    """``top{k}`` for each ``k ≤ C``, ``ece`` and ``nll`` of a test set's logits."""
    usable = [k for k in ks if k <= logits.shape[1]]
    out = {f"top{k}": v for k, v in topk_accuracy(logits, labels, usable).items()}
    out["ece"] = expected_calibration_error(logits, labels, num_bins)
    out["nll"] = negative_log_likelihood(logits, labels)
    return out
