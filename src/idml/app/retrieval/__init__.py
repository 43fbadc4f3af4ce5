"""Retrieval for applications: a saved gallery index, search with confidence, and its service.

* :class:`Index` (:mod:`idml.app.retrieval.index`): embeddings, ``||u||``, item ids/paths/labels and the
  model they came from, saved as safetensors + JSON with checksums; exact blocked search or faiss.
* :func:`confidence` (:mod:`idml.app.retrieval.confidence`): the one place that scores an answer.
* :mod:`idml.app.retrieval.output`: records, JSON, CSV, table and HTML of search results.
* :mod:`idml.app.retrieval.workflow`: galleries and queries from folders, CSVs or embedding files.
"""

from idml.app.retrieval.confidence import CONFIDENCE_KIND, confidence
from idml.app.retrieval.index import Index, IndexFormatError, SearchResult
from idml.app.retrieval.output import result_records

__all__ = [
    "CONFIDENCE_KIND",
    "Index",
    "IndexFormatError",
    "SearchResult",
    "confidence",
    "result_records",
]
