"""Mixup-supervised uncertainty: an *extension* of IDML that ties ``||u||`` to how ambiguous a
Mixup image is by construction. It is not part of the paper's method and is off by default.

Why it exists: under the paper's objective the uncertainty level of an image only follows the
balance of its positive pulls and negative pushes through ISM (IDML, Wang et al. 2022, Eq. 5–6: for
the similarity form ``∂S_IN/∂β = δ·e^{−y}/(2τ)``, so far pairs — mostly negatives — dominate and
the level of most images falls). Measured in ``benchmarks/study_idml.py``, that objective alone does
not make Mixup images more uncertain than clean ones for every loss. This term says so directly:
for the bounded head's level ``ρ_i = ||u_i||/u_max ∈ (0, 1)`` and a row's ambiguity
``t_i ∈ [0, 1]`` (:attr:`idml.augment.AugmentedBatch.ambiguity`: ``1 − |2λ − 1|`` for a mix of two
classes, 0 for an original image),

    L_u = (1/N) Σ_i BCE(ρ_i, κ·t_i) = −(1/N) Σ_i [κt_i·log ρ_i + (1 − κt_i)·log(1 − ρ_i)]

with ``κ`` the target level of a 50/50 mix. Its gradient on the level logit ``a_i`` is
``(ρ_i − κt_i)/N``: original images are drawn towards ``ρ = 0`` (ISM leaves their pairs alone) and
a mix towards ``κ·t_i``, so the trainer adds ``η·L_u`` to the metric loss.

Example:
    >>> import torch
    >>> level = torch.tensor([0.02, 0.5, 0.25])
    >>> ambiguity = torch.tensor([0.0, 1.0, 0.5])  # an original, a 50/50 mix, a 25/75 mix
    >>> round(mixup_uncertainty_loss(level, ambiguity, target_level=0.5).item(), 4)
    0.4252
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

_LEVEL_CLAMP = 1e-6
"""``ρ`` is clamped into ``[10⁻⁶, 1 − 10⁻⁶]`` so that a level rounded to 0 or 1 in float32 keeps
a finite loss (the gradient there is still ``ρ − κt``)."""


def mixup_uncertainty_loss(level: Tensor, ambiguity: Tensor, target_level: float) -> Tensor:
    """``L_u``: the mean binary cross-entropy between the levels ``ρ = ||u||/u_max`` ``(N,)`` and
    their targets ``κ·t`` (see the module docstring); ``target_level`` is ``κ ∈ (0, 1]``."""
    if not 0.0 < target_level <= 1.0:
        raise ValueError(f"target_level must lie in (0, 1], got {target_level}")
    if level.shape != ambiguity.shape:
        raise ValueError(
            f"level {tuple(level.shape)} and ambiguity {tuple(ambiguity.shape)} must have one value "
            "per row"
        )
    rho = level.float().clamp(_LEVEL_CLAMP, 1.0 - _LEVEL_CLAMP)
    target = (target_level * ambiguity).to(rho.dtype)
    return F.binary_cross_entropy(rho, target)


__all__ = ["mixup_uncertainty_loss"]
