"""Pairwise metrics: plain Euclidean distance, cosine similarity, and the introspective metric (ISM).

Every loss is written once against a :class:`Metric`. A metric maps two sets of semantic embeddings
(and, for ISM, their uncertainty embeddings) to a matrix ``M[i, j]``; ``is_similarity`` says whether
larger means more alike (cosine, ``S_IN``) or less alike (distance, ``D_IN``).

The introspective similarity metric (IDML paper, eq. 5–7; SPEC §3) weakens the semantic discrepancy of
a pair by its joint uncertainty ``β_ij = ||u_i + u_j||``::

    y      = (β^p + γ) / (τ · α^p)                         (relative uncertainty β̃/τ; p = power)
    D_IN   = α · exp(−y)                                   (distance form)
    S_IN   = 1 − (1 − C) · exp(−y)                         (similarity form, α → δ = ||ŝ_i − ŝ_j||)

``dD_IN/dα = e^{−y}(1 + y) ∈ (0, 1]`` for ``p = 1``: certain pairs train as with the plain metric,
uncertain pairs pull less. With ``γ = 0`` and ``u ≡ 0`` ISM equals the plain metric exactly.

Example:
    >>> import torch
    >>> x = torch.nn.functional.normalize(torch.randn(5, 8), dim=1)
    >>> plain = EuclideanDistance()
    >>> ism = IntrospectiveMetric(plain, gamma=0.0, tau=5.0)
    >>> torch.equal(ism(x, ux=torch.zeros(5, 3)), plain(x))
    True
    >>> bool((ism(x, ux=torch.randn(5, 3)) <= plain(x) + 1e-6).all())
    True
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_EPS = 1e-12


class ISMVariant(str, enum.Enum):
    """Which form of the introspective metric to use (SPEC §3 "Variants")."""

    SOFT = "soft"
    """The paper's differentiable form ``α·exp(−β̃/τ)``."""
    STRICT = "strict"
    """The indicator form ``α·1[α − β − γ > 0]`` (not differentiable in β; ablation only)."""
    DISSIMILAR = "dissimilar"
    """ISM-Dis: uncertainty pushes pairs toward the *maximal* distance (ablation; worse in the paper)."""


def safe_norm_from_squares(squared: Tensor) -> Tensor:
    """``sqrt`` of non-negative squared norms with a finite, zero gradient at exactly 0.

    The double ``where`` keeps the gradient of the diagonal of a pairwise matrix (``α_ii = 0``)
    finite instead of ``inf·0 = NaN``.
    """
    squared = squared.clamp_min(0)
    positive = squared > _EPS
    safe = torch.where(positive, squared, torch.ones_like(squared))
    return torch.where(positive, safe.sqrt(), torch.zeros_like(squared))


def pairwise_squared_distance(x: Tensor, y: Tensor) -> Tensor:
    """``||x_i − y_j||²`` as a ``(B, B')`` matrix, via the Gram expansion (no ``B×B'×d`` tensor)."""
    sq = x.pow(2).sum(1, keepdim=True) + y.pow(2).sum(1).unsqueeze(0) - 2.0 * x @ y.T
    return sq.clamp_min(0)


def pairwise_uncertainty(
    ux: Tensor | None, uy: Tensor | None, n: int, m: int, like: Tensor
) -> Tensor:
    """Joint uncertainty ``β_ij = ||u_i + u_j||`` (added *before* the norm), shape ``(n, m)``.

    A missing side (e.g. class proxies) has zero uncertainty.
    """
    if ux is None and uy is None:
        return like.new_zeros(n, m)
    if uy is None:
        return ux.norm(dim=1, keepdim=True).expand(n, m)  # type: ignore[union-attr]
    if ux is None:
        return uy.norm(dim=1).unsqueeze(0).expand(n, m)
    sq = ux.pow(2).sum(1, keepdim=True) + uy.pow(2).sum(1).unsqueeze(0) + 2.0 * ux @ uy.T
    return safe_norm_from_squares(sq)


class Metric(nn.Module, ABC):
    """A pairwise comparison of embeddings; ``is_similarity`` gives its direction."""

    is_similarity: bool = False
    uses_uncertainty: bool = False

    def __init__(self, normalize: bool = True) -> None:
        super().__init__()
        self.normalize = normalize

    def prepare(self, x: Tensor) -> Tensor:
        return F.normalize(x, dim=1) if self.normalize else x

    @abstractmethod
    def forward(
        self,
        x: Tensor,
        y: Tensor | None = None,
        ux: Tensor | None = None,
        uy: Tensor | None = None,
    ) -> Tensor:
        """``(B, B')`` matrix between rows of ``x`` and rows of ``y`` (``y = x`` when omitted)."""

    def paired(
        self, x: Tensor, y: Tensor, ux: Tensor | None = None, uy: Tensor | None = None
    ) -> Tensor:
        """Row-aligned values ``M(x_i, y_i)``, shape ``(B,)`` (for anchor–positive lists)."""
        return torch.diagonal(self(x, y, ux, uy))

    def more_similar(self, a: Tensor, b: Tensor) -> Tensor:
        """Elementwise: is value ``a`` more similar than ``b`` under this metric?"""
        return a > b if self.is_similarity else a < b

    @property
    def worst_value(self) -> float:
        """A value less similar than any the metric produces (used to mask)."""
        return float("-inf") if self.is_similarity else float("inf")


class EuclideanDistance(Metric):
    """``α_ij = ||s_i − s_j||₂`` (``power=2`` gives the squared distance).

    Embeddings are L2-normalised first unless ``normalize=False``.
    """

    is_similarity = False

    def __init__(self, normalize: bool = True, power: int = 1) -> None:
        super().__init__(normalize)
        if power not in (1, 2):
            raise ValueError(f"power must be 1 or 2, got {power}")
        self.power = power

    def forward(
        self,
        x: Tensor,
        y: Tensor | None = None,
        ux: Tensor | None = None,
        uy: Tensor | None = None,
    ) -> Tensor:
        x = self.prepare(x)
        y = x if y is None else self.prepare(y)
        if self.normalize:
            # ||x̂||² is 1 (0 for a zero row) and has zero gradient through the normalisation, so the
            # squared norms are taken detached: the same values and gradients, a cheaper backward.
            sq = (
                x.detach().pow(2).sum(1, keepdim=True)
                + y.detach().pow(2).sum(1).unsqueeze(0)
                - 2.0 * x @ y.T
            ).clamp_min(0)
        else:
            sq = pairwise_squared_distance(x, y)
        return sq if self.power == 2 else safe_norm_from_squares(sq)

    def paired(
        self, x: Tensor, y: Tensor, ux: Tensor | None = None, uy: Tensor | None = None
    ) -> Tensor:
        sq = (self.prepare(x) - self.prepare(y)).pow(2).sum(1)
        return sq if self.power == 2 else safe_norm_from_squares(sq)


class CosineSimilarity(Metric):
    """``C_ij = ŝ_i · ŝ_j`` on L2-normalised embeddings."""

    is_similarity = True

    def __init__(self) -> None:
        super().__init__(normalize=True)

    def forward(
        self,
        x: Tensor,
        y: Tensor | None = None,
        ux: Tensor | None = None,
        uy: Tensor | None = None,
    ) -> Tensor:
        x = self.prepare(x)
        y = x if y is None else self.prepare(y)
        return x @ y.T

    def paired(
        self, x: Tensor, y: Tensor, ux: Tensor | None = None, uy: Tensor | None = None
    ) -> Tensor:
        return (self.prepare(x) * self.prepare(y)).sum(1)


class IntrospectiveMetric(Metric):
    """The introspective similarity metric wrapped around a plain metric (IDML eq. 5–7, SPEC §3).

    Args:
        base: :class:`EuclideanDistance` (distance form ``D_IN``) or :class:`CosineSimilarity`
            (similarity form ``S_IN``).
        gamma: introspective bias ``γ ≥ 0``.
        tau: weakening degree ``τ > 0``.
        power: 1 (paper: norms) or 2 (official code: squared ``α`` and ``β`` in the exponent).
        variant: soft (paper), strict (indicator) or dissimilar (ISM-Dis).
        d_max: maximal distance for ISM-Dis in distance form (2 on the unit sphere).
        delta_normalized: in similarity form, measure ``δ`` between L2-normalised embeddings
            (default) or between the raw vectors, as the official code does with unnormalised proxies.
    """

    uses_uncertainty = True

    def __init__(
        self,
        base: Metric,
        gamma: float = 0.0,
        tau: float = 5.0,
        power: int = 1,
        variant: ISMVariant | str = ISMVariant.SOFT,
        d_max: float = 2.0,
        delta_normalized: bool = True,
    ) -> None:
        super().__init__(normalize=base.normalize)
        if isinstance(base, IntrospectiveMetric):
            raise ValueError("base must be a plain metric, not another IntrospectiveMetric")
        if gamma < 0:
            raise ValueError(f"gamma (introspective bias) must be >= 0, got {gamma}")
        if tau <= 0:
            raise ValueError(f"tau (weakening degree) must be > 0, got {tau}")
        if power not in (1, 2):
            raise ValueError(f"power must be 1 or 2, got {power}")
        if isinstance(base, EuclideanDistance) and base.power != 1:
            raise ValueError("ISM wraps the Euclidean distance itself; use power=1 for the base")
        self.base = base
        self.gamma = float(gamma)
        self.tau = float(tau)
        self.power = power
        self.variant = ISMVariant(variant)
        self.d_max = float(d_max)
        self.delta_normalized = delta_normalized
        self.is_similarity = base.is_similarity

    def extra_repr(self) -> str:
        return (
            f"gamma={self.gamma}, tau={self.tau}, power={self.power}, variant={self.variant.value}"
        )

    def relative_uncertainty(self, alpha: Tensor, beta: Tensor) -> Tensor:
        """``y = (β^p + γ) / (τ·α^p)``; exactly 0 where ``β^p + γ = 0`` (even at ``α = 0``)."""
        # pow(1) is not free (a copy forward, extra multiplies backward): skip it for the paper's p = 1.
        if self.power == 1:
            num = beta if self.gamma == 0 else beta + self.gamma
            return num / (self.tau * alpha.clamp_min(1e-6))
        return (beta.square() + self.gamma) / (self.tau * alpha.clamp_min(1e-6).square())

    def weaken(self, plain: Tensor, alpha: Tensor, beta: Tensor) -> Tensor:
        """Apply the configured variant to plain values given semantic distance and uncertainty."""
        if self.variant is ISMVariant.STRICT:
            keep = (alpha.pow(self.power) - beta.pow(self.power) - self.gamma) > 0
            if self.is_similarity:
                return torch.where(keep, plain, torch.ones_like(plain))
            return torch.where(keep, plain, torch.zeros_like(plain))
        y = self.relative_uncertainty(alpha, beta)
        if self.variant is ISMVariant.SOFT and not self.is_similarity:
            return plain * torch.exp(-y)
        # The other forms are written as plain value + shift with expm1 (e^{−y} − 1, exactly 0 at
        # y = 0), so γ = 0 and u = 0 give the plain metric bit for bit: `1 − (1 − C)·1` is not C
        # in floating point.
        shrink = torch.expm1(-y)
        if self.variant is ISMVariant.SOFT:
            return plain - (1 - plain) * shrink
        # DISSIMILAR: mirror image, uncertainty pushes toward minimal similarity / maximal distance.
        if self.is_similarity:
            return plain + (1 + plain) * shrink
        return plain - (self.d_max - plain) * shrink

    def _alpha(self, x: Tensor, y: Tensor, plain: Tensor) -> Tensor:
        if not self.is_similarity:
            return plain
        if self.delta_normalized and isinstance(self.base, CosineSimilarity):
            # On the unit sphere ||x̂ − ŷ||² = 2 − 2·cos: no second normalisation and Gram matrix.
            # relative_uncertainty clamps α at 1e-6 anyway, so a plain clamp replaces the safe norm.
            return (2.0 - 2.0 * plain).clamp_min(1e-12).sqrt()
        if self.delta_normalized:
            x, y = F.normalize(x, dim=1), F.normalize(y, dim=1)
        return safe_norm_from_squares(pairwise_squared_distance(x, y))

    def forward(
        self,
        x: Tensor,
        y: Tensor | None = None,
        ux: Tensor | None = None,
        uy: Tensor | None = None,
    ) -> Tensor:
        if y is None:
            y, uy = x, ux
        plain = self.base(x, y)
        alpha = self._alpha(x, y, plain)
        beta = pairwise_uncertainty(ux, uy, x.shape[0], y.shape[0], plain)
        return self.weaken(plain, alpha, beta)

    def paired(
        self, x: Tensor, y: Tensor, ux: Tensor | None = None, uy: Tensor | None = None
    ) -> Tensor:
        plain = self.base.paired(x, y)
        if self.is_similarity:
            xs, ys = (
                (F.normalize(x, dim=1), F.normalize(y, dim=1)) if self.delta_normalized else (x, y)
            )
            alpha = safe_norm_from_squares((xs - ys).pow(2).sum(1))
        else:
            alpha = plain
        if ux is None and uy is None:
            beta = plain.new_zeros(plain.shape)
        else:
            u = (ux if ux is not None else 0) + (uy if uy is not None else 0)
            beta = safe_norm_from_squares(u.pow(2).sum(1))  # type: ignore[union-attr]
        return self.weaken(plain, alpha, beta)
