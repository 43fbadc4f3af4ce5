"""The typed choice names of the models: :class:`ChoiceEnum` and the backbone families."""

from __future__ import annotations

import enum


class ChoiceEnum(str, enum.Enum):
    """A string enum whose unknown values raise a ``ValueError`` listing the valid choices."""

    @classmethod
    def _missing_(cls, value: object) -> ChoiceEnum | None:
        choices = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"{value!r} is not a valid {cls.__name__}; choose one of {choices}")


class BackboneName(ChoiceEnum):
    """The registered backbone families (``model.backbone``)."""

    RESNET18 = "resnet18"
    RESNET50 = "resnet50"
    RESNET101 = "resnet101"
    GOOGLENET = "googlenet"
    EFFICIENTNET_LITE0 = "efficientnet_lite0"
    SMALL_CNN = "small_cnn"
    TIMM = "timm"
    """Any timm model, spelled ``timm:<model name>``."""
