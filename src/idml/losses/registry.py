"""The registry of losses: one :class:`LossSpec` per loss name, the one list a run config reads.

A loss declares everything a run needs to know about it next to its class: its hyper-parameters
once, as a :class:`LossParams` model with defaults and bounds (the class's ``params``; its
constructor takes its defaults from there), its natural metric (``default_metric``), whether it
models uncertainty itself (``probabilistic``) and, when its constructor's arguments are not just
its hyper-parameters, how to build it from them (:meth:`~idml.losses.MetricLoss.from_params`).
:func:`register_loss` adds it under a name; ``idml.app.config`` builds the ``loss:`` section of a run
from :data:`LOSSES`, so a registered loss is a valid ``loss.name`` with its keys checked.

Example:
    >>> from idml.losses import LOSSES
    >>> spec = LOSSES["proxy_anchor"]
    >>> spec.params(), spec.needs_proxies, spec.probabilistic
    (ProxyAnchorParams(alpha=32.0, margin=0.1), True, False)
    >>> type(spec.natural_metric()).__name__
    'CosineSimilarity'
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

from idml.metrics import Metric

if TYPE_CHECKING:
    from idml.losses.base import MetricLoss


class LossParams(BaseModel):
    """A loss's hyper-parameters as a config writes them: typed, bounded, unknown keys rejected.

    Subclass it next to the loss and set the loss class's ``params`` to it. Its field names are the
    keyword arguments of the loss's :meth:`~idml.losses.MetricLoss.from_params` (by default, of its
    constructor); a run config spells them ``loss.<field>``.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


@dataclass(frozen=True)
class LossContext:
    """What a run knows when it builds a loss, beyond the loss's hyper-parameters."""

    num_classes: int
    """Training classes (one proxy each for a proxy loss)."""
    embedding_dim: int
    """Dimension of the semantic embedding."""
    metric: Metric | None = None
    """The metric to train with (``None``: the loss's natural metric)."""
    proxy_uncertainty_dim: int | None = None
    """Size of the proxies' learnable uncertainty (``None``: proxies have none)."""


@dataclass(frozen=True)
class LossSpec:
    """A registered loss: its name, class and hyper-parameter model."""

    name: str
    loss: type[MetricLoss]
    params: type[LossParams]

    @property
    def probabilistic(self) -> bool:
        """The loss models each image as a distribution itself (PEL): the model gets the PEL
        head, its uncertainty always reaches the loss, and ISM does not apply."""
        return self.loss.probabilistic

    @property
    def needs_proxies(self) -> bool:
        """The loss learns one proxy per class (and needs ``num_classes``)."""
        from idml.losses.base import ProxyLoss

        return issubclass(self.loss, ProxyLoss)

    def natural_metric(self) -> Metric:
        """A new instance of the metric the loss is written for (``default_metric``)."""
        return self.loss.default_metric()

    def build(self, params: BaseModel | Mapping[str, Any], context: LossContext) -> MetricLoss:
        """The loss with these hyper-parameters (a params model, a config section that extends
        it, or a mapping of its fields) in ``context``."""
        if isinstance(params, BaseModel):
            values = {name: getattr(params, name) for name in self.params.model_fields}
        else:
            values = dict(params)
        return self.loss.from_params(self.params.model_validate(values), context)


_LOSSES: dict[str, LossSpec] = {}
LOSSES: Mapping[str, LossSpec] = MappingProxyType(_LOSSES)
"""Every registered loss by name, in registration order (read-only; see :func:`register_loss`)."""


def register_loss(
    name: str, loss: type[MetricLoss], params: type[LossParams] | None = None
) -> LossSpec:
    """Register ``loss`` as ``name`` (its hyper-parameters: ``params``, default ``loss.params``).

    Raises:
        ValueError: if ``name`` is taken by another class, is not an identifier, or the params model
            has a ``name`` field (a config's ``loss.name`` selects the loss).
    """
    params = params if params is not None else loss.params
    if not name.isidentifier():
        raise ValueError(f"loss name {name!r} must be an identifier (letters, digits, _)")
    if not (isinstance(params, type) and issubclass(params, LossParams)):
        raise ValueError(f"{loss.__name__}: params must be a LossParams model, got {params!r}")
    if "name" in params.model_fields:
        raise ValueError(f"{params.__name__}: 'name' is reserved for the loss's name")
    old = _LOSSES.get(name)
    if old is not None and (old.loss is not loss or old.params is not params):
        raise ValueError(f"loss name {name!r} is taken by {old.loss.__name__}")
    spec = LossSpec(name, loss, params)
    _LOSSES[name] = spec
    return spec
