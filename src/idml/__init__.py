"""idml: deep metric learning with introspective similarity (IDML) and self-supervised ranking (SSR).

The names below are imported on first use (PEP 562), so ``import idml`` — and with it the
command line's parser, ``idml --help`` and ``idml --version`` — does not load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Embeddings": "idml.embeddings",
    "CosineSimilarity": "idml.metrics",
    "EuclideanDistance": "idml.metrics",
    "IntrospectiveMetric": "idml.metrics",
    "ISMVariant": "idml.metrics",
    "Metric": "idml.metrics",
    "LabelSets": "idml.relations",
    "pair_masks": "idml.relations",
}
"""Public name → the module that defines it."""

if TYPE_CHECKING:
    from idml.embeddings import Embeddings
    from idml.metrics import (
        CosineSimilarity,
        EuclideanDistance,
        IntrospectiveMetric,
        ISMVariant,
        Metric,
    )
    from idml.relations import LabelSets, pair_masks


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'idml' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = [
    "CosineSimilarity",
    "Embeddings",
    "EuclideanDistance",
    "ISMVariant",
    "IntrospectiveMetric",
    "LabelSets",
    "Metric",
    "__version__",
    "pair_masks",
]
