"""Evaluation: exact blocked retrieval at Stanford-Online-Products scale, metrics, NMI, ``||u||``.

Entry point: :func:`evaluate_embeddings` (what to compute: :class:`EvaluationSettings`) →
:class:`EvaluationReport` (``.metrics``,
``.format_table()``, ``.to_json()``). Building blocks: :func:`exact_search` (blocked exact k-NN
plus the rank of every relevant item, never an N×N matrix), :func:`faiss_search` (approximate,
optional ``faiss`` extra), :class:`RankAccumulator` (Recall@K, R-Precision, MAP@R, MAP, MRR,
precision–recall from ranks), :func:`nmi_score` (with :class:`KMeansSettings`), :func:`summarize_uncertainty` and the file readers
:func:`load_embedding_file` / :func:`load_labels`. How sure each answer is (confidence scores, a
calibrated confidence, abstention thresholds, R-AUROC/AURC/ECE): :mod:`idml.evaluation.confidence`;
re-ranking shortlists (k-reciprocal, αQE/DBA): :mod:`idml.evaluation.reranking`. Conventions: those of the DML
literature (Musgrave et al. 2020, "A Metric Learning Reality Check"), listed in :mod:`idml.evaluation.search`.
"""

from idml.evaluation.clustering import KMeansSettings, kmeans_assign, nmi_score
from idml.evaluation.evaluate import (
    EvaluationReport,
    EvaluationSettings,
    RetrievalResult,
    evaluate_embeddings,
    evaluate_files,
)
from idml.evaluation.io import EmbeddingFile, EntryNames, load_embedding_file, load_labels
from idml.evaluation.retrieval_metrics import PRCurve, RankAccumulator, per_query_metrics
from idml.evaluation.scoring import PairScorer
from idml.evaluation.search import (
    NeighborLists,
    SearchExecution,
    SearchOutput,
    exact_search,
    faiss_search,
)
from idml.evaluation.uncertainty import UncertaintySummary, summarize_uncertainty

__all__ = [
    "EmbeddingFile",
    "EntryNames",
    "EvaluationReport",
    "EvaluationSettings",
    "KMeansSettings",
    "NeighborLists",
    "PRCurve",
    "PairScorer",
    "RankAccumulator",
    "RetrievalResult",
    "SearchExecution",
    "SearchOutput",
    "UncertaintySummary",
    "evaluate_embeddings",
    "evaluate_files",
    "exact_search",
    "faiss_search",
    "kmeans_assign",
    "load_embedding_file",
    "load_labels",
    "nmi_score",
    "per_query_metrics",
    "summarize_uncertainty",
]
