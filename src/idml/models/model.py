"""The embedding network: backbone → global pooling → semantic head (+ uncertainty head).

The heads live in :mod:`idml.models.heads` (re-exported here); :class:`UncertaintyHeadSpec` says
which uncertainty head a model carries and builds it.

For an image ``x`` with pooled backbone features ``f = pool(F(x))`` (IDML and SSR both put their
heads on the pooled features of one backbone):

- semantic embedding ``s = W_s f + b_s``, returned L2-normalised, ``ŝ = s / ||s||``;
- uncertainty embedding ``u`` from the *same* pooled features. By default a bounded level times a
  learned direction, ``u = u_max·σ(w·n(f) + c)·normalize(W_u f + b_u)`` with ``n(f)`` the features
  standardised over the batch (:class:`BoundedUncertaintyHead`, whose docstring gives the reasons:
  the paper's unbounded layer saturates ISM from the first step, and a level that reads ``f̂``
  cannot follow the image).
  The paper's form, ``u = act(W_u f + b_u)``, is ``UncertaintyHeadSpec(form='linear')`` (IDML
  paper §III-C: "two randomly initialised fully connected layers"; Wang et al. 2022, Sec. III-C writes
  ``y_IN = f(x) = {s, u}``). The paper's default is a plain linear head — ``u`` not normalised, no
  activation — so that ``||u||`` is learned. Options: a ReLU/softplus activation, or L2-normalising
  ``u`` as the authors' released code does. **Normalising starves the head:** the released code only
  compares images with zero-uncertainty proxies, where ``β = ||u_i + 0|| = ||u_i|| ≡ 1``, so the
  loss is constant in ``u`` and the head receives exactly zero gradient;
- PEL head (Oh et al. 2019, "HIB"): ``μ`` (the semantic head, normalised) and ``log σ²`` (a linear
  head, not normalised), packed as ``Embeddings(semantic=μ, uncertainty=log σ²)`` for the PEL loss.

Pooling: ``GAP(F) = mean_{h,w} F``, ``GMP(F) = max_{h,w} F`` or their sum (default, as in
the ProxyAnchor code of Kim et al. 2020 that IDML builds on). BatchNorm is frozen by default: running
statistics always (the layers stay in eval mode under ``model.train()``), affine parameters optionally.

Inputs are float images in ``[0, 1]``; the model normalises them itself with buffers, so a saved state
dict is a self-contained model. One-channel images are repeated to three channels for RGB backbones.

Example:
    >>> import torch
    >>> model = build_model("small_cnn", pretrained=False, embedding_dim=16, uncertainty=True)
    >>> emb = model(torch.rand(4, 1, 8, 8))
    >>> emb.semantic.shape, emb.uncertainty.shape
    (torch.Size([4, 16]), torch.Size([4, 16]))
    >>> torch.allclose(emb.semantic.norm(dim=1), torch.ones(4))
    True
    >>> model.features(torch.rand(4, 1, 8, 8)).shape == (4, model.feature_dim)
    True
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from idml.embeddings import Embeddings
from idml.images import check_images
from idml.models.backbones import (
    Backbone,
    BackboneName,
    BackboneSpec,
    build_backbone,
)
from idml.models.heads import (
    DEFAULT_UNCERTAINTY_INIT_LEVEL,
    DEFAULT_UNCERTAINTY_MAX_NORM,
    PEL_INITIAL_NOISE_NORM,
    POOLING_NAMES,
    BoundedUncertaintyHead,
    LevelInput,
    LogVarianceHead,
    Pooling,
    SemanticHead,
    UncertaintyActivation,
    UncertaintyForm,
    UncertaintyHead,
    UncertaintyHeadSpec,
    UncertaintyHeadSpecError,
    UncertaintyKind,
    global_pool,
    uncertainty_level,
)

__all__ = [
    "DEFAULT_UNCERTAINTY_INIT_LEVEL",
    "DEFAULT_UNCERTAINTY_MAX_NORM",
    "PEL_INITIAL_NOISE_NORM",
    "POOLING_NAMES",
    "BoundedUncertaintyHead",
    "EmbeddingModel",
    "LevelInput",
    "LogVarianceHead",
    "Pooling",
    "SemanticHead",
    "UncertaintyActivation",
    "UncertaintyForm",
    "UncertaintyHead",
    "UncertaintyHeadSpec",
    "UncertaintyHeadSpecError",
    "UncertaintyKind",
    "build_model",
    "global_pool",
    "uncertainty_level",
    "upgrade_build_config",
]


class EmbeddingModel(nn.Module):
    """Backbone + pooling + heads: ``[0, 1]`` images → :class:`~idml.embeddings.Embeddings`.

    Args:
        backbone: a :class:`~idml.models.backbones.Backbone` (its normalisation becomes buffers here).
        embedding_dim: ``d`` of the semantic embedding [512].
        uncertainty: the second head, see :class:`UncertaintyHeadSpec` [none].
        pooling: :class:`Pooling` [sum].
        freeze_bn: keep every backbone BatchNorm in eval mode (running statistics never update).
        freeze_bn_affine: also freeze BatchNorm's ``γ, β`` (``requires_grad=False``; they are then
            left out of :meth:`backbone_parameters`). The authors' code freezes both.
        validate_inputs: check that images are floats in ``[0, 1]`` (one reduction per batch).
    """

    input_mean: Tensor
    """``(1, C, 1, 1)`` the backbone's input mean (a buffer)."""
    input_std: Tensor
    """``(1, C, 1, 1)`` the backbone's input standard deviation (a buffer)."""

    def __init__(
        self,
        backbone: Backbone,
        embedding_dim: int = 512,
        uncertainty: UncertaintyHeadSpec | None = None,
        pooling: Pooling | str = Pooling.SUM,
        freeze_bn: bool = True,
        freeze_bn_affine: bool = False,
        validate_inputs: bool = True,
    ) -> None:
        super().__init__()
        if embedding_dim < 1:
            raise ValueError(f"embedding_dim must be >= 1, got {embedding_dim}")
        if freeze_bn_affine and not freeze_bn:
            raise ValueError(
                "freeze_bn_affine=True needs freeze_bn=True (affine parameters are frozen on top of "
                "the running statistics)"
            )
        if uncertainty is not None and not isinstance(uncertainty, UncertaintyHeadSpec):
            raise TypeError(
                f"uncertainty must be an UncertaintyHeadSpec or None, got {uncertainty!r} "
                "(UncertaintyHeadSpec.parse reads build_model's True, 'ism' and 'pel')"
            )
        self.uncertainty_kind = UncertaintyKind.NONE if uncertainty is None else uncertainty.kind
        self.uncertainty_backbone_gradient = uncertainty is None or uncertainty.backbone_gradient
        """Whether the uncertainty head's gradient reaches the backbone
        (:attr:`UncertaintyHeadSpec.backbone_gradient`)."""
        self.pooling = Pooling(pooling)
        self.backbone = backbone
        self.freeze_bn = freeze_bn
        self.freeze_bn_affine = freeze_bn_affine
        self.validate_inputs = validate_inputs
        channels = backbone.in_channels
        self.register_buffer("input_mean", torch.tensor(backbone.mean).view(1, channels, 1, 1))
        self.register_buffer("input_std", torch.tensor(backbone.std).view(1, channels, 1, 1))
        self.semantic_head = SemanticHead(backbone.feature_dim, embedding_dim)
        self.uncertainty_head: nn.Module | None = None
        if uncertainty is not None:
            self.uncertainty_head = uncertainty.build(backbone.feature_dim, embedding_dim)
        if freeze_bn_affine:
            for bn in self._batchnorms():
                for p in bn.parameters(recurse=False):
                    p.requires_grad_(False)
        self.build_config: dict[str, Any] = {}
        """Keyword arguments of :func:`build_model` that made this model (empty when built directly)."""
        self.train()

    # ----------------------------------------------------------------- sizes
    @property
    def feature_dim(self) -> int:
        """Size of the pooled backbone features (input of every head, and of SSR's ranking head)."""
        return self.backbone.feature_dim

    @property
    def embedding_dim(self) -> int:
        return self.semantic_head.linear.out_features

    @property
    def uncertainty_dim(self) -> int | None:
        """``d_u``, or ``None`` without an uncertainty head."""
        if self.uncertainty_head is None:
            return None
        linear = getattr(self.uncertainty_head, "linear", None)
        assert isinstance(linear, nn.Linear)  # the ISM and PEL heads both end in one
        return linear.out_features

    # ----------------------------------------------------------------- forward
    def normalize_images(self, images: Tensor) -> Tensor:
        """Validate ``[0, 1]`` images, repeat grayscale to RGB if needed, apply ``(x − mean) / std``."""
        channels = self.backbone.in_channels
        if self.validate_inputs:
            check_images(images)
        elif images.dim() != 4:
            raise ValueError(
                f"images must have shape (batch, channels, height, width), got {tuple(images.shape)}"
            )
        if images.shape[1] != channels:
            if images.shape[1] == 1:
                images = images.expand(-1, channels, -1, -1)
            else:
                raise ValueError(
                    f"images have {images.shape[1]} channels but backbone {self.backbone.spec} takes "
                    f"{channels}; build the model with in_channels={images.shape[1]}"
                )
        return (images - self.input_mean) / self.input_std

    def features(self, images: Tensor) -> Tensor:
        """Pooled backbone features ``(B, feature_dim)`` of ``[0, 1]`` images."""
        return global_pool(self.backbone(self.normalize_images(images)), self.pooling)

    def embed(self, features: Tensor) -> Embeddings:
        """Heads only: pooled features ``(B, feature_dim)`` → embeddings."""
        if features.dim() != 2 or features.shape[1] != self.feature_dim:
            raise ValueError(
                f"features must have shape (batch, {self.feature_dim}), got {tuple(features.shape)}"
            )
        semantic = self.semantic_head(features)
        uncertainty = None
        if self.uncertainty_head is not None:
            head_input = features if self.uncertainty_backbone_gradient else features.detach()
            uncertainty = self.uncertainty_head(head_input)
        return Embeddings(semantic, uncertainty)

    def forward(self, images: Tensor) -> Embeddings:
        """``[0, 1]`` images ``(B, C, H, W)`` → normalised semantic (+ uncertainty) embeddings."""
        return self.embed(self.features(images))

    def uncertainty_level(self, embeddings: Embeddings) -> Tensor:
        """Per-image uncertainty level for this model's head, see :func:`uncertainty_level`."""
        return uncertainty_level(embeddings, self.uncertainty_kind)

    # ----------------------------------------------------------------- training state
    def _batchnorms(self) -> Iterator[_BatchNorm]:
        return (m for m in self.backbone.modules() if isinstance(m, _BatchNorm))

    def train(self, mode: bool = True) -> EmbeddingModel:
        """Set train/eval mode; frozen BatchNorm layers stay in eval mode either way."""
        super().train(mode)
        if self.freeze_bn:
            for bn in self._batchnorms():
                bn.eval()
        return self

    def backbone_parameters(self) -> Iterator[nn.Parameter]:
        """Trainable backbone parameters (frozen BatchNorm affine parameters excluded)."""
        frozen = {id(p) for bn in self._batchnorms() for p in bn.parameters(recurse=False)}
        for p in self.backbone.parameters():
            if not (self.freeze_bn_affine and id(p) in frozen):
                yield p

    def head_parameters(self) -> Iterator[nn.Parameter]:
        """Parameters of the semantic and uncertainty heads (trained at the head learning rate)."""
        yield from self.semantic_head.parameters()
        yield from self.uncertainty_head_parameters()

    def uncertainty_head_parameters(self) -> Iterator[nn.Parameter]:
        """Parameters of the uncertainty head (none without one)."""
        if self.uncertainty_head is not None:
            yield from self.uncertainty_head.parameters()


def build_model(
    backbone: str | BackboneName | BackboneSpec = BackboneName.RESNET50,
    pretrained: bool | str | Path = True,
    embedding_dim: int = 512,
    uncertainty: bool
    | str
    | UncertaintyKind
    | UncertaintyHeadSpec
    | Mapping[str, Any]
    | None = False,
    pooling: Pooling | str = Pooling.SUM,
    freeze_bn: bool | None = None,
    freeze_bn_affine: bool = False,
    in_channels: int = 3,
    download: bool = False,
) -> EmbeddingModel:
    """Build an :class:`EmbeddingModel` from config-like keyword arguments (the ``model.*`` keys).

    Args:
        backbone: ``resnet18|resnet50|resnet101|googlenet|efficientnet_lite0|small_cnn`` or
            ``timm:<name>`` [resnet50].
        pretrained: ``True`` (ImageNet weights from the framework cache; never downloaded unless
            ``download``), ``False``, or a weights file path.
        embedding_dim: ``d`` [512].
        uncertainty: the uncertainty head: ``False``/``"none"``/``None`` (none), ``True``/``"ism"``
            (IDML's ``u``, the default bounded head) or ``"pel"``, or any other as an
            :class:`UncertaintyHeadSpec` (or its :meth:`~UncertaintyHeadSpec.to_dict`), e.g.
            ``UncertaintyHeadSpec(dim=128, form="linear")``.
        pooling: ``gap`` | ``gmp`` | ``sum`` (``avg``/``max`` accepted as aliases) [sum].
        freeze_bn: freeze BatchNorm running statistics; ``None`` = freeze iff pretrained.
        freeze_bn_affine: also freeze BatchNorm ``γ, β``.
        in_channels: 3, or 1 for ``small_cnn``/timm on grayscale data (RGB backbones repeat 1 → 3).
        download: allow downloading missing pretrained weights.

    The model's :attr:`~EmbeddingModel.build_config` holds these arguments in JSON form (the head
    as its :meth:`~UncertaintyHeadSpec.to_dict`), so that ``build_model(**config)`` builds the same
    model again; one stored by an older version goes through :func:`upgrade_build_config` first.
    """
    head = UncertaintyHeadSpec.parse(uncertainty)
    spec = BackboneSpec.parse(backbone)
    module = build_backbone(spec, pretrained=pretrained, download=download, in_channels=in_channels)
    is_pretrained = pretrained is not False
    if freeze_bn is None:
        freeze_bn = is_pretrained
    elif freeze_bn and not is_pretrained:
        warnings.warn(
            f"freeze_bn=True with a randomly initialised {spec} keeps BatchNorm at its initial "
            "statistics (mean 0, variance 1); set freeze_bn=False to train from scratch",
            stacklevel=2,
        )
    model = EmbeddingModel(
        module,
        embedding_dim=embedding_dim,
        uncertainty=head,
        pooling=pooling,
        freeze_bn=freeze_bn,
        freeze_bn_affine=freeze_bn_affine,
    )
    model.build_config = {
        "backbone": str(spec),
        "pretrained": pretrained if isinstance(pretrained, bool) else str(pretrained),
        "embedding_dim": embedding_dim,
        "uncertainty": None if head is None else head.to_dict(),
        "pooling": Pooling(pooling).value,
        "freeze_bn": freeze_bn,
        "freeze_bn_affine": freeze_bn_affine,
        "in_channels": in_channels,
    }
    return model


_FLAT_HEAD_KEYS = {
    "uncertainty_dim": "dim",
    "uncertainty_form": "form",
    "uncertainty_max_norm": "max_norm",
    "uncertainty_init_level": "init_level",
    "uncertainty_activation": "activation",
    "uncertainty_normalize": "normalize",
    "uncertainty_init_std": "init_std",
}
"""The ``build_config`` keys of the uncertainty head before :class:`UncertaintyHeadSpec`, each with
the spec field it became."""


def upgrade_build_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A stored :attr:`EmbeddingModel.build_config` as :func:`build_model` takes it today.

    Models built before :class:`UncertaintyHeadSpec` stored their head as flat ``uncertainty_*``
    keys beside ``uncertainty`` (the kind); they become one ``uncertainty`` spec dict (``None``
    without a head, whatever the flat keys said). The oldest have no ``uncertainty_form``: their
    head was the paper's linear layer, from before the bounded head became the default, so they
    keep it. A bounded head stored without ``level_input`` (flat, or a spec dict from before that
    field) read the unit feature direction, and its weights hold no standardisation statistics, so
    it keeps ``level_input="direction"``. A config of today's form comes back as it is.

    Example:
        >>> old = {"backbone": "small_cnn", "embedding_dim": 8, "uncertainty": "ism",
        ...        "uncertainty_dim": 4, "uncertainty_form": "bounded", "uncertainty_max_norm": 2.0}
        >>> new = upgrade_build_config(old)
        >>> new["uncertainty"]["dim"], new["uncertainty"]["max_norm"], sorted(new)
        (4, 2.0, ['backbone', 'embedding_dim', 'uncertainty'])
        >>> new["uncertainty"]["level_input"]
        'direction'
        >>> upgrade_build_config(new) == new
        True
    """
    flat = {field: config[key] for key, field in _FLAT_HEAD_KEYS.items() if key in config}
    if not flat:
        stored = config.get("uncertainty")
        if (
            isinstance(stored, Mapping)
            and stored.get("form") == UncertaintyForm.BOUNDED.value
            and "level_input" not in stored
        ):
            return {**config, "uncertainty": {**stored, "level_input": "direction"}}
        return dict(config)
    upgraded = {key: value for key, value in config.items() if key not in _FLAT_HEAD_KEYS}
    head = UncertaintyHeadSpec.parse(config.get("uncertainty", False))
    if head is not None:
        head = dataclasses.replace(head, **{"form": UncertaintyForm.LINEAR, **flat})
        if head.form is UncertaintyForm.BOUNDED:
            head = dataclasses.replace(head, level_input=LevelInput.DIRECTION)
    upgraded["uncertainty"] = None if head is None else head.to_dict()
    return upgraded
