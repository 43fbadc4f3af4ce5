"""Building blocks of the run schema (:mod:`idml.app.config`): the base :class:`Section`,
:class:`ConfigError`, :func:`choices` (a config key's ``Literal`` from a library's list), the
bounded number types :data:`UnitInterval` / :data:`OpenUnitInterval` and the ``loss`` section, generated from the loss registry :data:`idml.losses.LOSSES`.

Each registered loss gets a config model (:func:`loss_section`): its hyper-parameter model with
``name`` first. The ``loss`` key is validated as the discriminated union of the models of the
losses registered *at validation time*, so a loss registered after this module was imported
(README, "Extending idml") is a valid ``loss.name`` too.

It also holds :class:`PublishedNumbers`, the numbers a source reports for a recipe.
"""

from __future__ import annotations

import enum
import re
import typing
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializeAsAny,
    TypeAdapter,
    WrapValidator,
    create_model,
    model_validator,
)

from idml.losses import LOSSES, LossParams, LossSpec


def choices(values: Iterable[Any]) -> Any:
    """The ``Literal`` of a library's list of choices (an enum's values, a mapping's keys), so a
    config key accepts exactly what the library knows and says so when it does not.

    >>> from idml.augment import MixupMode
    >>> choices(MixupMode)
    typing.Literal['set', 'interpolate']
    """
    return Literal[tuple(v.value if isinstance(v, enum.Enum) else v for v in values)]


class ConfigError(ValueError):
    """A configuration problem, with the offending key and what to do about it."""


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


UnitInterval = Annotated[float, Field(ge=0, le=1)]
"""A number in ``[0, 1]``: a probability, or a share of a batch."""
OpenUnitInterval = Annotated[float, Field(gt=0, lt=1)]
"""A share strictly between 0 and 1."""


# --------------------------------------------------------------------------- losses
class LossSection(Section):
    """Base of the ``loss`` section: ``name`` picks a loss of :data:`idml.losses.LOSSES`, whose
    hyper-parameter model supplies the other keys (:func:`loss_section`)."""

    name: str

    @property
    def spec(self) -> LossSpec:
        """The registry entry of this loss."""
        return LOSSES[self.name]

    @property
    def probabilistic(self) -> bool:
        """The loss models uncertainty itself (PEL): the PEL head, no ISM."""
        return self.spec.probabilistic


DEFAULT_LOSS = "proxy_anchor"
_LOSS_SECTIONS: dict[tuple[str, type[LossParams]], type[LossSection]] = {}


def loss_section(name: str) -> type[LossSection]:
    """The config model of ``loss: {name: <name>, ...}``: the registered loss's hyper-parameter
    model (fields, defaults, bounds and validators) with ``name`` first.

    >>> loss_section("proxy_anchor")(name="proxy_anchor")
    ProxyAnchorConfig(name='proxy_anchor', alpha=32.0, margin=0.1)
    """
    spec = LOSSES[name]
    key = (name, spec.params)
    if key not in _LOSS_SECTIONS:
        title = spec.params.__name__.removesuffix("Params") + "Config"
        section = create_model(
            title,
            __base__=(spec.params, LossSection),
            __module__=__name__,
            name=(Literal[name], ...),  # type: ignore[valid-type]
        )
        section.__doc__ = spec.params.__doc__
        globals().setdefault(title, section)  # importable by name, so a config pickles
        _LOSS_SECTIONS[key] = section
    return _LOSS_SECTIONS[key]


class _LossSections(Mapping[str, type[LossSection]]):
    """Loss name → its config model, following the loss registry (a loss registered after this
    module was imported is a valid ``loss.name`` too)."""

    def __getitem__(self, name: str) -> type[LossSection]:
        return loss_section(name)

    def __iter__(self) -> typing.Iterator[str]:
        return iter(LOSSES)

    def __len__(self) -> int:
        return len(LOSSES)


LOSS_CONFIGS: Mapping[str, type[LossSection]] = _LossSections()
_LOSS_UNIONS: dict[tuple[type[LossSection], ...], TypeAdapter[Any]] = {}


def _validate_loss(value: Any, handler: Any) -> LossSection:
    """The ``loss`` section as the discriminated union of the registered losses' models."""
    members = tuple(LOSS_CONFIGS.values())
    if members not in _LOSS_UNIONS:
        union = typing.Union[members]  # noqa: UP007 (a runtime tuple of models)
        _LOSS_UNIONS[members] = TypeAdapter(Annotated[union, Field(discriminator="name")])
    return _LOSS_UNIONS[members].validate_python(value)


LossConfig = Annotated[SerializeAsAny[LossSection], WrapValidator(_validate_loss)]
"""Any registered loss's section, chosen by ``name`` (an unknown name lists the valid ones)."""


# --------------------------------------------------------------------------- published numbers
PUBLISHED_METRIC = re.compile(r"^(recall@[1-9]\d*|nmi|map@r|r_precision|map|mrr|top[1-9]\d*)$")


class PublishedNumbers(Section):
    """Numbers a source reports for a recipe, in % as printed, and where they are printed."""

    source: str = Field(min_length=1, description="paper, table and row the numbers come from")
    metrics: dict[str, float] = Field(
        description="metric name (as idml evaluates it) -> value in %"
    )
    recipe: dict[str, Any] = Field(
        default_factory=dict,
        description="dotted config key -> the source's value (dataset, backbone, embedding size, "
        "schedule): the numbers are compared with a run only when it keeps them (empty: not "
        "recorded, so not checked)",
    )
    classes: int | None = Field(
        None, ge=1, description="training classes of the source's dataset (checked when known)"
    )

    @model_validator(mode="before")
    @classmethod
    def _bare_metrics(cls, raw: Any) -> Any:
        # Run folders written before ``source`` existed hold the bare metric mapping.
        if isinstance(raw, dict) and raw and not {"source", "metrics"} & set(raw):
            return {"source": "unspecified", "metrics": raw}
        return raw

    @model_validator(mode="after")
    def _known_metrics(self) -> PublishedNumbers:
        for key, value in self.metrics.items():
            if not PUBLISHED_METRIC.match(key):
                raise ValueError(
                    f"published.metrics: unknown metric {key!r}; use recall@K, nmi, map@r, "
                    "r_precision, map, mrr or (classification) topK"
                )
            if not 0.0 <= value <= 100.0:
                raise ValueError(f"published.metrics.{key}={value} is not a percentage in [0, 100]")
        return self
