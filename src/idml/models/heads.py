"""The heads of :class:`~idml.models.model.EmbeddingModel` and what they are built from: global
pooling of the backbone's feature map, the semantic head, the uncertainty heads (plain linear,
bounded, PEL's ``log σ²``) with :class:`UncertaintyHeadSpec`, the description that builds one, and
the uncertainty level ``||u||``."""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from idml.choices import ChoiceEnum, EnumField
from idml.embeddings import Embeddings
from idml.metrics import unit_rows


class Pooling(ChoiceEnum):
    """Global pooling of the backbone's last feature map: GAP, GMP or their sum."""

    GAP = "gap"
    """Global average pooling, ``mean_{h,w} F``."""
    GMP = "gmp"
    """Global max pooling, ``max_{h,w} F``."""
    SUM = "sum"
    """``GAP + GMP`` (ProxyAnchor code, Kim et al. 2020; the default)."""

    @classmethod
    def _missing_(cls, value: object) -> Pooling | None:
        # The run config spells the first two "avg" / "max"; accept exactly those aliases.
        alias = POOLING_NAMES.get(value) if isinstance(value, str) else None
        return alias if alias is not None else super()._missing_(value)


POOLING_NAMES: dict[str, Pooling] = {"avg": Pooling.GAP, "max": Pooling.GMP, "sum": Pooling.SUM}
"""The pooling names a run config uses (``model.pooling``), each with its :class:`Pooling`."""


class UncertaintyKind(ChoiceEnum):
    """Which second head the model carries."""

    NONE = "none"
    """Plain DML: semantic embeddings only."""
    ISM = "ism"
    """IDML's uncertainty embedding ``u`` (Wang et al. 2022, Sec. III), consumed by ISM."""
    PEL = "pel"
    """Probabilistic embeddings (Oh et al. 2019): ``log σ²`` of a diagonal Gaussian around ``μ = s``."""


class UncertaintyActivation(ChoiceEnum):
    """Output non-linearity of the ISM uncertainty head (paper default: none)."""

    NONE = "none"
    RELU = "relu"
    SOFTPLUS = "softplus"


def global_pool(feature_map: Tensor, pooling: Pooling) -> Tensor:
    """``(B, C, H, W) → (B, C)`` by GAP, GMP or GAP + GMP."""
    if feature_map.dim() != 4:
        raise ValueError(
            f"feature_map must have shape (batch, channels, height, width), got {tuple(feature_map.shape)}"
        )
    if pooling is Pooling.GAP:
        return feature_map.mean(dim=(2, 3))
    if pooling is Pooling.GMP:
        return feature_map.amax(dim=(2, 3))
    return feature_map.mean(dim=(2, 3)) + feature_map.amax(dim=(2, 3))


class SemanticHead(nn.Module):
    """``ŝ = normalize(W f + b)``; ``W`` kaiming-normal (fan_out), ``b = 0`` as in Kim et al. 2020's code."""

    def __init__(self, feature_dim: int, embedding_dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(feature_dim, embedding_dim)
        nn.init.kaiming_normal_(self.linear.weight, mode="fan_out")
        nn.init.zeros_(self.linear.bias)

    def forward(self, features: Tensor) -> Tensor:
        return unit_rows(self.linear(features))


class UncertaintyHead(nn.Module):
    """``u = act(W f + b)``, optionally L2-normalised (IDML's uncertainty embedding, eq. 4).

    Args:
        feature_dim, uncertainty_dim: input and output sizes.
        activation: none (paper default), ReLU or softplus (non-negative ``u``).
        normalize: L2-normalise ``u`` as the authors' released code does. Then ``||u|| ≡ 1`` and,
            against zero-uncertainty proxies, ``β ≡ 1``: the head gets no gradient at all.
        init_std: ``None`` keeps PyTorch's default ``nn.Linear`` initialisation (the paper's "randomly
            initialised" layer); a number draws ``W ~ N(0, init_std²)`` with ``b = 0``, which sets the
            starting uncertainty level ``||u||`` (large ``||u||`` weakens every pair from the start).
    """

    def __init__(
        self,
        feature_dim: int,
        uncertainty_dim: int,
        activation: UncertaintyActivation = UncertaintyActivation.NONE,
        normalize: bool = False,
        init_std: float | None = None,
    ) -> None:
        super().__init__()
        self.linear = nn.Linear(feature_dim, uncertainty_dim)
        self.activation = UncertaintyActivation(activation)
        self.normalize = normalize
        if init_std is not None:
            if not (init_std >= 0 and math.isfinite(init_std)):
                raise ValueError(
                    f"uncertainty init_std must be a finite number >= 0, got {init_std}"
                )
            nn.init.normal_(self.linear.weight, std=init_std)
            nn.init.zeros_(self.linear.bias)

    def forward(self, features: Tensor) -> Tensor:
        u = self.linear(features)
        if self.activation is UncertaintyActivation.RELU:
            u = F.relu(u)
        elif self.activation is UncertaintyActivation.SOFTPLUS:
            u = F.softplus(u)
        return unit_rows(u) if self.normalize else u

    def extra_repr(self) -> str:
        return f"activation={self.activation.value}, normalize={self.normalize}"


class UncertaintyForm(ChoiceEnum):
    """How the ISM uncertainty head sets the scale of ``u`` (see :class:`BoundedUncertaintyHead`)."""

    BOUNDED = "bounded"
    """``u = u_max·σ(a(f))·ẑ``: a learned level in ``(0, u_max)`` times a learned direction (default)."""
    LINEAR = "linear"
    """``u = act(W f + b)``: the paper's plain linear layer, scale left to the initialisation."""


DEFAULT_UNCERTAINTY_MAX_NORM = 1.0
"""Default bound ``u_max`` of ``||u||``: with ``τ = 5`` a pair at chord ``δ`` keeps
``e^{−y} ≥ exp(−2/(5δ))`` (0.67 at ``δ = 1``, 0.14 at ``δ = 0.2``), so no pair farther apart than a
near-duplicate can be weakened to nothing."""

DEFAULT_UNCERTAINTY_INIT_LEVEL = 0.02
"""Default starting level ``||u||/u_max``: ``β ≤ 0.04`` at the first step, so ``e^{−y} ≥ 0.5`` for
every pair with ``δ ≥ 0.012`` (``γ = 0``, ``τ = 5``): ISM starts as the plain metric."""


class LevelInput(ChoiceEnum):
    """What the level logit of :class:`BoundedUncertaintyHead` reads."""

    STANDARDIZED = "standardized"
    """The pooled features standardised per dimension over the batch (running statistics at test
    time, like BatchNorm without its affine parameters): the default."""
    DIRECTION = "direction"
    """The unit feature direction ``f̂ = f/||f||``: the head before the standardised input became the
    default, kept for the runs trained with it and as the ablation that shows why it changed."""
    STANDARDIZED_RUNNING = "standardized_running"
    """Standardised by the running statistics in training as at test (the running averages are
    still updated from every training batch, with no gradient through them): an image's ``||u||``
    then depends on the image alone, never on the batch it trains in. The batch-statistics
    default lets the level read an image against its batch, and at test, against the running
    averages, the same image can get a very different ``||u||`` (``benchmarks/RESULTS.md``, "The
    ``||u||`` a model reports at test is not the ``||u||`` it trained with")."""


class BoundedUncertaintyHead(nn.Module):
    """The default ISM uncertainty embedding: a bounded level times a learned direction.

    For pooled features ``f``::

        ẑ = (W f + b) / ||W f + b||                 direction   (the paper's linear layer)
        a = w·n(f) + c                              level logit
        u = u_max · σ(a) · ẑ                        so ||u|| = u_max·σ(a) ∈ (0, u_max)

    where ``n(f)`` is ``f`` standardised per dimension, ``(f − E f)/√(Var f + ε)``, with the batch's
    statistics while training and their running averages at test time (BatchNorm without affine
    parameters; ``level_input="standardized_running"`` uses the running averages while training
    too, ``level_input="direction"`` reads ``f̂ = f/||f||`` instead).

    Why a bounded level (IDML, Wang et al. 2022, Eq. 5–6): ISM weakens a pair by ``e^{−y}``,
    ``y = (β + γ)/(τ·δ)`` with ``β = ||u_i + u_j||`` and the semantic chord ``δ ∈ [0, 2]``. ``β``
    must live on the scale of ``τ·δ`` (a few units at most), but a linear head's ``||u||`` is set by
    its initialisation and the feature scale — about 12 on a small CNN and 26–56 on pretrained
    EfficientNet-Lite0 features — which puts ``e^{−y}`` near ``10⁻¹⁰`` for every pair at the first
    step: every similarity is 1, and every gradient, to ``u`` as well, carries the vanishing factor
    ``e^{−y}``, so the state is absorbing. Three properties follow from this form:

    - *Start as the plain metric.* ``c = logit(init_level)`` and ``w = 0`` give every image
      ``||u|| = u_max·init_level`` (0.02 by default) at the first step, whatever the backbone, so
      with ``γ = 0`` the median weakening is close to 1 for every loss.
    - *Nothing absorbs.* ``β ≤ 2·u_max``, so every pair keeps
      ``e^{−y} ≥ exp(−(2·u_max + γ)/(τ·δ))``: gradients through ISM cannot vanish except for
      near-duplicates (``δ → 0``), and a saturated pair can recover.
    - *Still learned, for every loss.* The level ``σ(a)`` depends on the image, so against
      zero-uncertainty proxies ``β = ||u_i|| = u_max·σ(a_i)`` still varies and trains (unlike the
      released code's L2-normalised ``u``, where ``β ≡ 1``); for pairs, ``β_ij = ||u_i + u_j||``
      also depends on how the directions align, as in the paper.

    Why the level reads *standardised* features: what ISM's objective asks of ``u`` differs from
    image to image (per image, the gradient on the level logit has the sign of "its positive pairs
    pull harder than its negatives push": Mixup images mostly ask for more ``u``, clean ones for
    less), so the level must be able to follow the image. Pooled features after a ReLU share one
    dominant direction, so ``f̂`` differs little from image to image; the gradient on ``w`` is then
    mostly that common direction times the batch's *net* demand, and Adam moves ``w`` and ``c``
    by about the learning rate per step whatever the gradient's size. With ``f̂`` the level
    therefore moved as one number for all images: ``||u||`` varied by 0.4–9 % across test images
    and no more for Mixup images, and ISM stayed the identity (``benchmarks/RESULTS.md``, "IDML
    whose introspection is real"). Standardising removes the common direction and gives every
    feature unit spread, so ``w`` learns which features make an image uncertain at the pace of the
    rest of training. It also makes the logit's scale independent of the backbone's feature
    magnitude (sum pooling of a pretrained network gives ``||f||`` in the tens), which is why
    ``f̂`` was read before.

    With ``γ > 0`` (the paper's Cars setting, 2–3) every pair is weakened on purpose from the first
    step, whatever ``u`` is: ``e^{−y} ≤ exp(−γ/(τ·δ))``, e.g. 0.45 for ``γ = 2``, ``τ = 5`` and
    ``δ = 0.5``; the head only adds to that.

    Args:
        feature_dim, uncertainty_dim: input size and ``d_u``.
        max_norm: ``u_max > 0``, the bound of ``||u||``.
        init_level: ``||u||/u_max`` at initialisation, in ``(0, 1)``.
        level_input: what the level logit reads (:class:`LevelInput`).

    Example:
        >>> head = BoundedUncertaintyHead(16, 4, max_norm=1.0, init_level=0.02)
        >>> u = head(torch.randn(8, 16))
        >>> torch.allclose(u.norm(dim=1), torch.full((8,), 0.02))  # every image starts alike
        True
    """

    def __init__(
        self,
        feature_dim: int,
        uncertainty_dim: int,
        max_norm: float = DEFAULT_UNCERTAINTY_MAX_NORM,
        init_level: float = DEFAULT_UNCERTAINTY_INIT_LEVEL,
        level_input: LevelInput | str = LevelInput.STANDARDIZED,
    ) -> None:
        super().__init__()
        if not (math.isfinite(max_norm) and max_norm > 0):
            raise ValueError(f"uncertainty max_norm must be a finite number > 0, got {max_norm}")
        if not 0.0 < init_level < 1.0:
            raise ValueError(f"uncertainty init_level must lie in (0, 1), got {init_level}")
        self.linear = nn.Linear(feature_dim, uncertainty_dim)
        self.level_input = LevelInput(level_input)
        self.standardize: nn.Module | None = (
            None
            if self.level_input is LevelInput.DIRECTION
            else nn.BatchNorm1d(feature_dim, affine=False)
        )
        self.level = nn.Linear(feature_dim, 1)
        nn.init.zeros_(self.level.weight)
        nn.init.constant_(self.level.bias, math.log(init_level / (1.0 - init_level)))
        self.max_norm = float(max_norm)
        self.init_level = float(init_level)

    def level_features(self, features: Tensor) -> Tensor:
        """``n(f)``: what the level logit reads (see the class docstring)."""
        if self.standardize is None:
            return unit_rows(features)
        if self.level_input is not LevelInput.STANDARDIZED_RUNNING:
            return self.standardize(features.float())
        bn = self.standardize
        assert isinstance(bn, nn.BatchNorm1d) and bn.running_mean is not None  # as __init__ built
        assert bn.running_var is not None
        mean, var = bn.running_mean, bn.running_var
        if self.training:
            # The statistics before this batch (copies: the update below is in place), so no
            # image's level depends on the batch it is in; then the batch updates the averages.
            mean, var = mean.clone(), var.clone()
            with torch.no_grad():
                bn(features.detach().float())
        return F.batch_norm(features.float(), mean, var, training=False, eps=bn.eps)

    def forward(self, features: Tensor) -> Tensor:
        direction = unit_rows(self.linear(features))
        level = torch.sigmoid(self.level(self.level_features(features)))
        return direction * (self.max_norm * level)

    def extra_repr(self) -> str:
        return (
            f"max_norm={self.max_norm}, init_level={self.init_level}, "
            f"level_input={self.level_input.value}"
        )


PEL_INITIAL_NOISE_NORM = 0.1
"""Initial ``E||z − μ||`` of a PEL sample: small against unit-sphere distances, so training starts
close to the deterministic embedding (our choice; the HIB paper gives no initialisation)."""


class LogVarianceHead(nn.Module):
    """PEL's ``log σ² = W f + b`` (Oh et al. 2019, §3), one variance per embedding dimension.

    ``W`` starts at zero and ``b`` at ``log(0.1² / d)``, so every image starts with the same
    ``σ² = 0.01 / d`` and a sample ``z = μ + σ ⊙ ε`` lies about ``0.1`` from ``μ``.
    """

    def __init__(self, feature_dim: int, embedding_dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(feature_dim, embedding_dim)
        nn.init.zeros_(self.linear.weight)
        nn.init.constant_(self.linear.bias, math.log(PEL_INITIAL_NOISE_NORM**2 / embedding_dim))

    def forward(self, features: Tensor) -> Tensor:
        return self.linear(features)


class UncertaintyHeadSpecError(ValueError):
    """Fields of an :class:`UncertaintyHeadSpec` that do not go together.

    ``fields`` holds the offending fields with their values and ``reason`` says what is wrong, so
    that a front end can name the fields as its users write them (a run config, for one, writes
    ``model.uncertainty.<field>``).
    """

    def __init__(self, fields: dict[str, Any], reason: str) -> None:
        self.fields = fields
        self.reason = reason
        given = ", ".join(f"{name}={value!r}" for name, value in fields.items())
        super().__init__(f"UncertaintyHeadSpec({given}): {reason}")

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.fields, self.reason)


@dataclass(frozen=True)
class UncertaintyHeadSpec:
    """The uncertainty head of an :class:`~idml.models.model.EmbeddingModel`: which one, and how
    it is built (:meth:`build`). A model without an uncertainty head has no spec (``None``).

    Fields that do not go together are refused on construction (:class:`UncertaintyHeadSpecError`):
    the linear-only options with the bounded form, an activation or normalisation with PEL. Strings
    are accepted for the enums. :meth:`to_dict` is the JSON form that
    :attr:`EmbeddingModel.build_config <idml.models.model.EmbeddingModel.build_config>` stores;
    :meth:`parse` reads it back, and :func:`~idml.models.model.build_model`'s shorthands.

    Example:
        >>> head = UncertaintyHeadSpec(dim=8).build(feature_dim=32, embedding_dim=16)
        >>> type(head).__name__, head.linear.out_features
        ('BoundedUncertaintyHead', 8)
        >>> UncertaintyHeadSpec.parse("pel") == UncertaintyHeadSpec(UncertaintyKind.PEL)
        True
        >>> UncertaintyHeadSpec(init_std=0.1)
        Traceback (most recent call last):
        ...
        idml.models.heads.UncertaintyHeadSpecError: UncertaintyHeadSpec(init_std=0.1): only form='linear' (the paper's linear layer) takes activation, normalize and init_std; the bounded head sets its scale with max_norm and init_level
    """

    kind: EnumField[UncertaintyKind] = EnumField(UncertaintyKind.ISM)
    """``ism``: IDML's uncertainty embedding ``u``; ``pel``: PEL's ``log σ²`` (see
    :class:`UncertaintyKind`)."""
    dim: int | None = None
    """``d_u`` [``None``: the embedding's ``d``]; PEL needs ``d_u = d``."""
    form: EnumField[UncertaintyForm] = EnumField(UncertaintyForm.BOUNDED)
    """ISM: ``bounded`` (default, :class:`BoundedUncertaintyHead`) or ``linear`` (the paper's plain
    layer, :class:`UncertaintyHead`; ``activation``, ``normalize`` and ``init_std`` apply to it
    only)."""
    max_norm: float = DEFAULT_UNCERTAINTY_MAX_NORM
    """The bounded head's ``u_max``, the bound of ``||u||``."""
    init_level: float = DEFAULT_UNCERTAINTY_INIT_LEVEL
    """The bounded head's starting ``||u||/u_max``, in ``(0, 1)``."""
    level_input: EnumField[LevelInput] = EnumField(LevelInput.STANDARDIZED)
    """The bounded head: what its level logit reads (:class:`LevelInput`)."""
    activation: EnumField[UncertaintyActivation] = EnumField(UncertaintyActivation.NONE)
    """The linear head's output non-linearity: ``none`` (paper) | ``relu`` | ``softplus``."""
    normalize: bool = False
    """The linear head: L2-normalise ``u`` like the official code (no gradient reaches the head in
    proxy losses, see :class:`UncertaintyHead`)."""
    init_std: float | None = None
    """The linear head: ``None`` = PyTorch's default Linear init, else ``N(0, std²)`` weights."""
    backbone_gradient: bool = True
    """Whether the head's gradient reaches the backbone (``False``: the head reads the features
    detached, so ``u`` learns from them without shaping them; an ablation that separates what the
    uncertainty objective does to the features from what it does through ISM's weakening)."""

    def __post_init__(self) -> None:
        if self.kind is UncertaintyKind.NONE:
            raise UncertaintyHeadSpecError(
                {"kind": self.kind.value},
                "a spec describes an uncertainty head; a model without one takes uncertainty=None",
            )
        if self.dim is not None and self.dim < 1:
            raise UncertaintyHeadSpecError(
                {"dim": self.dim}, "d_u must be >= 1 (None: the embedding's size)"
            )
        if self.kind is UncertaintyKind.PEL:
            shaping = self._set_fields("activation", "normalize", "level_input")
            if shaping:
                raise UncertaintyHeadSpecError(
                    shaping,
                    "the PEL head takes no activation, normalize or level_input (it outputs "
                    "log σ², which must stay unconstrained)",
                )
        elif self.form is UncertaintyForm.BOUNDED:
            linear_only = self._set_fields("activation", "normalize", "init_std")
            if linear_only:
                raise UncertaintyHeadSpecError(
                    linear_only,
                    "only form='linear' (the paper's linear layer) takes activation, normalize and "
                    "init_std; the bounded head sets its scale with max_norm and init_level",
                )
        else:
            bounded_only = self._set_fields("level_input")
            if bounded_only:
                raise UncertaintyHeadSpecError(
                    bounded_only,
                    "only form='bounded' takes level_input (the linear layer has no level logit)",
                )

    def _set_fields(self, *names: str) -> dict[str, Any]:
        """Those of ``names`` that differ from their defaults, with their values."""
        defaults = {f.name: f.default for f in fields(self)}
        return {
            name: _plain(getattr(self, name))
            for name in names
            if getattr(self, name) != defaults[name]
        }

    @classmethod
    def parse(
        cls,
        value: bool | str | UncertaintyKind | Mapping[str, Any] | UncertaintyHeadSpec | None,
    ) -> UncertaintyHeadSpec | None:
        """The head that :func:`~idml.models.model.build_model`'s ``uncertainty`` names: none for
        ``None``, ``False`` or ``"none"``; the default head of a kind for ``True`` (ISM), ``"ism"``
        or ``"pel"``; a spec as it is, or from its :meth:`to_dict`."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, bool):
            return cls() if value else None
        if isinstance(value, Mapping):
            return cls(**value)
        kind = UncertaintyKind(value)
        return None if kind is UncertaintyKind.NONE else cls(kind)

    def to_dict(self) -> dict[str, Any]:
        """Every field, enums as their strings: JSON and YAML as they are."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    def output_dim(self, embedding_dim: int) -> int:
        """``d_u`` on a model whose semantic embedding has ``embedding_dim``: ``dim``, or
        ``embedding_dim`` when unset; the PEL head gives one variance per embedding dimension, so
        it refuses any other."""
        if self.kind is UncertaintyKind.PEL and self.dim not in (None, embedding_dim):
            raise UncertaintyHeadSpecError(
                {"dim": self.dim},
                "the PEL head gives one variance per embedding dimension, so dim must equal "
                f"embedding_dim={embedding_dim} (or be None)",
            )
        return embedding_dim if self.dim is None else self.dim

    def build(self, feature_dim: int, embedding_dim: int) -> nn.Module:
        """The head on ``feature_dim`` pooled features of a model with an ``embedding_dim``
        semantic embedding, freshly initialised."""
        dim = self.output_dim(embedding_dim)
        if self.kind is UncertaintyKind.PEL:
            return LogVarianceHead(feature_dim, dim)
        if self.form is UncertaintyForm.BOUNDED:
            return BoundedUncertaintyHead(
                feature_dim, dim, self.max_norm, self.init_level, self.level_input
            )
        return UncertaintyHead(feature_dim, dim, self.activation, self.normalize, self.init_std)


def _plain(value: Any) -> Any:
    """An enum member as its value; anything else as it is."""
    return value.value if isinstance(value, enum.Enum) else value


def uncertainty_level(
    embeddings: Embeddings, kind: UncertaintyKind | str = UncertaintyKind.ISM
) -> Tensor:
    """Per-image uncertainty level ``(B,)``.

    ISM: ``||u||`` (Wang et al. 2022, §IV "uncertainty level of an image is the L2-norm of its
    uncertainty embedding"). PEL: ``||σ|| = sqrt(Σ_k exp(log σ²_k))``, the expected distance of a
    sample from ``μ``, since ``||log σ²||`` would grow for *confident* images.
    """
    kind = UncertaintyKind(kind)
    if embeddings.uncertainty is None or kind is UncertaintyKind.NONE:
        raise ValueError(
            "embeddings carry no uncertainty; build the model with an uncertainty head "
            "(uncertainty=True or 'pel') to report uncertainty levels"
        )
    if kind is UncertaintyKind.PEL:
        return embeddings.uncertainty.exp().sum(dim=1).sqrt()
    return embeddings.uncertainty.norm(dim=1)
