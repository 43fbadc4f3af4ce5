"""Retrieval for applications: a saved gallery index, search with confidence, and its service.

* :class:`Index` (:mod:`idml.app.retrieval.index`): embeddings, ``||u||``, item ids/paths/labels and the
  model they came from; exact blocked search or faiss. Saved as a folder of versions, safetensors +
  JSON with checksums, written atomically and read back verified
  (:mod:`idml.app.retrieval.index_folder`).
* :class:`AnswerPolicy` (:mod:`idml.app.retrieval.confidence`): the one place that scores an answer
  (calibrated, or the top-1 similarity) and decides whether it abstains.
* :class:`GalleryReranking` (:mod:`idml.app.retrieval.reranking`): re-ranking at query time, its
  gallery side prepared when an index is loaded.
* :mod:`idml.app.retrieval.output`: records, JSON, CSV, table and HTML of search results.
* :mod:`idml.app.retrieval.workflow`: galleries and queries from folders, CSVs or embedding files.
"""

from idml.app.retrieval.confidence import AnswerPolicy
from idml.app.retrieval.index import Index, SearchResult
from idml.app.retrieval.index_folder import IndexFormatError
from idml.app.retrieval.output import result_records
from idml.app.retrieval.reranking import GalleryReranking

__all__ = [
    "AnswerPolicy",
    "GalleryReranking",
    "Index",
    "IndexFormatError",
    "SearchResult",
    "result_records",
]
