"""How well a confidence score tells right answers from wrong ones: R-AUROC, AURC, selective accuracy.

A *confidence* is any score per answer, larger = surer; an answer is *wrong* when, for retrieval,
its top-1 neighbour has another class than the query (for classification, when the predicted class
is wrong). The measures are those of the uncertainty benchmark of Kirchhof et al. (URL, NeurIPS
2023), so numbers compare with theirs:

* **R-AUROC** — the area under the ROC curve of the confidence for "the answer is right", i.e.
  ``P(c_right > c_wrong) + ½·P(c_right = c_wrong)`` over all (right, wrong) pairs (0.5 = chance,
  1 = the score ranks every right answer above every wrong one). :func:`error_auroc` is the same
  area seen from the other side (an uncertainty detecting the wrong answers): ``R-AUROC(c) =
  error_auroc(−c, wrong)``.
* **AURC** — the area under the risk–coverage curve (Geifman & El-Yaniv 2017): answer only the
  most confident share of queries and take the error rate of those answered, averaged over all
  coverage levels (lower is better; :func:`oracle_aurc` is the floor at a given error rate).
* **Selective accuracy** at a coverage (R@1 of the answered queries, for retrieval): the accuracy
  of the most confident ``⌈coverage · N⌉`` answers.

Every function treats tied confidences symmetrically: the result does not depend on the order of
the answers.

Example:
    >>> import torch
    >>> conf, wrong = torch.tensor([0.9, 0.8, 0.7, 0.6]), torch.tensor([False, True, False, True])
    >>> r_auroc(conf, wrong), aurc(conf, wrong), selective_accuracy(conf, wrong, 0.5)
    (0.75, 0.3333333333333333, 0.5)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from scipy.stats import rankdata
from torch import Tensor


@dataclass
class ConfidenceQuality:
    """How well one confidence score tells right answers from wrong ones.

    Attributes:
        auroc: the score's R-AUROC (:func:`r_auroc`): 0.5 is chance, 1 a perfect score.
        aurc: area under the risk–coverage curve (:func:`aurc`; lower is better).
    """

    auroc: float
    aurc: float


def error_auroc(uncertainty: Tensor, errors: Tensor) -> float:
    """``P(u_err > u_ok) + ½·P(u_err = u_ok)`` over all (wrong, right) pairs (Mann–Whitney): how
    well an uncertainty ranks the wrong answers (or any positives) first.

    NaN when every answer is right or every answer is wrong.

    >>> error_auroc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([False, False, True, True]))
    0.75
    """
    u = torch.as_tensor(uncertainty).double().flatten()
    err = torch.as_tensor(errors).bool().flatten()
    if len(u) != len(err):
        raise ValueError(f"the score has {len(u)} values but there are {len(err)} answers")
    n_err, n_ok = int(err.sum()), int((~err).sum())
    if n_err == 0 or n_ok == 0:
        return math.nan
    ranks = _average_ranks(u)
    return float((ranks[err].sum() - n_err * (n_err + 1) / 2) / (n_err * n_ok))


def r_auroc(confidence: Tensor, errors: Tensor) -> float:
    """R-AUROC (Kirchhof et al. 2023): the AUROC of ``confidence`` for "the answer is right",
    ``P(c_right > c_wrong) + ½·P(c_right = c_wrong)``; NaN when all answers are right or all wrong.
    """
    return error_auroc(-torch.as_tensor(confidence).double(), errors)


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


def selective_accuracy(confidence: Tensor, errors: Tensor, coverage: float) -> float:
    """Accuracy of the ``m = ⌈coverage · N⌉`` most confident answers.

    Answers tied with the ``m``-th confidence are taken in part, at their group's accuracy (the
    expected accuracy over every order of the ties), so the result does not depend on the order
    of the answers.
    """
    if not 0.0 < coverage <= 1.0:
        raise ValueError(f"coverage must lie in (0, 1], got {coverage}")
    c = torch.as_tensor(confidence).double().flatten()
    right = (~torch.as_tensor(errors).bool().flatten()).double()
    n = len(c)
    if n == 0:
        return math.nan
    m = math.ceil(coverage * n - 1e-9)  # coverage · N in float64: 0.7 · 10 is 7.000…01, not 7
    cut = torch.sort(c, descending=True).values[m - 1]
    above = c > cut
    tied = c == cut
    taken = m - int(above.sum())
    total = float(right[above].sum()) + taken * float(right[tied].mean())
    return total / m


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
    """R-AUROC and AURC of each named confidence score.

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
        out[name] = ConfidenceQuality(r_auroc(confidence, err), aurc(confidence, err))
    return out


def _average_ranks(values: Tensor) -> Tensor:
    """1-based ranks of ``values`` in increasing order, ties given their average rank."""
    return torch.from_numpy(rankdata(values.double().cpu().numpy(), method="average"))
