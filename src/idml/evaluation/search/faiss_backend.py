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
) -> Any:
    """A trained faiss index of ``factory`` (``"Flat"``, ``"HNSW32"``, ``"IVF1024,Flat"``, …)
    holding ``vectors`` ``(N, d)``, ranking by ``metric``.

    ``parameters`` (``faiss.ParameterSpace`` syntax, e.g. ``"efSearch=128"``, ``"nprobe=32"``) are
    applied before the vectors are added, so build-time ones take effect (``efConstruction``, the
    HNSW graph's candidate list while it is built: the ceiling of the recall any ``efSearch``
    reaches; :data:`DEFAULT_EF_CONSTRUCTION` when not given). A factory or parameter faiss refuses
    is a ``ValueError`` naming it.
    """
    faiss = _faiss()
    x = np.ascontiguousarray(vectors.detach().float().cpu().numpy(), dtype=np.float32)
    kind = faiss.METRIC_INNER_PRODUCT if metric == "inner_product" else faiss.METRIC_L2
    try:
        index = faiss.index_factory(x.shape[1], factory, kind)
    except RuntimeError as err:
        raise ValueError(
            f"faiss cannot build index {factory!r} ({str(err).splitlines()[-1]}); use a factory "
            "string such as Flat, HNSW32 or IVF1024,Flat"
        ) from None
    if not index.is_trained:
        try:
            index.train(x)
        except RuntimeError as err:
            raise ValueError(
                f"faiss cannot train index {factory!r} on {len(x)} vectors "
                f"({str(err).splitlines()[-1]}); use fewer IVF lists, or Flat / HNSW32"
            ) from None
    if hasattr(index, "hnsw") and "efConstruction" not in (parameters or ""):
        index.hnsw.efConstruction = DEFAULT_EF_CONSTRUCTION
    faiss_parameters(index, parameters)
    index.add(x)
    return index


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
