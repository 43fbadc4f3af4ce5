"""Isotonic calibrator: ``P(top-1 right) = g(f)``, ``g`` the non-decreasing fit to one score.

Isotonic regression (Zadrozny & Elkan 2002) of "the top-1 neighbour has the query's class" on a
single confidence score ``f``: the pool-adjacent-violators fit, evaluated between its breakpoints by
linear interpolation and clipped to the end values outside them (scikit-learn's
``IsotonicRegression``, ``out_of_bounds="clip"``). It makes no parametric assumption, so it can
calibrate any monotone relation, but it cannot combine scores, keeps the ranking of its one input
(its R-AUROC is that score's, less what its flat steps tie) and needs more calibration queries
than the four numbers per score of :mod:`idml.evaluation.confidence.logistic`. Which one a run
uses is chosen by measurement (``benchmarks/study_confidence.py``).

Example:
    >>> import torch
    >>> from idml.evaluation.confidence.top1 import Top1Similarity
    >>> x = torch.tensor([[0.1], [0.2], [0.3], [0.6], [0.7], [0.9]])
    >>> right = torch.tensor([False, False, True, False, True, True])
    >>> cal = IsotonicCalibrator.fit((Top1Similarity(),), x, right)
    >>> cal.predict(torch.tensor([[0.0], [0.45], [1.0]])).tolist()
    [0.0, 0.5, 1.0]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from idml.evaluation.confidence.base import ConfidenceScore, score_from_key


@dataclass(frozen=True)
class IsotonicCalibrator:
    """A fitted non-decreasing step-and-ramp function of one score (module docstring)."""

    features: tuple[ConfidenceScore, ...]
    """Exactly one score."""
    thresholds: tuple[float, ...]
    """The fit's breakpoints in the score, increasing."""
    probabilities: tuple[float, ...]
    """``g`` at each breakpoint, non-decreasing, in ``[0, 1]``."""

    kind: ClassVar[str] = "isotonic"

    def __post_init__(self) -> None:
        if len(self.features) != 1:
            raise ValueError(
                f"an isotonic calibrator maps exactly one score, got {len(self.features)}"
            )
        t, p = np.asarray(self.thresholds), np.asarray(self.probabilities)
        if len(t) == 0 or len(t) != len(p):
            raise ValueError(
                f"an isotonic calibrator needs as many probabilities as thresholds (at least "
                f"one), got {len(t)} and {len(p)}"
            )
        if np.any(np.diff(t) < 0) or np.any(np.diff(p) < 0) or p.min() < 0 or p.max() > 1:
            raise ValueError(
                "isotonic thresholds and probabilities must be non-decreasing, probabilities "
                "in [0, 1]"
            )

    @classmethod
    def fit(
        cls, features: Sequence[ConfidenceScore], values: Tensor, correct: Tensor
    ) -> IsotonicCalibrator:
        """Fit on ``values`` ``(n, 1)`` and ``correct`` ``(n,)``."""
        from sklearn.isotonic import IsotonicRegression

        x = torch.as_tensor(values).double()
        if x.dim() != 2 or x.shape[1] != 1:
            raise ValueError(
                f"isotonic calibration fits one score: values must be (n, 1), got {tuple(x.shape)}"
            )
        model = IsotonicRegression(y_min=0.0, y_max=1.0, out_of_bounds="clip")
        model.fit(x[:, 0].numpy(), torch.as_tensor(correct).double().numpy())
        return cls(
            tuple(features),
            tuple(float(v) for v in model.X_thresholds_),
            tuple(float(v) for v in model.y_thresholds_),
        )

    def predict(self, values: Tensor) -> Tensor:
        """``(n,)`` float64 probabilities from ``(n, 1)`` scores (NaN stays NaN)."""
        x = torch.as_tensor(values).double()[:, 0].numpy()
        p = np.interp(x, np.asarray(self.thresholds), np.asarray(self.probabilities))
        return torch.from_numpy(np.where(np.isnan(x), np.nan, p))

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (see :mod:`idml.evaluation.confidence.calibration`)."""
        return {
            "kind": self.kind,
            "features": [f.key for f in self.features],
            "thresholds": list(self.thresholds),
            "probabilities": list(self.probabilities),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> IsotonicCalibrator:
        return cls(
            tuple(score_from_key(k) for k in data["features"]),
            tuple(float(v) for v in data["thresholds"]),
            tuple(float(v) for v in data["probabilities"]),
        )
