"""The self-supervised ranking loss of SSR (Fu et al. 2021, eq. 13–17).

With ``S_{m,n} = cos(g(x_m), g(T_n(x_m)))`` the similarity of image ``m`` to its view at level
``n = 1..N`` in the ranking head's space, views of weaker transforms must be more similar by a margin
``α`` (eq. 11–13), and every view must stay above a boundary ``β`` (eq. 16)::

    L_sort = mean_m (1/s) · log[1 + Σ_{n=1}^{N−1} exp(s · (S_{m,n+1} − S_{m,n} + α))]     (eq. 14)
    L_pos  = mean_m (1/s) · log[1 + Σ_{n=1}^{N}   exp(−s · (S_{m,n} − β))]                (eq. 16)
    L_ranking = L_sort + λ · L_pos                                                         (eq. 17)

The ``1/s`` factor is the one under which the paper's gradient (eq. 15) holds as printed, with no
``s``: with ``h_{m,n} = exp(s · (S_{m,n+1} − S_{m,n} + α))`` (``h_{m,0} = h_{m,N} = 0``),
``∂L_sort/∂S_{m,n} = (1/M) · (h_{m,n−1} − h_{m,n}) / (1 + Σ_j h_{m,j})`` — harder (more violated) pairs
get larger gradients. As ``s → ∞`` an image's term tends to the largest of its hinges
``[S_{m,n+1} − S_{m,n} + α]₊`` (eq. 13 with the mean replaced by a max), so views ordered by more
than the margin cost nothing.

Example:
    >>> import torch
    >>> ordered = torch.tensor([[0.95, 0.8, 0.65, 0.5]])  # gaps of 0.15 > α = 0.05
    >>> out = RankingLoss(scale=200.0, margin=0.05, boundary=0.4)(ordered)
    >>> round(out.sort.item(), 6), round(out.pos.item(), 6)
    (0.0, 0.0)
    >>> swapped = torch.tensor([[0.8, 0.95, 0.65, 0.5]])
    >>> round(RankingLoss(scale=200.0)(swapped).sort.item(), 3)  # → the worst hinge 0.15 + 0.05
    0.2
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor, nn

from idml.metrics import unit_rows


class RankingOutput(NamedTuple):
    """The ranking loss and its parts; tensors keep their graph (detach them for logging)."""

    loss: Tensor
    """Scalar ``L_ranking = L_sort + λ·L_pos`` (eq. 17); *not* yet weighted by ``γ_r`` (eq. 18)."""
    sort: Tensor
    """Scalar ``L_sort`` (eq. 14)."""
    pos: Tensor
    """Scalar ``L_pos`` (eq. 16)."""
    similarities: Tensor
    """``(M, N)`` similarities ``S_{m,n}`` of each image to its views ``n = 1..N``."""


def view_similarities(embeddings: Tensor) -> Tensor:
    """``S_{m,n} = cos(z_{m,0}, z_{m,n})`` for ``n = 1..N`` from ``(M, N + 1, d)`` view embeddings.

    View 0 is the original image. Embeddings are L2-normalised here (in float32 at least), so the
    head's output may be passed as is, normalised or not.
    """
    _check_finite_float("embeddings", embeddings)
    if embeddings.dim() != 3 or embeddings.shape[1] < 2 or embeddings.shape[0] < 1:
        raise ValueError(
            "embeddings must have shape (M images, N + 1 views, dim) with the original first and "
            f"N >= 1, got {tuple(embeddings.shape)}"
        )
    z = unit_rows(embeddings.to(torch.promote_types(embeddings.dtype, torch.float32)), dim=-1)
    return (z[:, 1:] * z[:, :1]).sum(dim=-1)


def sort_loss(similarities: Tensor, scale: float = 12.0, margin: float = 0.05) -> Tensor:
    """``L_sort = mean_m (1/s)·log[1 + Σ_{n=1}^{N−1} exp(s·(S_{m,n+1} − S_{m,n} + α))]`` (eq. 14).

    Zero terms for ``N = 1`` (nothing to order).
    """
    check_similarities(similarities)
    gaps = similarities[:, 1:] - similarities[:, :-1] + margin
    return _log1p_sum_exp(scale * gaps).mean() / scale


def positive_loss(similarities: Tensor, scale: float = 12.0, boundary: float = 0.5) -> Tensor:
    """``L_pos = mean_m (1/s)·log[1 + Σ_{n=1}^{N} exp(−s·(S_{m,n} − β))]`` (eq. 16)."""
    check_similarities(similarities)
    return _log1p_sum_exp(-scale * (similarities - boundary)).mean() / scale


def order_accuracy(similarities: Tensor, margin: float = 0.0) -> Tensor:
    """Share of adjacent levels ranked correctly, ``mean[S_{m,n} − S_{m,n+1} > margin]`` (for logging).

    With ``margin = 0``: 1 when every image's views are ordered by transform strength. With the loss's
    ``α_r``: the share of pairs eq. 13 no longer penalises. NaN for ``N = 1``.
    """
    check_similarities(similarities)
    return (similarities[:, :-1] - similarities[:, 1:] > margin).float().mean()


class RankingLoss(nn.Module):
    """``L_ranking = L_sort + λ·L_pos`` of SSR (Fu et al. 2021, eq. 14, 16, 17).

    ``forward`` takes either the ``(M, N)`` similarity matrix ``S`` (columns ``n = 1..N``) or the
    ``(M, N + 1, d)`` ranking-head outputs with the original view first, and returns a
    :class:`RankingOutput` (loss, ``L_sort``, ``L_pos``, ``S``).

    Args:
        scale: ``s`` [12], the sharpness of the smooth maximum.
        margin: ``α_r`` [0.05] between the similarities of adjacent levels.
        boundary: ``β_r`` [0.5] every view's similarity should exceed.
        pos_weight: ``λ_r`` [1] of ``L_pos``.
    """

    def __init__(
        self,
        scale: float = 12.0,
        margin: float = 0.05,
        boundary: float = 0.5,
        pos_weight: float = 1.0,
    ) -> None:
        super().__init__()
        for name, value, positive in (
            ("scale", scale, True),
            ("margin", margin, False),
            ("boundary", boundary, False),
            ("pos_weight", pos_weight, False),
        ):
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
            ):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            if positive and value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if pos_weight < 0:
            raise ValueError(f"pos_weight must be >= 0, got {pos_weight}")
        self.scale = float(scale)
        self.margin = float(margin)
        self.boundary = float(boundary)
        self.pos_weight = float(pos_weight)

    def extra_repr(self) -> str:
        return (
            f"scale={self.scale}, margin={self.margin}, boundary={self.boundary}, "
            f"pos_weight={self.pos_weight}"
        )

    def forward(self, inputs: Tensor) -> RankingOutput:
        """Loss from similarities ``(M, N)`` or view embeddings ``(M, N + 1, d)`` (dispatch on ``dim``)."""
        if not isinstance(inputs, Tensor):
            raise TypeError(f"inputs must be a torch.Tensor, got {type(inputs).__name__}")
        if inputs.dim() == 3:
            similarities = view_similarities(inputs)
        elif inputs.dim() == 2:
            similarities = inputs
        else:
            raise ValueError(
                "inputs must be similarities (M, N) or view embeddings (M, N + 1, dim), got shape "
                f"{tuple(inputs.shape)}"
            )
        sort = sort_loss(similarities, self.scale, self.margin)
        pos = positive_loss(similarities, self.scale, self.boundary)
        return RankingOutput(sort + self.pos_weight * pos, sort, pos, similarities)


def check_similarities(similarities: Tensor) -> None:
    """Raise ``ValueError`` unless ``similarities`` is a finite float ``(M, N)`` matrix, ``M, N >= 1``."""
    _check_finite_float("similarities", similarities)
    if similarities.dim() != 2 or similarities.shape[0] < 1 or similarities.shape[1] < 1:
        raise ValueError(
            "similarities must have shape (M images, N levels) with M, N >= 1, got "
            f"{tuple(similarities.shape)}"
        )


def _check_finite_float(name: str, value: Tensor) -> None:
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if not value.dtype.is_floating_point:
        raise ValueError(f"{name} must be a floating tensor, got dtype {value.dtype}")
    if not bool(torch.isfinite(value).all()):
        raise ValueError(
            f"{name} contains NaN or inf; check the ranking head's inputs and mixed-precision settings"
        )


def _log1p_sum_exp(logits: Tensor) -> Tensor:
    """``log(1 + Σ_n exp(logits[:, n]))`` per row, stable for large logits (logsumexp with a 0 term)."""
    zero = logits.new_zeros(logits.shape[0], 1)
    return torch.logsumexp(torch.cat([zero, logits], dim=1), dim=1)
