"""ProxyAnchor loss: each class proxy is an anchor that pulls its positives and pushes its negatives.

Kim et al. 2020 ("Proxy Anchor Loss for Deep Metric Learning", eq. 4), with ``P`` all proxies,
``P⁺`` the proxies with at least one positive in the batch, ``X_p⁺`` / ``X_p⁻`` the samples positive /
negative to proxy ``p`` and ``s(x, p)`` the similarity::

    L = 1/|P⁺| Σ_{p∈P⁺} log(1 + Σ_{x∈X_p⁺} exp(−α·(s(x, p) − δ)))
      + 1/|P|  Σ_{p∈P}  log(1 + Σ_{x∈X_p⁻} exp( α·(s(x, p) + δ)))

[defaults α 32, δ 0.1; with ISM: IDML, TPAMI, Eq. 16].
``s`` is cosine by default, ``S_IN`` with the introspective metric (the only
loss with ISM in the authors' code), and ``−D`` for a distance metric. With set labels a mixed image
is in ``X_p⁺`` of *both* source proxies (:meth:`~idml.relations.LabelSets.proxy_mask`).

Example:
    >>> import torch
    >>> loss_fn = ProxyAnchorLoss(num_classes=2, embedding_dim=2)
    >>> with torch.no_grad():
    ...     _ = loss_fn.proxies.copy_(torch.eye(2))
    >>> x = torch.tensor([[1.0, 0.0]])
    >>> # proxy 0: log(1 + e^{−32·0.9}); proxy 1 (negative, cos 0): log(1 + e^{3.2}) / 2 proxies
    >>> round(loss_fn(x, torch.tensor([0])).item(), 4)
    1.62
"""

from __future__ import annotations

import math

from pydantic import Field
from torch import Tensor

from idml.embeddings import Embeddings
from idml.losses.base import ProxyLoss, check_positive, masked_logsumexp
from idml.losses.registry import LossParams
from idml.metrics import CosineSimilarity, Metric
from idml.relations import LabelSets


class ProxyAnchorParams(LossParams):
    """ProxyAnchor's scale and margin."""

    alpha: float = Field(32.0, gt=0, allow_inf_nan=False, description="α, the scale")
    margin: float = Field(0.1, allow_inf_nan=False, description="δ, the margin")


_DEFAULT = ProxyAnchorParams()


class ProxyAnchorLoss(ProxyLoss):
    """ProxyAnchor (Kim et al. 2020, eq. 4) over any metric, with set labels.

    Args:
        num_classes: number of training classes ``C`` (one proxy each).
        embedding_dim: dimension ``d`` of the semantic embedding.
        metric: cosine similarity by default; ``IntrospectiveMetric(CosineSimilarity(), ...)`` gives
            IDML's ``S_IN`` between samples (with uncertainty) and proxies (zero or learnable
            uncertainty); a distance ``D`` enters as ``s = −D``.
        alpha: scaling ``α > 0`` [32].
        margin: ``δ`` [0.1].
        proxy_uncertainty_dim: give each proxy a learnable uncertainty vector of this size.

    Proxies are kaiming-normal (fan_out) as in the paper, exposed as :attr:`proxies` for their own
    learning rate (×100 the backbone's in the ProxyAnchor recipe the IDML presets follow).
    """

    params = ProxyAnchorParams
    default_metric = CosineSimilarity
    repr_fields = (*ProxyLoss.repr_fields, "alpha", "margin")

    def __init__(
        self,
        num_classes: int,
        embedding_dim: int,
        metric: Metric | None = None,
        alpha: float = _DEFAULT.alpha,
        margin: float = _DEFAULT.margin,
        proxy_uncertainty_dim: int | None = None,
    ) -> None:
        super().__init__(num_classes, embedding_dim, metric, proxy_uncertainty_dim)
        check_positive("alpha", alpha)
        if not math.isfinite(margin):
            raise ValueError(f"margin must be a finite number, got {margin}")
        self.alpha = float(alpha)
        self.margin = float(margin)

    def compute(self, embeddings: Embeddings, labels: LabelSets) -> Tensor:
        similarity = self.metric.oriented(self.proxy_matrix(embeddings))
        positive = labels.proxy_mask(self.num_classes)
        pull = masked_logsumexp(
            self.alpha * (self.margin - similarity), positive, dim=0, add_one=True
        )
        push = masked_logsumexp(
            self.alpha * (similarity + self.margin), ~positive, dim=0, add_one=True
        )
        # A proxy with no positive contributes log(1 + 0) = 0 and is left out of the divisor.
        proxies_with_positives = positive.any(dim=0).sum().clamp_min(1)
        return pull.sum() / proxies_with_positives + push.sum() / self.num_classes
