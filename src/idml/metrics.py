"""Pairwise metrics: plain Euclidean distance, cosine similarity, and the introspective metric (ISM).

Every loss is written once against a :class:`Metric`. A metric maps two sets of semantic embeddings
(and, for ISM, their uncertainty embeddings) to a matrix ``M[i, j]``; ``is_similarity`` says whether
larger means more alike (cosine, ``S_IN``) or less alike (distance, ``D_IN``), and the metric's
direction methods (:meth:`Metric.oriented`, :meth:`Metric.to_distance`, ...) turn its values into
the orientation a loss or miner is written in.

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
(:class:`idml.models.model.BoundedUncertaintyHead`); :mod:`idml.app.training.monitoring` measures the weakening
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
import typing
from typing import Literal

import torch
from torch import Tensor, nn

from idml.embeddings import Embeddings

_EPS = 1e-12
"""Squared norms at or below this count as 0 (a square root's gradient is infinite at 0)."""


ISMPower = Literal[1, 2]
"""ISM's exponent ``p`` of ``α`` and ``β`` (1: the paper's norms, 2: the official code's squares)."""


class ISMVariant(str, enum.Enum):
    """Which form of the introspective metric to use (all three are IDML's: Eq. 4, Eq. 6, ISM-Dis)."""

    SOFT = "soft"
    """The paper's differentiable form ``α·exp(−β̃/τ)`` (IDML Eq. 6)."""
    STRICT = "strict"
    """The indicator form ``α·1[α − β − γ > 0]`` (IDML Eq. 4; not differentiable in β; ablation only)."""
    DISSIMILAR = "dissimilar"
    """ISM-Dis: uncertainty pushes pairs toward the *maximal* distance (ablation; worse in the paper:
    Wang et al. 2022, "Introspective Deep Metric Learning for Image Retrieval", Table 4)."""


def unit_rows(x: Tensor, dim: int = 1, eps: float = 1e-12) -> Tensor:
    """``x / ||x||`` along ``dim``: ``F.normalize(x, dim=dim)`` exactly, except that a vector of
    zeros stays zero with a bounded gradient. Every normalisation that gradients pass through (the
    heads, the metrics, SSR's head and loss) uses it.

    ``F.normalize`` divides a zero vector by ``eps``, so the gradient that reaches it is ``1/eps =
    10¹²`` times the incoming one. Zero vectors are not hypothetical: pretrained EfficientNet-Lite0
    maps a white or mid-grey image (a blank Omniglot crop) to features that are exactly zero, the
    semantic head's bias starts at 0 (Kim et al. 2020's code), and one such image made the whole
    batch's gradient norm infinite (through the head, then through the metric that normalises its
    operands again), so that clipping discarded the step. Here a zero vector is divided by 1: its
    output is the same 0, and its gradient is the incoming one."""
    norm = x.norm(2, dim=dim, keepdim=True)
    return x / torch.where(norm == 0, torch.ones_like(norm), norm.clamp_min(eps))


def safe_norm_from_squares(squared: Tensor) -> Tensor:
    """``√s`` of squared norms ``s``: exactly 0, with a zero gradient, where ``s ≤ 10⁻¹²`` (negative
    rounding errors of a Gram expansion included); ``√s`` and ``∂/∂s = 1/(2√s)`` elsewhere. A NaN
    input stays NaN.

    The zero gradient keeps the diagonal of a pairwise matrix (``α_ii = 0``) finite.
    """
    # `where` multiplies the discarded branch's gradient by 0, and 0·∞ (√'s slope at 0) is NaN:
    # clamping the inner argument keeps that branch finite. Above 10⁻¹² the clamp is the identity.
    return torch.where(squared <= _EPS, 0.0, squared.clamp_min(_EPS).sqrt())


def pairwise_squared_distance(x: Tensor, y: Tensor) -> Tensor:
    """``||x_i − y_j||²`` as a ``(B, B')`` matrix, via the Gram expansion (no ``B×B'×d`` tensor)."""
    sq = x.pow(2).sum(1, keepdim=True) + y.pow(2).sum(1).unsqueeze(0) - 2.0 * x @ y.T
    return sq.clamp_min(0)


def pairwise_uncertainty(
    ux: Tensor | None, uy: Tensor | None, n: int, m: int, like: Tensor
) -> Tensor:
    """Joint uncertainty ``β_ij = ||u_i + u_j||`` (added *before* the norm; IDML, defined
    with ``α`` just before Eq. 3), shape ``(n, m)``.

    ``β_ij² = ||u_i||² + ||u_j||² + 2·u_i·u_j`` comes from one Gram matrix, and ``β`` is exactly 0,
    with a zero gradient, where ``β² ≤ 10⁻¹²`` (:func:`safe_norm_from_squares`). A missing side
    (e.g. class proxies) has zero uncertainty, so ``β_ij = ||u_i||``.

    >>> u = torch.tensor([[3.0, 0.0], [-3.0, 4.0]])
    >>> pairwise_uncertainty(u, u, 2, 2, u)
    tensor([[ 6.,  4.],
            [ 4., 10.]])
    """
    if ux is None and uy is None:
        return like.new_zeros(n, m)
    if uy is None:
        return torch.linalg.vector_norm(ux, dim=1, keepdim=True).expand(n, m)
    if ux is None:
        return torch.linalg.vector_norm(uy, dim=1).unsqueeze(0).expand(n, m)
    sq_x = ux.square().sum(1)
    sq_y = sq_x if uy is ux else uy.square().sum(1)
    return safe_norm_from_squares(torch.addmm(sq_x[:, None] + sq_y[None, :], ux, uy.T, alpha=2.0))


_ALPHA_FLOOR = 1e-6
"""``α`` is clamped below at this value in the exponent, so ``y`` stays finite at ``α = 0``."""


def relative_uncertainty(
    alpha: Tensor, beta: Tensor, tau: float, gamma: float, power: int = 1
) -> Tensor:
    """``y = (β^p + γ) / (τ·max(α, 10⁻⁶)^p)``: the relative uncertainty ``β̃/τ`` of IDML Eq. 6
    (``p = 1``; the official code uses ``p = 2``). Exactly 0 where ``β^p + γ = 0``, even at
    ``α = 0``; no gradient reaches ``α ≤ 10⁻⁶``."""
    return (beta.pow(power) + gamma) / (tau * alpha.clamp_min(_ALPHA_FLOOR).pow(power))


def oriented(values: Tensor, similarity: bool) -> Tensor:
    """Metric values as "larger is more alike" scores: a similarity ``S`` unchanged, a distance
    ``D`` as ``−D`` (:meth:`Metric.oriented`)."""
    return values if similarity else -values


def to_distance(values: Tensor, similarity: bool) -> Tensor:
    """Metric values as a distance: distances unchanged, similarities ``S`` mapped to the chord
    distance ``√(2 − 2S)`` (:meth:`Metric.to_distance`).

    For cosine similarity this is exactly the Euclidean distance between L2-normalised embeddings
    (``||ŝ_i − ŝ_j||² = 2 − 2C_ij``). For the similarity form of ISM,
    ``2 − 2S_IN = α²·exp(−y)``, so the result is ``α·exp(−y/2)``: the distance form ``D_IN`` with the
    weakening degree doubled. The square root has a finite gradient at ``S = 1``.

    >>> to_distance(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), similarity=True)
    tensor([[0.0000, 1.4142],
            [1.4142, 0.0000]])
    """
    return safe_norm_from_squares(2.0 - 2.0 * values) if similarity else values


class Metric(nn.Module):
    """A pairwise comparison of embeddings; ``is_similarity`` gives its direction, and the methods
    below state every direction-dependent rule once for losses and miners.

    :meth:`forward` is the one public comparison; a plain metric implements :meth:`matrix` on
    prepared rows, one that uses the uncertainty embeddings (ISM) implements :meth:`compare`
    instead."""

    is_similarity: bool = False
    uses_uncertainty: bool = False

    def __init__(self, normalize: bool = True) -> None:
        super().__init__()
        self.normalize = normalize

    def prepare(self, x: Tensor) -> Tensor:
        return unit_rows(x) if self.normalize else x

    def forward(
        self,
        x: Tensor,
        y: Tensor | None = None,
        ux: Tensor | None = None,
        uy: Tensor | None = None,
    ) -> Tensor:
        """``(B, B')`` matrix between rows of ``x`` and rows of ``y`` (``y = x`` when omitted), with
        the uncertainty embeddings ``ux`` and ``uy`` of the two sides (see :meth:`compare`)."""
        return self.compare(x, y, ux, uy)

    def compare(self, x: Tensor, y: Tensor | None, ux: Tensor | None, uy: Tensor | None) -> Tensor:
        """:meth:`forward` with every argument given (``y = None``: the batch against itself).

        A plain metric passes both sides through :meth:`prepare` (the batch once when ``y`` is
        ``None``) to :meth:`matrix` and ignores the uncertainties ``ux`` and ``uy``; a metric that
        uses them (ISM) implements this instead."""
        x = self.prepare(x)
        return self.matrix(x, x if y is None else self.prepare(y))

    def matrix(self, x: Tensor, y: Tensor) -> Tensor:
        """``(B, B')`` values between the prepared rows ``x`` and ``y``: what a plain metric
        implements (a metric that implements :meth:`compare` need not)."""
        raise NotImplementedError(f"{type(self).__name__} implements neither matrix nor compare")

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

    def oriented(self, values: Tensor) -> Tensor:
        """This metric's values as "larger is more alike" scores: ``S`` as is, a distance as ``−D``."""
        return oriented(values, self.is_similarity)

    def to_distance(self, values: Tensor) -> Tensor:
        """This metric's values as a distance: ``D`` as is, ``S`` as the chord ``√(2 − 2S)``
        (:func:`to_distance`)."""
        return to_distance(values, self.is_similarity)

    def to_squared_distance(self, values: Tensor) -> Tensor:
        """This metric's values as squared distances on the unit sphere: ``D²`` for a distance
        (plain ``α`` or ``D_IN``, whose base is never squared), ``2·(1 − S)`` for a similarity
        (``||ŝ_i − ŝ_j||²`` for cosine); the squared Euclidean distance is returned as is."""
        return 2.0 * (1.0 - values) if self.is_similarity else values.square()


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

    def matrix(self, x: Tensor, y: Tensor) -> Tensor:
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

    def to_squared_distance(self, values: Tensor) -> Tensor:
        return values if self.power == 2 else values.square()


class CosineSimilarity(Metric):
    """``C_ij = ŝ_i · ŝ_j`` on L2-normalised embeddings."""

    is_similarity = True

    def __init__(self) -> None:
        super().__init__(normalize=True)

    def matrix(self, x: Tensor, y: Tensor) -> Tensor:
        return x @ y.T

    def paired(
        self, x: Tensor, y: Tensor, ux: Tensor | None = None, uy: Tensor | None = None
    ) -> Tensor:
        return (self.prepare(x) * self.prepare(y)).sum(1)


class IntrospectiveMetric(Metric):
    """The introspective similarity metric wrapped around a plain metric (IDML Eq. 4–6; TPAMI Eq. 7).

    With the plain value ``P`` (``α = ||ŝ_i − ŝ_j||`` or the cosine ``C``), the semantic distance
    ``α`` (for the similarity form ``δ = ||ŝ_i − ŝ_j||``), the joint uncertainty
    ``β = ||u_i + u_j||`` and the relative uncertainty ``y = (β^p + γ)/(τ·α^p)``
    (:func:`relative_uncertainty`), the forms are::

        soft,  distance    D_IN = α·e^{−y}                    (IDML Eq. 6)
        soft,  similarity  S_IN = 1 − (1 − C)·e^{−y}          (TPAMI Eq. 7)
        dissimilar         t + (P − t)·e^{−y},  t = d_max (distance) or −1 (similarity)   (ISM-Dis)
        strict             P where α^p − (β^p + γ) > 0, else 0 (distance) or 1 (similarity)  (Eq. 4)

    The soft and dissimilar forms are ``t + (P − t)·e^{−y}`` with the limit ``t`` at full
    uncertainty (:attr:`limit`); every one is ``P`` at ``y = 0`` bit for bit. The warm-up strength
    ``s`` scales ``y → s·y`` (and ``β^p + γ → s·(β^p + γ)`` in the strict form).

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
        if power not in typing.get_args(ISMPower):
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

    def extra_repr(self) -> str:
        return (
            f"gamma={self.gamma}, tau={self.tau}, power={self.power}, variant={self.variant.value}"
        )

    @property
    def limit(self) -> float:
        """``t``, the value a pair tends to as its uncertainty grows: the soft forms pull toward
        "alike" (``D → 0``, ``S → 1``), ISM-Dis toward "unlike" (``D → d_max``, ``S → −1``)."""
        if self.variant is ISMVariant.DISSIMILAR:
            return -1.0 if self.is_similarity else self.d_max
        return 1.0 if self.is_similarity else 0.0

    def relative_uncertainty(self, alpha: Tensor, beta: Tensor) -> Tensor:
        """``s·y`` with ``y = (β^p + γ) / (τ·α^p)`` (:func:`relative_uncertainty`) and ``s`` the
        warm-up strength."""
        if self.strength == 0:
            return torch.zeros_like(alpha)
        return relative_uncertainty(alpha, beta, self.tau / self.strength, self.gamma, self.power)

    def weaken(self, plain: Tensor, alpha: Tensor, beta: Tensor) -> Tensor:
        """The configured form from the plain values ``P``, semantic distances ``α`` and joint
        uncertainties ``β`` (see the class docstring)."""
        if self.variant is ISMVariant.STRICT:
            return torch.where(self._strict_keep(alpha, beta), plain, self.limit)
        y = self.relative_uncertainty(alpha, beta)
        if self.variant is ISMVariant.SOFT and not self.is_similarity:
            # D_IN = α·e^{−y}: a product keeps its relative accuracy when e^{−y} underflows.
            return plain * torch.exp(-y)
        # t + (P − t)·e^{−y} written as P + (P − t)·(e^{−y} − 1), so that y = 0 gives P exactly
        # (1 − (1 − C)·1 is not C in floating point).
        return plain + (plain - self.limit) * torch.expm1(-y)

    def _strict_keep(self, alpha: Tensor, beta: Tensor) -> Tensor:
        """The strict form's indicator ``α^p − s·(β^p + γ) > 0`` (``s`` the warm-up strength)."""
        return (alpha.pow(self.power) - self.strength * (beta.pow(self.power) + self.gamma)) > 0

    def _operands(
        self, x: Tensor, y: Tensor | None, ux: Tensor | None, uy: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """``(P, y, u_y)``: the plain matrix and the right-hand side (the batch itself when ``y`` is
        omitted)."""
        if y is None:
            # The base metric is told it compares the batch with itself, so it normalises the batch
            # once (not once per side): bit for bit the plain metric's matrix.
            return self.base(x), x, ux
        return self.base(x, y), y, uy

    def _alpha(self, x: Tensor, y: Tensor, plain: Tensor) -> Tensor:
        """``α``: the distance itself, or for the similarity form ``δ = ||ŝ_i − ŝ_j||``."""
        if not self.is_similarity:
            return plain
        if self.delta_normalized and isinstance(self.base, CosineSimilarity):
            # On the unit sphere ||x̂ − ŷ||² = 2 − 2·cos: no second normalisation or Gram matrix.
            # The clamp keeps √ differentiable at C = 1 and is the identity above 10⁻¹².
            return (2.0 - 2.0 * plain).clamp_min(_EPS).sqrt()
        if self.delta_normalized:
            x, y = unit_rows(x), unit_rows(y)
        return safe_norm_from_squares(pairwise_squared_distance(x, y))

    def compare(self, x: Tensor, y: Tensor | None, ux: Tensor | None, uy: Tensor | None) -> Tensor:
        plain, y, uy = self._operands(x, y, ux, uy)
        if self.strength == 0:
            return plain
        beta = pairwise_uncertainty(ux, uy, x.shape[0], y.shape[0], plain)
        return self.weaken(plain, self._alpha(x, y, plain), beta)

    @torch.no_grad()
    def weakening(self, x: Embeddings, y: Embeddings | None = None) -> Tensor:
        """The weakening factor of every pair of ``x`` and ``y`` (``x`` itself when omitted),
        ``(B, B')``, without gradients: ``e^{−s·y}`` for the soft and dissimilar forms (1 = the
        plain metric, 0 = fully weakened), the indicator ``1[α^p > s·(β^p + γ)]`` for the strict
        form. What a saturation monitor looks at.

        >>> ism = IntrospectiveMetric(CosineSimilarity(), tau=5.0)
        >>> ism.weakening(Embeddings(torch.eye(2), torch.zeros(2, 3))).tolist()
        [[1.0, 1.0], [1.0, 1.0]]
        """
        xs, ux = x.semantic, x.uncertainty
        ys, uy = (None, None) if y is None else (y.semantic, y.uncertainty)
        plain, ys, uy = self._operands(xs, ys, ux, uy)
        beta = pairwise_uncertainty(ux, uy, xs.shape[0], ys.shape[0], plain)
        alpha = self._alpha(xs, ys, plain)
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
            xs, ys = (unit_rows(x), unit_rows(y)) if self.delta_normalized else (x, y)
            alpha = safe_norm_from_squares((xs - ys).pow(2).sum(1))
        else:
            alpha = plain
        # Both sides' uncertainty summed, one side's alone, or none (then no weakening).
        u = ux + uy if ux is not None and uy is not None else (ux if ux is not None else uy)
        beta = (
            plain.new_zeros(plain.shape) if u is None else safe_norm_from_squares(u.pow(2).sum(1))
        )
        return self.weaken(plain, alpha, beta)
