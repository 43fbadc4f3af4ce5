"""Normalised softmax loss: cross-entropy over temperature-scaled cosine similarities to class proxies.

Zhai & Wu 2019 ("Classification is a strong baseline for deep metric learning", the
normalised-softmax loss): with
L2-normalised embeddings ``ŝ_i`` and proxies ``p̂_c``, the logits are ``z_ic = S(s_i, p_c) / T`` and the
loss is the cross-entropy ``−log softmax(z_i)_{l_i}`` averaged over the batch (default ``T = 0.05``;
with ISM: IDML, TPAMI, Eq. 14).

Any metric plugs in: with the introspective metric ``S = S_IN`` (IDML, TPAMI, Eq. 7), so an uncertain sample is
"close to every proxy" and its logits flatten; a distance metric enters as ``z = −D / T``.

Set labels (Mixup; IDML, Sec. III-C) use :func:`set_label_cross_entropy`: by default the target is the uniform
distribution over the label set, so a mixed image is pulled toward *both* source proxies.

Example:
    >>> import torch
    >>> loss_fn = NormalizedSoftmaxLoss(num_classes=3, embedding_dim=4)
    >>> with torch.no_grad():
    ...     _ = loss_fn.proxies.copy_(torch.eye(3, 4))
    >>> x = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    >>> round(loss_fn(x, torch.tensor([0, 1])).item(), 6)  # log(1 + 2·e^{-20})
    0.0
    >>> round(loss_fn(x, torch.tensor([1, 1])).item(), 4)  # first sample wrong by 1/T = 20
    10.0
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

from idml.embeddings import Embeddings
from idml.losses.base import ProxyLoss, check_positive
from idml.losses.registry import LossParams
from idml.metrics import CosineSimilarity, Metric
from idml.relations import LabelSets

SetTarget = Literal["uniform", "sum"]
"""How a multi-label (Mixup) set becomes a softmax target; see :func:`set_label_cross_entropy`."""

_SET_TARGETS: tuple[str, ...] = ("uniform", "sum")


def check_set_target(set_target: str) -> None:
    """Raise a ``ValueError`` unless ``set_target`` is one of ``"uniform"``, ``"sum"``."""
    if set_target not in _SET_TARGETS:
        raise ValueError(f"set_target must be one of {_SET_TARGETS}, got {set_target!r}")


def set_label_cross_entropy(
    logits: Tensor, membership: Tensor, set_target: SetTarget = "uniform"
) -> Tensor:
    """Per-sample cross-entropy of ``(B, C)`` logits against label *sets*, shape ``(B,)``.

    With ``P = softmax(z_i)`` and the sample's label set ``S_i`` (row ``i`` of ``membership``):

    - ``"uniform"``: ``−(1/|S_i|) Σ_{c∈S_i} log P_c`` — cross-entropy against the uniform distribution
      on the set; its minimum puts equal mass on every source class, so a mixed image is pulled
      toward both proxies (the λ-free analogue of the official code's ``λ·L(l_a) + (1−λ)·L(l_b)``).
    - ``"sum"``: ``−log Σ_{c∈S_i} P_c`` — NCA's probability that the sample is assigned to *some*
      positive (Goldberger et al. 2004, NCA; Movshovitz-Attias et al. 2017, ProxyNCA). Satisfied by
      matching either source.

    Both equal the ordinary cross-entropy ``−log P_{l_i}`` for singleton sets.

    Example:
        >>> logits = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
        >>> member = torch.tensor([[True, True, False, False]])
        >>> round(set_label_cross_entropy(logits, member, "uniform").item(), 4)  # log 4
        1.3863
        >>> round(set_label_cross_entropy(logits, member, "sum").item(), 4)  # log 2
        0.6931
    """
    check_set_target(set_target)
    log_probs = torch.log_softmax(logits, dim=1)
    if set_target == "sum":
        return -torch.logsumexp(log_probs.masked_fill(~membership, float("-inf")), dim=1)
    # log_softmax of finite logits is finite, so multiplying by a 0/1 target never meets 0·inf.
    target = membership.to(log_probs.dtype)
    target = target / target.sum(dim=1, keepdim=True)
    return -(log_probs * target).sum(dim=1)


class NormalizedSoftmaxParams(LossParams):
    """The softmax temperature."""

    temperature: float = Field(0.05, gt=0, allow_inf_nan=False, description="T; logits S / T")


_DEFAULT = NormalizedSoftmaxParams()


class NormalizedSoftmaxLoss(ProxyLoss):
    """Normalised softmax (Zhai & Wu 2019): ``mean_i CE(S(s_i, p_·)/T, S_i)``.

    Args:
        num_classes: number of training classes ``C`` (one proxy each).
        embedding_dim: dimension ``d`` of the semantic embedding.
        metric: cosine similarity by default (as in the paper); an :class:`~idml.metrics.IntrospectiveMetric`
            gives ``S_IN`` between samples (with their uncertainty) and proxies (zero or learnable
            uncertainty); a distance metric is used as ``−D``.
        temperature: ``T > 0`` [0.05]; logits are ``S / T``.
        proxy_uncertainty_dim: give each proxy a learnable uncertainty vector of this size.
        set_target: how a Mixup label set becomes the target, see :func:`set_label_cross_entropy`
            [``"uniform"``].

    The proxies are :attr:`proxies` (``(C, d)``, kaiming-normal), so a trainer can put them in their
    own parameter group. The metric L2-normalises them, as the paper's weight normalisation does.
    """

    params = NormalizedSoftmaxParams
    default_metric = CosineSimilarity
    repr_fields = (*ProxyLoss.repr_fields, "temperature", "set_target")

    def __init__(
        self,
        num_classes: int,
        embedding_dim: int,
        metric: Metric | None = None,
        temperature: float = _DEFAULT.temperature,
        proxy_uncertainty_dim: int | None = None,
        set_target: SetTarget = "uniform",
    ) -> None:
        super().__init__(num_classes, embedding_dim, metric, proxy_uncertainty_dim)
        check_positive("temperature", temperature)
        check_set_target(set_target)
        self.temperature = float(temperature)
        self.set_target: SetTarget = set_target

    def logits(self, embeddings: Embeddings) -> Tensor:
        """``(B, C)`` logits ``z_ic = S(s_i, p_c) / T`` (``−D/T`` for a distance metric)."""
        return self.metric.oriented(self.proxy_matrix(embeddings)) / self.temperature

    def compute(self, embeddings: Embeddings, labels: LabelSets) -> Tensor:
        logits = self.logits(embeddings)
        membership = labels.proxy_mask(self.num_classes)
        return set_label_cross_entropy(logits, membership, self.set_target).mean()
