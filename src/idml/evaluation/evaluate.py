"""The evaluation entry point: :func:`evaluate_embeddings` → :class:`EvaluationReport`.

It runs the exact blocked retrieval of :mod:`idml.evaluation.search` (or, optionally, an approximate
faiss index), turns the ranks of the relevant items into every retrieval metric
(:mod:`idml.evaluation.retrieval_metrics`), adds NMI of k-means (:mod:`idml.evaluation.clustering`)
and, for IDML models, a summary of the uncertainty levels ``||u||``
(:mod:`idml.evaluation.uncertainty`). The trainer calls it after each epoch; ``idml evaluate``
calls it on embedding files.

Conventions of the DML literature: L2-normalised semantic embeddings, cosine (or Euclidean) ranking with the
query excluded by index, Recall@K, R-Precision and MAP@R as in Musgrave et al. 2020 (MAP@R divides
by R), queries alone in their class excluded and counted. ``introspective_metric`` ranks with the
introspective similarity metric on semantic + uncertainty embeddings instead (IDML paper, Table 5
ablation; the paper's default test protocol is the plain metric).

Example:
    >>> import torch
    >>> x = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9], [0.7, 0.7]])
    >>> report = evaluate_embeddings(x, torch.tensor([0, 0, 1, 1, 2]), ks=(1, 2), nmi=False)
    >>> report.metrics["recall@1"], report.retrieval.num_lone_queries
    (1.0, 1)
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from idml.embeddings import Embeddings, check_matrix
from idml.evaluation.clustering import (
    KNN_GRAPH_NEIGHBORS,
    KMeansBackend,
    describe_backend,
    nmi_score,
    resolve_backend,
)
from idml.evaluation.io import EmbeddingFile, check_labels, load_embedding_file, load_labels
from idml.evaluation.retrieval_metrics import (
    DEFAULT_RECALL_LEVELS,
    PRCurve,
    RankAccumulator,
    default_cutoffs,
    ranks_from_neighbors,
)
from idml.evaluation.scoring import MetricSpec, PairScorer
from idml.evaluation.search import NeighborLists, exact_search, faiss_search, neighbors_only
from idml.evaluation.uncertainty import (
    ConfidenceQuality,
    UncertaintySummary,
    confidence_quality,
    oracle_aurc,
    summarize_uncertainty,
)
from idml.metrics import IntrospectiveMetric

ArrayLike = Tensor | np.ndarray
EmbeddingInput = Tensor | np.ndarray | Embeddings
KnnBackend = Literal["exact", "faiss"]


@dataclass
class RetrievalResult:
    """Retrieval results: neighbour lists, metric means, per-query and per-class values.

    Attributes:
        ks: the K of Recall@K.
        metrics: metric name → mean over non-lone queries (``recall@K``, ``r_precision``,
            ``map@r``, ``map``, ``mrr``; approximate search reports ``mrr@k`` instead of the
            last two).
        per_query: metric name → ``(Q,)`` float64 values in query order (NaN for lone queries).
        per_class: class label → metric means over its non-lone queries, with ``num_queries`` and
            ``num_lone_queries``.
        pr_curve: precision–recall data (see :class:`~idml.evaluation.retrieval_metrics.PRCurve`).
        neighbor_indices: ``(Q, k)`` reference indices of the nearest neighbours (``-1`` = none).
        neighbor_values: ``(Q, k)`` their metric values: similarities, or distances when
            ``values_are_similarities`` is false (NaN = none).
        values_are_similarities: whether ``neighbor_values`` are similarities (else distances).
        num_queries, num_references: sizes; ``same_set`` when the set was searched against itself.
        lone_queries: indices of the queries with no relevant reference (excluded from metrics).
        metric_name: the ranking metric; ``backend``: ``"exact"`` or ``"faiss:<index>"``.
    """

    ks: tuple[int, ...]
    metrics: dict[str, float]
    per_query: dict[str, Tensor]
    per_class: dict[int, dict[str, float]]
    pr_curve: PRCurve
    neighbor_indices: Tensor
    neighbor_values: Tensor
    values_are_similarities: bool
    num_queries: int
    num_references: int
    same_set: bool
    lone_queries: Tensor
    metric_name: str
    backend: str

    @property
    def num_lone_queries(self) -> int:
        return int(self.lone_queries.numel())

    def to_dict(self, per_class: bool = False) -> dict[str, Any]:
        """A JSON-ready dict (no per-query arrays or neighbour lists; per-class on request)."""
        out: dict[str, Any] = {
            "metrics": {k: _clean(v) for k, v in self.metrics.items()},
            "num_queries": self.num_queries,
            "num_references": self.num_references,
            "same_set": self.same_set,
            "num_lone_queries": self.num_lone_queries,
            "ks": list(self.ks),
            "metric": self.metric_name,
            "backend": self.backend,
            "pr_curve": self.pr_curve.to_dict(),
        }
        if per_class:
            out["per_class"] = {
                str(c): {k: _clean(v) for k, v in row.items()} for c, row in self.per_class.items()
            }
        return out


@dataclass
class EvaluationReport:
    """Everything :func:`evaluate_embeddings` measured."""

    retrieval: RetrievalResult
    nmi: float | None
    uncertainty: UncertaintySummary | None
    timings: dict[str, float] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    confidence: dict[str, ConfidenceQuality] = field(default_factory=dict)
    """How well each confidence score predicts a wrong top-1 neighbour
    (:func:`~idml.evaluation.uncertainty.confidence_quality`): ``top1_cos`` always, ``norm_u`` and
    ``combined`` when the queries carry uncertainty."""
    oracle_aurc: float | None = None
    """The AURC of a perfect confidence score at this error rate (the floor of every ``aurc_*``)."""
    uncertainty_levels: Tensor | None = None
    """``||u||`` of every query (``None`` without uncertainty embeddings)."""

    @property
    def metrics(self) -> dict[str, float]:
        """Retrieval metric means, ``nmi`` (when computed), then ``auroc_<score>`` /
        ``aurc_<score>`` of each confidence score and ``aurc_oracle``, in report order."""
        out = dict(self.retrieval.metrics)
        if self.nmi is not None:
            out["nmi"] = self.nmi
        for name, quality in self.confidence.items():
            out[f"auroc_{name}"] = quality.auroc
            out[f"aurc_{name}"] = quality.aurc
        if self.oracle_aurc is not None:
            out["aurc_oracle"] = self.oracle_aurc
        return out

    @property
    def pr_curve(self) -> PRCurve:
        """The precision–recall data of the retrieval (see :class:`RetrievalResult`)."""
        return self.retrieval.pr_curve

    def to_dict(self, per_class: bool = False) -> dict[str, Any]:
        """A JSON-ready dict: metrics (with NMI), counts, PR curve, ``||u||``, timings, settings."""
        out = self.retrieval.to_dict(per_class)
        out["metrics"] = {k: _clean(v) for k, v in self.metrics.items()}
        if self.uncertainty is not None:
            out["uncertainty"] = self.uncertainty.to_dict(per_class)
        out["timings_s"] = {k: round(v, 4) for k, v in self.timings.items()}
        out["settings"] = self.settings
        return out

    def to_json(self, per_class: bool = False, indent: int | None = 2) -> str:
        """The report as JSON (stable keys; NaN written as ``null``)."""
        return json.dumps(self.to_dict(per_class), indent=indent)

    def format_table(self, per_class: int = 0) -> str:
        """A readable report: a header line, the metric table, counts and ``||u||`` if known.

        ``per_class`` > 0 appends the that many classes with the lowest Recall@1.
        """
        r = self.retrieval
        against = "themselves" if r.same_set else f"{r.num_references:,} references"
        header = (
            f"{r.num_queries:,} queries against {against}; metric {r.metric_name}, "
            f"search {r.backend}"
        )
        lines = [header, "", self._metric_table()]
        lines.append("")
        lines.append(f"lone queries (alone in their class, excluded): {r.num_lone_queries:,}")
        if self.uncertainty is not None:
            u = self.uncertainty
            qs = ", ".join(f"q{round(q * 100):02d} {_fmt(v)}" for q, v in u.quantiles.items())
            lines.append(
                f"uncertainty ||u||: mean {_fmt(u.mean)}, std {_fmt(u.std)}, "
                f"min {_fmt(u.min)}, max {_fmt(u.max)}; {qs}"
            )
            if u.recall_at_1_by_quartile:
                parts = ", ".join(_fmt(v) for v in u.recall_at_1_by_quartile)
                lines.append(f"recall@1 by ||u|| quartile (least uncertain first): {parts}")
        if per_class > 0 and r.per_class:
            key = f"recall@{r.ks[0]}"
            rows = sorted(
                r.per_class.items(),
                key=lambda item: (math.inf if math.isnan(item[1][key]) else item[1][key], item[0]),
            )[:per_class]
            lines.append("")
            lines.append(f"classes with the lowest {key}:")
            lines += [
                f"  class {c}: {key} {_fmt(row[key])}, map@r {_fmt(row['map@r'])}, "
                f"{row['num_queries']} queries"
                for c, row in rows
            ]
        return "\n".join(lines)

    def _metric_table(self) -> str:
        metrics = self.metrics
        width = max(len(k) for k in metrics)
        lines = [f"{'metric'.ljust(width)}  value", f"{'-' * width}  ------"]
        lines += [f"{k.ljust(width)}  {_fmt(v)}" for k, v in metrics.items()]
        method = self.settings.get("nmi_method")
        if method is not None:
            # Say how NMI was computed (or that it was not): the approximation reads differently.
            if "nmi" in metrics:
                lines[-1] += f"  {method}"
            else:
                lines.append(f"{'nmi'.ljust(width)}  {method}")
        return "\n".join(lines)


def _fmt(value: float) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.4f}"


def _clean(value: float) -> float | None:
    return None if isinstance(value, float) and math.isnan(value) else value


def _check_ks(ks: Sequence[int]) -> tuple[int, ...]:
    if isinstance(ks, int):
        ks = (ks,)
    out = tuple(ks)
    if not out:
        raise ValueError("ks must contain at least one K for Recall@K, e.g. (1, 2, 4, 8)")
    for k in out:
        if isinstance(k, bool) or not isinstance(k, int | np.integer) or k <= 0:
            raise ValueError(f"ks must be positive integers (K of Recall@K), got {list(out)}")
    return tuple(int(k) for k in out)


def _split(
    embeddings: EmbeddingInput, uncertainty: ArrayLike | None, name: str
) -> tuple[Tensor, Tensor | None]:
    """Semantic and uncertainty tensors from an :class:`Embeddings` or an array, validated."""
    if isinstance(embeddings, Embeddings):
        if uncertainty is not None and embeddings.uncertainty is not None:
            raise ValueError(f"{name}: uncertainty given twice (in Embeddings and as an argument)")
        semantic, unc = embeddings.semantic, embeddings.uncertainty
        unc = unc if uncertainty is None else torch.as_tensor(uncertainty)
    else:
        semantic = torch.as_tensor(embeddings)
        unc = None if uncertainty is None else torch.as_tensor(uncertainty)
    semantic = semantic.detach()
    if semantic.dim() == 2 and semantic.shape[0] == 0:
        raise ValueError(f"{name} is empty; pass at least two embeddings")
    check_matrix(name, semantic)
    if unc is not None:
        unc = unc.detach()
        check_matrix(f"{name} uncertainty", unc)
        if unc.shape[0] != semantic.shape[0]:
            raise ValueError(
                f"{name} uncertainty has {unc.shape[0]} rows but {name} has {semantic.shape[0]}; "
                "pass one uncertainty vector per embedding"
            )
    return semantic, unc


def _labels(labels: ArrayLike | Sequence[int], n: int, name: str) -> Tensor:
    out = check_labels(torch.as_tensor(labels), name)
    if len(out) != n:
        raise ValueError(
            f"{name} has {len(out)} entries but there are {n} embeddings; pass one label per row"
        )
    return out


def evaluate_embeddings(
    embeddings: EmbeddingInput,
    labels: ArrayLike | Sequence[int],
    ks: Sequence[int] = (1, 2, 4, 8),
    *,
    query: tuple[EmbeddingInput, ArrayLike | Sequence[int]] | None = None,
    uncertainty: ArrayLike | None = None,
    metric: MetricSpec = "cosine",
    introspective_metric: IntrospectiveMetric | None = None,
    normalize: bool = True,
    device: torch.device | str | None = None,
    block_size: int | None = None,
    num_neighbors: int = 10,
    nmi: bool = True,
    nmi_backend: KMeansBackend = "auto",
    seed: int = 1234,
    kmeans_iterations: int = 20,
    pr_cutoffs: Sequence[int] | None = None,
    recall_levels: Sequence[float] = DEFAULT_RECALL_LEVELS,
    knn_backend: KnnBackend = "exact",
    faiss_index: str = "HNSW32",
    faiss_parameters: str | None = None,
    progress: bool | Callable[[int], object] = False,
) -> EvaluationReport:
    """Evaluate embeddings for retrieval (Recall@K, R-Precision, MAP@R, MAP, MRR, PR), NMI and ``||u||``.

    Args:
        embeddings: ``(N, d)`` reference (gallery) embeddings — an array, a tensor or an
            :class:`~idml.embeddings.Embeddings` carrying uncertainty. Without ``query`` they are
            also the queries ("the test set against itself"; each query excluded by index).
        labels: ``(N,)`` integer class ids.
        ks: the K of Recall@K (SOP convention: ``(1, 10, 100, 1000)``).
        query: a separate query set ``(query_embeddings, query_labels)``.
        uncertainty: ``(N, d_u)`` uncertainty embeddings of ``embeddings`` (alternatively inside an
            :class:`~idml.embeddings.Embeddings`); the query set's comes with its
            :class:`~idml.embeddings.Embeddings`.
        metric: ``"cosine"`` (default), ``"euclidean"`` or a :class:`~idml.metrics.Metric`.
        introspective_metric: rank with this ISM on semantic + uncertainty embeddings instead
            (IDML Table 5 ablation); needs uncertainty on both sides.
        normalize: L2-normalise semantic embeddings (the literature's convention); also for NMI.
        device: where to search (default: the embeddings' device); CPU and CUDA.
        block_size: tile side of the blocked search; memory ``O(block² + N·(k + R_max))``.
        num_neighbors: neighbour lists to return per query (metrics never depend on them).
        nmi: compute NMI of k-means (#clusters = #query classes) on the query embeddings.
        nmi_backend, seed, kmeans_iterations: k-means settings (see
            :mod:`idml.evaluation.clustering`; with faiss the defaults reproduce
            pytorch-metric-learning; ``"knn"`` is the fast k-NN-graph k-means for many classes,
            which ``"auto"`` picks when points × classes is large, e.g. SOP);
            ``settings["nmi_method"]`` says which ran.
        pr_cutoffs: rank cut-offs of the precision–recall curve (default 1, 2, 4, …, all).
        recall_levels: recall levels of interpolated precision (default 0.0, 0.1, …, 1.0).
        knn_backend: ``"exact"`` (default) or ``"faiss"`` (approximate index ``faiss_index`` with
            ``faiss_parameters``; metrics then come from the neighbour lists, which are made long
            enough for R-Precision and MAP@R, and MAP/MRR over the whole gallery are not reported).
        progress: ``True`` for progress (a bar on a terminal, plain lines in a log; see
            :mod:`idml.progress`), or a callback receiving tile counts.

    Raises:
        ValueError: mismatched lengths, NaN/inf rows, a single class, ``K ≤ 0``, no query with a
            same-class reference, missing uncertainty for ISM.
    """
    timings: dict[str, float] = {}
    start = time.perf_counter()
    ks = _check_ks(ks)
    if num_neighbors < 0:
        raise ValueError(f"num_neighbors must be >= 0, got {num_neighbors}")
    ref_semantic, ref_unc = _split(embeddings, uncertainty, "embeddings")
    ref_labels = _labels(labels, ref_semantic.shape[0], "labels")
    same_set = query is None
    if same_set:
        q_semantic, q_unc, q_labels = ref_semantic, ref_unc, ref_labels
    else:
        if not isinstance(query, tuple) or len(query) != 2:
            raise ValueError("query must be a pair (query_embeddings, query_labels)")
        q_semantic, q_unc = _split(query[0], None, "query embeddings")
        q_labels = _labels(query[1], q_semantic.shape[0], "query labels")
        if q_semantic.shape[1] != ref_semantic.shape[1]:
            raise ValueError(
                f"query embeddings have dimension {q_semantic.shape[1]} but the references have "
                f"{ref_semantic.shape[1]}"
            )
    all_labels = ref_labels if same_set else torch.cat([q_labels, ref_labels])
    classes = torch.unique(all_labels)
    if len(classes) < 2:
        raise ValueError(
            f"all embeddings have the same label ({int(classes[0])}); retrieval metrics need at "
            "least two classes"
        )
    if introspective_metric is not None:
        if not isinstance(introspective_metric, IntrospectiveMetric):
            raise ValueError("introspective_metric must be an idml.metrics.IntrospectiveMetric")
        if q_unc is None or ref_unc is None:
            raise ValueError(
                "introspective_metric needs uncertainty embeddings for queries and references; "
                "pass uncertainty= or Embeddings(semantic, uncertainty)"
            )
    scorer = PairScorer.from_spec(
        introspective_metric if introspective_metric is not None else metric, normalize
    )
    if knn_backend not in ("exact", "faiss"):
        raise ValueError(f"knn_backend must be 'exact' or 'faiss', got {knn_backend!r}")
    # Checked before the search, which takes minutes at SOP scale. "auto" picks by the k-means
    # work N × C (clusters = query classes): full k-means where it is quick, the graph otherwise.
    kmeans = (
        resolve_backend(nmi_backend, q_semantic.shape[0], int(torch.unique(q_labels).numel()))
        if nmi
        else None
    )
    # The "knn" k-means reuses the search's lists when they are plain-metric neighbours within the
    # query set: search at least its graph size, whatever num_neighbors asks to return.
    graph_k = KNN_GRAPH_NEIGHBORS if kmeans == "knn" and same_set and scorer.kind != "metric" else 0
    search_k = max(num_neighbors, graph_k)
    timings["validate"] = time.perf_counter() - start

    start = time.perf_counter()
    num_ranked = ref_semantic.shape[0] - (1 if same_set else 0)
    cutoffs = (
        tuple(int(c) for c in pr_cutoffs) if pr_cutoffs is not None else default_cutoffs(num_ranked)
    )
    if any(c < 1 for c in cutoffs):
        raise ValueError(f"pr_cutoffs must be positive ranks, got {list(cutoffs)}")
    n_q = q_semantic.shape[0]
    if knn_backend == "exact":
        out = exact_search(
            q_semantic,
            q_labels,
            search_k,
            None if same_set else ref_semantic,
            None if same_set else ref_labels,
            metric=scorer,
            query_uncertainty=q_unc if scorer.uses_uncertainty else None,
            reference_uncertainty=None if same_set or not scorer.uses_uncertainty else ref_unc,
            block_size=block_size,
            device=device,
            progress=progress,
        )
        acc = RankAccumulator(n_q, ks, cutoffs, tuple(recall_levels))
        for query_ids, ranks, num_rel in out.rank_chunks:
            acc.add(query_ids, ranks, num_rel)
        neighbors = out.neighbors
        backend = "exact"
    else:
        if scorer.kind == "metric":
            raise ValueError("the faiss backend supports only the plain cosine/euclidean metrics")
        num_rel = _num_relevant(q_labels, ref_labels, same_set)
        depth = max(max(ks), int(num_rel.max()), search_k)
        neighbors = faiss_search(
            q_semantic,
            min(depth, num_ranked),
            None if same_set else ref_semantic,
            metric=scorer.kind,
            normalize=normalize,
            index_factory=faiss_index,
            search_parameters=faiss_parameters,
        )
        neighbor_labels = torch.where(
            neighbors.indices >= 0, ref_labels[neighbors.indices.clamp_min(0)], -1
        )
        ranks = ranks_from_neighbors(neighbor_labels, q_labels, num_rel)
        acc = RankAccumulator(
            n_q,
            ks,
            cutoffs,
            tuple(recall_levels),
            complete=False,
            known_depth=neighbors.k,
        )
        acc.add(torch.arange(n_q), ranks, num_rel)
        backend = f"faiss:{faiss_index}"
    graph = neighbors.indices[:, :graph_k].cpu() if graph_k else None
    neighbors = NeighborLists(
        neighbors.indices[:, :num_neighbors], neighbors.scores[:, :num_neighbors]
    )
    timings["retrieval"] = time.perf_counter() - start

    lone = acc.lone
    if bool(lone.all()):
        raise ValueError(
            "no query has a same-class reference (every query is alone in its class); check that "
            "query and reference labels share classes"
        )
    start = time.perf_counter()
    values = scorer.values(neighbors.scores)
    values = torch.where(neighbors.indices >= 0, values, torch.full_like(values, math.nan))
    retrieval = RetrievalResult(
        ks=ks,
        metrics=acc.means(),
        per_query=acc.per_query_values(),
        per_class=acc.per_class(q_labels),
        pr_curve=acc.pr_curve(),
        neighbor_indices=neighbors.indices.cpu(),
        neighbor_values=values.cpu(),
        values_are_similarities=scorer.is_similarity,
        num_queries=n_q,
        num_references=ref_semantic.shape[0],
        same_set=same_set,
        lone_queries=lone.nonzero().flatten(),
        metric_name=scorer.name,
        backend=backend,
    )
    timings["metrics"] = time.perf_counter() - start

    nmi_value = None
    if kmeans is not None:
        start = time.perf_counter()
        x = torch.nn.functional.normalize(q_semantic.float(), dim=1) if normalize else q_semantic
        if kmeans == "knn" and graph is None:
            # Separate queries, or an ISM ranking: the graph needs its own search of the queries.
            metric_name = "cosine" if normalize else "euclidean"
            graph = neighbors_only(x, KNN_GRAPH_NEIGHBORS, metric=metric_name).indices.cpu()
        nmi_value = nmi_score(
            x,
            q_labels,
            backend=kmeans,
            seed=seed,
            iterations=kmeans_iterations,
            neighbors=graph,
        )
        timings["nmi"] = time.perf_counter() - start

    summary = None
    levels = None if q_unc is None else q_unc.float().norm(dim=1).cpu()
    if levels is not None:
        summary = summarize_uncertainty(
            levels, q_labels, recall_at_1=retrieval.per_query.get("recall@1")
        )
    confidence: dict[str, ConfidenceQuality] = {}
    oracle = None
    recall_at_1 = retrieval.per_query.get("recall@1")
    if recall_at_1 is not None and values.shape[1] > 0:
        # Lone queries have no right answer; queries with no neighbour at all have no answer.
        answered = ~torch.isnan(recall_at_1) & ~torch.isnan(values[:, 0].double().cpu())
        if bool(answered.any()):
            errors = recall_at_1[answered] == 0
            top1 = values[:, 0].double().cpu()[answered]
            confidence = confidence_quality(
                errors,
                top1 if scorer.is_similarity else -top1,
                None if levels is None else levels[answered],
            )
            oracle = oracle_aurc(errors)
    settings: dict[str, Any] = {
        "metric": scorer.name,
        "normalize": normalize,
        "ks": list(ks),
        "knn_backend": backend,
        "block_size": block_size,
        "nmi_backend": kmeans,
        "nmi_method": describe_backend(kmeans, kmeans_iterations),
        "seed": seed,
        "kmeans_iterations": kmeans_iterations,
    }
    return EvaluationReport(
        retrieval, nmi_value, summary, timings, settings, confidence, oracle, levels
    )


def _num_relevant(q_labels: Tensor, ref_labels: Tensor, same_set: bool) -> Tensor:
    """Number of same-label references of each query (itself excluded in a same-set search)."""
    sorted_ref, _ = torch.sort(ref_labels)
    counts = torch.searchsorted(sorted_ref, q_labels, right=True) - torch.searchsorted(
        sorted_ref, q_labels
    )
    return (counts - (1 if same_set else 0)).clamp_min(0)


def evaluate_files(
    embeddings_path: str | Path,
    labels_path: str | Path | None = None,
    *,
    query_embeddings_path: str | Path | None = None,
    query_labels_path: str | Path | None = None,
    embeddings_key: str | None = None,
    uncertainty_key: str | None = None,
    labels_key: str | None = None,
    **options: Any,
) -> EvaluationReport:
    """:func:`evaluate_embeddings` on files (``.npy``, ``.npz``, ``.pt``, ``.safetensors``).

    Labels come from ``labels_path`` or, if it is omitted, from the ``labels`` entry of the
    embeddings file; uncertainty from the file's ``uncertainty`` entry. ``query_*`` name a separate
    query set the same way. ``options`` are passed on to :func:`evaluate_embeddings`.

    An ``uncertainty`` entry of shape ``(N,)`` holds uncertainty *levels* ``||u||`` (what ``idml
    embed`` writes): they are summarised as they are (as ``(N, 1)`` vectors, whose norm is the level),
    but cannot drive ISM, which needs the uncertainty vectors.
    """
    ism = options.get("introspective_metric") is not None
    ref = load_embedding_file(
        embeddings_path,
        embeddings_key=embeddings_key,
        uncertainty_key=uncertainty_key,
        labels_key=labels_key if labels_path is None else None,
    )
    labels = _file_labels(ref, labels_path, labels_key)
    query = None
    if query_embeddings_path is not None:
        q = load_embedding_file(
            query_embeddings_path,
            embeddings_key=embeddings_key,
            uncertainty_key=uncertainty_key,
            labels_key=labels_key if query_labels_path is None else None,
        )
        query = (
            Embeddings(q.semantic.float(), _file_uncertainty(q, ism)),
            _file_labels(q, query_labels_path, labels_key),
        )
    elif query_labels_path is not None:
        raise ValueError("query labels were given without query embeddings")
    return evaluate_embeddings(
        Embeddings(ref.semantic.float(), _file_uncertainty(ref, ism)),
        labels,
        query=query,
        **options,
    )


def _file_uncertainty(source: EmbeddingFile, ism: bool) -> Tensor | None:
    """The file's uncertainty as ``(N, d_u)`` vectors; levels ``(N,)`` become ``(N, 1)``."""
    u = source.uncertainty
    if u is None or u.dim() != 1:
        return None if u is None else u.float()
    if ism:
        raise ValueError(
            f"{source.path}: 'uncertainty' holds one level ||u|| per image (as `idml embed` writes), "
            "but --introspective needs the uncertainty vectors; evaluate the run with "
            "`idml evaluate --checkpoint RUN --introspective`, or drop --introspective"
        )
    # Levels are norms (>= 0), so a one-column vector has exactly that norm.
    return u.float().abs().unsqueeze(1)


def _file_labels(
    source: EmbeddingFile, labels_path: str | Path | None, labels_key: str | None
) -> Tensor:
    if labels_path is not None:
        return load_labels(labels_path, labels_key)
    if source.labels is None:
        keys = ", ".join(repr(k) for k in source.keys) or "(a single unnamed array)"
        raise ValueError(
            f"{source.path}: no labels entry (keys found: {keys}); pass a labels file "
            "(--labels) or store the labels under 'labels'"
        )
    return check_labels(source.labels, f"{source.path}: labels")
