"""Eight DML losses and the PEL baseline, each written once against a pluggable metric.

The losses are the ones IDML (Wang et al., TPAMI) combines with its metric in Sec. III-D, Eq. 8–16
(contrastive, margin, triplet, multi-similarity, softmax, ProxyNCA, ProxyAnchor) plus FastAP, which
its experiments also cover (Tables I–II).

Every loss accepts plain ``(B, d)`` embeddings or :class:`~idml.embeddings.Embeddings` with
uncertainty (for the introspective metric), and integer labels or Mixup
:class:`~idml.relations.LabelSets`.

:data:`LOSSES` registers each under the name a run config gives it (``loss.name``), with its
hyper-parameter model (:mod:`idml.losses.registry`); a new loss is one file and one
:func:`register_loss` line below.
"""

from idml.losses.base import MetricLoss, ProxyLoss
from idml.losses.contrastive import ContrastiveLoss, ContrastiveParams
from idml.losses.fastap import FastAPLoss, FastAPParams
from idml.losses.margin import MarginLoss, MarginParams
from idml.losses.multi_similarity import MultiSimilarityLoss, MultiSimilarityParams
from idml.losses.pel import PELLoss, PELParams
from idml.losses.proxy_anchor import ProxyAnchorLoss, ProxyAnchorParams
from idml.losses.proxy_nca import ProxyNCALoss, ProxyNCAParams
from idml.losses.registry import LOSSES, LossContext, LossParams, LossSpec, register_loss
from idml.losses.softmax import NormalizedSoftmaxLoss, NormalizedSoftmaxParams
from idml.losses.triplet import TripletLoss, TripletParams

# The order is the order ``idml`` lists the loss names in.
register_loss("contrastive", ContrastiveLoss)
register_loss("margin", MarginLoss)
register_loss("triplet", TripletLoss)
register_loss("multi_similarity", MultiSimilarityLoss)
register_loss("normalized_softmax", NormalizedSoftmaxLoss)
register_loss("proxy_nca", ProxyNCALoss)
register_loss("proxy_anchor", ProxyAnchorLoss)
register_loss("fastap", FastAPLoss)
register_loss("pel", PELLoss)

__all__ = [
    "LOSSES",
    "ContrastiveLoss",
    "ContrastiveParams",
    "FastAPLoss",
    "FastAPParams",
    "LossContext",
    "LossParams",
    "LossSpec",
    "MarginLoss",
    "MarginParams",
    "MetricLoss",
    "MultiSimilarityLoss",
    "MultiSimilarityParams",
    "NormalizedSoftmaxLoss",
    "NormalizedSoftmaxParams",
    "PELLoss",
    "PELParams",
    "ProxyAnchorLoss",
    "ProxyAnchorParams",
    "ProxyLoss",
    "ProxyNCALoss",
    "ProxyNCAParams",
    "TripletLoss",
    "TripletParams",
    "register_loss",
]
