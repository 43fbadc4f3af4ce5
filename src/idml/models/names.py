"""The typed choice names of the models: the backbone families."""

from __future__ import annotations

from idml.choices import ChoiceEnum


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
