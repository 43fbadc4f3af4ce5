"""ProxyNCA: neighbourhood component analysis against one proxy per class.

Movshovitz-Attias et al. 2017 ("No fuss distance metric learning using proxies", the ProxyNCA
loss) on squared Euclidean distances between L2-normalised samples and proxies, both scaled to norm
``√scale`` (default ``scale = 9``, i.e. norm 3; with ISM: IDML, TPAMI, Eq. 15)::

    d_ic = scale · ||ŝ_i − p̂_c||²
    L    = mean_i −log( exp(−d_{i,l_i}) / Σ_c exp(−d_ic) )

The positive proxy stays in the denominator (a softmax over all proxies), which is the convention of
pytorch-metric-learning's ``ProxyNCALoss`` with ``softmax_scale = scale`` (the paper leaves it out
of the denominator; including it keeps the loss bounded below by 0).

The squared distance is taken from whatever metric is configured: ``EuclideanDistance(power=2)`` as
is, any other distance (notably the introspective ``D_IN``) squared, and a similarity ``S`` as
``2·(1 − S)`` — the squared distance between unit vectors with cosine ``S`` (so cosine and ``S_IN``
work too). Set labels follow :func:`~idml.losses.softmax.set_label_cross_entropy`.

Example:
    >>> import torch
    >>> loss_fn = ProxyNCALoss(num_classes=2, embedding_dim=2)
    >>> with torch.no_grad():
    ...     _ = loss_fn.proxies.copy_(torch.eye(2))
    >>> x = torch.tensor([[0.6, 0.8]])
    >>> # d = 9·[0.8, 0.4] = [7.2, 3.6] → −log(e^{−7.2} / (e^{−7.2} + e^{−3.6})) = log(1 + e^{3.6})
    >>> round(loss_fn(x, torch.tensor([0])).item(), 4)
    3.627
"""

from __future__ import annotations

from functools import partial

from pydantic import Field
from torch import Tensor

from idml.embeddings import Embeddings
from idml.losses.base import ProxyLoss, check_positive
from idml.losses.registry import LossParams
from idml.losses.softmax import SetTarget, check_set_target, set_label_cross_entropy
from idml.metrics import EuclideanDistance, Metric
from idml.relations import LabelSets


class ProxyNCAParams(LossParams):
    """The scale of ProxyNCA's squared distances."""

    scale: float = Field(9.0, gt=0, allow_inf_nan=False, description="softmax scale")


_DEFAULT = ProxyNCAParams()


class ProxyNCALoss(ProxyLoss):
    """ProxyNCA (Movshovitz-Attias et al. 2017, softmax form): ``mean_i CE(−scale·d²_i·, S_i)``.

    Args:
        num_classes: number of training classes ``C`` (one proxy each).
        embedding_dim: dimension ``d`` of the semantic embedding.
        metric: squared Euclidean distance on L2-normalised vectors by default; any metric works via
            :meth:`~idml.metrics.Metric.to_squared_distance` (e.g.
            ``IntrospectiveMetric(EuclideanDistance())`` gives ``D_IN²``).
        scale: multiplies the squared distances [9: samples and proxies at norm 3]; equal to
            pytorch-metric-learning's ``softmax_scale``.
        proxy_uncertainty_dim: give each proxy a learnable uncertainty vector of this size.
        set_target: how a Mixup label set becomes the target [``"uniform"``]; ``"sum"`` is NCA's
            "probability of landing on any positive", see
            :func:`~idml.losses.softmax.set_label_cross_entropy`.

    Unlike pytorch-metric-learning, a sample whose positive probability underflows to 0 is kept (the
    log-softmax is computed stably), not dropped from the mean.
    """

    params = ProxyNCAParams
    default_metric = partial(EuclideanDistance, power=2)
    repr_fields = (*ProxyLoss.repr_fields, "scale", "set_target")

    def __init__(
        self,
        num_classes: int,
        embedding_dim: int,
        metric: Metric | None = None,
        scale: float = _DEFAULT.scale,
        proxy_uncertainty_dim: int | None = None,
        set_target: SetTarget = "uniform",
    ) -> None:
        super().__init__(num_classes, embedding_dim, metric, proxy_uncertainty_dim)
        check_positive("scale", scale)
        check_set_target(set_target)
        self.scale = float(scale)
        self.set_target: SetTarget = set_target

    def compute(self, embeddings: Embeddings, labels: LabelSets) -> Tensor:
        squared = self.metric.to_squared_distance(self.proxy_matrix(embeddings))
        membership = labels.proxy_mask(self.num_classes)
        return set_label_cross_entropy(-self.scale * squared, membership, self.set_target).mean()
