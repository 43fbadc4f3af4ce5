"""The evaluation entry point: :func:`evaluate_embeddings` → :class:`EvaluationReport`.

It runs the exact blocked retrieval of :mod:`idml.evaluation.search` (or, optionally, an
approximate faiss index), turns the ranks of the relevant items into every retrieval metric
(:mod:`idml.evaluation.retrieval_metrics`), adds NMI of k-means (:mod:`idml.evaluation.clustering`)
and, for IDML models, a summary of the uncertainty levels ``||u||``
(:mod:`idml.evaluation.uncertainty`). What it computes is an :class:`EvaluationSettings`. The
trainer calls it after each epoch; ``idml evaluate`` calls it on embedding files.

Conventions of the DML literature: L2-normalised semantic embeddings, cosine (or Euclidean)
ranking with the query excluded by index, Recall@K, R-Precision and MAP@R as in Musgrave et al.
2020 (MAP@R divides by R), queries alone in their class excluded and counted.
``introspective_metric`` ranks with the introspective similarity metric on semantic + uncertainty
embeddings instead (IDML paper, Table 5 ablation; the paper's default test protocol is the plain
metric).

Example:
    >>> import torch
    >>> x = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9], [0.7, 0.7]])
    >>> settings = EvaluationSettings(ks=(1, 2), nmi=False)
    >>> report = evaluate_embeddings(x, torch.tensor([0, 0, 1, 1, 2]), settings)
    >>> report.metrics["recall@1"], report.retrieval.num_lone_queries
    (1.0, 1)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from idml.embeddings import Embeddings, check_matrix
from idml.evaluation.clustering import (
    KNN_GRAPH_NEIGHBORS,
    KMeansBackend,
    KMeansSettings,
    describe_backend,
    nmi_score,
    resolve_backend,
)
from idml.evaluation.confidence import (
    AnswerNeighbors,
    ConfidenceCalibration,
    ReferenceHubness,
)
from idml.evaluation.confidence.assessment import assess_confidence
from idml.evaluation.io import (
    USUAL_ENTRIES,
    EmbeddingFile,
    EntryNames,
    check_labels,
    load_embedding_file,
    load_labels,
)
from idml.evaluation.report import EvaluationReport, RetrievalResult
from idml.evaluation.retrieval_metrics import (
    RankAccumulator,
    default_cutoffs,
    ranks_from_neighbors,
)
from idml.evaluation.scoring import PairScorer
from idml.evaluation.search import (
    NeighborLists,
    SearchExecution,
    exact_search,
    faiss_search,
    neighbor_search,
    neighbors_only,
)
from idml.evaluation.settings import EvaluationSettings, KnnBackend
from idml.evaluation.uncertainty import summarize_uncertainty
from idml.metrics import IntrospectiveMetric

__all__ = [
    "EvaluationReport",
    "EvaluationSettings",
    "KnnBackend",
    "RetrievalResult",
    "evaluate_embeddings",
    "evaluate_files",
]

ArrayLike = Tensor | np.ndarray
EmbeddingInput = Tensor | np.ndarray | Embeddings


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


@dataclass
class _Sets:
    """Validated queries and references (the same tensors in a same-set evaluation)."""

    q_semantic: Tensor
    q_unc: Tensor | None
    q_labels: Tensor
    ref_semantic: Tensor
    ref_unc: Tensor | None
    ref_labels: Tensor
    same_set: bool
    query_rows: Tensor | None = None
    """With roles: the rows of the queries among the embeddings given (references likewise)."""
    ref_rows: Tensor | None = None


def role_rows(roles: Sequence[str] | np.ndarray, n: int) -> tuple[Tensor, Tensor]:
    """``(query_rows, gallery_rows)``: the positions of the ``"query"`` and the ``"gallery"`` rows
    of ``roles`` (one per embedding; other rows, e.g. ``""``, take no part), each non-empty."""
    values = np.asarray(roles, dtype=object).reshape(-1)
    if len(values) != n:
        raise ValueError(f"roles has {len(values)} entries but there are {n} embeddings")
    unknown = sorted({str(v) for v in values} - {"query", "gallery", ""})
    if unknown:
        raise ValueError(f"roles must be 'query', 'gallery' or '', got {unknown}")
    rows = {r: torch.from_numpy(np.flatnonzero(values == r)) for r in ("query", "gallery")}
    for role, found in rows.items():
        if len(found) == 0:
            raise ValueError(
                f"roles mark no {role} row; queries are searched against the gallery, so both "
                "are needed"
            )
    return rows["query"], rows["gallery"]


def _sets(
    embeddings: EmbeddingInput,
    labels: ArrayLike | Sequence[int],
    query: tuple[EmbeddingInput, ArrayLike | Sequence[int]] | None,
    uncertainty: ArrayLike | None,
    roles: Sequence[str] | np.ndarray | None = None,
) -> _Sets:
    ref_semantic, ref_unc = _split(embeddings, uncertainty, "embeddings")
    ref_labels = _labels(labels, ref_semantic.shape[0], "labels")
    if roles is not None:
        if query is not None:
            raise ValueError("give either roles or a separate query set, not both")
        q_rows, g_rows = role_rows(roles, ref_semantic.shape[0])
        q, g = q_rows.to(ref_semantic.device), g_rows.to(ref_semantic.device)
        return _Sets(
            q_semantic=ref_semantic[q],
            q_unc=None if ref_unc is None else ref_unc[q.to(ref_unc.device)],
            q_labels=ref_labels[q.to(ref_labels.device)],
            ref_semantic=ref_semantic[g],
            ref_unc=None if ref_unc is None else ref_unc[g.to(ref_unc.device)],
            ref_labels=ref_labels[g.to(ref_labels.device)],
            same_set=False,
            query_rows=q_rows,
            ref_rows=g_rows,
        )
    if query is None:
        return _Sets(ref_semantic, ref_unc, ref_labels, ref_semantic, ref_unc, ref_labels, True)
    if not isinstance(query, tuple) or len(query) != 2:
        raise ValueError("query must be a pair (query_embeddings, query_labels)")
    q_semantic, q_unc = _split(query[0], None, "query embeddings")
    q_labels = _labels(query[1], q_semantic.shape[0], "query labels")
    if q_semantic.shape[1] != ref_semantic.shape[1]:
        raise ValueError(
            f"query embeddings have dimension {q_semantic.shape[1]} but the references have "
            f"{ref_semantic.shape[1]}"
        )
    return _Sets(q_semantic, q_unc, q_labels, ref_semantic, ref_unc, ref_labels, False)


def evaluate_embeddings(
    embeddings: EmbeddingInput,
    labels: ArrayLike | Sequence[int],
    settings: EvaluationSettings | None = None,
    *,
    query: tuple[EmbeddingInput, ArrayLike | Sequence[int]] | None = None,
    roles: Sequence[str] | np.ndarray | None = None,
    uncertainty: ArrayLike | None = None,
    introspective_metric: IntrospectiveMetric | None = None,
    calibration: ConfidenceCalibration | None = None,
    device: torch.device | str | None = None,
    progress: bool | Callable[[int], object] = False,
) -> EvaluationReport:
    """Evaluate embeddings for retrieval (Recall@K, R-Precision, MAP@R, MAP, MRR, PR), NMI,
    ``||u||`` and the confidence of the top-1 answers.

    Args:
        embeddings: ``(N, d)`` reference (gallery) embeddings — an array, a tensor or an
            :class:`~idml.embeddings.Embeddings` carrying uncertainty. Without ``query`` they are
            also the queries ("the test set against itself"; each query excluded by index).
        labels: ``(N,)`` integer class ids.
        settings: what to compute (:class:`EvaluationSettings`; default: its defaults). Its
            ``num_neighbors`` alone decides how many neighbours the search computes.
        query: a separate query set ``(query_embeddings, query_labels)``.
        roles: ``(N,)`` ``"query"``, ``"gallery"`` or ``""`` per embedding (open-metric-learning's
            retrieval format): the query rows are searched against the gallery rows only, by the
            same blocked search as a separate query set; rows of neither role take no part.
            The report's neighbour indices and ``query_rows`` then refer to rows of
            ``embeddings``.
        uncertainty: ``(N, d_u)`` uncertainty embeddings of ``embeddings`` (alternatively inside an
            :class:`~idml.embeddings.Embeddings`); the query set's comes with its
            :class:`~idml.embeddings.Embeddings`.
        introspective_metric: rank with this ISM on semantic + uncertainty embeddings instead
            (IDML Table 5 ablation); needs uncertainty on both sides.
        calibration: a calibrated confidence fitted on *other* queries (e.g. the validation split
            of the training classes; :func:`~idml.evaluation.confidence.fit_calibration`): adds
            its R-AUROC, ECE, reliability diagram and abstention thresholds to the report.
        device: where to search (default: the embeddings' device); CPU and CUDA.
        progress: ``True`` for progress (a bar on a terminal, plain lines in a log; see
            :mod:`idml.progress`), or a callback receiving tile counts.

    The k-NN-graph k-means (``nmi_backend="knn"``) reuses the first
    :data:`~idml.evaluation.clustering.KNN_GRAPH_NEIGHBORS` neighbours of the search when they are
    plain-metric neighbours within the query set and ``num_neighbors`` is at least that many;
    otherwise it searches the queries for its graph itself. ``settings["nmi_method"]`` of the
    report says which k-means ran.

    Raises:
        ValueError: mismatched lengths, NaN/inf rows, a single class, no query with a same-class
            reference, missing uncertainty for ISM (bad settings fail in
            :class:`EvaluationSettings`).
    """
    s = EvaluationSettings() if settings is None else settings
    timings: dict[str, float] = {}
    start = time.perf_counter()
    sets = _sets(embeddings, labels, query, uncertainty, roles)
    all_labels = sets.ref_labels if sets.same_set else torch.cat([sets.q_labels, sets.ref_labels])
    classes = torch.unique(all_labels)
    if len(classes) < 2:
        raise ValueError(
            f"all embeddings have the same label ({int(classes[0])}); retrieval metrics need at "
            "least two classes"
        )
    if introspective_metric is not None:
        if not isinstance(introspective_metric, IntrospectiveMetric):
            raise ValueError("introspective_metric must be an idml.metrics.IntrospectiveMetric")
        if sets.q_unc is None or sets.ref_unc is None:
            raise ValueError(
                "introspective_metric needs uncertainty embeddings for queries and references; "
                "pass uncertainty= or Embeddings(semantic, uncertainty)"
            )
    scorer = PairScorer.from_spec(
        introspective_metric if introspective_metric is not None else s.metric, s.normalize
    )
    # Checked before the search, which takes minutes at SOP scale. "auto" picks by the k-means
    # work N × C (clusters = query classes): full k-means where it is quick, the graph otherwise.
    n_q = sets.q_semantic.shape[0]
    kmeans = (
        resolve_backend(s.nmi_backend, n_q, int(torch.unique(sets.q_labels).numel()))
        if s.nmi
        else None
    )
    timings["validate"] = time.perf_counter() - start

    with_u = sets.q_unc is not None
    depth = s.num_neighbors
    if s.confidence is not None:
        depth = max(depth, s.confidence.depth(with_u, calibration))
    elif calibration is not None:
        raise ValueError("a calibration was given but settings.confidence is None; pass both")
    start = time.perf_counter()
    retrieved = _retrieve(sets, scorer, s, depth, device, progress)
    acc, neighbors, backend = retrieved.ranks, retrieved.neighbors, retrieved.backend
    # The confidence reads gallery positions (the gallery's labels); the report shows rows.
    reported = neighbors
    if sets.ref_rows is not None:  # gallery positions → rows of the embeddings given
        found = neighbors.indices
        rows = sets.ref_rows.to(found.device)[found.clamp_min(0)]
        reported = NeighborLists(torch.where(found >= 0, rows, found), neighbors.scores)
    timings["retrieval"] = time.perf_counter() - start
    lone = acc.lone
    if bool(lone.all()):
        raise ValueError(
            "no query has a same-class reference (every query is alone in its class); check that "
            "query and reference labels share classes"
        )
    start = time.perf_counter()
    kept = NeighborLists(
        reported.indices[:, : s.num_neighbors], reported.scores[:, : s.num_neighbors]
    )
    values = scorer.values(kept.scores)
    values = torch.where(kept.indices >= 0, values, torch.full_like(values, math.nan))
    retrieval = RetrievalResult(
        ks=tuple(s.ks),
        metrics=acc.means(),
        per_query=acc.per_query_values(),
        per_class=acc.per_class(sets.q_labels),
        pr_curve=acc.pr_curve(),
        neighbor_indices=kept.indices.cpu(),
        neighbor_values=values.cpu(),
        values_are_similarities=scorer.is_similarity,
        num_queries=n_q,
        num_references=sets.ref_semantic.shape[0],
        same_set=sets.same_set,
        lone_queries=lone.nonzero().flatten(),
        metric_name=scorer.name,
        backend=backend,
        query_rows=sets.query_rows,
    )
    timings["metrics"] = time.perf_counter() - start

    nmi_value = None
    if kmeans is not None:
        start = time.perf_counter()
        # The search's lists serve as the k-means graph when they are plain-metric neighbours
        # within the query set and long enough; the search depth never depends on k-means.
        own = retrieved.gallery_neighbors if sets.same_set else None
        graph = None
        if (
            own is not None
            and scorer.kind != "metric"
            and own.k >= min(KNN_GRAPH_NEIGHBORS, n_q - 1)
        ):
            graph = own.indices[:, :KNN_GRAPH_NEIGHBORS].cpu()
        nmi_value = _nmi(sets, s, kmeans, graph)
        timings["nmi"] = time.perf_counter() - start

    levels = None if sets.q_unc is None else sets.q_unc.float().norm(dim=1).cpu()
    summary = None
    if levels is not None:
        summary = summarize_uncertainty(
            levels, sets.q_labels, recall_at_1=retrieval.per_query.get("recall@1")
        )
    confidence = None
    if s.confidence is not None:
        start = time.perf_counter()
        hubness = _hubness(sets, scorer, s, retrieved.gallery_neighbors, calibration, device)
        answers = AnswerNeighbors.from_search(neighbors, sets.ref_labels, hubness, levels)
        confidence = assess_confidence(answers, sets.q_labels, lone, s.confidence, calibration)
        timings["confidence"] = time.perf_counter() - start
    report_settings: dict[str, Any] = {
        "metric": scorer.name,
        "normalize": s.normalize,
        "ks": list(s.ks),
        "knn_backend": backend,
        "full_ranking": retrieved.ranks.complete,
        "score_kernels": retrieved.kernels,
        "block_size": s.block_size,
        "nmi_backend": kmeans,
        "nmi_method": describe_backend(kmeans, s.kmeans_iterations),
        "seed": s.seed,
        "kmeans_iterations": s.kmeans_iterations,
        "reranking": None if s.reranking is None else s.reranking.name,
    }
    if confidence is not None:
        report_settings["confidence_kind"] = confidence.kind
    return EvaluationReport(
        retrieval, nmi_value, summary, timings, report_settings, confidence, levels
    )


@dataclass
class _Retrieved:
    """What the search (and re-ranking) found: the metrics' ranks, each query's final lists, the
    backend's name, and the gallery's own lists when they were computed on the way."""

    ranks: RankAccumulator
    neighbors: NeighborLists
    backend: str
    gallery_neighbors: NeighborLists | None = None
    kernels: str | None = None
    """What computed the exact search's scores (:mod:`idml.evaluation.search.kernels`)."""


def _retrieve(
    sets: _Sets,
    scorer: PairScorer,
    s: EvaluationSettings,
    depth: int,
    device: torch.device | str | None,
    progress: bool | Callable[[int], object],
) -> _Retrieved:
    """Search ``depth`` neighbours per query, and accumulate the ranks of the relevant items:
    exact over the whole gallery (with the products that computed its scores), or from lists:
    the exact search's (``full_ranking=False``), re-ranked ones, or faiss's."""
    same_set = sets.same_set
    num_ranked = sets.ref_semantic.shape[0] - (1 if same_set else 0)
    cutoffs = s.pr_cutoffs if s.pr_cutoffs is not None else default_cutoffs(num_ranked)
    n_q = sets.q_semantic.shape[0]
    num_rel = _num_relevant(sets.q_labels, sets.ref_labels, same_set)
    # Metrics from lists need every relevant item's place: lists at least R_max deep.
    list_depth = min(max(max(s.ks), int(num_rel.max()), depth), num_ranked)
    execution = SearchExecution(
        block_size=s.block_size, device=device, progress=progress, kernel=s.score_kernel
    )
    kernels = None
    if s.knn_backend == "exact" and s.reranking is None and s.full_ranking:
        out = exact_search(
            Embeddings(sets.q_semantic, sets.q_unc),
            sets.q_labels,
            depth,
            None if same_set else Embeddings(sets.ref_semantic, sets.ref_unc),
            None if same_set else sets.ref_labels,
            metric=scorer,
            execution=execution,
        )
        acc = RankAccumulator(n_q, tuple(s.ks), tuple(cutoffs), tuple(s.recall_levels))
        for query_ids, ranks, num_rel_chunk in out.rank_chunks:
            acc.add(query_ids, ranks, num_rel_chunk)
        gallery = out.neighbors if same_set else None
        return _Retrieved(acc, out.neighbors, "exact", gallery, out.kernels)
    if s.knn_backend == "exact" and s.reranking is None:
        # Lists alone: no label is relevant to the search, so nothing below each query's k-th
        # best score is counted.
        lists = neighbor_search(
            Embeddings(sets.q_semantic, sets.q_unc),
            list_depth,
            None if same_set else Embeddings(sets.ref_semantic, sets.ref_unc),
            metric=scorer,
            execution=execution,
        )
        found, kernels = lists.neighbors, lists.kernels
        backend, gallery_neighbors = "exact (neighbour lists)", found if same_set else None
    elif s.knn_backend == "exact":
        assert s.reranking is not None
        reranker = s.reranking
        shortlist_depth = min(max(list_depth, reranker.depth, reranker.gallery_depth), num_ranked)
        shortlist = neighbors_only(
            sets.q_semantic,
            shortlist_depth,
            None if same_set else sets.ref_semantic,
            metric=scorer,
            execution=execution,
        )
        graph = shortlist
        if not same_set and reranker.gallery_depth > 0:
            graph = neighbors_only(
                sets.ref_semantic,
                min(reranker.gallery_depth, sets.ref_semantic.shape[0] - 1),
                metric=scorer,
                execution=replace(execution, progress=False),
            )
        prepared = reranker.prepare(
            sets.ref_semantic, graph if reranker.gallery_depth > 0 or same_set else None
        )
        found = reranker.rerank(shortlist, prepared, None if same_set else sets.q_semantic)
        backend = f"exact, re-ranked by {reranker.name}"
        gallery_neighbors = shortlist if same_set else (graph if graph is not shortlist else None)
    else:
        if scorer.kind == "metric":
            raise ValueError("the faiss backend supports only the plain cosine/euclidean metrics")
        found = faiss_search(
            sets.q_semantic,
            list_depth,
            None if same_set else sets.ref_semantic,
            metric=scorer.kind,
            normalize=s.normalize,
            index_factory=s.faiss_index,
            search_parameters=s.faiss_parameters,
        )
        backend, gallery_neighbors = f"faiss:{s.faiss_index}", None
    neighbor_labels = torch.where(
        found.indices >= 0, sets.ref_labels[found.indices.clamp_min(0)], -1
    )
    ranks = ranks_from_neighbors(neighbor_labels, sets.q_labels, num_rel)
    acc = RankAccumulator(
        n_q,
        tuple(s.ks),
        tuple(cutoffs),
        tuple(s.recall_levels),
        complete=False,
        known_depth=found.k,
    )
    acc.add(torch.arange(n_q), ranks, num_rel)
    return _Retrieved(acc, found, backend, gallery_neighbors, kernels)


def _nmi(sets: _Sets, s: EvaluationSettings, kmeans: KMeansBackend, graph: Tensor | None) -> float:
    """NMI of k-means on the (normalised) query embeddings; ``graph``: the k-NN graph if known."""
    x = sets.q_semantic
    x = torch.nn.functional.normalize(x.float(), dim=1) if s.normalize else x
    if kmeans == "knn" and graph is None:
        metric: Literal["cosine", "euclidean"] = "cosine" if s.normalize else "euclidean"
        graph = neighbors_only(x, KNN_GRAPH_NEIGHBORS, metric=metric).indices.cpu()
    settings = KMeansSettings(kmeans, s.seed, s.kmeans_iterations)
    return nmi_score(x, sets.q_labels, settings, graph)


def _hubness(
    sets: _Sets,
    scorer: PairScorer,
    s: EvaluationSettings,
    gallery_neighbors: NeighborLists | None,
    calibration: ConfidenceCalibration | None,
    device: torch.device | str | None,
) -> ReferenceHubness | None:
    """The references' hubness when a confidence score needs it: from the gallery's own lists when
    the search computed them (deep enough), else from one search of the gallery against itself.
    With re-ranking it is still the plain metric's: a property of the gallery, not of a query."""
    assert s.confidence is not None
    k = s.confidence.hubness_k(sets.q_unc is not None, calibration)
    if k is None:
        return None
    n_r = sets.ref_semantic.shape[0]
    if gallery_neighbors is not None and gallery_neighbors.k >= min(k, n_r - 1):
        return ReferenceHubness.from_neighbors(gallery_neighbors, k)
    gallery = neighbors_only(
        Embeddings(sets.ref_semantic, sets.ref_unc),
        k,
        metric=scorer,
        execution=SearchExecution(block_size=s.block_size, device=device),
    )
    return ReferenceHubness.from_neighbors(gallery, k)


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
    entry_names: EntryNames = USUAL_ENTRIES,
    settings: EvaluationSettings | None = None,
    introspective_metric: IntrospectiveMetric | None = None,
    calibration: ConfidenceCalibration | None = None,
    device: torch.device | str | None = None,
    progress: bool | Callable[[int], object] = False,
) -> EvaluationReport:
    """:func:`evaluate_embeddings` on files (``.npy``, ``.npz``, ``.pt``, ``.safetensors``).

    Labels come from ``labels_path`` or, if it is omitted, from the ``labels`` entry of the
    embeddings file; uncertainty from the file's ``uncertainty`` entry (``entry_names`` names
    other entries, for the query file too). ``query_*`` name a separate query set the same way.
    ``settings``, ``introspective_metric``, ``calibration``, ``device`` and ``progress`` are those
    of :func:`evaluate_embeddings`.

    A ``roles`` entry (``idml embed`` of images with query/gallery roles) makes the evaluation
    search the file's queries against its gallery (``roles`` of :func:`evaluate_embeddings`).

    An ``uncertainty`` entry of shape ``(N,)`` holds uncertainty *levels* ``||u||`` (what ``idml
    embed`` writes): they are summarised as they are (as ``(N, 1)`` vectors, whose norm is the level),
    but cannot drive ISM, which needs the uncertainty vectors. Levels that are all zero are what
    ``idml embed`` writes for a model without an uncertainty head: the report then has no
    uncertainty rows (no ``||u||`` summary, quartiles or ``auroc_norm_u`` of a constant).
    """
    ism = introspective_metric is not None
    # With a separate labels file the labels entry name is that file's, not the embeddings file's.
    unlabelled = replace(entry_names, labels=None)
    ref = load_embedding_file(embeddings_path, entry_names if labels_path is None else unlabelled)
    labels = _file_labels(ref, labels_path, entry_names.labels)
    query, query_classes = None, None
    if query_embeddings_path is not None:
        q = load_embedding_file(
            query_embeddings_path, entry_names if query_labels_path is None else unlabelled
        )
        query_classes = q.classes
        query = (
            Embeddings(q.semantic.float(), _file_uncertainty(q, ism)),
            _file_labels(q, query_labels_path, entry_names.labels),
        )
    elif query_labels_path is not None:
        raise ValueError("query labels were given without query embeddings")
    if ref.roles is not None and query is not None:
        raise ValueError(
            f"{embeddings_path} marks query and gallery images (a 'roles' entry); its queries are "
            "searched against its gallery, so drop the separate query file"
        )
    report = evaluate_embeddings(
        Embeddings(ref.semantic.float(), _file_uncertainty(ref, ism)),
        labels,
        settings,
        query=query,
        roles=ref.roles,
        introspective_metric=introspective_metric,
        calibration=calibration,
        device=device,
        progress=progress,
    )
    # The file's class names (``idml embed`` writes them) name the per-class results, when they
    # are the names of these labels: the labels come from the same file, and a query file, if
    # any, names its classes the same.
    names = ref.classes if labels_path is None else None
    if query is not None and (query_labels_path is not None or query_classes != names):
        names = None
    every = [labels] if query is None else [labels, query[1]]
    if names is not None and all(t.numel() == 0 or int(t.max()) < len(names) for t in every):
        report.class_names = tuple(names)
    return report


def _file_uncertainty(source: EmbeddingFile, ism: bool) -> Tensor | None:
    """The file's uncertainty as ``(N, d_u)`` vectors; levels ``(N,)`` become ``(N, 1)``;
    all-zero levels (a model without an uncertainty head) are no uncertainty."""
    u = source.uncertainty
    if u is None or u.dim() != 1:
        return None if u is None else u.float()
    if u.numel() and not bool(u.any()):
        return None
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
