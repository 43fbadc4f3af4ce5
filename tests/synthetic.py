"""Synthetic embeddings for evaluation tests."""

from __future__ import annotations

import numpy as np


def clustered(
    n: int, classes: int, dim: int, noise: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """``n`` float32 points around ``classes`` Gaussian centres (``noise`` × unit spread), with
    uniformly drawn integer labels."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, n)
    centers = rng.standard_normal((classes, dim))
    x = centers[labels] + noise * rng.standard_normal((n, dim))
    return x.astype(np.float32), labels
