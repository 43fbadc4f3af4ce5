"""Approximate k-nearest neighbours with a faiss index (the optional ``faiss`` extra): the one
place a faiss index is built (:func:`faiss_build`), for the evaluation's ``knn_backend="faiss"``
(:func:`faiss_search`) and for a saved gallery index (``idml index --backend faiss``). faiss is
imported only when an index is built."""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from idml.evaluation.search.results import NeighborLists
from idml.evaluation.search.state import INF

DEFAULT_EF_CONSTRUCTION = 200
"""HNSW ``efConstruction`` unless the parameters give one. faiss's own default (40) builds a graph
whose recall@10 levels off at 0.91 on the 1M × 512 clustered benchmark gallery whatever the
``efSearch``; 200 reaches 0.999 at efSearch 128 (``benchmarks/RESULTS.md``, gallery search)."""

DEFAULT_NPROBE = 32
"""IVF ``nprobe`` (inverted lists visited per query) unless the parameters give one. faiss's own
default (1) visits a single list and misses most neighbours of a query near a cell border
(``benchmarks/RESULTS.md``, gallery past one machine's memory: recall@10 against nprobe)."""

MIN_TRAIN_SIZE = 100_000
"""A trained index (IVF, PQ) learns from at least this many vectors when the gallery has them:
product quantisers fit 256 centroids per sub-vector, and faiss's k-means wants 39 or more points
per centroid."""

TRAIN_POINTS_PER_LIST = 64
"""…and from 64 vectors per inverted list (faiss warns below 39, subsamples above 256)."""

FaissMetric = Literal["inner_product", "l2"]
"""What the index ranks by: the inner product (cosine on unit vectors) or the squared L2 distance."""


def _faiss() -> Any:
    try:
        import faiss
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ValueError(
            "the faiss backend needs the faiss package; `pip install idml[faiss]`"
        ) from err
    return faiss


def faiss_build(
    vectors: Tensor,
    factory: str,
    parameters: str | None = None,
    metric: FaissMetric = "inner_product",
    *,
    train_vectors: Tensor | None = None,
    train_size: int | None = None,
) -> Any:
    """A trained faiss index of ``factory`` (``"Flat"``, ``"HNSW32"``, ``"IVF1024,Flat"``,
    ``"IVF4096,PQ32"``, ``"IVF65536_HNSW32,PQ32"``, …) holding ``vectors`` ``(N, d)``, ranking by
    ``metric``.

    An index that must be trained (IVF coarse quantiser, product quantiser) learns from
    ``train_vectors``, else from the rows :func:`training_positions` picks (``train_size`` of them; the
    default is :func:`default_train_size`), so a gallery of 10⁷ items trains in minutes.
    ``parameters`` (``faiss.ParameterSpace`` syntax, e.g. ``"efSearch=128"``, ``"nprobe=32"``) are
    applied before the vectors are added, so build-time ones take effect (``efConstruction``, the
    HNSW graph's candidate list while it is built: the ceiling of the recall any ``efSearch``
    reaches; :data:`DEFAULT_EF_CONSTRUCTION` when not given); an IVF index searches
    :data:`DEFAULT_NPROBE` lists unless told otherwise. A factory or parameter faiss refuses is a
    ``ValueError`` naming it.
    """
    index = faiss_trained(
        vectors if train_vectors is None else train_vectors,
        factory,
        parameters,
        metric,
        train_size=None if train_vectors is not None else train_size,
        sampled=train_vectors is None,
    )
    faiss_add(index, vectors)
    return index


def faiss_trained(
    vectors: Tensor,
    factory: str,
    parameters: str | None = None,
    metric: FaissMetric = "inner_product",
    *,
    train_size: int | None = None,
    sampled: bool = True,
) -> Any:
    """An empty index of ``factory``, trained (when it must be) on ``vectors`` — on their
    rows of :func:`training_positions` when ``sampled`` — with ``parameters`` set: :func:`faiss_build`
    without the adding, for an index filled in pieces (:func:`faiss_add`)."""
    faiss = _faiss()
    index = new_index(factory, int(vectors.shape[1]), metric)
    if not index.is_trained:
        sample = (
            vectors[training_positions(len(vectors), index, train_size)] if sampled else vectors
        )
        x = _as_faiss_rows(sample)
        try:
            index.train(x)
        except RuntimeError as err:
            raise ValueError(
                f"faiss cannot train index {factory!r} on {len(x)} vectors "
                f"({str(err).splitlines()[-1]}); use fewer IVF lists, or Flat / HNSW32"
            ) from None
    if hasattr(index, "hnsw") and "efConstruction" not in (parameters or ""):
        index.hnsw.efConstruction = DEFAULT_EF_CONSTRUCTION
    if _ivf_lists(index) and "nprobe" not in (parameters or ""):
        faiss.extract_index_ivf(index).nprobe = DEFAULT_NPROBE
    faiss_parameters(index, parameters)
    return index


def new_index(factory: str, dim: int, metric: FaissMetric = "inner_product") -> Any:
    """An empty faiss index of ``factory`` for vectors of dimension ``dim``; a factory faiss
    refuses is a ``ValueError`` naming it."""
    faiss = _faiss()
    kind = faiss.METRIC_INNER_PRODUCT if metric == "inner_product" else faiss.METRIC_L2
    try:
        return faiss.index_factory(dim, factory, kind)
    except RuntimeError as err:
        raise ValueError(
            f"faiss cannot build index {factory!r} for dimension {dim} "
            f"({str(err).splitlines()[-1]}); use a factory string such as Flat, HNSW32, "
            "IVF1024,Flat or IVF4096,PQ32 (PQ's sub-vector count must divide the dimension)"
        ) from None


def faiss_add(index: Any, vectors: Tensor, chunk: int = 1 << 20) -> None:
    """Add ``vectors`` to ``index`` in slices of ``chunk`` rows (a float32 copy of one slice at a
    time, not of the whole gallery)."""
    for start in range(0, int(vectors.shape[0]), chunk):
        index.add(_as_faiss_rows(vectors[start : start + chunk]))


def training_positions(count: int, index: Any, train_size: int | None = None) -> Tensor:
    """The rows of a gallery of ``count`` items that faiss ``index`` (untrained) learns from: ``train_size`` (default :func:`default_train_size` of its lists) evenly spaced
    rows, all when they are fewer, none when it needs no training. Evenly spaced: a gallery listed
    folder by folder is sampled in every folder, and the sample does not depend on how the gallery
    was sharded over processes."""
    if index.is_trained:
        return torch.zeros(0, dtype=torch.long)
    size = train_size or default_train_size(_ivf_lists(index))
    if size >= count:
        return torch.arange(count)
    return torch.div(torch.arange(size, dtype=torch.long) * count, size, rounding_mode="floor")


def default_train_size(lists: int) -> int:
    """Vectors a trained index learns from by default: :data:`TRAIN_POINTS_PER_LIST` per inverted
    list, at least :data:`MIN_TRAIN_SIZE`."""
    return max(MIN_TRAIN_SIZE, TRAIN_POINTS_PER_LIST * lists)


def _ivf_lists(index: Any) -> int:
    """The inverted lists of an IVF index (0 for any other)."""
    faiss = _faiss()
    try:
        return int(faiss.extract_index_ivf(index).nlist)
    except (RuntimeError, AttributeError):
        return 0


def _as_faiss_rows(vectors: Tensor) -> np.ndarray:
    return np.ascontiguousarray(vectors.detach().float().cpu().numpy(), dtype=np.float32)


def faiss_parameters(index: Any, parameters: str | None) -> None:
    """Set ``parameters`` (e.g. ``"efSearch=128"``) on a built index; a ``ValueError`` naming
    them when they do not apply to it."""
    if not parameters:
        return
    faiss = _faiss()
    try:
        faiss.ParameterSpace().set_index_parameters(index, parameters)
    except RuntimeError as err:
        raise ValueError(
            f"faiss search parameters {parameters!r} do not apply to this index "
            f"({str(err).splitlines()[-1]}); e.g. efSearch=128 or efConstruction=200 (HNSW), "
            "nprobe=32 (IVF)"
        ) from None


def faiss_search(
    query: Tensor,
    k: int,
    reference: Tensor | None = None,
    *,
    metric: str = "cosine",
    normalize: bool = True,
    index_factory: str = "HNSW32",
    search_parameters: str | None = None,
) -> NeighborLists:
    """Approximate k-nearest neighbours with a faiss index of :func:`faiss_build`.

    For collections too large for exact search. ``index_factory`` is any faiss factory string
    (``"Flat"`` exact, ``"HNSW32"``, ``"IVF1024,Flat"``, ...); ``search_parameters`` are passed to
    ``faiss.ParameterSpace`` (e.g. ``"efSearch=128"`` or ``"nprobe=32"``). Cosine uses an
    inner-product index on normalised vectors, Euclidean an L2 index (score ``−||x − y||²``).
    With ``reference=None`` the set is searched against itself and each query's own index is
    removed from its list (by index; if the index missed it, the last neighbour is dropped). Tie
    order is faiss's.
    """
    if metric not in ("cosine", "euclidean"):
        raise ValueError(f"faiss search supports metric 'cosine' or 'euclidean', got {metric!r}")
    if k < 1:
        raise ValueError(f"k (number of neighbours) must be >= 1, got {k}")
    same_set = reference is None
    ref = query if reference is None else reference
    if metric == "cosine" or normalize:
        query, ref = (
            torch.nn.functional.normalize(query.float(), dim=1),
            torch.nn.functional.normalize(ref.float(), dim=1),
        )
    q_np = query.detach().float().cpu().contiguous().numpy()
    index = faiss_build(
        ref, index_factory, search_parameters, "inner_product" if metric == "cosine" else "l2"
    )
    extra = 1 if same_set else 0
    k_eff = min(k, index.ntotal - extra)
    if k_eff < 1:
        raise ValueError("the reference set has no item to return as a neighbour")
    distances, indices = index.search(q_np, k_eff + extra)
    scores = torch.from_numpy(distances)
    ids = torch.from_numpy(indices).long()
    if metric == "euclidean":
        scores = -scores
    if same_set:
        own = ids == torch.arange(len(ids)).unsqueeze(1)
        missing = ~own.any(1)
        own[missing, -1] = True
        keep = ~own
        ids = ids[keep].view(len(ids), k_eff)
        scores = scores[keep].view(len(ids), k_eff)
    scores = torch.where(ids < 0, torch.full_like(scores, -INF), scores)
    return NeighborLists(ids, scores)
