"""The heads of :class:`~idml.models.model.EmbeddingModel` and what they are built from: global
pooling of the backbone's feature map, the semantic head, the uncertainty heads (plain linear,
bounded, PEL's ``log σ²``) and the uncertainty level ``||u||``."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from idml.embeddings import Embeddings
from idml.models.names import ChoiceEnum


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
        return alias if alias is not None else super()._missing_(value)  # type: ignore[return-value]


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
        return F.normalize(self.linear(features), dim=1)


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
                    f"uncertainty_init_std must be a finite number >= 0, got {init_std}"
                )
            nn.init.normal_(self.linear.weight, std=init_std)
            nn.init.zeros_(self.linear.bias)

    def forward(self, features: Tensor) -> Tensor:
        u = self.linear(features)
        if self.activation is UncertaintyActivation.RELU:
            u = F.relu(u)
        elif self.activation is UncertaintyActivation.SOFTPLUS:
            u = F.softplus(u)
        return F.normalize(u, dim=1) if self.normalize else u

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


class BoundedUncertaintyHead(nn.Module):
    """The default ISM uncertainty embedding: a bounded level times a learned direction.

    For pooled features ``f`` (unit direction ``f̂ = f/||f||``)::

        ẑ = (W f + b) / ||W f + b||                 direction   (the paper's linear layer)
        a = w·f̂ + c                                 level logit
        u = u_max · σ(a) · ẑ                        so ||u|| = u_max·σ(a) ∈ (0, u_max)

    Why (IDML, Wang et al. 2022, Eq. 5–6): ISM weakens a pair by ``e^{−y}``,
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

    With ``γ > 0`` (the paper's Cars setting, 2–3) every pair is weakened on purpose from the first
    step, whatever ``u`` is: ``e^{−y} ≤ exp(−γ/(τ·δ))``, e.g. 0.45 for ``γ = 2``, ``τ = 5`` and
    ``δ = 0.5``; the head only adds to that.

    The level logit reads the *unit* feature direction ``f̂`` so that its scale does not depend on
    the backbone's feature magnitude (sum pooling of a pretrained network gives ``||f||`` in the
    tens); the direction may read ``f`` itself, since only ``ẑ`` is used.

    Args:
        feature_dim, uncertainty_dim: input size and ``d_u``.
        max_norm: ``u_max > 0``, the bound of ``||u||``.
        init_level: ``||u||/u_max`` at initialisation, in ``(0, 1)``.
    """

    def __init__(
        self,
        feature_dim: int,
        uncertainty_dim: int,
        max_norm: float = DEFAULT_UNCERTAINTY_MAX_NORM,
        init_level: float = DEFAULT_UNCERTAINTY_INIT_LEVEL,
    ) -> None:
        super().__init__()
        if not (math.isfinite(max_norm) and max_norm > 0):
            raise ValueError(f"uncertainty max_norm must be a finite number > 0, got {max_norm}")
        if not 0.0 < init_level < 1.0:
            raise ValueError(f"uncertainty init_level must lie in (0, 1), got {init_level}")
        self.linear = nn.Linear(feature_dim, uncertainty_dim)
        self.level = nn.Linear(feature_dim, 1)
        nn.init.zeros_(self.level.weight)
        nn.init.constant_(self.level.bias, math.log(init_level / (1.0 - init_level)))
        self.max_norm = float(max_norm)
        self.init_level = float(init_level)

    def forward(self, features: Tensor) -> Tensor:
        direction = F.normalize(self.linear(features), dim=1)
        level = torch.sigmoid(self.level(F.normalize(features, dim=1)))
        return direction * (self.max_norm * level)

    def extra_repr(self) -> str:
        return f"max_norm={self.max_norm}, init_level={self.init_level}"


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
