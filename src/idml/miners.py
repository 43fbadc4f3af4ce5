"""Miners: choose the informative pairs or triplets of a batch from the metric matrix the loss sees.

A miner reads a ``(B, B)`` metric matrix (distance or similarity, plain or introspective) and the
batch's label sets, and returns typed indices: :class:`PairIndices` for pair losses (contrastive,
multi-similarity) or :class:`TripletIndices` for triplet losses (triplet, margin). Mining runs under
``torch.no_grad`` on a detached matrix: it selects terms, gradients flow only through the loss.

Positives and negatives always come from :class:`~idml.relations.LabelSets`, so Mixup *set labels*
work unchanged (two images are positives iff their label sets intersect, as IDML defines for
Mixup); no miner looks
at integer labels.

Every miner is written once in *similarity orientation*: a distance ``D`` is mined as ``−D``, so
"more similar" is always "larger" (see :func:`~idml.metrics.oriented`, re-exported here with
:func:`~idml.metrics.to_distance`; losses use the same rules as :meth:`~idml.metrics.Metric.oriented`).

Example:
    >>> import torch
    >>> from idml.metrics import EuclideanDistance
    >>> from idml.relations import LabelSets
    >>> x = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.6, 0.8], [0.0, 1.0]])
    >>> labels = LabelSets.from_labels(torch.tensor([0, 0, 1, 1]))
    >>> d = EuclideanDistance()(x)
    >>> SemiHardMiner(margin=0.5)(d, labels, similarity=False).anchor.tolist()
    [0, 1, 2, 3]
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Literal, NamedTuple

import torch
from torch import Tensor

from idml.embeddings import Embeddings
from idml.metrics import Metric, oriented, to_distance
from idml.relations import LabelSets

__all__ = [
    "DistanceWeightedMiner",
    "Miner",
    "MinerArg",
    "MultiSimilarityMiner",
    "PairIndices",
    "SemiHardMiner",
    "TripletIndices",
    "all_pairs",
    "all_triplets",
    "as_pairs",
    "as_triplets",
    "oriented",
    "resolve_miner",
    "to_distance",
    "triplet_mask",
]


class PairIndices(NamedTuple):
    """Anchor–positive pairs ``(anchor_pos[k], positive[k])`` and anchor–negative pairs
    ``(anchor_neg[k], negative[k])``, each a 1-D long tensor of row indices into the batch."""

    anchor_pos: Tensor
    positive: Tensor
    anchor_neg: Tensor
    negative: Tensor

    @classmethod
    def from_masks(cls, positive: Tensor, negative: Tensor) -> PairIndices:
        """All ``True`` entries of two ``(B, B)`` boolean masks, in row-major order."""
        anchor_pos, pos = positive.nonzero(as_tuple=True)
        anchor_neg, neg = negative.nonzero(as_tuple=True)
        return cls(anchor_pos, pos, anchor_neg, neg)

    def masks(self, size: int) -> tuple[Tensor, Tensor]:
        """``(positive, negative)`` boolean ``(size, size)`` masks of the selected pairs."""
        pos = torch.zeros(size, size, dtype=torch.bool, device=self.anchor_pos.device)
        neg = torch.zeros_like(pos)
        pos[self.anchor_pos, self.positive] = True
        neg[self.anchor_neg, self.negative] = True
        return pos, neg


class TripletIndices(NamedTuple):
    """Triplets ``(anchor[k], positive[k], negative[k])`` as three 1-D long tensors."""

    anchor: Tensor
    positive: Tensor
    negative: Tensor

    @classmethod
    def from_mask(cls, mask: Tensor) -> TripletIndices:
        """All ``True`` entries of a ``(B, B, B)`` mask indexed ``[anchor, positive, negative]``."""
        anchor, pos, neg = mask.nonzero(as_tuple=True)
        return cls(anchor, pos, neg)

    @property
    def size(self) -> int:
        """Number of triplets (``count`` would shadow ``tuple.count``)."""
        return int(self.anchor.numel())


# ---------------------------------------------------------------------------------------- helpers
def triplet_mask(labels: LabelSets) -> Tensor:
    """``(B, B, B)`` mask of valid triplets ``[a, p, n]``: ``p`` positive and ``n`` negative of ``a``."""
    return labels.positive_mask()[:, :, None] & labels.negative_mask()[:, None, :]


def all_pairs(labels: LabelSets) -> PairIndices:
    """Every ordered positive pair (self excluded) and every ordered negative pair of the batch."""
    return PairIndices.from_masks(labels.positive_mask(), labels.negative_mask())


def all_triplets(labels: LabelSets) -> TripletIndices:
    """Every triplet ``(a, p, n)`` with ``p`` a positive and ``n`` a negative of ``a``."""
    return TripletIndices.from_mask(triplet_mask(labels))


def as_pairs(indices: PairIndices | TripletIndices) -> PairIndices:
    """Pairs from mined indices; a triplet ``(a, p, n)`` gives the pairs ``(a, p)`` and ``(a, n)``.

    Pairs shared by several triplets are repeated, so a pair loss weighs them as the miner did.
    """
    if isinstance(indices, PairIndices):
        return indices
    return PairIndices(indices.anchor, indices.positive, indices.anchor, indices.negative)


def as_triplets(indices: PairIndices | TripletIndices, size: int) -> TripletIndices:
    """Triplets from mined indices; mined pairs give every ``(a, p, n)`` with ``(a, p)`` and ``(a, n)``
    both mined (repeated pairs count once)."""
    if isinstance(indices, TripletIndices):
        return indices
    pos, neg = indices.masks(size)
    return TripletIndices.from_mask(pos[:, :, None] & neg[:, None, :])


def _check_inputs(matrix: Tensor, labels: LabelSets) -> None:
    if not isinstance(matrix, Tensor) or matrix.dim() != 2 or matrix.shape[0] != matrix.shape[1]:
        shape = tuple(matrix.shape) if isinstance(matrix, Tensor) else type(matrix).__name__
        raise ValueError(
            f"matrix must be a square (batch, batch) metric matrix of the batch, got {shape}"
        )
    if not matrix.dtype.is_floating_point:
        raise ValueError(f"matrix must be a floating tensor, got dtype {matrix.dtype}")
    if len(labels) != matrix.shape[0]:
        raise ValueError(
            f"labels has {len(labels)} entries but matrix has {matrix.shape[0]} rows; "
            "pass one label (set) per batch element"
        )
    if not bool(torch.isfinite(matrix).all()):
        raise ValueError("matrix contains NaN or inf; check the embeddings and the metric")


# ---------------------------------------------------------------------------------------- miners
class Miner(ABC):
    """Selects pairs or triplets of a batch from its ``(B, B)`` metric matrix.

    Call it as ``miner(matrix, labels, similarity=..., dim=...)`` where ``similarity`` says whether the
    matrix is a similarity (larger = more alike) and ``dim`` is the embedding dimension (used only by
    :class:`DistanceWeightedMiner`). Subclasses implement :meth:`mine`, which runs without gradient.
    """

    repr_fields: ClassVar[tuple[str, ...]] = ()
    """The settings ``repr`` shows as ``name=value``."""

    def __repr__(self) -> str:
        settings = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.repr_fields)
        return f"{type(self).__name__}({settings})"

    def __call__(
        self,
        matrix: Tensor,
        labels: Tensor | LabelSets,
        *,
        similarity: bool,
        dim: int | None = None,
    ) -> PairIndices | TripletIndices:
        """Validate the ``(B, B)`` matrix against ``labels`` and mine it without gradient."""
        sets = LabelSets.coerce(labels)
        _check_inputs(matrix, sets)
        with torch.no_grad():
            return self.mine(matrix.detach(), sets.to(matrix.device), similarity, dim)

    def mine_embeddings(
        self, embeddings: Tensor | Embeddings, labels: Tensor | LabelSets, metric: Metric
    ) -> PairIndices | TripletIndices:
        """Mine directly from embeddings under ``metric`` (the matrix is computed without gradient)."""
        emb = Embeddings.coerce(embeddings)
        with torch.no_grad():
            matrix = metric(emb.semantic, ux=emb.uncertainty)
        return self(matrix, labels, similarity=metric.is_similarity, dim=emb.dim)

    @abstractmethod
    def mine(
        self, matrix: Tensor, labels: LabelSets, similarity: bool, dim: int | None
    ) -> PairIndices | TripletIndices:
        """Select indices from a validated, detached matrix."""


MinerArg = Miner | Literal["default"] | None
"""A loss's ``miner`` argument: a miner, ``"default"`` (the loss's paper miner) or ``None`` (all)."""


def resolve_miner(miner: MinerArg, default: Miner | None) -> Miner | None:
    """The miner a loss uses: ``default`` for ``"default"``, otherwise ``miner`` itself."""
    if isinstance(miner, str):
        if miner != "default":
            raise ValueError(f'miner must be a Miner, "default" or None, got {miner!r}')
        return default
    if miner is not None and not isinstance(miner, Miner):
        raise ValueError(f'miner must be a Miner, "default" or None, got {type(miner).__name__}')
    return miner


class _SimilarityMiner(Miner):
    """A miner written in similarity orientation: it selects from ``S`` (a distance as ``−D``).

    Subclasses implement :meth:`select`.
    """

    def mine(
        self, matrix: Tensor, labels: LabelSets, similarity: bool, dim: int | None
    ) -> PairIndices | TripletIndices:
        return self.select(oriented(matrix, similarity), labels)

    @abstractmethod
    def select(self, s: Tensor, labels: LabelSets) -> PairIndices | TripletIndices:
        """Select indices from ``s``, the validated, detached matrix with larger = more alike."""


_CHUNK_ENTRIES = 1 << 24
"""Largest ``(positive pairs, B)`` block :class:`SemiHardMiner` compares at once (bounds memory)."""


class SemiHardMiner(_SimilarityMiner):
    """Semi-hard triplets (Schroff et al. 2015, FaceNet, eq. 4 and §3.2).

    Keeps every triplet ``(a, p, n)`` whose negative is farther than the positive but inside the
    margin: ``D_ap < D_an < D_ap + δ`` (for a similarity: ``S_ap > S_an > S_ap − δ``). These triplets
    all have a positive loss ``[D_ap − D_an + δ]₊`` yet avoid the collapse that the hardest negatives
    cause early in training.

    The window is tested only for the ``P`` actual positive pairs against all ``B`` candidates, a
    ``(P, B)`` comparison instead of ``(B, B, B)`` (``P`` is a few per cent of ``B²`` for class-balanced
    batches: 3 820 of 57 600 pairs for 30 classes × 4 images plus 120 Mixup images), in chunks of at
    most ``2²⁴`` entries. Triplets come out ordered by ``(a, p, n)``.

    Args:
        margin: the window ``δ > 0``; use the triplet loss's margin.

    >>> from idml.relations import LabelSets
    >>> d = torch.tensor([[0.0, 0.3, 0.35, 0.9], [0.3, 0.0, 0.9, 0.35],
    ...                   [0.35, 0.9, 0.0, 0.3], [0.9, 0.35, 0.3, 0.0]])
    >>> t = SemiHardMiner(0.1)(d, torch.tensor([0, 0, 1, 1]), similarity=False)
    >>> list(zip(t.anchor.tolist(), t.positive.tolist(), t.negative.tolist()))
    [(0, 1, 2), (1, 0, 3), (2, 3, 0), (3, 2, 1)]
    """

    repr_fields = ("margin",)

    def __init__(self, margin: float = 0.1) -> None:
        if not margin > 0:
            raise ValueError(f"margin (semi-hard window δ) must be > 0, got {margin}")
        self.margin = float(margin)

    def select(self, s: Tensor, labels: LabelSets) -> TripletIndices:
        anchor, positive = labels.positive_mask().nonzero(as_tuple=True)
        # A non-negative candidate gets +inf similarity, so its gap is −inf and fails "gap > 0".
        candidates = s.masked_fill(~labels.negative_mask(), float("inf"))
        rows_per_chunk = max(1, _CHUNK_ENTRIES // max(s.shape[0], 1))
        found: list[tuple[Tensor, Tensor]] = []
        for start in range(0, anchor.numel(), rows_per_chunk):
            a = anchor[start : start + rows_per_chunk]
            p = positive[start : start + rows_per_chunk]
            # gap[k, n] = how much more alike positive p_k is to anchor a_k than candidate n, built
            # in place in the gathered rows (−c + s rounds exactly as s − c).
            gap = candidates.index_select(0, a).neg_().add_(s[a, p].unsqueeze(1))
            keep = (gap > 0).logical_and_(gap < self.margin)
            pair, negative = keep.nonzero(as_tuple=True)
            found.append((pair + start, negative))
        if not found:
            empty = anchor.new_zeros(0)
            return TripletIndices(empty, empty.clone(), empty.clone())
        pair = torch.cat([f[0] for f in found])
        return TripletIndices(anchor[pair], positive[pair], torch.cat([f[1] for f in found]))


class MultiSimilarityMiner(_SimilarityMiner):
    """Multi-similarity pair mining (Wang et al. 2019, eq. 5 and 6).

    With ``S`` the similarity of a pair, a positive pair ``(a, p)`` is kept when it is less similar
    than the anchor's most similar negative plus ``ε``: ``S_ap − ε < max_{n} S_an`` (eq. 6); a negative
    pair ``(a, n)`` is kept when it is more similar than the anchor's least similar positive minus
    ``ε``: ``S_an + ε > min_{p} S_ap`` (eq. 5). Distances are mined as ``−D``, which gives
    ``D_ap + ε > min_n D_an`` and ``D_an − ε < max_p D_ap``. An anchor without negatives keeps no
    positive and one without positives keeps no negative.

    Args:
        epsilon: the mining margin ``ε ≥ 0``.

    >>> from idml.relations import LabelSets
    >>> s = torch.tensor([[1.0, 0.9, 0.2], [0.9, 1.0, 0.85], [0.2, 0.85, 1.0]])
    >>> p = MultiSimilarityMiner(0.1)(s, torch.tensor([0, 0, 1]), similarity=True)
    >>> p.anchor_pos.tolist(), p.positive.tolist(), p.anchor_neg.tolist(), p.negative.tolist()
    ([1], [0], [1], [2])
    """

    repr_fields = ("epsilon",)

    def __init__(self, epsilon: float = 0.1) -> None:
        if not epsilon >= 0:
            raise ValueError(f"epsilon (mining margin) must be >= 0, got {epsilon}")
        self.epsilon = float(epsilon)

    def select(self, s: Tensor, labels: LabelSets) -> PairIndices:
        pos, neg = labels.positive_mask(), labels.negative_mask()
        hardest_neg = s.masked_fill(~neg, float("-inf")).amax(dim=1, keepdim=True)
        easiest_pos = s.masked_fill(~pos, float("inf")).amin(dim=1, keepdim=True)
        keep_pos = pos & (s - self.epsilon < hardest_neg)
        keep_neg = neg & (s + self.epsilon > easiest_pos)
        return PairIndices.from_masks(keep_pos, keep_neg)


class DistanceWeightedMiner(Miner):
    """Distance-weighted sampling of negatives (Wu et al. 2017, "Sampling Matters", §4).

    On the unit sphere in ``R^n`` the distance between uniformly spread points has density
    ``q(d) ∝ d^{n−2}(1 − d²/4)^{(n−3)/2}``. Sampling a negative with probability
    ``∝ min(φ, q(d)^{-1})`` spreads the chosen negatives over all distances instead of the crowd near
    ``√2``. Computed in log space,
    ``log q(d)^{-1} = −(n−2)·log d − ((n−3)/2)·log(1 − d²/4)``, then normalised per anchor
    (a softmax over the anchor's admissible negatives), so large ``n`` cannot overflow.

    Distances are clamped below at ``cutoff``; since ``q^{-1}`` decreases on ``(0, √2]`` for
    ``n ≥ 3``, this is exactly the cap ``min(φ, q^{-1})`` with ``φ = q^{-1}(cutoff)``. Negatives at
    ``d ≥ nonzero_loss_cutoff`` are never drawn (they give zero margin loss), nor pairs at ``d ≥ 2``
    where ``q`` is undefined. A similarity matrix is first mapped to the chord distance
    ``√(2 − 2S)`` (:func:`~idml.metrics.to_distance`).

    Each anchor keeps *every* positive and draws one negative per positive, with replacement, as in
    the paper's reference code. Anchors without admissible negatives are skipped.

    Args:
        cutoff: lower clamp of the distance (``φ = q^{-1}(cutoff)``).
        nonzero_loss_cutoff: negatives at or beyond this distance are never sampled.
        generator: the random generator for sampling (``None``: torch's global generator).

    >>> from idml.relations import LabelSets
    >>> d = torch.tensor([[0.0, 0.2, 0.8, 1.5], [0.2, 0.0, 0.9, 1.0],
    ...                   [0.8, 0.9, 0.0, 0.4], [1.5, 1.0, 0.4, 0.0]])
    >>> miner = DistanceWeightedMiner(generator=torch.Generator().manual_seed(0))
    >>> p = miner.probabilities(d, LabelSets.coerce(torch.tensor([0, 0, 1, 1])), dim=8)
    >>> p[0].tolist()  # the only admissible negative of anchor 0 is 2 (1.5 >= 1.4)
    [0.0, 0.0, 1.0, 0.0]
    >>> t = miner(d, torch.tensor([0, 0, 1, 1]), similarity=False, dim=8)
    >>> t.anchor.tolist(), t.positive.tolist(), t.negative[0].item()
    ([0, 1, 2, 3], [1, 0, 3, 2], 2)
    """

    repr_fields = ("cutoff", "nonzero_loss_cutoff")

    def __init__(
        self,
        cutoff: float = 0.5,
        nonzero_loss_cutoff: float = 1.4,
        generator: torch.Generator | None = None,
    ) -> None:
        if not 0 < cutoff < nonzero_loss_cutoff:
            raise ValueError(
                f"need 0 < cutoff < nonzero_loss_cutoff, got cutoff={cutoff} and "
                f"nonzero_loss_cutoff={nonzero_loss_cutoff}"
            )
        self.cutoff = float(cutoff)
        self.nonzero_loss_cutoff = float(nonzero_loss_cutoff)
        self.generator = generator

    def probabilities(
        self, distance: Tensor, labels: LabelSets, dim: int | None, similarity: bool = False
    ) -> Tensor:
        """``(B, B)`` sampling probabilities of negatives per anchor (rows sum to 1, or are all 0
        for an anchor without admissible negatives)."""
        if dim is None or dim < 3:
            raise ValueError(
                f"dim (the embedding dimension n in q(d)) must be an integer >= 3, got {dim}"
            )
        d = to_distance(distance, similarity).clamp_min(self.cutoff)
        admissible = labels.negative_mask() & (d < self.nonzero_loss_cutoff) & (d < 2.0)
        # Inadmissible entries are overwritten below; clamping keeps their logs finite meanwhile.
        d_safe = torch.where(admissible, d, torch.ones_like(d))
        log_inv_q = -(dim - 2.0) * d_safe.log() - ((dim - 3.0) / 2.0) * torch.log1p(
            -0.25 * d_safe.pow(2)
        )
        log_inv_q = log_inv_q.masked_fill(~admissible, float("-inf"))
        has_any = admissible.any(dim=1, keepdim=True)
        # A row of -inf would softmax to NaN; give it zeros instead.
        log_inv_q = torch.where(has_any, log_inv_q, torch.zeros_like(log_inv_q))
        return torch.softmax(log_inv_q, dim=1) * has_any

    def mine(
        self, matrix: Tensor, labels: LabelSets, similarity: bool, dim: int | None
    ) -> TripletIndices:
        probs = self.probabilities(matrix, labels, dim, similarity)
        pos = labels.positive_mask()
        sampleable = probs.sum(dim=1) > 0
        per_anchor = int(pos.sum(dim=1).max().item()) if pos.numel() else 0
        anchor, positive = (pos & sampleable[:, None]).nonzero(as_tuple=True)
        if per_anchor == 0 or anchor.numel() == 0:
            empty = matrix.new_zeros(0, dtype=torch.long)
            return TripletIndices(empty, empty.clone(), empty.clone())
        # One draw table for all anchors; rows that cannot sample get a dummy uniform row.
        table = torch.where(sampleable[:, None], probs, torch.ones_like(probs))
        draws = torch.multinomial(table, per_anchor, replacement=True, generator=self.generator)
        rank = (pos.long().cumsum(dim=1) - 1)[anchor, positive]
        return TripletIndices(anchor, positive, draws[anchor, rank])
