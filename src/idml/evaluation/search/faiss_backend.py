"""Approximate k-nearest neighbours with a faiss index (the optional ``faiss`` extra)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from idml.evaluation.search.results import NeighborLists
from idml.evaluation.search.state import INF


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
    """Approximate k-nearest neighbours with a faiss index.

    For collections too large for exact search. ``index_factory`` is any faiss factory string
    (``"Flat"`` exact, ``"HNSW32"``, ``"IVF1024,Flat"``, ...); ``search_parameters`` are passed to
    ``faiss.ParameterSpace`` (e.g. ``"efSearch=128"`` or ``"nprobe=32"``). Cosine uses an
    inner-product index on normalised vectors, Euclidean an L2 index (score ``−||x − y||²``).
    With ``reference=None`` the set is searched against itself and each query's own index is
    removed from its list (by index; if the index missed it, the last neighbour is dropped). Tie
    order is faiss's.
    """
    try:
        import faiss
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ValueError(
            "the faiss backend needs the faiss package; `pip install idml[faiss]`"
        ) from err
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
    r_np = ref.detach().float().cpu().contiguous().numpy()
    kind = faiss.METRIC_INNER_PRODUCT if metric == "cosine" else faiss.METRIC_L2
    index = faiss.index_factory(r_np.shape[1], index_factory, kind)
    if search_parameters:
        space: Any = faiss.ParameterSpace()  # its stub types only (index, name, value)
        space.set_index_parameters(index, search_parameters)
    if not index.is_trained:
        index.train(r_np)
    index.add(r_np)
    extra = 1 if same_set else 0
    k_eff = min(k, len(r_np) - extra)
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
