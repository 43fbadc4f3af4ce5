"""Logistic calibrator: ``P(top-1 right) = σ(b + Σ_j w_j · (f_j − μ_j)/σ_j)`` over a few scores.

Platt scaling (Platt 1999) extended to several confidence scores ``f_j`` (top-1 similarity,
margin, k-NN agreement, …): a logistic regression of "the top-1 neighbour has the query's class"
on the standardised scores, fitted by maximum likelihood with a weak L2 penalty (scikit-learn's
``LogisticRegression``, ``C = 1`` on standardised features: a prior that only matters with few
calibration queries or separable data). Four numbers per score, so it fits on a few hundred
held-out queries without overfitting, and its output is a probability whose ranking can beat every
single score (it weighs them). Why this and not only isotonic regression:
:mod:`idml.evaluation.confidence.isotonic`.

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

import torch
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
        inverse_regularization: float = 1.0,
    ) -> LogisticCalibrator:
        """Fit on ``values`` ``(n, f)`` (column ``j`` = ``features[j]`` of each calibration
        query) and ``correct`` ``(n,)`` (the query's top-1 neighbour has its class)."""
        from sklearn.linear_model import LogisticRegression

        x = torch.as_tensor(values).double()
        y = torch.as_tensor(correct).bool()
        mean = x.mean(0)
        scale = x.std(0, unbiased=False)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        model = LogisticRegression(C=inverse_regularization, tol=1e-10, max_iter=10_000)
        model.fit(((x - mean) / scale).numpy(), y.numpy())
        return cls(
            tuple(features),
            tuple(mean.tolist()),
            tuple(scale.tolist()),
            tuple(float(w) for w in model.coef_[0]),
            float(model.intercept_[0]),
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
