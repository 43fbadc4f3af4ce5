"""Summaries of the uncertainty level ``||u_i||`` of each image (IDML, Wang et al.).

IDML gives each image an uncertainty embedding ``u_i``; its norm is the image's uncertainty level
(Wang et al. 2022, Fig. 9: mixed and occluded test images get higher levels). The summary reports
its distribution (mean, standard deviation, extremes, quantiles), its per-class mean, and — when retrieval results are
given — Recall@1 per uncertainty quartile, which shows whether uncertain images are the hard ones.

Example:
    >>> import torch
    >>> s = summarize_uncertainty(torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([0, 0, 1, 1]))
    >>> s.mean, s.per_class_mean
    (2.5, {0: 1.5, 1: 3.5})
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

DEFAULT_QUANTILES: tuple[float, ...] = (0.05, 0.25, 0.5, 0.75, 0.95)


@dataclass
class UncertaintySummary:
    """Distribution of ``||u||`` over a set of images."""

    count: int
    mean: float
    std: float
    min: float
    max: float
    quantiles: dict[float, float]
    per_class_mean: dict[int, float]
    recall_at_1_by_quartile: list[float] = field(default_factory=list)
    """Recall@1 of the queries in each ``||u||`` quartile, least uncertain first (empty if unknown)."""

    def to_dict(self, per_class: bool = True) -> dict[str, object]:
        """A JSON-ready dict (per-class means on request)."""
        out: dict[str, object] = {
            "count": self.count,
            "mean": self.mean,
            "std": self.std,
            "min": self.min,
            "max": self.max,
            "quantiles": {str(q): v for q, v in self.quantiles.items()},
            "recall@1_by_quartile": self.recall_at_1_by_quartile,
        }
        if per_class:
            out["per_class_mean"] = {str(c): v for c, v in self.per_class_mean.items()}
        return out


def summarize_uncertainty(
    levels: Tensor,
    labels: Tensor | None = None,
    quantiles: Sequence[float] = DEFAULT_QUANTILES,
    recall_at_1: Tensor | None = None,
) -> UncertaintySummary:
    """Summarise uncertainty levels ``(N,)`` (``||u_i||``), optionally per class and vs. Recall@1.

    Args:
        levels: the uncertainty level of each image.
        labels: class of each image, for per-class means.
        quantiles: quantile levels in [0, 1].
        recall_at_1: per-image Recall@1 (NaN for lone queries, which are skipped) to break down by
            uncertainty quartile.
    """
    levels = torch.as_tensor(levels).detach().double().cpu().flatten()
    if levels.numel() == 0:
        raise ValueError("uncertainty levels are empty; pass at least one image")
    if not bool(torch.isfinite(levels).all()):
        raise ValueError("uncertainty levels contain NaN or inf; check the uncertainty embeddings")
    qs = [float(q) for q in quantiles]
    if any(not 0.0 <= q <= 1.0 for q in qs):
        raise ValueError(f"quantiles must lie in [0, 1], got {qs}")
    q_values = torch.quantile(levels, torch.tensor(qs, dtype=torch.float64)).tolist() if qs else []
    per_class: dict[int, float] = {}
    if labels is not None:
        labels = torch.as_tensor(labels).cpu().long().flatten()
        if len(labels) != len(levels):
            raise ValueError(
                f"labels has {len(labels)} entries but there are {len(levels)} uncertainty levels"
            )
        classes, inverse = torch.unique(labels, return_inverse=True)
        sums = torch.zeros(len(classes), dtype=torch.float64).index_add_(0, inverse, levels)
        means = sums / torch.bincount(inverse, minlength=len(classes)).double()
        per_class = dict(zip(classes.tolist(), means.tolist()))
    by_quartile: list[float] = []
    if recall_at_1 is not None:
        recall = torch.as_tensor(recall_at_1).double().cpu().flatten()
        keep = ~torch.isnan(recall)
        if int(keep.sum()) >= 4:
            lv, rc = levels[keep], recall[keep]
            # Stable order by level so equal levels split deterministically.
            order = torch.argsort(lv, stable=True)
            by_quartile = [float(part.mean()) for part in torch.tensor_split(rc[order], 4)]
    return UncertaintySummary(
        count=int(levels.numel()),
        mean=float(levels.mean()),
        std=float(levels.std(unbiased=False)),
        min=float(levels.min()),
        max=float(levels.max()),
        quantiles=dict(zip(qs, q_values)),
        per_class_mean=per_class,
        recall_at_1_by_quartile=by_quartile,
    )
