"""Pairwise scores for retrieval: one number per (query, reference) pair, larger = closer.

The search engine (:mod:`idml.evaluation.search`) only ever compares scores, so every metric is turned
into a *score* once, here:

* cosine similarity ``C_ij = ŝ_i · ŝ_j`` (on L2-normalised embeddings, the default);
* Euclidean distance ``α_ij = ||s_i − s_j||``, scored as ``−α_ij²`` (the square is monotone, so the
  ranking is the same and no square root is taken in the N×N work). The score is computed by a
  single matrix product of augmented vectors ``[s_i, ||s_i||², 1] · [2 s_j, −1, −||s_j||²]ᵀ
  = −||s_i − s_j||²`` so no extra pass over the score tile is needed;
* any :class:`~idml.metrics.Metric` — in particular the introspective metric ISM (IDML paper
  eq. 5–7; the Table 5 ablation "ISM at test time") on semantic *and* uncertainty embeddings —
  scored as the metric value (similarity) or its negation (distance).

Example:
    >>> import torch
    >>> x = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    >>> d = PairScorer.from_spec("euclidean", normalize=False).pairwise_values(x)
    >>> round(float(d[0, 1]), 4), round(float(d[1, 1]), 4) + 0.0  # ||(1, 0) − (0, 2)|| = √5
    (2.2361, 0.0)
    >>> PairScorer.from_spec("cosine").pairwise_values(x).tolist()
    [[1.0, 0.0], [0.0, 1.0]]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from idml.embeddings import Embeddings
from idml.metrics import CosineSimilarity, EuclideanDistance, IntrospectiveMetric, Metric

MetricSpec = Literal["cosine", "euclidean"] | Metric
"""A metric by name (``"cosine"``, ``"euclidean"``) or as a :class:`~idml.metrics.Metric` instance."""


def side_rows(side: Tensor | Embeddings) -> tuple[Tensor, Tensor | None]:
    """The semantic rows and the uncertainty embeddings of one side of a comparison (a plain
    tensor has none)."""
    if isinstance(side, Embeddings):
        return side.semantic, side.uncertainty
    return side, None


@dataclass(frozen=True)
class PreparedSide:
    """One side (queries or references) of the search, in the layout the scorer multiplies.

    ``vectors`` are the (normalised, possibly augmented) semantic rows; ``uncertainty`` is only kept
    for metrics that use it (ISM).
    """

    vectors: Tensor
    uncertainty: Tensor | None


_NAMED_KINDS: dict[str, Literal["cosine", "euclidean"]] = {
    "cosine": "cosine",
    "euclidean": "euclidean",
}
"""The metrics a name selects (case-insensitive): the fast paths of :class:`PairScorer`."""


@dataclass(eq=False)
class PairScorer:
    """Turns a metric into tile scores ``score(Q_block, R_block)`` with "larger = closer".

    Use :meth:`from_spec`. ``kind`` is ``"cosine"``, ``"euclidean"`` (fast paths, one matrix product
    per tile) or ``"metric"`` (a general :class:`~idml.metrics.Metric`, e.g. ISM, called per tile);
    ``normalize`` L2-normalises the semantic rows first; ``squared`` reports squared Euclidean
    distances as :meth:`values`.
    """

    kind: Literal["cosine", "euclidean", "metric"]
    normalize: bool
    metric: Metric | None = None
    squared: bool = False

    def __post_init__(self) -> None:
        if (self.kind == "metric") != (self.metric is not None):
            raise ValueError(
                f"PairScorer(kind={self.kind!r}) takes a metric exactly when kind is 'metric'; "
                "build it with PairScorer.from_spec"
            )

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_spec(cls, metric: MetricSpec, normalize: bool = True) -> PairScorer:
        """Build a scorer from a metric name or instance.

        Plain :class:`~idml.metrics.CosineSimilarity` / :class:`~idml.metrics.EuclideanDistance`
        instances take the fast path (their ``normalize`` flag and Euclidean ``power`` are honoured);
        every other metric, including :class:`~idml.metrics.IntrospectiveMetric`, is called per tile.
        """
        if isinstance(metric, str):
            kind = _NAMED_KINDS.get(metric.lower())
            if kind is None:
                raise ValueError(
                    f"metric must be 'cosine', 'euclidean' or an idml.metrics.Metric, got {metric!r}"
                )
            return cls(kind, normalize)
        if isinstance(metric, CosineSimilarity) and type(metric) is CosineSimilarity:
            return cls("cosine", True)
        if isinstance(metric, EuclideanDistance) and type(metric) is EuclideanDistance:
            return cls("euclidean", metric.normalize, squared=metric.power == 2)
        if isinstance(metric, Metric):
            return cls("metric", metric.normalize, metric=metric)
        raise ValueError(
            f"metric must be 'cosine', 'euclidean' or an idml.metrics.Metric, got {type(metric).__name__}"
        )

    # ------------------------------------------------------------------ properties
    @property
    def uses_uncertainty(self) -> bool:
        """Whether the scores depend on uncertainty embeddings (ISM)."""
        return self.metric is not None and self.metric.uses_uncertainty

    @property
    def is_similarity(self) -> bool:
        """Whether user-facing :meth:`values` are similarities (else distances)."""
        if self.metric is None:
            return self.kind == "cosine"
        return bool(self.metric.is_similarity)

    @property
    def name(self) -> str:
        """A short human-readable name of the metric (for reports)."""
        if self.kind != "metric":
            return self.kind + (" (squared)" if self.squared else "")
        if isinstance(self.metric, IntrospectiveMetric):
            return f"introspective({type(self.metric.base).__name__}, {self.metric.extra_repr()})"
        return type(self.metric).__name__

    @property
    def symmetric(self) -> bool:
        """``score(a, b) == score(b, a)`` for the same set, so one tile can serve both directions.

        True for the plain metrics and for ISM (``α`` and ``β_ij = ||u_i + u_j||`` are symmetric);
        an arbitrary user metric is not assumed to be symmetric.
        """
        if self.kind != "metric":
            return True
        return isinstance(self.metric, IntrospectiveMetric) or type(self.metric) in (
            CosineSimilarity,
            EuclideanDistance,
        )

    # ------------------------------------------------------------------ computation
    def prepare(
        self, semantic: Tensor, uncertainty: Tensor | None = None
    ) -> tuple[PreparedSide, PreparedSide]:
        """Precompute both sides of a same-set search (queries and references are the same rows)."""
        side = self.prepare_side(semantic, uncertainty)
        return side, self._as_reference(side)

    def prepare_side(self, semantic: Tensor, uncertainty: Tensor | None = None) -> PreparedSide:
        """Normalise (and, for the Euclidean fast path, augment) one set of embeddings as *queries*.

        Use :meth:`prepare_reference` for the reference side.
        """
        x = semantic.float()
        if self.kind == "metric":
            unc = (
                uncertainty.float() if (uncertainty is not None and self.uses_uncertainty) else None
            )
            return PreparedSide(x, unc)
        if self.normalize or self.kind == "cosine":
            x = F.normalize(x, dim=1)
        if self.kind == "euclidean":
            sq = x.pow(2).sum(1, keepdim=True)
            x = torch.cat([x, sq, torch.ones_like(sq)], dim=1)
        return PreparedSide(x.contiguous(), None)

    def prepare_reference(
        self, semantic: Tensor, uncertainty: Tensor | None = None
    ) -> PreparedSide:
        """Like :meth:`prepare_side` for the reference (gallery) set."""
        return self._as_reference(self.prepare_side(semantic, uncertainty))

    def _as_reference(self, side: PreparedSide) -> PreparedSide:
        if self.kind != "euclidean":
            return side
        x, sq = side.vectors[:, :-2], side.vectors[:, -2:-1]
        # [2 s_j, −1, −||s_j||²] so that the augmented dot product is −||s_i − s_j||².
        ref = torch.cat([2.0 * x, -torch.ones_like(sq), -sq], dim=1)
        return PreparedSide(ref.contiguous(), None)

    def tile(
        self,
        queries: PreparedSide,
        references: PreparedSide,
        rows: slice,
        cols: slice,
        product: Callable[[Tensor, Tensor], Tensor] | None = None,
    ) -> Tensor:
        """Scores ``(len(rows), len(cols))`` between ``queries[rows]`` and ``references[cols]``.

        The plain metrics' tile is one fp32 product ``q·rᵀ``, computed by ``product`` when given
        (the kernel :mod:`idml.evaluation.search.kernels` measured fastest on this machine).
        """
        q, r = queries.vectors[rows], references.vectors[cols]
        if self.kind != "metric":
            return q @ r.T if product is None else product(q, r)
        assert self.metric is not None
        uq = None if queries.uncertainty is None else queries.uncertainty[rows]
        ur = None if references.uncertainty is None else references.uncertainty[cols]
        return self.metric.oriented(self.metric(q, r, uq, ur))

    def pairwise_values(
        self, query: Tensor | Embeddings, reference: Tensor | Embeddings | None = None
    ) -> Tensor:
        """The full matrix of user-facing metric values (small inputs only: it is ``Q × R``)
        between ``query`` and ``reference`` (``query`` itself when omitted); the uncertainty
        embeddings of an :class:`~idml.embeddings.Embeddings` side are used by ISM.

        >>> ism = PairScorer.from_spec(IntrospectiveMetric(CosineSimilarity(), gamma=1.0))
        >>> [round(v, 4) for v in ism.pairwise_values(Embeddings(torch.eye(2)))[0].tolist()]
        [1.0, 0.1319]
        """
        if reference is None:
            q, r = self.prepare(*side_rows(query))
        else:
            q = self.prepare_side(*side_rows(query))
            r = self.prepare_reference(*side_rows(reference))
        everything = slice(None)
        return self.values(self.tile(q, r, everything, everything))

    def values(self, scores: Tensor) -> Tensor:
        """User-facing metric values from scores: similarity, or distance (``√(−score)``)."""
        if self.kind == "cosine":
            return scores
        if self.kind == "euclidean":
            sq = (-scores).clamp_min(0)
            return sq if self.squared else sq.sqrt()
        assert self.metric is not None
        return self.metric.oriented(scores)  # the orientation is its own inverse
