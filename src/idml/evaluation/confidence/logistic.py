"""Logistic calibrator: ``P(top-1 right) = σ(b + Σ_j w_j · (f_j − μ_j)/σ_j)`` over a few scores.

Platt scaling (Platt 1999) extended to several confidence scores ``f_j`` (top-1 similarity,
margin, k-NN agreement, …): a logistic regression of "the top-1 neighbour has the query's class"
on the standardised scores, fitted by maximum likelihood with a weak L2 penalty
(``Σ_i log-loss_i + ½‖w‖²``, scikit-learn's ``C = 1`` objective; the intercept is not penalised)
and **non-negative weights** ``w_j ≥ 0``. Every score is oriented as a confidence (larger =
surer), so a negative weight would say "surer by this score, so more likely wrong": with the
handful of wrong answers a calibration split often has, maximum likelihood finds such signs by
chance, and on new classes they turn the ranking upside down (measured on the demo: one seed with
a single wrong answer in its fit half fell to R-AUROC ≈ 0.2). The constraint lets a useless score
drop out (weight 0) but never reverse. Fitted by L-BFGS-B on the exact gradient, in float64.

Four numbers per score, so it fits on a few hundred held-out queries, and its output is a
probability whose ranking can beat every single score (it weighs them). Why this and not only
isotonic regression: :mod:`idml.evaluation.confidence.isotonic`.

Example:
    >>> import torch
    >>> from idml.evaluation.confidence.top1 import Top1Similarity
    >>> x = torch.tensor([[0.1], [0.2], [0.3], [0.6], [0.7], [0.9]])
    >>> right = torch.tensor([False, False, True, False, True, True])
    >>> cal = LogisticCalibrator.fit((Top1Similarity(),), x, right)
    >>> p = cal.predict(torch.tensor([[0.0], [1.0]])).tolist()
    >>> p[0] < 0.5 < p[1]
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from scipy.special import expit
from torch import Tensor

from idml.evaluation.confidence.base import ConfidenceScore, score_from_key


@dataclass(frozen=True)
class LogisticCalibrator:
    """A fitted logistic model on the scores ``features`` (module docstring)."""

    features: tuple[ConfidenceScore, ...]
    mean: tuple[float, ...]
    """``μ_j``: each score's mean on the calibration queries."""
    scale: tuple[float, ...]
    """``σ_j``: each score's standard deviation there (1 for a constant score)."""
    weights: tuple[float, ...]
    """``w_j``: the weight of each standardised score."""
    bias: float

    kind: ClassVar[str] = "logistic"

    def __post_init__(self) -> None:
        n = len(self.features)
        if n == 0 or any(len(v) != n for v in (self.mean, self.scale, self.weights)):
            raise ValueError(
                f"a logistic calibrator needs one mean, scale and weight per feature; got "
                f"{n} features, {len(self.mean)} means, {len(self.scale)} scales, "
                f"{len(self.weights)} weights"
            )
        if any(not s > 0 for s in self.scale):
            raise ValueError(f"feature scales must be positive, got {list(self.scale)}")

    @classmethod
    def fit(
        cls,
        features: Sequence[ConfidenceScore],
        values: Tensor,
        correct: Tensor,
        penalty: float = 1.0,
    ) -> LogisticCalibrator:
        """Fit on ``values`` ``(n, f)`` (column ``j`` = ``features[j]`` of each calibration
        query) and ``correct`` ``(n,)`` (the query's top-1 neighbour has its class), minimising
        ``Σ_i log(1 + exp(−ỹ_i z_i)) + (penalty/2)·‖w‖²`` (``ỹ = ±1``) over ``w ≥ 0`` and ``b``."""
        x = torch.as_tensor(values).double()
        y = torch.as_tensor(correct).bool()
        mean = x.mean(0)
        scale = x.std(0, unbiased=False)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        weights, bias = _fit_nonnegative((x - mean) / scale, y, penalty)
        return cls(
            tuple(features),
            tuple(mean.tolist()),
            tuple(scale.tolist()),
            tuple(weights.tolist()),
            float(bias),
        )

    def predict(self, values: Tensor) -> Tensor:
        """``(n,)`` float64 probabilities from the feature matrix ``(n, f)`` (NaN rows stay NaN)."""
        x = torch.as_tensor(values).double()
        mean, scale, weights = (
            torch.tensor(v, dtype=torch.float64) for v in (self.mean, self.scale, self.weights)
        )
        return torch.sigmoid((x - mean) / scale @ weights + self.bias)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (see :mod:`idml.evaluation.confidence.calibration`)."""
        return {
            "kind": self.kind,
            "features": [f.key for f in self.features],
            "mean": list(self.mean),
            "scale": list(self.scale),
            "weights": list(self.weights),
            "bias": self.bias,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LogisticCalibrator:
        return cls(
            tuple(score_from_key(k) for k in data["features"]),
            tuple(float(v) for v in data["mean"]),
            tuple(float(v) for v in data["scale"]),
            tuple(float(v) for v in data["weights"]),
            float(data["bias"]),
        )


def _fit_nonnegative(z: Tensor, right: Tensor, penalty: float) -> tuple[Tensor, float]:
    """``argmin_{w ≥ 0, b} Σ_i softplus(−ỹ_i (z_i·w + b)) + (penalty/2)·‖w‖²`` by L-BFGS-B."""
    from scipy.optimize import minimize

    z_np = z.numpy()
    sign = np.where(right.numpy(), 1.0, -1.0)

    def objective(theta: np.ndarray) -> tuple[float, np.ndarray]:
        w, b = theta[:-1], theta[-1]
        margin = sign * (z_np @ w + b)
        loss = np.logaddexp(0.0, -margin).sum() + 0.5 * penalty * w @ w
        # d/dm softplus(−m) = −σ(−m)
        g = -sign * expit(-margin)
        return float(loss), np.append(z_np.T @ g + penalty * w, g.sum())

    start = np.zeros(z_np.shape[1] + 1)
    bounds = [(0.0, None)] * z_np.shape[1] + [(None, None)]
    result = minimize(
        objective,
        start,
        jac=True,
        method="L-BFGS-B",
        bounds=bounds,
        options={"maxiter": 10_000, "ftol": 1e-15, "gtol": 1e-10},
    )
    return torch.from_numpy(result.x[:-1].copy()), float(result.x[-1])
