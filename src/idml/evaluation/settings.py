"""What an evaluation computes and how: :class:`EvaluationSettings`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from idml.evaluation.clustering import KMeansBackend
from idml.evaluation.confidence.assessment import ConfidenceSettings
from idml.evaluation.reranking import Reranker
from idml.evaluation.retrieval_metrics import DEFAULT_RECALL_LEVELS
from idml.evaluation.scoring import MetricSpec
from idml.evaluation.search.kernels import KERNEL_NAMES, KernelName

KnnBackend = Literal["exact", "faiss"]


@dataclass(frozen=True)
class EvaluationSettings:
    """The settings of :func:`~idml.evaluation.evaluate_embeddings` (validated on construction).

    Attributes:
        ks: the K of Recall@K (SOP convention: ``(1, 10, 100, 1000)``).
        metric: ``"cosine"`` (default), ``"euclidean"`` or a :class:`~idml.metrics.Metric`.
        normalize: L2-normalise semantic embeddings (the literature's convention); also for NMI.
        block_size: tile side of the blocked search (default per device); memory
            ``O(block² + N·(k + R_max))``.
        num_neighbors: how many nearest neighbours the report keeps per query. The search goes
            deeper when the confidence scores read more; metrics never depend on the lists, and
            the k-NN-graph k-means reuses them only when they are long enough (else it runs its
            own search).
        nmi: compute NMI of k-means (#clusters = #query classes) on the query embeddings.
        nmi_backend, seed, kmeans_iterations: k-means settings (see
            :mod:`idml.evaluation.clustering`; with faiss the defaults reproduce
            pytorch-metric-learning; ``"knn"`` is the fast k-NN-graph k-means for many classes,
            which ``"auto"`` picks when points × classes is large, e.g. SOP).
        pr_cutoffs: rank cut-offs of the precision–recall curve (default 1, 2, 4, …, all).
        recall_levels: recall levels of interpolated precision (default 0.0, 0.1, …, 1.0).
        knn_backend: ``"exact"`` (default) or ``"faiss"`` (approximate index ``faiss_index`` with
            ``faiss_parameters``; metrics then come from the neighbour lists, which are made long
            enough for R-Precision and MAP@R, and MAP/MRR over the whole gallery are not reported).
        full_ranking: rank every relevant item in the whole gallery (default): MAP and MRR over
            the whole gallery and the precision–recall curve at every cut-off need it. ``False``:
            the exact search keeps only each query's neighbour list, as deep as the largest K of
            Recall@K and the largest class, which gives Recall@K, R-Precision and MAP@R exactly
            (pytorch-metric-learning's ``AccuracyCalculator`` metrics) without counting the
            gallery below it: several times faster on a large gallery of small classes (SOP).
            MAP and MRR over the whole gallery are then not reported (``mrr@k`` is), as with
            ``knn_backend="faiss"``; a relevant item tied in score with an irrelevant one is
            ordered by index, as in the lists, instead of after it.
        score_kernel: the products of the exact search (:mod:`idml.evaluation.search.kernels`):
            ``"auto"`` (default) measures the candidates on this machine for a large search;
            ``"torch"``, ``"openblas"``, ``"faiss"`` or ``"bf16"`` force one. Results are exact
            with every kernel.
        reranking: re-order each query's shortlist before metrics and confidence
            (:mod:`idml.evaluation.reranking`: k-reciprocal, αQE/DBA); exact search with the cosine
            metric only. Metrics then come from the re-ranked lists, searched deep enough for
            R-Precision and MAP@R (the first ``max(reranking.depth, R)`` neighbours are
            re-ranked), and MAP/MRR over the whole gallery are not reported.
        confidence: which confidence scores to judge and how (R-AUROC, AURC, selective R@1,
            ECE and abstention thresholds of a calibrated confidence;
            :class:`~idml.evaluation.confidence.assessment.ConfidenceSettings`); ``None`` for none.

    Example:
        >>> EvaluationSettings(ks=8, nmi=False).ks
        (8,)
    """

    ks: Sequence[int] = (1, 2, 4, 8)
    metric: MetricSpec = "cosine"
    normalize: bool = True
    block_size: int | None = None
    num_neighbors: int = 10
    nmi: bool = True
    nmi_backend: KMeansBackend = "auto"
    seed: int = 1234
    kmeans_iterations: int = 20
    pr_cutoffs: Sequence[int] | None = None
    recall_levels: Sequence[float] = DEFAULT_RECALL_LEVELS
    knn_backend: KnnBackend = "exact"
    full_ranking: bool = True
    faiss_index: str = "HNSW32"
    faiss_parameters: str | None = None
    score_kernel: KernelName = "auto"
    reranking: Reranker | None = None
    confidence: ConfidenceSettings | None = ConfidenceSettings()  # noqa: RUF009 (frozen, immutable)

    def __post_init__(self) -> None:
        # Sequences become tuples so that settings are immutable and compare by value.
        object.__setattr__(self, "ks", _check_ks(self.ks))
        object.__setattr__(self, "recall_levels", tuple(self.recall_levels))
        if self.pr_cutoffs is not None:
            cutoffs = tuple(int(c) for c in self.pr_cutoffs)
            if any(c < 1 for c in cutoffs):
                raise ValueError(f"pr_cutoffs must be positive ranks, got {list(cutoffs)}")
            object.__setattr__(self, "pr_cutoffs", cutoffs)
        if self.num_neighbors < 0:
            raise ValueError(f"num_neighbors must be >= 0, got {self.num_neighbors}")
        if self.confidence is not None and not isinstance(self.confidence, ConfidenceSettings):
            raise ValueError(
                f"confidence must be a ConfidenceSettings or None, got {type(self.confidence).__name__}"
            )
        if self.knn_backend not in ("exact", "faiss"):
            raise ValueError(f"knn_backend must be 'exact' or 'faiss', got {self.knn_backend!r}")
        if self.score_kernel not in KERNEL_NAMES:
            raise ValueError(
                f"score_kernel must be one of {KERNEL_NAMES}, got {self.score_kernel!r}"
            )
        if self.reranking is not None:
            if not isinstance(self.reranking, Reranker):
                raise ValueError(
                    "reranking must be an idml.evaluation.reranking.Reranker (KReciprocal, "
                    f"QueryExpansion) or None, got {type(self.reranking).__name__}"
                )
            if self.knn_backend != "exact" or self.metric != "cosine" or not self.normalize:
                raise ValueError(
                    "re-ranking works on the exact search's cosine similarities of normalised "
                    f"embeddings; got knn_backend={self.knn_backend!r}, metric={self.metric!r}, "
                    f"normalize={self.normalize}"
                )


def _check_ks(ks: Sequence[int] | int) -> tuple[int, ...]:
    if isinstance(ks, int):
        ks = (ks,)
    out = tuple(ks)
    if not out:
        raise ValueError("ks must contain at least one K for Recall@K, e.g. (1, 2, 4, 8)")
    for k in out:
        if isinstance(k, bool) or not isinstance(k, int | np.integer) or k <= 0:
            raise ValueError(f"ks must be positive integers (K of Recall@K), got {list(out)}")
    return tuple(int(k) for k in out)
