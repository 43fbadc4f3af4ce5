"""The typed container for what an encoder produces for a batch of images.

IDML gives every image a *semantic* embedding ``s ∈ R^d`` and an *uncertainty* embedding
``u ∈ R^{d_u}`` (IDML, Wang et al., Sec. III: ``y_IN = {s, u}``). Plain DML has only ``s``. The
uncertainty level reported for an image is ``||u||``.

Example:
    >>> import torch
    >>> e = Embeddings(torch.ones(4, 8), torch.zeros(4, 8))
    >>> len(e), e.dim, e.uncertainty_level().tolist()
    (4, 8, [0.0, 0.0, 0.0, 0.0])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from idml.checks import value_checks_enabled


@dataclass
class Embeddings:
    """Semantic embeddings ``(B, d)`` and optional uncertainty embeddings ``(B, d_u)``."""

    semantic: Tensor
    uncertainty: Tensor | None = None

    def __post_init__(self) -> None:
        check_matrix("embeddings", self.semantic)
        if self.uncertainty is not None:
            check_matrix("uncertainty", self.uncertainty)
            if self.uncertainty.shape[0] != self.semantic.shape[0]:
                raise ValueError(
                    f"uncertainty has {self.uncertainty.shape[0]} rows but embeddings has "
                    f"{self.semantic.shape[0]}; pass one uncertainty vector per image"
                )

    @classmethod
    def coerce(cls, embeddings: Tensor | Embeddings) -> Embeddings:
        return embeddings if isinstance(embeddings, Embeddings) else cls(embeddings)

    def __len__(self) -> int:
        return self.semantic.shape[0]

    @property
    def dim(self) -> int:
        return self.semantic.shape[1]

    @property
    def has_uncertainty(self) -> bool:
        return self.uncertainty is not None

    def uncertainty_level(self) -> Tensor:
        """``||u_i||`` per image (zeros when there is no uncertainty embedding)."""
        if self.uncertainty is None:
            return self.semantic.new_zeros(len(self))
        return self.uncertainty.norm(dim=1)

    def cat(self, other: Embeddings) -> Embeddings:
        if (self.uncertainty is None) != (other.uncertainty is None):
            raise ValueError("cannot concatenate embeddings with and without uncertainty")
        unc = None
        if self.uncertainty is not None and other.uncertainty is not None:
            unc = torch.cat([self.uncertainty, other.uncertainty])
        return Embeddings(torch.cat([self.semantic, other.semantic]), unc)

    def __getitem__(self, index: Tensor | slice) -> Embeddings:
        unc = None if self.uncertainty is None else self.uncertainty[index]
        return Embeddings(self.semantic[index], unc)

    def detach(self) -> Embeddings:
        unc = None if self.uncertainty is None else self.uncertainty.detach()
        return Embeddings(self.semantic.detach(), unc)

    def to(self, *args: Any, **kwargs: Any) -> Embeddings:
        unc = None if self.uncertainty is None else self.uncertainty.to(*args, **kwargs)
        return Embeddings(self.semantic.to(*args, **kwargs), unc)


class NonFiniteEmbeddingsError(ValueError):
    """An embedding matrix holds NaN or inf (a diverged model, not a caller's mistake of shape)."""


def check_matrix(name: str, value: Tensor) -> None:
    """Raise a ``ValueError`` naming ``name`` unless ``value`` is a finite floating ``(B, d)`` tensor."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() != 2:
        raise ValueError(f"{name} must have shape (batch, dim), got {tuple(value.shape)}")
    if not value.dtype.is_floating_point:
        raise ValueError(f"{name} must be a floating tensor, got dtype {value.dtype}")
    # A NaN or inf anywhere makes the sum non-finite: one reduction instead of an elementwise mask on
    # every loss call. The sum can also overflow on finite input, hence the exact check behind it.
    if not value_checks_enabled():
        return
    if not bool(torch.isfinite(value.detach().sum())) and not bool(torch.isfinite(value).all()):
        bad = (~torch.isfinite(value)).any(dim=1).nonzero().flatten()[:5].tolist()
        raise NonFiniteEmbeddingsError(
            f"{name} contains NaN or inf (rows {bad}...); check the learning rate, the input "
            "images and mixed precision settings"
        )
