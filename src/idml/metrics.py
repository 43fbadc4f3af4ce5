"""Pairwise metrics: plain Euclidean distance, cosine similarity, and the introspective metric (ISM).

Every loss is written once against a :class:`Metric`. A metric maps two sets of semantic embeddings
(and, for ISM, their uncertainty embeddings) to a matrix ``M[i, j]``; ``is_similarity`` says whether
larger means more alike (cosine, ``S_IN``) or less alike (distance, ``D_IN``).

The introspective similarity metric (IDML, Wang et al.: Eq. 5–6; similarity form: TPAMI Eq. 7)
weakens the semantic discrepancy of a pair by its joint uncertainty ``β_ij = ||u_i + u_j||``::

    y      = (β^p + γ) / (τ · α^p)                         (relative uncertainty β̃/τ; p = power)
    D_IN   = α · exp(−y)                                   (distance form)
    S_IN   = 1 − (1 − C) · exp(−y)                         (similarity form, α → δ = ||ŝ_i − ŝ_j||)

``dD_IN/dα = e^{−y}(1 + y) ∈ (0, 1]`` for ``p = 1`` (the gradient analysis of IDML, TPAMI Eq. 19–20
and Fig. 6): certain pairs train as with the plain metric,
uncertain pairs pull less. With ``γ = 0`` and ``u ≡ 0`` ISM equals the plain metric exactly.

``β`` must live on the scale of ``τ·α`` (``α ≤ 2`` on the unit sphere): an uncertainty embedding with
``||u||`` in the tens puts ``e^{−y}`` near ``10⁻¹⁰`` for every pair, and every gradient through ISM
with it. The default uncertainty head keeps ``||u||`` bounded and starts it small
(:class:`idml.models.model.BoundedUncertaintyHead`); :mod:`idml.monitoring` measures the weakening
during training, and :attr:`IntrospectiveMetric.strength` lets a trainer ramp ISM in (a warm-up).

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
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

_EPS = 1e-12


class ISMVariant(str, enum.Enum):
    """Which form of the introspective metric to use (all three are IDML's: Eq. 4, Eq. 6, ISM-Dis)."""

    SOFT = "soft"
    """The paper's differentiable form ``α·exp(−β̃/τ)`` (IDML Eq. 6)."""
    STRICT = "strict"
    """The indicator form ``α·1[α − β − γ > 0]`` (IDML Eq. 4; not differentiable in β; ablation only)."""
    DISSIMILAR = "dissimilar"
    """ISM-Dis: uncertainty pushes pairs toward the *maximal* distance (ablation; worse in the paper:
    Wang et al. 2022, "Introspective Deep Metric Learning for Image Retrieval", Table 4)."""


def safe_norm_from_squares(squared: Tensor) -> Tensor:
    """``√s`` of squared norms ``s``: exactly 0, with a zero gradient, where ``s ≤ 10⁻¹²`` (negative
    rounding errors of a Gram expansion included); ``∂/∂s = 1/(2√s)`` elsewhere.

    The zero gradient keeps the diagonal of a pairwise matrix (``α_ii = 0``) finite instead of
    ``inf·0 = NaN``. One autograd node with float-only masks (:class:`_SafeSqrt`); a NaN input stays
    NaN.
    """
    return _SafeSqrt.apply(squared)


class _SafeSqrt(torch.autograd.Function):
    """The node behind :func:`safe_norm_from_squares`.

    ``threshold`` zeroes ``s ≤ 10⁻¹²`` and the backward divides by ``2√s`` with 0 turned into
    ``+inf``: the values and gradients of ``where(s > 10⁻¹², √s, 0)`` without boolean ``where``
    passes, each of which costs several float passes on the CPU (``benchmarks/RESULTS.md``, Losses).
    """

    @staticmethod
    def forward(ctx: Any, squared: Tensor) -> Tensor:
        root = torch.threshold(squared, _EPS, 0.0).sqrt_()
        ctx.save_for_backward(root)
        return root

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (root,) = ctx.saved_tensors
        return grad / _zero_to_inf(root).mul_(2.0)


def _zero_to_inf(values: Tensor) -> Tensor:
    """Non-negative ``values`` with 0 replaced by ``+inf``, so that ``g / result`` is 0 there.

    A float-only kernel: on the CPU a boolean ``where`` over a ``B×B`` matrix costs about ten
    elementwise float passes.
    """
    return torch.threshold(values, 0.0, float("inf"))


def _mask_at_or_below(grad: Tensor, values: Tensor, floor: float) -> Tensor:
    """``grad`` with 0 wherever ``values ≤ floor`` (a ``clamp_min(floor)``'s backward), float-only."""
    return torch.ops.aten.threshold_backward(grad, values, floor)


def pairwise_squared_distance(x: Tensor, y: Tensor) -> Tensor:
    """``||x_i − y_j||²`` as a ``(B, B')`` matrix, via the Gram expansion (no ``B×B'×d`` tensor)."""
    sq = x.pow(2).sum(1, keepdim=True) + y.pow(2).sum(1).unsqueeze(0) - 2.0 * x @ y.T
    return sq.clamp_min(0)


class _JointUncertainty(torch.autograd.Function):
    """``β_ij = ||u_i + v_j||`` from one Gram matrix, with a closed-form backward.

    Forward: ``β_ij² = ||u_i||² + ||v_j||² + 2·u_i·v_j`` (one ``n×m×d_u`` product), then a square root
    that is exactly 0 (with zero gradient) where ``β² ≤ 10⁻¹²``, as :func:`safe_norm_from_squares`.

    Backward, with ``W = ∂L/∂β ⊘ β`` (0 where ``β = 0``) and ``∂β_ij/∂u_i = (u_i + v_j)/β_ij``::

        ∂L/∂u = rowsum(W) ⊙ u + W·v          ∂L/∂v = colsum(W) ⊙ v + Wᵀ·u

    For self-pairs (``v`` omitted, ``v = u``) both sides add up to
    ``∂L/∂u = rowsum(W + Wᵀ) ⊙ u + (W + Wᵀ)·u``: one matrix product instead of autograd's two, and
    no ``n×d_u`` broadcasts for the squared norms, which roughly halves the time of forward +
    backward (``benchmarks/RESULTS.md``, Losses).
    """

    @staticmethod
    def forward(ctx: Any, ux: Tensor, uy: Tensor | None) -> Tensor:
        other = ux if uy is None else uy
        sq_x = ux.square().sum(1)
        sq_y = sq_x if uy is None else other.square().sum(1)
        sq = (sq_x[:, None] + sq_y[None, :]).addmm_(ux, other.T, alpha=2.0)
        beta = torch.threshold(sq, _EPS, 0.0).sqrt_()
        ctx.self_pairs = uy is None
        ctx.save_for_backward(ux, other, beta)
        return beta

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        ux, other, beta = ctx.saved_tensors
        weight = grad / _zero_to_inf(beta)
        if ctx.self_pairs:
            weight = weight + weight.T
            return (weight @ ux).addcmul_(weight.sum(1, keepdim=True), ux), None
        grad_x = grad_y = None
        if ctx.needs_input_grad[0]:
            grad_x = (weight @ other).addcmul_(weight.sum(1, keepdim=True), ux)
        if ctx.needs_input_grad[1]:
            grad_y = (weight.T @ ux).addcmul_(weight.sum(0).unsqueeze(1), other)
        return grad_x, grad_y


class _RowNorm(torch.autograd.Function):
    """``||u_i||`` as an ``(n, 1)`` column, with the backward ``∂L/∂u_i = g_i·u_i/||u_i||`` (0 where
    ``||u_i|| = 0``, as torch's norm) computed on the column before one broadcast multiply.

    torch's own norm backward masks zero norms with a broadcast ``masked_fill`` over the whole
    ``n×d_u`` gradient, several times the cost of the rest on the CPU; this is the one-sided
    ``β_ij = ||u_i||`` of every proxy loss.
    """

    @staticmethod
    def forward(ctx: Any, u: Tensor) -> Tensor:
        norm = torch.linalg.vector_norm(u, dim=1, keepdim=True)
        ctx.save_for_backward(u, norm)
        return norm

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        u, norm = ctx.saved_tensors
        return u * (grad / _zero_to_inf(norm))


def pairwise_uncertainty(
    ux: Tensor | None, uy: Tensor | None, n: int, m: int, like: Tensor
) -> Tensor:
    """Joint uncertainty ``β_ij = ||u_i + u_j||`` (added *before* the norm; IDML, defined
    with ``α`` just before Eq. 3),
    shape ``(n, m)``.

    A missing side (e.g. class proxies) has zero uncertainty, so ``β_ij = ||u_i||``. Passing the same
    tensor as ``ux`` and ``uy`` (a batch against itself) takes the cheaper self-pair backward of
    :class:`_JointUncertainty`. ``β`` is exactly 0, with a zero gradient, where ``β² ≤ 10⁻¹²``.

    >>> u = torch.tensor([[3.0, 0.0], [-3.0, 4.0]])
    >>> pairwise_uncertainty(u, u, 2, 2, u)
    tensor([[ 6.,  4.],
            [ 4., 10.]])
    """
    if ux is None and uy is None:
        return like.new_zeros(n, m)
    if uy is None:
        return _RowNorm.apply(ux).expand(n, m)
    if ux is None:
        return _RowNorm.apply(uy).T.expand(n, m)
    return _JointUncertainty.apply(ux, None if uy is ux else uy)


_ALPHA_FLOOR = 1e-6
"""``α`` is clamped below at this value in the exponent, so ``y`` stays finite at ``α = 0``."""


def _negative_relative_uncertainty(
    alpha: Tensor, beta: Tensor, tau: float, gamma: float, power: int
) -> tuple[Tensor, Tensor]:
    """``(−y, −τ·α_c^p)`` with ``y = (β^p + γ)/(τ·α_c^p)`` and ``α_c = max(α, 10⁻⁶)``.

    The negated denominator gives ``−y`` in one division (the same bits as ``−(num/den)``), which is
    what the exponential takes, and ``∂L/∂β`` in one more in :class:`_Weakening`.
    """
    alpha_c = alpha.clamp_min(_ALPHA_FLOOR)
    if power == 1:
        # pow(1) is not free (a copy forward, extra multiplies backward): skip it for the paper's p = 1.
        num = beta if gamma == 0 else beta + gamma
        neg_den = alpha_c.mul_(-tau)
    else:
        num = beta.square() + gamma
        neg_den = alpha_c.square_().mul_(-tau)
    return num / neg_den, neg_den


class _Weakening(torch.autograd.Function):
    """The soft and dissimilar ISM forms as one autograd node (IDML Eq. 5–6; TPAMI Eq. 7).

    With ``P`` the plain value (``α`` or ``C``), ``t`` the limit at full uncertainty (0 for ``D_IN``,
    1 for ``S_IN``, ``d_max`` and −1 for ISM-Dis) and ``y = (β^p + γ)/(τ·α_c^p)``,
    ``α_c = max(α, 10⁻⁶)``, every form is ``out = t + (P − t)·e^{−y}``. It is evaluated as
    ``P·e^{−y}`` for ``D_IN`` (relative accuracy when ``e^{−y}`` underflows) and as
    ``P + (P − t)·expm1(−y)`` otherwise, so ``y = 0`` returns ``P`` bit for bit
    (``1 − (1 − C)·1`` is not ``C`` in floating point).

    Closed-form backward, with ``q = ∂L/∂out·(P − t)·e^{−y}`` (``= −∂L/∂y``)::

        ∂out/∂P = e^{−y}
        ∂L/∂α   = q·p·y/α_c     for α > 10⁻⁶, else 0 (the clamp)
        ∂L/∂β   = −q·p·β^{p−1}/(τ·α_c^p)

    For ``D_IN`` (``P = α``, ``t = 0``) the two ``α`` paths add up to the paper's
    ``dD_IN/dα = e^{−y}(1 + p·y)`` and ``dD_IN/dβ = −α·e^{−y}·p·β^{p−1}/(τ·α^p)``; for ``S_IN``,
    ``∂S/∂C = e^{−y}``, ``∂S/∂δ = −(1 − C)·e^{−y}·p·y/δ``, ``∂S/∂β = (1 − C)·e^{−y}·p·β^{p−1}/(τ·δ^p)``.
    Both gradients share ``s = −q/(τ·α_c^p)``: ``∂L/∂β = p·β^{p−1}·s`` and
    ``∂L/∂α = −p·τ·α_c^{p−1}·y·s``. One node with about eight elementwise passes, fewer than a chain
    of autograd nodes needs (``benchmarks/RESULTS.md``, Losses). Not twice differentiable.

    With ``alpha=None`` the plain value is a cosine and ``α`` is the chord between the unit vectors,
    ``δ = √max(2 − 2C, 10⁻¹²)`` (``||x̂ − ŷ||² = 2 − 2C``), computed inside; its gradient
    ``∂δ/∂C = −1/δ`` (0 where the clamp is active) is folded into ``∂L/∂C``.
    """

    @staticmethod
    def forward(
        ctx: Any,
        plain: Tensor,
        alpha: Tensor | None,
        beta: Tensor,
        tau: float,
        gamma: float,
        power: int,
        target: float,
        multiplicative: bool,
    ) -> Tensor:
        gap = None
        if alpha is None:
            gap = torch.rsub(plain, 2.0, alpha=2.0)  # 2 − 2C in one pass
            alpha = gap.clamp_min(_EPS).sqrt_()
        neg_y, neg_den = _negative_relative_uncertainty(alpha, beta, tau, gamma, power)
        if multiplicative:
            factor = torch.exp(neg_y)
            out = plain * factor
        else:
            factor = torch.expm1(neg_y)
            # (P − t)·expm1(−y) + P in place. Not addcmul: its fused multiply-add rounds once and
            # would move values by an ulp from the two-step formula that the tests pin and that
            # stored runs were computed with.
            out = (plain - target).mul_(factor).add_(plain)
        ctx.params = (tau, power, target, multiplicative)
        ctx.plain_is_alpha = plain is alpha and plain.shape == out.shape and gap is None
        ctx.save_for_backward(plain, alpha, beta, neg_y, neg_den, factor, gap)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        plain, alpha, beta, neg_y, neg_den, factor, gap = ctx.saved_tensors
        tau, power, target, multiplicative = ctx.params
        chord = gap is not None
        # ∂out/∂P = e^{−y}; the additive forms stored expm1(−y) = e^{−y} − 1.
        grad_plain = grad * factor if multiplicative else torch.addcmul(grad, grad, factor)
        grad_alpha = grad_beta = None
        if chord or ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            q = grad_plain * plain if target == 0 else (plain - target).mul_(grad_plain)
            shared = q.div_(neg_den)  # s = −q/(τ·α_c^p)
            if chord or ctx.needs_input_grad[1]:
                grad_alpha = _mask_at_or_below(neg_y, alpha, _ALPHA_FLOOR).mul_(shared)
                grad_alpha.mul_(power * tau)
                if power == 2:
                    grad_alpha.mul_(alpha.clamp_min(_ALPHA_FLOOR))
            if ctx.needs_input_grad[2]:
                grad_beta = shared if power == 1 else shared.mul_(beta).mul_(2.0)
        if chord:
            # ∂δ/∂C = −1/δ above the clamp.
            grad_plain.sub_(_mask_at_or_below(grad_alpha.div_(alpha), gap, _EPS))
            return _sum_to(grad_plain, plain), None, _sum_to(grad_beta, beta), *_NO_GRADS
        if ctx.plain_is_alpha and grad_alpha is not None:
            # D_IN weakens α itself: hand autograd one summed gradient instead of two to add.
            return grad_plain.add_(grad_alpha), None, _sum_to(grad_beta, beta), *_NO_GRADS
        return (
            _sum_to(grad_plain, plain) if ctx.needs_input_grad[0] else None,
            _sum_to(grad_alpha, alpha),
            _sum_to(grad_beta, beta),
            *_NO_GRADS,
        )


_NO_GRADS = (None,) * 5
"""The gradients of :class:`_Weakening`'s non-tensor arguments."""


def _sum_to(grad: Tensor | None, like: Tensor) -> Tensor | None:
    """A gradient reduced to the shape of a broadcast input (``β`` of one-sided uncertainty)."""
    if grad is None or grad.shape == like.shape:
        return grad
    return grad.sum_to_size(like.shape)


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
            )
            # safe_norm_from_squares zeroes rounding errors below 0 itself; only d² needs the clamp.
            return sq.clamp_min(0) if self.power == 2 else safe_norm_from_squares(sq)
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
    """The introspective similarity metric wrapped around a plain metric (IDML Eq. 5–6; TPAMI Eq. 7).

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

    Attributes:
        strength: ``s ∈ [0, 1]`` scales the relative uncertainty, ``y → s·y`` (an ISM warm-up ramps it
            from 0 to 1 over the first steps; ``s = 0`` is the plain metric exactly). It is set by
            whoever runs training, not a hyper-parameter of the metric: 1 unless changed.
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
        self.strength = 1.0

    @property
    def _tau(self) -> float:
        """``τ/s``: the warm-up strength ``s`` scales ``y = (β^p + γ)/(τ·α^p)`` by ``s``."""
        return self.tau / self.strength

    def extra_repr(self) -> str:
        return (
            f"gamma={self.gamma}, tau={self.tau}, power={self.power}, variant={self.variant.value}"
        )

    def relative_uncertainty(self, alpha: Tensor, beta: Tensor) -> Tensor:
        """``y = (β^p + γ) / (τ·α^p)`` (IDML eq. 6: ``β̃/τ``) with ``α`` clamped below at ``10⁻⁶``;
        exactly 0 where ``β^p + γ = 0`` (even at ``α = 0``)."""
        if self.strength == 0:
            return torch.zeros_like(alpha)
        neg_y, _ = _negative_relative_uncertainty(alpha, beta, self._tau, self.gamma, self.power)
        return neg_y.neg_()

    def weaken(self, plain: Tensor, alpha: Tensor, beta: Tensor) -> Tensor:
        """Apply the configured variant to plain values given semantic distance and uncertainty.

        The soft and dissimilar forms run as one autograd node (:class:`_Weakening`, closed-form
        backward); the strict form is an indicator and stays a ``where``.
        """
        if self.variant is ISMVariant.STRICT:
            keep = self._strict_keep(alpha, beta)
            if self.is_similarity:
                return torch.where(keep, plain, torch.ones_like(plain))
            return torch.where(keep, plain, torch.zeros_like(plain))
        return self._smooth_weaken(plain, alpha, beta)

    def _strict_keep(self, alpha: Tensor, beta: Tensor) -> Tensor:
        """The strict form's indicator ``α^p − s·(β^p + γ) > 0`` (``s`` the warm-up strength)."""
        return (alpha.pow(self.power) - self.strength * (beta.pow(self.power) + self.gamma)) > 0

    def _smooth_weaken(self, plain: Tensor, alpha: Tensor | None, beta: Tensor) -> Tensor:
        """The soft or dissimilar form; ``alpha=None``: the chord of the cosine ``plain``."""
        # The value the metric tends to as the pair's uncertainty grows: soft forms pull
        # toward "alike" (D → 0, S → 1), ISM-Dis toward "unlike" (D → d_max, S → −1).
        if self.variant is ISMVariant.SOFT:
            target = 1.0 if self.is_similarity else 0.0
        else:
            target = -1.0 if self.is_similarity else self.d_max
        multiplicative = self.variant is ISMVariant.SOFT and not self.is_similarity
        return _Weakening.apply(
            plain, alpha, beta, self._tau, self.gamma, self.power, target, multiplicative
        )

    @property
    def _chord_alpha(self) -> bool:
        """Whether ``δ`` is the chord of the base cosine (no second normalisation or Gram matrix)."""
        return (
            self.is_similarity and self.delta_normalized and isinstance(self.base, CosineSimilarity)
        )

    def _alpha(self, x: Tensor, y: Tensor, plain: Tensor) -> Tensor:
        if not self.is_similarity:
            return plain
        if self._chord_alpha:
            # On the unit sphere ||x̂ − ŷ||² = 2 − 2·cos (the soft forms compute this inside _Weakening).
            return (2.0 - 2.0 * plain).clamp_min(_EPS).sqrt()
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
            # The base metric is told it compares the batch with itself, so it normalises the batch
            # once (not once per side): bit for bit the plain metric's matrix.
            plain = self.base(x)
            y, uy = x, ux
        else:
            plain = self.base(x, y)
        if self.strength == 0:
            return plain
        beta = pairwise_uncertainty(ux, uy, x.shape[0], y.shape[0], plain)
        if self._chord_alpha and self.variant is not ISMVariant.STRICT:
            return self._smooth_weaken(plain, None, beta)
        return self.weaken(plain, self._alpha(x, y, plain), beta)

    @torch.no_grad()
    def weakening(
        self,
        x: Tensor,
        y: Tensor | None = None,
        ux: Tensor | None = None,
        uy: Tensor | None = None,
    ) -> Tensor:
        """The weakening factor of every pair, ``(B, B')``, without gradients: ``e^{−s·y}`` for the
        soft and dissimilar forms (1 = the plain metric, 0 = fully weakened), the indicator
        ``1[α^p > s·(β^p + γ)]`` for the strict form. What a saturation monitor looks at."""
        plain = self.base(x) if y is None else self.base(x, y)
        y_side, uy = (x, ux) if y is None else (y, uy)
        beta = pairwise_uncertainty(ux, uy, x.shape[0], y_side.shape[0], plain)
        alpha = self._alpha(x, y_side, plain)
        if self.variant is ISMVariant.STRICT:
            return self._strict_keep(alpha, beta).to(plain.dtype)
        return torch.exp(-self.relative_uncertainty(alpha, beta))

    def paired(
        self, x: Tensor, y: Tensor, ux: Tensor | None = None, uy: Tensor | None = None
    ) -> Tensor:
        plain = self.base.paired(x, y)
        if self.strength == 0:
            return plain
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
