"""Eight DML losses and the PEL baseline, each written once against a pluggable metric.

The losses are the ones IDML (Wang et al., TPAMI) combines with its metric in Sec. III-D, Eq. 8–16
(contrastive, margin, triplet, multi-similarity, softmax, ProxyNCA, ProxyAnchor) plus FastAP, which
its experiments also cover (Tables I–II).

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
