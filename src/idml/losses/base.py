"""Base classes shared by every loss: input validation and the pluggable metric.

A loss is written once against a :class:`~idml.metrics.Metric` and a
:class:`~idml.relations.LabelSets` relation, so the same class trains with the plain metric, with the
introspective metric (pass uncertainty embeddings) and with Mixup set labels. Losses know metrics and
relations, never datasets.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from idml.checks import value_checks_enabled
from idml.embeddings import Embeddings
from idml.losses.registry import LossContext, LossParams
from idml.metrics import EuclideanDistance, IntrospectiveMetric, Metric
from idml.miners import (
    Miner,
    PairIndices,
    TripletIndices,
    all_pairs,
    all_triplets,
    as_pairs,
    as_triplets,
)
from idml.relations import LabelSets, pair_masks


class MetricLoss(nn.Module):
    """A loss over a batch of embeddings and their label sets.

    Subclasses implement :meth:`compute` on validated inputs. ``forward`` accepts a plain ``(B, d)``
    tensor or an :class:`Embeddings` (semantic + uncertainty), and integer labels ``(B,)`` or
    :class:`LabelSets`.
    """

    params: ClassVar[type[LossParams]] = LossParams
    """The loss's hyper-parameters (defaults and bounds); the constructor's defaults come from it."""
    default_metric: ClassVar[Callable[[], Metric]] = EuclideanDistance
    """The natural metric, used when none is given (and by a run's ``build``, which wraps it in ISM)."""
    probabilistic: ClassVar[bool] = False
    """The loss models each image as a distribution itself (PEL): its input's uncertainty is the
    PEL head's log-variance, and ISM does not apply."""
    miner: Miner | None = None
    """The loss's miner; ``None`` sums over every pair or triplet of the batch."""
    repr_fields: ClassVar[tuple[str, ...]] = ()
    """The attributes :meth:`extra_repr` shows as ``name=value`` (its hyper-parameters)."""

    def __init__(self, metric: Metric | None = None) -> None:
        super().__init__()
        self.metric = metric if metric is not None else type(self).default_metric()

    def extra_repr(self) -> str:
        return ", ".join(f"{name}={getattr(self, name)!r}" for name in self.repr_fields)

    @classmethod
    def from_params(cls, params: Any, context: LossContext) -> MetricLoss:
        """The loss with hyper-parameters ``params`` (a ``cls.params``) in ``context``.

        The default passes the metric and every field of ``params`` to the constructor; a loss
        whose constructor takes other arguments (a miner built from some fields, ``num_classes``)
        overrides it.
        """
        return cls(context.metric, **params.model_dump())

    def forward(self, embeddings: Tensor | Embeddings, labels: Tensor | LabelSets) -> Tensor:
        emb = Embeddings.coerce(embeddings)
        sets = LabelSets.coerce(labels)
        if len(sets) != len(emb):
            raise ValueError(
                f"labels has {len(sets)} entries but embeddings has {len(emb)} rows; "
                "pass exactly one label (set) per embedding"
            )
        sets = sets.to(emb.semantic.device)
        loss = self.compute(emb, sets)
        if value_checks_enabled() and not bool(torch.isfinite(loss).all()):
            raise FloatingPointError(
                f"{type(self).__name__} produced a non-finite loss ({loss.item()}); "
                "lower the learning rate or check the inputs"
            )
        return loss

    def compute(self, embeddings: Embeddings, labels: LabelSets) -> Tensor:
        raise NotImplementedError

    def pairwise(self, embeddings: Embeddings) -> Tensor:
        """The configured metric over all pairs of the batch (uncertainty used when present)."""
        return self.metric(embeddings.semantic, ux=embeddings.uncertainty)

    def mined_pairs(self, matrix: Tensor, labels: LabelSets, dim: int) -> PairIndices:
        """The pairs the loss sums over: every positive and negative pair without a miner, else
        the miner's selection on ``matrix`` (a mined triplet ``(a, p, n)`` gives ``(a, p)`` and
        ``(a, n)``). ``dim`` is the embedding dimension, which some miners need."""
        if self.miner is None:
            return all_pairs(labels)
        return as_pairs(self.miner(matrix, labels, similarity=self.metric.is_similarity, dim=dim))

    def mined_triplets(
        self, matrix: Tensor, labels: LabelSets, dim: int, similarity: bool | None = None
    ) -> TripletIndices:
        """The triplets the loss sums over: every valid triplet without a miner, else the miner's
        selection on ``matrix`` (mined pairs give every ``(a, p, n)`` with both pairs mined).

        ``similarity`` says how ``matrix`` is oriented when it is not the metric's own matrix (a
        loss that mines on distances derived from a similarity passes ``False``)."""
        if self.miner is None:
            return all_triplets(labels)
        if similarity is None:
            similarity = self.metric.is_similarity
        mined = self.miner(matrix, labels, similarity=similarity, dim=dim)
        return as_triplets(mined, len(labels))

    @torch.no_grad()
    def weakening(
        self, embeddings: Embeddings, labels: LabelSets
    ) -> tuple[Tensor, Tensor, Tensor] | None:
        """ISM's weakening factor of the relations this loss compares, with their masks.

        Returns ``(factors, positive, negative)``: the factor of every pair of the batch (self
        pairs excluded from both masks), or ``None`` when the metric is not introspective or the
        batch carries no uncertainty. Proxy losses compare samples with proxies instead.
        """
        if not isinstance(self.metric, IntrospectiveMetric) or embeddings.uncertainty is None:
            return None
        factors = self.metric.weakening(embeddings)
        positive, negative = pair_masks(labels.to(factors.device))
        return factors, positive, negative


class ProxyLoss(MetricLoss):
    """A loss against one learnable proxy per class.

    Args:
        num_classes: number of training classes ``C`` (labels must lie in ``0..C-1``).
        embedding_dim: dimension ``d`` of the semantic embedding.
        metric: the pluggable metric (ISM compares samples to proxies too).
        proxy_uncertainty_dim: when set, each proxy gets a learnable uncertainty vector of this size
            (initialised at zero); by default proxies have zero uncertainty, as in the official code.
    """

    repr_fields: ClassVar[tuple[str, ...]] = ("num_classes", "embedding_dim")

    def __init__(
        self,
        num_classes: int,
        embedding_dim: int,
        metric: Metric | None = None,
        proxy_uncertainty_dim: int | None = None,
    ) -> None:
        super().__init__(metric)
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        if embedding_dim < 1:
            raise ValueError(f"embedding_dim must be >= 1, got {embedding_dim}")
        self.num_classes = num_classes
        self.embedding_dim = embedding_dim
        self.proxies = nn.Parameter(torch.empty(num_classes, embedding_dim))
        self.reset_proxies()
        self.proxy_uncertainty: nn.Parameter | None = None
        if proxy_uncertainty_dim is not None:
            self.proxy_uncertainty = nn.Parameter(torch.zeros(num_classes, proxy_uncertainty_dim))

    @classmethod
    def from_params(cls, params: Any, context: LossContext) -> MetricLoss:
        """The proxy loss sized by ``context`` (classes, dimension, proxy uncertainty)."""
        return cls(
            context.num_classes,
            context.embedding_dim,
            context.metric,
            proxy_uncertainty_dim=context.proxy_uncertainty_dim,
            **params.model_dump(),
        )

    def reset_proxies(self) -> None:
        nn.init.kaiming_normal_(self.proxies, mode="fan_out")

    def forward(self, embeddings: Tensor | Embeddings, labels: Tensor | LabelSets) -> Tensor:
        emb = Embeddings.coerce(embeddings)
        if emb.dim != self.embedding_dim:
            raise ValueError(
                f"embeddings have dimension {emb.dim} but {type(self).__name__} was built with "
                f"embedding_dim={self.embedding_dim}"
            )
        if (
            self.proxy_uncertainty is not None
            and emb.uncertainty is not None
            and emb.uncertainty.shape[1] != self.proxy_uncertainty.shape[1]
        ):
            raise ValueError(
                f"uncertainty has dimension {emb.uncertainty.shape[1]} but the proxies' learnable "
                f"uncertainty has {self.proxy_uncertainty.shape[1]}; set proxy_uncertainty_dim to "
                "the uncertainty head's output size"
            )
        sets = LabelSets.coerce(labels)
        if value_checks_enabled() and sets.max_label() >= self.num_classes:
            raise ValueError(
                f"labels: label {sets.max_label()} is out of range for {self.num_classes} proxies; "
                "labels must lie in 0..num_classes-1"
            )
        return super().forward(emb, sets)

    @torch.no_grad()
    def weakening(
        self, embeddings: Embeddings, labels: LabelSets
    ) -> tuple[Tensor, Tensor, Tensor] | None:
        """ISM's weakening factor between each sample and each proxy, with the sample–proxy masks
        (positive: a proxy of one of the sample's labels)."""
        if not isinstance(self.metric, IntrospectiveMetric) or embeddings.uncertainty is None:
            return None
        factors = self.metric.weakening(
            embeddings, Embeddings(self.proxies, self.proxy_uncertainty)
        )
        positive = labels.to(factors.device).proxy_mask(self.num_classes)
        return factors, positive, ~positive

    def proxy_matrix(self, embeddings: Embeddings) -> Tensor:
        """``(B, C)`` metric values between samples and proxies."""
        return self.metric(
            embeddings.semantic, self.proxies, embeddings.uncertainty, self.proxy_uncertainty
        )


def masked_logsumexp(values: Tensor, mask: Tensor, dim: int, add_one: bool = False) -> Tensor:
    """``log Σ_{mask} exp(values)`` (``log(1 + Σ ...)`` with ``add_one``); empty sums give ``-inf``/0."""
    values = values.masked_fill(~mask, float("-inf"))
    if add_one:
        zeros = values.new_zeros((*values.shape[:dim], 1, *values.shape[dim + 1 :]))
        values = torch.cat([values, zeros], dim=dim)
    return torch.logsumexp(values, dim=dim)


def check_positive(name: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a positive finite number, got {value}")
