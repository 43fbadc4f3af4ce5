"""The faiss backend of :class:`~idml.app.retrieval.index.Index`: building a faiss index from a factory
string and setting its search parameters (faiss is imported only when a faiss index is built)."""

from __future__ import annotations

from typing import Any

import numpy as np
from torch import Tensor

DEFAULT_EF_CONSTRUCTION = 200
"""HNSW ``efConstruction`` unless the parameters give one. faiss's own default (40) builds a graph
whose recall@10 levels off at 0.91 on the 1M × 512 clustered benchmark gallery whatever the
``efSearch``; 200 reaches 0.999 at efSearch 128 (``benchmarks/RESULTS.md``, gallery search)."""


def faiss_build(embeddings: Tensor, factory: str, parameters: str | None = None) -> Any:
    """A trained faiss index of ``factory`` holding ``embeddings``. ``parameters`` are applied
    before the vectors are added, so build-time ones take effect (``efConstruction``, the HNSW
    graph's candidate list while it is built: the ceiling of the recall any ``efSearch`` reaches;
    :data:`DEFAULT_EF_CONSTRUCTION` when not given)."""
    try:
        import faiss
    except ImportError as err:
        raise ValueError(
            "backend 'faiss' needs the faiss package; `pip install idml[faiss]`"
        ) from err
    x = np.ascontiguousarray(embeddings.numpy(), dtype=np.float32)
    try:
        index = faiss.index_factory(x.shape[1], factory, faiss.METRIC_INNER_PRODUCT)
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
    if not parameters:
        return
    import faiss

    try:
        space: Any = faiss.ParameterSpace()  # its stub types only (index, name, value)
        space.set_index_parameters(index, parameters)
    except RuntimeError as err:
        raise ValueError(
            f"faiss search parameters {parameters!r} do not apply to this index "
            f"({str(err).splitlines()[-1]}); e.g. efSearch=128 or efConstruction=200 (HNSW), "
            "nprobe=32 (IVF)"
        ) from None
