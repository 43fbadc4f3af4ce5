"""Re-ranking an index's answers at query time: the gallery side, prepared once per loaded index.

A re-ranker (:mod:`idml.evaluation.reranking`: k-reciprocal, αQE / DBA) re-orders each query's
shortlist of nearest items. Its gallery side — the gallery's own neighbour graph and what it
computes from it (k-reciprocal's sparse kernel vectors, DBA's augmented vectors) — is not stored in
the index: :meth:`GalleryReranking.prepare` computes it when the index is loaded (``idml search``,
``idml serve`` at start-up), from one search of the gallery against itself (exact, or with the
index's faiss index). The confidence of an answer is computed after re-ranking, so a calibration
applies only when it was fitted under the same re-ranking (:func:`idml.app.calibration.mismatch`).

Example:
    >>> import torch
    >>> from idml.app.retrieval.index import Index
    >>> from idml.evaluation.reranking import QueryExpansion
    >>> index = Index.create(torch.eye(4) + 0.1)
    >>> reranking = GalleryReranking.prepare(index, QueryExpansion(query_neighbors=1, shortlist=4))
    >>> index.search(torch.tensor([[1.0, 0.2, 0.0, 0.0]]), k=2, reranking=reranking).indices.tolist()
    [[0, 1]]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from idml.app.calibration import reranking_name
from idml.evaluation.reranking import Reranker
from idml.evaluation.search import NeighborLists

if TYPE_CHECKING:
    from idml.app.retrieval.index import Index


@dataclass(frozen=True)
class GalleryReranking:
    """A re-ranker and its gallery side for one index (module docstring)."""

    reranker: Reranker
    prepared: Any

    @classmethod
    def prepare(
        cls, index: Index, reranker: Reranker, device: torch.device | str | None = None
    ) -> GalleryReranking:
        """Prepare ``reranker``'s gallery side for ``index`` (its graph searched if it reads one)."""
        graph = None
        if reranker.gallery_depth > 0 and len(index) > 1:
            graph = index.gallery_neighbors(reranker.gallery_depth, device=device)
        return cls(reranker, reranker.prepare(index.all_vectors("re-ranking"), graph))

    @property
    def name(self) -> str:
        """The re-ranking as a calibration records it."""
        return reranking_name(self.reranker)

    def rerank(self, shortlist: NeighborLists, queries: Tensor) -> NeighborLists:
        """The shortlists of unit ``queries`` re-ordered with the re-ranker's scores."""
        return self.reranker.rerank(shortlist, self.prepared, queries)
