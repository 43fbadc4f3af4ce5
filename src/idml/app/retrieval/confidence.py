"""The confidence reported with a retrieval answer.

One function decides it, so that a calibrated score can replace it in one place. Today the
confidence of a query's answer is its top-1 cosine similarity ``ŝ_q · ŝ_{n_1}`` (in ``[-1, 1]``;
higher = closer match), labelled ``"top1_cosine"`` in every output. The query's uncertainty level
``||u_q||`` (Wang et al. 2022, IDML §IV) is reported beside it, uncombined: measured as detectors
of a wrong top-1 neighbour (:mod:`idml.evaluation.confidence`, reported by every evaluation as
``r_auroc_*``/``aurc_*``), ``||u||`` is at chance and the rank average of both scores
below the cosine alone, so the cosine is the confidence until a score that beats it is measured.

Example:
    >>> import torch
    >>> score, kind = confidence(torch.tensor([0.75, 0.25]), torch.tensor([1.0, 3.0]))
    >>> score.tolist(), kind
    ([0.75, 0.25], 'top1_cosine')
"""

from __future__ import annotations

import torch
from torch import Tensor

CONFIDENCE_KIND = "top1_cosine"
"""The label of what :func:`confidence` returns, written next to every confidence value."""


def confidence(top1_similarity: Tensor, query_uncertainty: Tensor) -> tuple[Tensor, str]:
    """``(score (Q,), kind)`` for queries whose nearest item has ``top1_similarity`` (cosine).

    ``query_uncertainty`` (``||u_q||``, ``(Q,)``) is accepted so that a calibrated score using it
    can be dropped in without changing any caller; the current score does not use it. Queries
    without any neighbour (an empty gallery) get ``NaN``.
    """
    top1 = torch.as_tensor(top1_similarity, dtype=torch.float32)
    query_uncertainty = torch.as_tensor(query_uncertainty)
    if top1.shape != query_uncertainty.shape:
        raise ValueError(
            f"top1_similarity {tuple(top1.shape)} and query_uncertainty "
            f"{tuple(query_uncertainty.shape)} must have the same shape (one value per query)"
        )
    return torch.where(torch.isfinite(top1), top1, torch.full_like(top1, float("nan"))), (
        CONFIDENCE_KIND
    )
