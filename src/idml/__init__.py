"""idml: deep metric learning with introspective similarity (IDML) and self-supervised ranking (SSR)."""

from idml.embeddings import Embeddings
from idml.metrics import (
    CosineSimilarity,
    EuclideanDistance,
    IntrospectiveMetric,
    ISMVariant,
    Metric,
)
from idml.relations import LabelSets, pair_masks

__version__ = "0.1.0"

__all__ = [
    "CosineSimilarity",
    "Embeddings",
    "EuclideanDistance",
    "ISMVariant",
    "IntrospectiveMetric",
    "LabelSets",
    "Metric",
    "__version__",
    "pair_masks",
]
