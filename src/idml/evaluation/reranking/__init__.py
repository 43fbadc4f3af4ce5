"""Re-ranking at query time: re-order each query's shortlist without an ``N×N`` matrix.

* :class:`QueryExpansion` — α-query expansion and database-side augmentation (Radenović et al.
  2019), :mod:`~idml.evaluation.reranking.query_expansion`;
* :class:`KReciprocal` — k-reciprocal re-ranking (Zhong et al. 2017) on the sparse neighbour
  graph, :mod:`~idml.evaluation.reranking.k_reciprocal`.

Both implement :class:`Reranker` (:mod:`~idml.evaluation.reranking.base`): ``prepare`` the
gallery once (from its embeddings and its own neighbour lists), then ``rerank`` each query batch's
shortlists from the exact search, re-ordered with new scores (larger = closer), which
:func:`~idml.evaluation.evaluate_embeddings` (``EvaluationSettings.reranking``) turns into metrics
and confidence scores like any search's lists.
"""

from idml.evaluation.reranking.base import Reranker
from idml.evaluation.reranking.k_reciprocal import KReciprocal, ReciprocalGallery
from idml.evaluation.reranking.query_expansion import (
    ExpansionGallery,
    QueryExpansion,
    augment_database,
)

__all__ = [
    "ExpansionGallery",
    "KReciprocal",
    "QueryExpansion",
    "ReciprocalGallery",
    "Reranker",
    "augment_database",
]
