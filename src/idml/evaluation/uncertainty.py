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

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from scipy.stats import rankdata
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


# --------------------------------------------------------------------------- confidence of an answer
@dataclass
class ConfidenceQuality:
    """How well one confidence score tells right top-1 answers from wrong ones.

    Attributes:
        auroc: area under the ROC curve of the score's *uncertainty* (its negation for confidence
            scores) for detecting a wrong top-1 neighbour: 0.5 is chance, 1 a perfect detector.
        aurc: area under the risk–coverage curve — the mean, over coverage levels, of the error
            rate of the answers kept when only the most confident share is answered (lower is
            better; Geifman & El-Yaniv 2017).
    """

    auroc: float
    aurc: float


def error_auroc(uncertainty: Tensor, errors: Tensor) -> float:
    """``P(u_err > u_ok) + ½·P(u_err = u_ok)`` over all (wrong, right) pairs (Mann–Whitney).

    NaN when every answer is right or every answer is wrong.

    >>> error_auroc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([False, False, True, True]))
    0.75
    """
    u = torch.as_tensor(uncertainty).double().flatten()
    err = torch.as_tensor(errors).bool().flatten()
    n_err, n_ok = int(err.sum()), int((~err).sum())
    if n_err == 0 or n_ok == 0:
        return math.nan
    ranks = _average_ranks(u)
    return float((ranks[err].sum() - n_err * (n_err + 1) / 2) / (n_err * n_ok))


def risk_coverage(confidence: Tensor, errors: Tensor) -> tuple[Tensor, Tensor]:
    """The risk–coverage curve: answering only the queries with confidence ``≥ c``, for each
    observed ``c`` (most confident first), the share answered and their error rate.

    Tied confidences are answered together (the curve does not depend on the order of ties).
    Returns ``(coverage, risk)`` of the distinct confidence levels, each ``(L,)`` float64.
    """
    c = torch.as_tensor(confidence).double().flatten()
    err = torch.as_tensor(errors).double().flatten()
    order = torch.argsort(c, descending=True, stable=True)
    c, err = c[order], err[order]
    # The last position of each group of equal confidence.
    ends = torch.cat([torch.nonzero(c[1:] != c[:-1]).flatten(), torch.tensor([len(c) - 1])])
    answered = (ends + 1).double()
    return answered / len(c), torch.cumsum(err, 0)[ends] / answered


def aurc(confidence: Tensor, errors: Tensor) -> float:
    """Area under the risk–coverage curve: ``mean_i risk(c_i)``, where ``risk(c)`` is the error
    rate of the queries with confidence ``≥ c`` (lower is better).

    >>> aurc(torch.tensor([0.9, 0.8, 0.7, 0.6]), torch.tensor([False, True, False, True]))
    0.3333333333333333
    """
    coverage, risk = risk_coverage(confidence, errors)
    counts = torch.diff(coverage, prepend=torch.zeros(1, dtype=torch.float64))
    return float((risk * counts).sum())


def oracle_aurc(errors: Tensor) -> float:
    """The lowest AURC any score can reach at this error rate (all right answers first)."""
    err = torch.as_tensor(errors).bool().flatten()
    n = len(err)
    ok = int((~err).sum())
    # Right answers answered first carry risk 0; then every wrong answer adds one error.
    risks = torch.arange(1, n - ok + 1, dtype=torch.float64) / torch.arange(
        ok + 1, n + 1, dtype=torch.float64
    )
    return float(risks.sum() / n) if n else math.nan


def rank_combination(*confidences: Tensor) -> Tensor:
    """The mean of the scores' normalised ranks, ``(1/k)·Σ_j rank(c_j)/n`` (ties share their
    average rank): a confidence that combines scores of different scales with no parameter to fit.
    """
    if not confidences:
        raise ValueError("rank_combination needs at least one score")
    n = len(confidences[0])
    if any(len(c) != n for c in confidences):
        raise ValueError(f"scores to combine differ in length: {[len(c) for c in confidences]}")
    ranks = [_average_ranks(torch.as_tensor(c).double().flatten()) for c in confidences]
    return sum(ranks[1:], ranks[0]) / (len(ranks) * n)


def score_quality(errors: Tensor, scores: dict[str, Tensor]) -> dict[str, ConfidenceQuality]:
    """AUROC (wrong-answer detection by ``−score``) and AURC of each named confidence score.

    Args:
        errors: ``(N,)`` bool, the answer is wrong.
        scores: name → ``(N,)`` confidence (larger = surer).
    """
    err = torch.as_tensor(errors).bool().flatten()
    out: dict[str, ConfidenceQuality] = {}
    for name, confidence in scores.items():
        confidence = torch.as_tensor(confidence).double().flatten()
        if len(confidence) != len(err):
            raise ValueError(
                f"{name} has {len(confidence)} values but there are {len(err)} answers"
            )
        out[name] = ConfidenceQuality(error_auroc(-confidence, err), aurc(confidence, err))
    return out


def confidence_quality(
    errors: Tensor,
    top1_similarity: Tensor,
    uncertainty_level: Tensor | None = None,
) -> dict[str, ConfidenceQuality]:
    """AUROC and AURC of the retrieval confidence scores for "the top-1 neighbour is wrong".

    Scores (each as a confidence, larger = surer):

    - ``top1_cos``: the similarity of the nearest neighbour;
    - ``norm_u``: ``−||u||`` of the query (IDML's uncertainty level), when known;
    - ``combined``: :func:`rank_combination` of the two, when ``||u||`` is known.

    Args:
        errors: ``(Q,)`` bool, the top-1 neighbour has another class.
        top1_similarity: ``(Q,)`` similarity of each query's nearest neighbour.
        uncertainty_level: ``(Q,)`` ``||u||`` of each query.
    """
    scores = {"top1_cos": torch.as_tensor(top1_similarity).double().flatten()}
    if uncertainty_level is not None:
        level = torch.as_tensor(uncertainty_level).double().flatten()
        if len(level) != len(scores["top1_cos"]):
            raise ValueError(
                f"norm_u has {len(level)} values but there are {len(scores['top1_cos'])} queries"
            )
        scores["norm_u"] = -level
        scores["combined"] = rank_combination(scores["top1_cos"], -level)
    return score_quality(errors, scores)


def _average_ranks(values: Tensor) -> Tensor:
    """1-based ranks of ``values`` in increasing order, ties given their average rank."""
    return torch.from_numpy(rankdata(values.double().cpu().numpy(), method="average"))
