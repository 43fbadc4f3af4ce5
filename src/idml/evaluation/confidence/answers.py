"""What a confidence score reads: each query's nearest references, from the search's top-k lists.

A retrieval *answer* is the label of the query's nearest reference. Every confidence score of
:mod:`idml.evaluation.confidence` is a function of the query's first ``k`` neighbours — their
scores, their labels, how "hub-like" the top-1 reference is — and of the query's ``||u||``, so it
costs ``O(Q·k)`` next to the search's ``O(Q·R·d)`` and never needs an ``N×N`` matrix.

Example:
    >>> import torch
    >>> from idml.evaluation.search import NeighborLists
    >>> lists = NeighborLists(torch.tensor([[1, 2], [0, 2]]), torch.tensor([[0.9, 0.5], [0.9, 0.1]]))
    >>> answers = AnswerNeighbors.from_search(lists, reference_labels=torch.tensor([0, 0, 1]))
    >>> answers.labels.tolist(), answers.depth
    ([[0, 1], [0, 1]], 2)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from idml.evaluation.search import NeighborLists


@dataclass(frozen=True)
class ReferenceHubness:
    """Each reference's mean score to its ``k`` nearest *other* references.

    A reference close to many others (a "hub", Radovanović et al. 2010) is the nearest neighbour of
    many queries whatever their class, so a high similarity to it says less; this is the
    ``r_S`` term of CSLS (Conneau et al. 2018), with the gallery standing in for the queries' own
    distribution (exact in a same-set evaluation, where the queries are the gallery).
    """

    k: int
    values: Tensor
    """``(R,)`` float64: mean of each reference's first ``k`` neighbour scores (fewer when the
    gallery has fewer; NaN for a reference with no other)."""

    @classmethod
    def from_neighbors(cls, gallery_neighbors: NeighborLists, k: int) -> ReferenceHubness:
        """From the gallery searched against itself (each reference excluded from its own list),
        at least ``k`` deep."""
        if k < 1:
            raise ValueError(f"hubness needs k >= 1 neighbours, got {k}")
        if gallery_neighbors.k < k and gallery_neighbors.k < gallery_neighbors.indices.shape[0] - 1:
            raise ValueError(
                f"hubness@{k} needs the gallery's {k} nearest neighbours, but its lists hold "
                f"{gallery_neighbors.k}; search the gallery at least {k} deep"
            )
        return cls(k, _finite_mean(gallery_neighbors.scores[:, :k]))


@dataclass(frozen=True)
class AnswerNeighbors:
    """Each query's nearest references, as every confidence score reads them.

    Attributes:
        indices: ``(Q, k)`` reference index of each neighbour, nearest first (``-1``: none).
        scores: ``(Q, k)`` float64 search scores (larger = closer: the cosine similarity for
            cosine, ``−‖x − y‖²`` for Euclidean; see :class:`~idml.evaluation.scoring.PairScorer`),
            ``-inf`` where there is no neighbour.
        labels: ``(Q, k)`` class of each neighbour (``-1``: none); ``None`` when the gallery has
            no labels (scores that need them then raise).
        hubness: the references' hubness, for CSLS; ``None`` if not computed.
        uncertainty_level: ``(Q,)`` ``||u||`` of each query; ``None`` without an uncertainty head.
        num_references: the gallery's size, when known: lists shorter than a score's ``k`` are
            then accepted when they hold every other reference there is.
    """

    indices: Tensor
    scores: Tensor
    labels: Tensor | None = None
    hubness: ReferenceHubness | None = None
    uncertainty_level: Tensor | None = None
    num_references: int | None = None

    @classmethod
    def from_search(
        cls,
        neighbors: NeighborLists,
        reference_labels: Tensor | None = None,
        hubness: ReferenceHubness | None = None,
        uncertainty_level: Tensor | None = None,
    ) -> AnswerNeighbors:
        """From a search's (or a re-ranker's) neighbour lists and the gallery's labels."""
        indices = neighbors.indices.cpu().long()
        scores = neighbors.scores.detach().cpu().double()
        scores = scores.masked_fill(indices < 0, -torch.inf)
        labels = None
        if reference_labels is not None:
            ref = torch.as_tensor(reference_labels).cpu().long()
            labels = torch.where(indices >= 0, ref[indices.clamp_min(0)], -1)
        level = None
        if uncertainty_level is not None:
            level = torch.as_tensor(uncertainty_level).detach().cpu().double().flatten()
            if len(level) != len(indices):
                raise ValueError(
                    f"uncertainty_level has {len(level)} values but there are {len(indices)} "
                    "queries; pass one ||u|| per query"
                )
        size = None if reference_labels is None else len(ref)
        if size is None and hubness is not None:
            size = len(hubness.values)
        return cls(indices, scores, labels, hubness, level, size)

    def take(self, rows: Tensor) -> AnswerNeighbors:
        """The answers of the queries ``rows`` (indices or a bool mask), in that order."""
        level = None if self.uncertainty_level is None else self.uncertainty_level[rows]
        labels = None if self.labels is None else self.labels[rows]
        return AnswerNeighbors(
            self.indices[rows], self.scores[rows], labels, self.hubness, level, self.num_references
        )

    @property
    def depth(self) -> int:
        """Neighbours per query."""
        return int(self.indices.shape[1])

    @property
    def answered(self) -> Tensor:
        """``(Q,)`` bool: the query has at least one neighbour (an answer)."""
        if self.depth == 0:
            return torch.zeros(len(self.indices), dtype=torch.bool)
        return self.indices[:, 0] >= 0

    def need_depth(self, k: int, score: str) -> None:
        """Raise unless the lists hold ``k`` neighbours (or every reference there is)."""
        short = self.depth < k
        if short and self.num_references is not None:
            # A same-set search holds at most R − 1 neighbours per query.
            short = self.depth < self.num_references - 1
        if short:
            raise ValueError(
                f"confidence score {score} reads {k} neighbours per query but the lists hold "
                f"{self.depth}; search at least {k} deep"
            )

    def need_labels(self, score: str) -> Tensor:
        """The neighbours' labels, or a clear error naming ``score``."""
        if self.labels is None:
            raise ValueError(
                f"confidence score {score} needs the labels of the references (the gallery); "
                "pass reference_labels, or use a label-free score (top1, csls@k)"
            )
        return self.labels

    def need_hubness(self, k: int, score: str) -> ReferenceHubness:
        """The references' hubness at ``k``, or a clear error naming ``score``."""
        if self.hubness is None or self.hubness.k != k:
            have = "none" if self.hubness is None else f"hubness@{self.hubness.k}"
            raise ValueError(
                f"confidence score {score} needs the references' hubness at k={k} (have {have}); "
                f"pass ReferenceHubness.from_neighbors(gallery_neighbors, {k})"
            )
        return self.hubness

    def need_uncertainty(self, score: str) -> Tensor:
        """The queries' ``||u||``, or a clear error naming ``score``."""
        if self.uncertainty_level is None:
            raise ValueError(
                f"confidence score {score} needs each query's uncertainty level ||u|| (a model "
                "with an uncertainty head); pass uncertainty_level"
            )
        return self.uncertainty_level


def _finite_mean(scores: Tensor) -> Tensor:
    """Row means of the finite entries (``-inf`` marks a missing neighbour); NaN for none."""
    s = scores.detach().cpu().double()
    finite = torch.isfinite(s)
    total = torch.where(finite, s, torch.zeros_like(s)).sum(1)
    return total / finite.sum(1)
