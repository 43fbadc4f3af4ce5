"""A saved gallery index: embeddings, uncertainty levels, item ids/paths/labels and their model.

Search is by cosine similarity of L2-normalised semantic embeddings, ``sim(q, i) = ŝ_q · ŝ_i``
(the retrieval metric of the DML literature and of :mod:`idml.evaluation`):

* ``backend="exact"`` (default): the blocked exact search of
  :func:`idml.evaluation.search.neighbors_only` (never a ``Q × N`` matrix); ties are ordered by item
  position, lower first;
* ``backend="faiss"``: a faiss index on the same vectors (the optional ``faiss`` extra), any
  factory string with an inner-product metric (``"Flat"`` exact, ``"HNSW32"``, ``"IVF1024,Flat"``)
  for approximate search on large galleries; ``search_parameters`` such as ``"efSearch=128"`` or
  ``"nprobe=32"`` trade speed for recall (given at creation, ``"efConstruction=200"`` also builds a
  better HNSW graph, raising the recall every ``efSearch`` reaches).

On disk an index is a folder of versions under a ``current`` pointer, written atomically under a
lock and read back verified (no pickle anywhere): :mod:`idml.app.retrieval.index_folder`.

**Paths**: an index records the gallery's root folder and each item's path relative to it, and
refuses items outside the root unless built with ``allow_outside_root``; a service can then answer
with paths relative to the root, or ids only, never a path of the server
(:func:`idml.app.retrieval.output.result_records`). Images are opened (thumbnails, checks) only
through :meth:`Index.item_file`, which keeps to the same rule.

**Galleries past one machine's memory**: a faiss index built with ``store_vectors=False``
(``idml index --no-vectors``) keeps no float32 copy of the embeddings (``4·d`` bytes per item) in
memory or on disk: the faiss index alone holds the items, so a compressed one (``IVF65536,PQ32``:
32-byte codes, ``IVF…_HNSW32`` coarse quantiser for many lists) costs its code and id per item.
Such an index keeps the exact vectors of its first :data:`SPOT_VECTORS` items for the check that
images still give their stored embeddings (:func:`idml.app.retrieval.workflow.check_embeddings`).
An index is trained on a sample of the gallery (:func:`~idml.evaluation.search.faiss_backend.faiss_build`).

Example:
    >>> import torch
    >>> gallery = torch.eye(3)
    >>> index = Index.create(gallery, torch.tensor([0.5, 1.0, 2.0]), ids=["a", "b", "c"])
    >>> result = index.search(torch.tensor([[0.9, 0.1, 0.0]]), k=2)
    >>> [index.ids[i] for i in result.indices[0].tolist()]
    ['a', 'b']
    >>> result.confidence_kind, result.answered.tolist()
    ('top1', [True])
"""

from __future__ import annotations

import functools
import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from idml.app.inference import ModelInfo
from idml.app.retrieval.confidence import AnswerPolicy
from idml.app.retrieval.index_folder import (
    BACKENDS,
    MANIFEST,
    SPOT_VECTORS,
    IndexDescription,
    IndexFormatError,
    VersionContents,
    read_current,
    save_version,
)
from idml.evaluation.confidence import AnswerNeighbors, ReferenceHubness
from idml.evaluation.scoring import PairScorer, PreparedSide
from idml.evaluation.search import NeighborLists, SearchExecution, neighbors_only
from idml.evaluation.search.faiss_backend import faiss_add, faiss_build, faiss_parameters

if TYPE_CHECKING:
    from idml.app.retrieval.reranking import GalleryReranking

MAX_PADDED_K = 1000
"""``k`` may exceed the index's size (the answer is padded with "no neighbour") up to this; a
larger ``k`` than both is refused before anything is allocated."""


class _UnitCosine(PairScorer):
    """Cosine similarity of rows that are unit vectors already: the index normalises items once,
    when they are added, and queries in :meth:`Index.search`; normalising the whole gallery again
    at every call would cost a pass over it however few the queries."""

    def __init__(self) -> None:
        super().__init__("cosine", normalize=True)

    def prepare_side(self, semantic: Tensor, uncertainty: Tensor | None = None) -> PreparedSide:
        return PreparedSide(semantic.float().contiguous(), None)


@dataclass
class SearchResult:
    """Top-``k`` neighbours of ``Q`` queries and the confidence of each query's answer.

    ``indices[q, r]`` is the item position of the ``r``-th neighbour (``-1`` where the gallery has
    fewer than ``k`` items), ``similarities`` their cosine similarities (in the re-ranked order
    when the search re-ranks); ``query_uncertainty`` the queries' ``||u||`` (NaN when the queries
    were given as bare embeddings); ``confidence`` the answer's confidence, of kind
    ``confidence_kind``, and ``answered`` whether the query is answered or abstains
    (:class:`~idml.app.retrieval.confidence.AnswerPolicy`).
    """

    indices: Tensor
    similarities: Tensor
    query_uncertainty: Tensor
    confidence: Tensor
    confidence_kind: str
    answered: Tensor

    def __len__(self) -> int:
        return int(self.indices.shape[0])


@dataclass(eq=False, repr=False)
class Index:
    """Unit-normalised gallery embeddings with their uncertainty, items and model (see module doc).

    Build one with :meth:`create` (which checks and normalises the items) or :meth:`load`.
    """

    embeddings: Tensor | None
    """``(N, d)`` float32 unit vectors; ``None`` for a faiss index built without them."""
    uncertainty: Tensor
    """``(N,)`` float32 ``||u||`` of each item."""
    ids: list[str]
    """Unique item ids."""
    paths: list[str | None]
    """Each item's file: relative to :attr:`root` (POSIX separators) when the index has one, else
    as given."""
    labels: list[str | None]
    model: ModelInfo | None
    """The model that embedded the items (checked when the index is extended or searched)."""
    backend: str = "exact"
    faiss_factory: str = "HNSW32"
    search_parameters: str | None = None
    faiss_index: Any = None
    """The faiss index of :attr:`embeddings` (backend ``"faiss"``), else ``None``."""
    root: Path | None = None
    """The gallery's root folder (absolute), or ``None`` (paths kept as given)."""
    allow_outside_root: bool = False
    """Whether items outside :attr:`root` were allowed when the index was built."""
    _gallery_lists: dict[int, NeighborLists] = field(default_factory=dict, init=False)
    """Each item's nearest other items, by depth, once computed (:meth:`gallery_neighbors`)."""
    spot: Tensor | None = None
    """Without :attr:`embeddings`: the exact vectors of the first (up to :data:`SPOT_VECTORS`)
    items."""

    # ----------------------------------------------------------------- building
    @classmethod
    def create(
        cls,
        embeddings: Tensor,
        uncertainty: Tensor | None = None,
        ids: Sequence[str] | None = None,
        paths: Sequence[str | os.PathLike | None] | None = None,
        labels: Sequence[str | None] | None = None,
        model: ModelInfo | None = None,
        *,
        backend: str = "exact",
        faiss_factory: str = "HNSW32",
        search_parameters: str | None = None,
        root: str | os.PathLike | None = None,
        allow_outside_root: bool = False,
        store_vectors: bool = True,
        train_size: int | None = None,
        train_vectors: Tensor | None = None,
    ) -> Index:
        """An index of ``embeddings`` ``(N, d)`` (normalised here) and their ``||u||`` ``(N,)``.

        A faiss index that must be trained learns from ``train_vectors`` (unit vectors) or from a
        sample of ``train_size`` of the embeddings (default:
        :func:`~idml.evaluation.search.faiss_backend.default_train_size`). With
        ``store_vectors=False`` (faiss only) the float32 embeddings are not kept (module
        docstring).

        ``ids`` default to the row numbers; they must be unique. ``model`` is recorded and checked
        whenever the index is extended or searched with images. ``paths`` are the items' files
        (absolute, or relative to the working directory); with ``root`` (the gallery's folder)
        they are recorded relative to it, and a path outside it is refused unless
        ``allow_outside_root``.
        """
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if not store_vectors and backend != "faiss":
            raise ValueError(
                "an exact index searches its stored vectors; store_vectors=False (--no-vectors) "
                "needs backend='faiss'"
            )
        emb, unc, (id_list, path_list, label_list) = _check_items(
            embeddings, uncertainty, ids, paths, labels
        )
        root_path = None if root is None else Path(root).resolve()
        if root_path is not None:
            path_list = [relative_to_root(p, root_path, allow_outside_root) for p in path_list]
        index = cls(
            emb,
            unc,
            id_list,
            path_list,
            label_list,
            model,
            backend,
            faiss_factory,
            search_parameters,
            root=root_path,
            allow_outside_root=allow_outside_root,
        )
        if backend == "faiss":
            index.faiss_index = faiss_build(
                emb,
                faiss_factory,
                search_parameters,
                train_vectors=train_vectors,
                train_size=train_size,
            )
        if not store_vectors:
            index.spot = emb[:SPOT_VECTORS].clone()
            index.embeddings = None
        return index

    def add(self, other: Index) -> Index:
        """A new index with the items of ``other`` appended (this one is left unchanged), e.g.
        ``index.add(Index.create(embeddings, uncertainty, ids, model=model))``.

        Refused when ``other``'s model differs from this index's model, when the dimension differs,
        when an id is already in the index, or when an item lies outside this index's root (unless
        it was built with ``allow_outside_root``): the result equals a fresh index of the union,
        with this index's backend, settings and root.
        """
        model = other.model
        if model is not None and self.model is not None and not model.same_model(self.model):
            raise IndexFormatError(
                f"the new items were embedded by model {model.weights_sha256[:12]} "
                f"({model.source}) but the index holds embeddings of model "
                f"{self.model.weights_sha256[:12]} ({self.model.source}); embeddings of different "
                "models are not comparable. Use the index's run, or build a new index"
            )
        if other.dim != self.dim:
            raise IndexFormatError(
                f"the new embeddings have dimension {other.dim} but the index has "
                f"{self.dim}; they come from another model"
            )
        if other.embeddings is None:
            raise IndexFormatError(
                "the items to add must carry their embeddings (an index built from them with "
                "Index.create); an index without vectors cannot be added to another"
            )
        clash = set(other.ids).intersection(self.ids)
        if clash:
            raise IndexFormatError(
                f"{len(clash)} id(s) are already in the index, e.g. {sorted(clash)[:3]}; "
                "an item can be added once (give other ids, or build a new index)"
            )
        new_paths = other.absolute_paths()
        if self.root is not None:
            new_paths = [
                relative_to_root(p, self.root, self.allow_outside_root, adding=True)
                for p in new_paths
            ]
        faiss_index = None
        if self.backend == "faiss":
            import faiss

            faiss_index = faiss.clone_index(self.faiss_index)
            faiss_add(faiss_index, other.embeddings)
            faiss_parameters(faiss_index, self.search_parameters)
        embeddings, spot = None, self.spot
        if self.embeddings is not None:
            embeddings = torch.cat([self.embeddings, other.embeddings])
        elif spot is not None and len(spot) < SPOT_VECTORS:
            spot = torch.cat([spot, other.embeddings[: SPOT_VECTORS - len(spot)]])
        return Index(
            embeddings,
            torch.cat([self.uncertainty, other.uncertainty]),
            self.ids + other.ids,
            self.paths + new_paths,
            self.labels + other.labels,
            self.model if self.model is not None else model,
            self.backend,
            self.faiss_factory,
            self.search_parameters,
            faiss_index,
            self.root,
            self.allow_outside_root,
            spot,
        )

    def set_search_parameters(self, parameters: str) -> None:
        """Change the faiss search parameters in place (e.g. ``"efSearch=512"``): the
        recall/speed trade-off of an approximate index, without rebuilding it."""
        if self.backend != "faiss":
            raise ValueError(
                f"search parameters {parameters!r} apply to the faiss backend; this index is exact"
            )
        faiss_parameters(self.faiss_index, parameters)
        self.search_parameters = parameters

    # ----------------------------------------------------------------- properties
    def __len__(self) -> int:
        return len(self.ids)

    @property
    def dim(self) -> int:
        if self.embeddings is not None:
            return int(self.embeddings.shape[1])
        return int(self.faiss_index.d)

    def stored_vectors(self, positions: Sequence[int]) -> Tensor:
        """The exact stored vectors of items ``positions`` (without :attr:`embeddings`, only the
        first :data:`SPOT_VECTORS` items have them: an ``IndexError`` for the others)."""
        rows = list(positions)
        if self.embeddings is not None:
            return self.embeddings[rows]
        assert self.spot is not None
        if any(not 0 <= r < len(self.spot) for r in rows):
            raise IndexError(
                f"this index keeps the exact vectors of its first {len(self.spot)} items only"
            )
        return self.spot[rows]

    def all_vectors(self, purpose: str) -> Tensor:
        """:attr:`embeddings`, which ``purpose`` reads; an index that keeps no vectors
        (``--no-vectors``) is refused, naming ``purpose`` and what to do."""
        if self.embeddings is None:
            raise ValueError(
                f"{purpose} reads every gallery vector, and this index keeps none (built with "
                "--no-vectors); rebuild it without --no-vectors, or answer without it"
            )
        return self.embeddings

    def describe(self) -> dict[str, Any]:
        """Size, dimension, backend and model, as ``idml search --json`` reports them (``idml
        serve``'s ``/info`` leaves out the model's folders: see :mod:`~idml.app.retrieval.server`)."""
        return {
            "count": len(self),
            "dim": self.dim,
            "metric": "cosine",
            "backend": self.backend,
            "faiss_factory": self.faiss_factory if self.backend == "faiss" else None,
            "search_parameters": self.search_parameters if self.backend == "faiss" else None,
            "vectors": self.embeddings is not None,
            "model": None if self.model is None else self.model.to_dict(),
        }

    def absolute_paths(self) -> list[str | None]:
        """Each item's file as an absolute path (``None`` where the item has none)."""
        if self.root is None:
            return [None if p is None else os.path.abspath(p) for p in self.paths]
        return [None if p is None else os.path.normpath(self.root / p) for p in self.paths]

    def item_file(self, position: int) -> Path | None:
        """The file of item ``position``, for opening: ``None`` when the item has no path, or
        when the path leads outside :attr:`root` (through ``..`` or a link) and the index was not
        built with ``allow_outside_root``."""
        path = self.paths[position]
        if path is None:
            return None
        if self.root is None:
            return Path(path)
        full = (self.root / path).resolve()
        if not self.allow_outside_root and not full.is_relative_to(self.root):
            return None
        return full

    # ----------------------------------------------------------------- search
    def search(
        self,
        queries: Tensor,
        k: int = 10,
        query_uncertainty: Tensor | None = None,
        *,
        policy: AnswerPolicy | None = None,
        reranking: GalleryReranking | None = None,
        block_size: int | None = None,
        device: torch.device | str | None = None,
    ) -> SearchResult:
        """Top-``k`` items of each query embedding ``(Q, d)`` by cosine similarity, and the
        confidence of each query's answer.

        ``query_uncertainty`` ``(Q,)``: the queries' ``||u||`` (reported; read by a calibration
        that uses it); NaN when not given. ``policy`` scores the answers and decides which abstain
        (default :class:`~idml.app.retrieval.confidence.AnswerPolicy`: the top-1 similarity, no
        abstention); ``reranking`` re-orders each query's shortlist first
        (:class:`~idml.app.retrieval.reranking.GalleryReranking` of this index), and the
        confidence is computed after it. The search goes as deep as the re-ranker's shortlist
        and the confidence's features need and returns the first ``k``. Refused before any work:
        queries of another dimension, NaN, inf or all zero (a zero vector has no direction to
        compare), and ``k`` that is not an integer in ``1 .. max(len(index), MAX_PADDED_K)``.
        """
        policy = AnswerPolicy() if policy is None else policy
        queries = torch.as_tensor(queries)
        if queries.dim() == 1:
            queries = queries.unsqueeze(0)
        if queries.dim() != 2 or queries.shape[1] != self.dim:
            raise ValueError(
                f"queries must have shape (Q, {self.dim}) (the index's dimension), got "
                f"{tuple(queries.shape)}"
            )
        if not queries.dtype.is_floating_point or not bool(torch.isfinite(queries).all()):
            raise ValueError("query embeddings must be finite floating-point numbers")
        zero = (queries.float().abs().amax(dim=1) == 0).nonzero().flatten().tolist()
        if zero:
            raise ValueError(
                f"query embedding(s) {zero[:5]} are all zero: a zero vector has no direction, so "
                "no neighbour would mean anything; check the model or the file that produced them"
            )
        check_k(k, len(self))
        q = torch.nn.functional.normalize(queries.float(), dim=1)
        n_q = q.shape[0]
        if query_uncertainty is None:
            q_unc = torch.full((n_q,), float("nan"))
        else:
            q_unc = torch.as_tensor(query_uncertainty, dtype=torch.float32).reshape(-1)
            if q_unc.shape[0] != n_q:
                raise ValueError(f"query_uncertainty has {q_unc.shape[0]} values for {n_q} queries")
        if policy.needs_uncertainty and bool(torch.isnan(q_unc).any()):
            raise ValueError(
                "the calibrated confidence reads each query's ||u||, which embedding queries do "
                "not carry; query with images, or use a calibration without norm_u"
            )
        deep = max(k, policy.depth, 0 if reranking is None else reranking.reranker.depth)
        found = self._nearest(q, min(deep, len(self)), block_size, device)
        ids = found.indices[:, :k]
        # Shown: each neighbour's cosine similarity (float32 rounding can pass 1 by a step).
        sims = found.scores[:, :k].clamp(-1.0, 1.0)
        if reranking is not None and found.k > 0:
            found = reranking.rerank(found, q)
            ids = found.indices[:, :k]  # re-ranking changes the order, not the similarities
            vectors = self.all_vectors("re-ranking")
            sims = (vectors[ids.clamp_min(0)] @ q.unsqueeze(2)).squeeze(2).clamp(-1, 1)
        hubness = None
        if policy.hubness_k is not None:
            hubness = ReferenceHubness.from_neighbors(
                self.gallery_neighbors(policy.hubness_k, block_size, device), policy.hubness_k
            )
        answers = AnswerNeighbors.from_search(
            found,
            reference_labels=self.class_ids,
            hubness=hubness,
            uncertainty_level=None if bool(torch.isnan(q_unc).any()) else q_unc,
        )
        score, answered = policy.score(answers)
        sims = torch.where(ids < 0, torch.full_like(sims, float("nan")), sims)
        if ids.shape[1] < k:  # fewer items than k: pad as "no neighbour"
            pad = k - ids.shape[1]
            ids = torch.cat([ids, torch.full((n_q, pad), -1, dtype=torch.long)], 1)
            sims = torch.cat([sims, torch.full((n_q, pad), float("nan"))], 1)
        return SearchResult(ids, sims, q_unc, score, policy.kind, answered)

    def _nearest(
        self,
        q: Tensor,
        depth: int,
        block_size: int | None = None,
        device: torch.device | str | None = None,
    ) -> NeighborLists:
        """The ``depth`` nearest items of unit queries ``q`` by cosine (``-1``: no item)."""
        n_q = q.shape[0]
        if depth == 0:
            return NeighborLists(torch.full((n_q, 0), -1, dtype=torch.long), torch.zeros((n_q, 0)))
        if self.backend == "faiss":
            distances, found = self.faiss_index.search(q.numpy(), depth)
            ids, sims = torch.from_numpy(found).long(), torch.from_numpy(distances).float()
            return NeighborLists(ids, torch.where(ids < 0, -torch.inf, sims))
        assert self.embeddings is not None  # an exact index always keeps its vectors
        lists = neighbors_only(
            q,
            depth,
            self.embeddings,
            metric=_UnitCosine(),
            execution=SearchExecution(block_size=block_size, device=device),
        )
        return NeighborLists(lists.indices.cpu().long(), lists.scores.cpu().float())

    def gallery_neighbors(
        self, k: int, block_size: int | None = None, device: torch.device | str | None = None
    ) -> NeighborLists:
        """Each item's ``k`` nearest *other* items (cosine; fewer when the index has fewer):
        the gallery graph a re-ranker and the hubness-corrected confidence read. Searched once
        per loaded index (exact, or with the faiss index) and kept."""
        k = min(k, max(len(self) - 1, 0))
        known = [d for d in self._gallery_lists if d >= k]
        if known:
            lists = self._gallery_lists[min(known)]
            return NeighborLists(lists.indices[:, :k], lists.scores[:, :k])
        vectors = self.all_vectors("the gallery graph (re-ranking, csls@k)")
        if self.backend == "faiss":
            lists = self._nearest(vectors, min(k + 1, len(self)))
            own = lists.indices == torch.arange(len(self)).unsqueeze(1)
            scores = lists.scores.masked_fill(own, -torch.inf)
            order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
            ids = lists.indices.gather(1, order)
            scores = scores.gather(1, order)
            lists = NeighborLists(torch.where(torch.isinf(scores), -1, ids), scores)
        else:
            lists = neighbors_only(
                vectors,
                k,
                metric=_UnitCosine(),
                execution=SearchExecution(block_size=block_size, device=device),
            )
            lists = NeighborLists(lists.indices.cpu().long(), lists.scores.cpu().float())
        self._gallery_lists[k] = lists
        return lists

    @functools.cached_property
    def class_ids(self) -> Tensor:
        """``(N,)`` an integer class per item, equal for equal labels; an unlabelled item is a
        class of its own (it agrees with no other), so the label-reading confidence scores
        treat it as a different answer."""
        names = sorted({label for label in self.labels if label is not None})
        ids = {name: i for i, name in enumerate(names)}
        return torch.tensor(
            [ids[x] if x is not None else len(ids) + i for i, x in enumerate(self.labels)],
            dtype=torch.long,
        )

    # ----------------------------------------------------------------- files
    def save(
        self,
        folder: str | Path,
        overwrite: bool = False,
        log: Callable[[str], object] = lambda _: None,
    ) -> Path:
        """Write the index as a new version of ``folder`` and make it current
        (:func:`~idml.app.retrieval.index_folder.save_version`).

        Without ``overwrite`` a folder that already holds an index is refused. The folder's lock
        is held throughout (use :func:`~idml.app.retrieval.index_folder.writing` to hold it from
        reading an index to saving its extension); ``log`` hears of a dead writer's lock taken
        over.
        """
        description = IndexDescription(
            **self.describe(),
            root=None if self.root is None else str(self.root),
            allow_outside_root=self.allow_outside_root,
        )
        contents = VersionContents(
            description,
            self.embeddings,
            self.spot,
            self.uncertainty,
            self.ids,
            self.paths,
            self.labels,
            self.faiss_index,
        )
        return save_version(folder, contents, overwrite, log)

    @classmethod
    def load(cls, folder: str | Path, search_parameters: str | None = None) -> Index:
        """Read and verify an index folder
        (:func:`~idml.app.retrieval.index_folder.read_current`); ``search_parameters`` override
        the saved faiss ones."""
        contents, where = read_current(folder)
        described = contents.description
        dim = described.dim
        model = None
        if described.model is not None:
            try:
                model = ModelInfo.from_dict(described.model, str(where / MANIFEST))
            except (TypeError, ValueError) as err:
                raise IndexFormatError(f"{err}; rebuild the index") from None
            if model.embedding_dim != dim:
                raise IndexFormatError(
                    f"{where / MANIFEST}: the model embeds in {model.embedding_dim} dimensions "
                    f"but the embeddings have {dim}; they are not its embeddings. "
                    "Rebuild the index"
                )
        params = search_parameters or described.search_parameters
        if contents.faiss_index is not None:
            faiss_parameters(contents.faiss_index, params)
        root = described.root
        return cls(
            contents.embeddings,
            contents.uncertainty,
            contents.ids,
            contents.paths,
            contents.labels,
            model,
            described.backend,
            described.faiss_factory or "HNSW32",
            params,
            contents.faiss_index,
            None if root is None else Path(root),
            described.allow_outside_root,
            contents.spot,
        )


def check_k(k: Any, size: int) -> int:
    """``k`` if it is an integer in ``1 .. max(size, MAX_PADDED_K)``, else a ValueError that says
    the range (checked before anything of size ``k`` is allocated)."""
    if isinstance(k, bool) or not isinstance(k, int):
        raise ValueError(f"k (neighbours per query) must be an integer, got {k!r}")
    limit = max(size, MAX_PADDED_K)
    if not 1 <= k <= limit:
        raise ValueError(
            f"k (neighbours per query) must be between 1 and {limit} (the index holds {size} "
            f"items), got {k}"
        )
    return k


def relative_to_root(
    path: str | None, root: Path, allow_outside: bool, adding: bool = False
) -> str | None:
    """``path`` relative to ``root`` (POSIX separators); a path outside it (through ``..``, an
    absolute path or a link) is an :class:`IndexFormatError` unless ``allow_outside``."""
    if path is None:
        return None
    full = Path(os.path.abspath(path))
    inside = full.is_relative_to(root) and Path(os.path.realpath(full)).is_relative_to(
        os.path.realpath(root)
    )
    if not inside and not allow_outside:
        fix = (
            "The root was set when the index was built: add items from under it, or build the "
            "index again with a --root that holds every folder you will add"
            if adding
            else "Give a --root that contains every item, or pass --allow-outside-root if the "
            "index will never be served to people who must not see other folders"
        )
        raise IndexFormatError(
            f"{path} is outside the gallery root {root}; an index records and opens only files "
            f"under its root. {fix}"
        )
    return Path(os.path.relpath(full, root)).as_posix()


def unit_rows(x: Tensor, chunk: int = 1 << 20) -> Tensor:
    """``x`` with every row divided by its L2 norm, the norm summed in float64 and rounded to
    float32 once: a row's unit vector then does not depend on which rows are normalised with it
    (a float32 reduction is vectorised by the row count), so the shards of a gallery normalised
    apart give the bytes of the whole normalised at once. Slices of ``chunk`` rows bound the
    float64 copy."""
    norms = torch.cat(
        [x[i : i + chunk].double().norm(dim=1) for i in range(0, len(x), chunk)]
        or [torch.zeros(0, dtype=torch.float64)]
    )
    return (x / norms.float().clamp_min(1e-12).unsqueeze(1)).contiguous()


def _check_items(
    embeddings: Tensor,
    uncertainty: Tensor | None,
    ids: Sequence[str] | None,
    paths: Sequence[str | os.PathLike[Any] | None] | None,
    labels: Sequence[str | None] | None,
) -> tuple[Tensor, Tensor, tuple[list[str], list[str | None], list[str | None]]]:
    embeddings = torch.as_tensor(embeddings)
    if embeddings.dim() != 2 or not embeddings.dtype.is_floating_point:
        raise ValueError(
            f"embeddings must be a floating (N, d) array, got {embeddings.dtype} "
            f"{tuple(embeddings.shape)}"
        )
    if not bool(torch.isfinite(embeddings).all()):
        raise ValueError("embeddings contain NaN or inf; check the model that produced them")
    n = embeddings.shape[0]
    emb = unit_rows(embeddings.detach().float().cpu())
    if uncertainty is None:
        unc = torch.zeros(n)
    else:
        unc = torch.as_tensor(uncertainty).detach().float().cpu().reshape(-1)
        if unc.shape[0] != n:
            raise ValueError(f"uncertainty has {unc.shape[0]} values for {n} embeddings")
    id_list = [str(i) for i in range(n)] if ids is None else [str(x) for x in ids]
    if len(id_list) != n:
        raise ValueError(f"{len(id_list)} ids for {n} embeddings; give one id per item")
    if len(set(id_list)) != n:
        dup = next(x for x, count in Counter(id_list).items() if count > 1)
        raise ValueError(f"item ids must be unique; {dup!r} appears more than once")
    columns: list[list[str | None]] = []
    for name, values in (("paths", paths), ("labels", labels)):
        column: list[str | None] = (
            [None] * n if values is None else [None if v is None else str(v) for v in values]
        )
        if len(column) != n:
            raise ValueError(f"{len(column)} {name} for {n} embeddings; give one per item")
        columns.append(column)
    return emb, unc.contiguous(), (id_list, columns[0], columns[1])
