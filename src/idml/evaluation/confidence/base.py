"""The confidence-score interface and its registry: one :class:`ConfidenceScore` class per score.

A score maps :class:`~idml.evaluation.confidence.answers.AnswerNeighbors` to one float64 value per
query, larger = surer that the top-1 neighbour's label is right, NaN for a query without any
neighbour. Each class sets ``name`` (its registry key) and, if it reads the first ``k``
neighbours, is a :class:`NeighbourScore` (whose one field is ``k``); its :attr:`~ConfidenceScore.key` (``"margin@10"``) names it in
reports, metric keys (``r_auroc_margin@10``) and calibrator files. :func:`register_score` adds a
class under its name, :func:`score_from_key` builds one back from a key (what a config or a
calibrator file holds), and :data:`CONFIDENCE_SCORES` lists them all.

Example:
    >>> score_from_key("agreement@5")
    KnnAgreement(k=5)
    >>> score_from_key("top1").key
    'top1'
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar

from torch import Tensor

from idml.evaluation.confidence.answers import AnswerNeighbors


class ConfidenceScore(ABC):
    """A per-query confidence computed from the neighbour lists (module docstring)."""

    name: ClassVar[str]
    """The registry key of the class (``key`` without the ``@k``)."""

    @property
    def key(self) -> str:
        """The score's name, with its neighbour count for a :class:`NeighbourScore`
        (``"agreement@10"``)."""
        return self.name

    @property
    def depth(self) -> int:
        """How many neighbours per query the score reads."""
        return 1

    needs_labels: ClassVar[bool] = False
    """Whether the score needs the gallery's labels (else it works on any index)."""
    needs_uncertainty: ClassVar[bool] = False
    """Whether the score needs the queries' ``||u||`` (a model with an uncertainty head)."""

    @property
    def hubness_k(self) -> int | None:
        """The ``k`` of the references' hubness the score needs (``None``: none)."""
        return None

    @abstractmethod
    def __call__(self, answers: AnswerNeighbors) -> Tensor:
        """``(Q,)`` float64 confidence of each query's answer (NaN: no neighbour)."""


_SCORES: dict[str, type[ConfidenceScore]] = {}
CONFIDENCE_SCORES: Mapping[str, type[ConfidenceScore]] = MappingProxyType(_SCORES)
"""Every registered confidence score class by name (read-only; see :func:`register_score`)."""


def register_score(cls: type[ConfidenceScore]) -> type[ConfidenceScore]:
    """Register a :class:`ConfidenceScore` dataclass under its ``name`` (a class decorator)."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"{cls.__name__}: name must be an identifier, got {name!r}")
    if not dataclasses.is_dataclass(cls):
        raise ValueError(f"{cls.__name__} must be a dataclass (its fields are its parameters)")
    fields = {f.name for f in dataclasses.fields(cls)}
    expected = {"k"} if issubclass(cls, NeighbourScore) else set()
    if fields != expected:
        raise ValueError(
            f"{cls.__name__}: a score's only parameter is k, in a NeighbourScore (the scores that "
            f"read k neighbours); got fields {sorted(fields)}"
        )
    old = _SCORES.get(name)
    if old is not None and old is not cls:
        raise ValueError(f"confidence score name {name!r} is taken by {old.__name__}")
    _SCORES[name] = cls
    return cls


def score_from_key(key: str) -> ConfidenceScore:
    """The score a key names: ``"top1"``, ``"margin@10"``, ``"agreement@5"``, ``"csls@10"``, …

    Raises:
        ValueError: an unknown name (listing the registered ones), a missing or invalid ``@k``
            for a score that reads ``k`` neighbours, or an ``@k`` for one that does not.
    """
    name, at, arg = str(key).partition("@")
    cls = _SCORES.get(name)
    if cls is None:
        known = ", ".join(
            f"{n}@k" if issubclass(c, NeighbourScore) else n for n, c in sorted(_SCORES.items())
        )
        raise ValueError(f"unknown confidence score {key!r}; known: {known}")
    if not issubclass(cls, NeighbourScore):
        if at:
            raise ValueError(f"confidence score {name!r} takes no @k, got {key!r}")
        return cls()
    if not arg.isdigit() or int(arg) < 1:
        raise ValueError(
            f"confidence score {name!r} reads k neighbours: write it {name}@k with k >= 1, "
            f"e.g. {name}@10 (got {key!r})"
        )
    return cls(k=int(arg))


@dataclass(frozen=True)
class NeighbourScore(ConfidenceScore):
    """A score that reads each query's first ``k`` neighbours (``k`` checked on construction)."""

    k: int = 10

    def __post_init__(self) -> None:
        k = self.k
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"{type(self).__name__}: k must be an integer >= 1, got {k!r}")

    @property
    def key(self) -> str:
        return f"{self.name}@{self.k}"

    @property
    def depth(self) -> int:
        return self.k
