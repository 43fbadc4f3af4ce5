"""Clustering quality: NMI of k-means clusters against the class labels.

``NMI = I(Y; Ω) / ((H(Y) + H(Ω)) / 2)`` (arithmetic normalisation, scikit-learn's default) between
the labels ``Y`` and the k-means assignment ``Ω`` with as many clusters as classes, as in Oh Song
et al. 2016 and the pytorch-metric-learning ``AccuracyCalculator``.

Backends: ``"faiss"`` (Lloyd's algorithm, ``iterations`` rounds, seeded random initial centroids —
with the default ``iterations=20`` and ``seed=1234`` it is exactly what pytorch-metric-learning
computes, so NMI values match it), ``"sklearn"`` (k-means++ initialisation, one run, at most
``iterations`` rounds) and ``"auto"`` (the ``"knn"`` approximation below when ``N × C`` exceeds
:data:`AUTO_FULL_KMEANS_MAX_WORK`, else faiss when installed — the ``faiss`` extra — else
scikit-learn). Lloyd's assignment step costs ``N × C × d`` per round: at Stanford Online Products
scale (11,316 classes) a run takes minutes even with faiss, and scikit-learn's k-means++ is
impractical there.

``"knn"`` is the fast alternative for large C: Lloyd's algorithm whose assignment step only
considers the clusters of a point's k nearest neighbours and its own (Deng & Zhao 2018, "Fast
k-means based on k-NN graph"), on the neighbour lists the exact search has already produced. A
round costs ``N × (k + 1) × d``; the first assignment to the seeded random initial centroids uses
the seeds among a point's neighbours and an exact search only for points with none. The result is
a k-means local optimum like Lloyd's, not the same one, so its NMI is close to — not equal to —
the other backends' (on the SOP-scale benchmark: 0.8819 for both; see benchmarks/RESULTS.md).

Example:
    >>> import torch
    >>> x = torch.cat([torch.zeros(5, 2), torch.ones(5, 2)]) + 0.01 * torch.randn(10, 2)
    >>> labels = torch.tensor([0] * 5 + [1] * 5)
    >>> round(nmi_score(x, labels, KMeansSettings("sklearn", seed=0)), 6)
    1.0
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from sklearn.metrics import normalized_mutual_info_score
from torch import Tensor

KMeansBackend = Literal["auto", "faiss", "sklearn", "knn"]


@dataclass(frozen=True)
class KMeansSettings:
    """How k-means runs (see the module docstring): its backend, the seed of its initial centroids
    and its rounds; the defaults with faiss reproduce pytorch-metric-learning's NMI."""

    backend: KMeansBackend = "auto"
    seed: int = 1234
    iterations: int = 20

    def __post_init__(self) -> None:
        if self.iterations < 1:
            raise ValueError(f"iterations must be >= 1, got {self.iterations}")


def faiss_available() -> bool:
    """Whether the optional ``faiss`` package can be imported."""
    try:
        import faiss  # noqa: F401
    except ImportError:
        return False
    return True


AUTO_FULL_KMEANS_MAX_WORK = 50_000_000
"""Largest ``N × C`` (points × clusters) for which ``"auto"`` runs full Lloyd k-means.

A Lloyd round costs ``N × C × d`` multiply-adds; the k-NN-graph rounds cost ``N × (k + 1) × d``.
CUB (5,924 × 100) and Cars (8,131 × 98) are far below the limit and get full k-means in seconds;
In-Shop (14,218 × 3,985) and SOP (60,502 × 11,316, where 20 full rounds take minutes on a laptop)
are above it and get the k-NN-graph approximation."""


def resolve_backend(
    backend: KMeansBackend,
    num_points: int | None = None,
    num_clusters: int | None = None,
) -> Literal["faiss", "sklearn", "knn"]:
    """The k-means backend that runs for ``backend``; an explicit request must be met.

    ``"auto"`` → ``"knn"`` when ``num_points × num_clusters`` (both given) exceeds
    :data:`AUTO_FULL_KMEANS_MAX_WORK`, else faiss when installed, else scikit-learn.
    """
    if backend == "auto":
        if (
            num_points is not None
            and num_clusters is not None
            and num_points * num_clusters > AUTO_FULL_KMEANS_MAX_WORK
        ):
            return "knn"
        return "faiss" if faiss_available() else "sklearn"
    if backend == "faiss" and not faiss_available():
        raise ValueError(
            "nmi backend 'faiss' requested but faiss is not installed; "
            "`pip install idml[faiss]` or use backend='sklearn'"
        )
    if backend not in ("faiss", "sklearn", "knn"):
        raise ValueError(
            f"k-means backend must be 'auto', 'faiss', 'sklearn' or 'knn', got {backend!r}"
        )
    return backend


def describe_backend(resolved: str | None, iterations: int = 20) -> str:
    """How NMI was computed, in words, for tables, JSON and reports (``None``: skipped)."""
    if resolved is None:
        return "skipped"
    if resolved == "knn":
        return (
            f"k-NN-graph k-means (approximation: {KNN_GRAPH_NEIGHBORS} neighbours, "
            f"{iterations} rounds)"
        )
    if resolved == "faiss":
        return f"full k-means (faiss Lloyd, {iterations} rounds)"
    return f"full k-means (scikit-learn k-means++, at most {iterations} rounds)"


def kmeans_assign(
    x: Tensor,
    num_clusters: int,
    kmeans: KMeansSettings | None = None,
    neighbors: Tensor | None = None,
) -> Tensor:
    """Cluster index ``(N,)`` of each row of ``x`` after k-means with ``num_clusters`` clusters.

    ``kmeans`` [``KMeansSettings()``]: backend, seed and rounds. ``neighbors`` ``(N, k)`` (indices
    into ``x``, ``-1`` for none) are required by the ``"knn"`` backend;
    :func:`idml.evaluation.evaluate_embeddings` passes the search's neighbour lists.
    """
    kmeans = kmeans if kmeans is not None else KMeansSettings()
    if x.dim() != 2 or x.shape[0] == 0:
        raise ValueError(f"k-means needs a non-empty (N, d) matrix, got shape {tuple(x.shape)}")
    n = x.shape[0]
    if not 1 <= num_clusters <= n:
        raise ValueError(f"num_clusters must be between 1 and the {n} points, got {num_clusters}")
    # "auto" may only pick the graph approximation when there is a graph to run it on.
    resolved = (
        resolve_backend(kmeans.backend, n, num_clusters)
        if neighbors is not None
        else resolve_backend(kmeans.backend)
    )
    if resolved == "knn":
        if neighbors is None or neighbors.dim() != 2 or neighbors.shape[0] != n:
            raise ValueError(
                "the 'knn' k-means backend needs neighbour lists of shape (N, k) for the N points"
            )
        return knn_kmeans(
            x.detach().float(), num_clusters, neighbors, kmeans.seed, kmeans.iterations
        )
    data = np.ascontiguousarray(x.detach().float().cpu().numpy())
    if resolved == "faiss":
        import faiss

        # faiss warns below 39 points per centroid; ~5 images per class (SOP) is normal here.
        km = faiss.Kmeans(
            data.shape[1],
            num_clusters,
            niter=kmeans.iterations,
            seed=kmeans.seed,
            verbose=False,
            min_points_per_centroid=1,
        )
        km.train(data)
        _, assignment = km.index.search(data, 1)
        return torch.from_numpy(assignment.reshape(-1).astype(np.int64))
    from sklearn.cluster import KMeans

    km_sk = KMeans(
        n_clusters=num_clusters, n_init=1, max_iter=kmeans.iterations, random_state=kmeans.seed
    )
    return torch.from_numpy(km_sk.fit_predict(data).astype(np.int64))


KNN_GRAPH_NEIGHBORS = 10
"""Neighbours per point of the graph the ``"knn"`` backend restricts assignments to; evaluation
searches at least this many so the graph (and the NMI) does not depend on ``num_neighbors``."""

_CHUNK = 4096


def _closest(x: Tensor, centroids: Tensor, candidates: Tensor) -> Tensor:
    """Per row, the candidate centroid (``-1`` = none) nearest in Euclidean distance.

    ``argmin ||x − c||² = argmax 2 x·c − ||c||²``; ties go to the first candidate listed.
    """
    sq = centroids.pow(2).sum(1)
    out = torch.empty(len(x), dtype=torch.long, device=x.device)
    for i in range(0, len(x), _CHUNK):
        cand = candidates[i : i + _CHUNK]
        safe = cand.clamp_min(0)
        # index_select copies whole centroid rows (faster than advanced indexing); the
        # batched product is then one (k × d)·(d × 1) per point.
        gathered = centroids.index_select(0, safe.reshape(-1)).view(*safe.shape, -1)
        dots = torch.bmm(gathered, x[i : i + _CHUNK].unsqueeze(2)).squeeze(2)
        score = 2 * dots - sq[safe]
        score = score.masked_fill(cand < 0, -torch.inf)
        out[i : i + _CHUNK] = cand.gather(1, score.argmax(1, keepdim=True)).squeeze(1)
    return out


def knn_kmeans(
    x: Tensor, num_clusters: int, neighbors: Tensor, seed: int = 1234, iterations: int = 20
) -> Tensor:
    """Lloyd's k-means with the assignment restricted by a k-NN graph (Deng & Zhao 2018).

    Initial centroids: ``num_clusters`` distinct points drawn with ``seed``. Initial assignment:
    the nearest of the seeds among the point itself and its neighbours, or, for points with no
    seed there, the nearest of all seeds (exact, blocked). Each round then recomputes centroids as
    member means (an emptied cluster keeps its centroid) and moves each point to the nearest of
    its own cluster and its neighbours' clusters; it stops early when nothing moves.
    """
    n = x.shape[0]
    neighbors = neighbors.to(x.device).long()
    gen = torch.Generator().manual_seed(seed)
    seeds = torch.randperm(n, generator=gen)[:num_clusters].to(x.device)
    centroids = x[seeds].clone()
    seed_cluster = torch.full((n,), -1, dtype=torch.long, device=x.device)
    seed_cluster[seeds] = torch.arange(num_clusters, device=x.device)
    own = torch.arange(n, device=x.device).unsqueeze(1)
    graph = torch.cat([own, neighbors], dim=1)
    cand = torch.where(graph >= 0, seed_cluster[graph.clamp_min(0)], -1)
    assignment = _closest(x, centroids, cand)
    orphans = (cand < 0).all(1).nonzero().flatten()
    sq = centroids.pow(2).sum(1)
    for i in range(0, len(orphans), 1024):
        rows = orphans[i : i + 1024]
        assignment[rows] = (2 * x[rows] @ centroids.T - sq).argmax(1)
    valid = graph >= 0
    for _ in range(iterations):
        counts = torch.bincount(assignment, minlength=num_clusters)
        sums = torch.zeros_like(centroids).index_add_(0, assignment, x)
        centroids = torch.where(
            (counts > 0).unsqueeze(1), sums / counts.clamp_min(1).unsqueeze(1), centroids
        )
        cand = torch.where(valid, assignment[graph.clamp_min(0)], -1)
        moved = _closest(x, centroids, cand)
        if torch.equal(moved, assignment):
            break
        assignment = moved
    return assignment.cpu()


def nmi_score(
    x: Tensor, labels: Tensor, kmeans: KMeansSettings | None = None, neighbors: Tensor | None = None
) -> float:
    """NMI between ``labels`` and k-means clusters of ``x`` (#clusters = #distinct labels); see
    :func:`kmeans_assign` for ``kmeans`` and ``neighbors``."""
    labels = torch.as_tensor(labels)
    if labels.dim() != 1 or len(labels) != x.shape[0]:
        raise ValueError(
            f"labels must be a vector with one entry per embedding row ({x.shape[0]}), "
            f"got shape {tuple(labels.shape)}"
        )
    num_clusters = int(torch.unique(labels).numel())
    clusters = kmeans_assign(x, num_clusters, kmeans, neighbors)
    return float(normalized_mutual_info_score(labels.cpu().numpy(), clusters.numpy()))
