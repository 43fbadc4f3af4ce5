"""Classification metrics: top-k accuracy, expected calibration error and negative log-likelihood.

- Top-k accuracy: the share of images whose true class is among the ``k`` largest logits (ties
  broken by ``torch.topk``, i.e. by index).
- Expected calibration error (Naeini et al. 2015; Guo et al. 2017, eq. 3): the confidences
  ``p̂_i = max_c softmax(z_i)_c`` are put into ``M`` equal-width bins ``B_m = ((m−1)/M, m/M]`` and
  ``ECE = Σ_m |B_m|/N · |acc(B_m) − conf(B_m)|``, with ``acc`` the bin's accuracy and ``conf``
  its mean confidence (``M = 15`` as in Guo et al.).
  The per-bin pairs ``(conf(B_m), acc(B_m))`` drawn against each other are the reliability
  diagram (Guo et al. 2017, Fig. 1; DeGroot & Fienberg 1983): a calibrated classifier's bars lie on
  the diagonal. :func:`calibration_bins` computes both, so ECE and the diagram share one binning
  (:mod:`idml.evaluation.reliability`, which bins any probability of being right).
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

import torch
import torch.nn.functional as F
from torch import Tensor

from idml.evaluation.reliability import CalibrationBins, probability_bins

__all__ = [
    "CalibrationBins",
    "calibration_bins",
    "classification_metrics",
    "confusion_matrix",
    "expected_calibration_error",
    "negative_log_likelihood",
    "topk_accuracy",
]


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


def calibration_bins(logits: Tensor, labels: Tensor, num_bins: int = 15) -> CalibrationBins:
    """The confidences ``max_c softmax(z_i)_c`` of the rows of ``logits`` in ``num_bins``
    equal-width bins, with each bin's correct count (module docstring)."""
    _check(logits, labels)
    probs = torch.softmax(logits.double(), dim=1)
    confidence, predicted = probs.max(dim=1)
    return probability_bins(confidence, predicted == labels, num_bins)


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
