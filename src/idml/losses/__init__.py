"""The eight DML losses of SPEC §4 and the PEL baseline, each written once against a pluggable metric.

Every loss accepts plain ``(B, d)`` embeddings or :class:`~idml.embeddings.Embeddings` with
uncertainty (for the introspective metric), and integer labels or Mixup
:class:`~idml.relations.LabelSets`.
"""

from idml.losses.base import MetricLoss, ProxyLoss
from idml.losses.contrastive import ContrastiveLoss
from idml.losses.fastap import FastAPLoss
from idml.losses.margin import MarginLoss
from idml.losses.multi_similarity import MultiSimilarityLoss
from idml.losses.pel import PELLoss
from idml.losses.proxy_anchor import ProxyAnchorLoss
from idml.losses.proxy_nca import ProxyNCALoss
from idml.losses.softmax import NormalizedSoftmaxLoss
from idml.losses.triplet import TripletLoss

__all__ = [
    "ContrastiveLoss",
    "FastAPLoss",
    "MarginLoss",
    "MetricLoss",
    "MultiSimilarityLoss",
    "NormalizedSoftmaxLoss",
    "PELLoss",
    "ProxyAnchorLoss",
    "ProxyLoss",
    "ProxyNCALoss",
    "TripletLoss",
]
