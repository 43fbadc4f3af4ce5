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

On disk an index is a folder of versions and a pointer to the current one (no pickle anywhere)::

    current                  one line: the name of the current version, e.g. "v000002"
    v000002/                 the current version:
        manifest.json            format, version, count, dimension, backend, the model, the gallery
                                 root, file checksums
        embeddings.safetensors   "embeddings" (N, d) float32 unit vectors, "uncertainty" (N,) float32
                                 (an index built without vectors: "spot", the first few items'
                                 vectors, instead of "embeddings")
        items.json               "ids", "paths", "labels" (one per item; paths/labels may be null)
        faiss.index              only for backend "faiss" (faiss's own binary format)
    v000001/                 the previous version (kept until the next write, then removed)
    .lock                    while ``idml index`` writes: its PID, host and start time

**Writing** (:meth:`Index.save`) holds the lock (a second writer is refused naming the first),
writes the new version into a hidden folder, flushes it to disk, renames it into place and then
replaces ``current`` with one atomic rename: a kill at any instant leaves ``current`` naming a
complete version, the old or the new one. A full disk is reported with the folder and the bytes
needed; the temporary folder is removed and the old version stays current.

**Reading** (:meth:`Index.load`) distrusts the folder: ``current`` and every file name in the
manifest must name an entry inside the folder; every file's SHA-256 and size are checked; the
contents must be what the manifest says (count, dimension, finite unit vectors, ids unique strings,
a faiss index of the same size); a malformed file is a one-line :class:`IndexFormatError` naming it.
An index of the first format (the files directly in the folder, absolute paths) still loads.

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
import hashlib
import json
import os
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_bytes
from torch import Tensor

from idml.app.inference import ModelInfo, read_json_file
from idml.app.retrieval.confidence import AnswerPolicy
from idml.app.run_folder import LOCK_FILE, folder_lock
from idml.app.storage import (
    fsync_folder,
    remove_quietly,
    write_failure,
    write_file,
    write_new_files,
)
from idml.evaluation.confidence import AnswerNeighbors, ReferenceHubness
from idml.evaluation.scoring import PairScorer, PreparedSide
from idml.evaluation.search import NeighborLists, SearchExecution, neighbors_only
from idml.evaluation.search.faiss_backend import faiss_add, faiss_build, faiss_parameters

if TYPE_CHECKING:
    from idml.app.retrieval.reranking import GalleryReranking

FORMAT = "idml-index"
VERSION = 2
"""2: versions under a ``current`` pointer, paths relative to the recorded root. 1 (still read):
the files directly in the index folder, absolute paths."""
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
EMBEDDINGS_FILE = "embeddings.safetensors"
ITEMS_FILE = "items.json"
FAISS_FILE = "faiss.index"
CURRENT = "current"
BACKENDS = ("exact", "faiss")
MAX_PADDED_K = 1000
"""``k`` may exceed the index's size (the answer is padded with "no neighbour") up to this; a
larger ``k`` than both is refused before anything is allocated."""
UNIT_NORM_TOLERANCE = 1e-3
"""How far a stored embedding's norm may be from 1: float32 normalisation leaves ~1e-7; an
index whose vectors were written unnormalised (an edited file) is refused."""
SPOT_VECTORS = 16
"""Items whose exact vectors an index without vectors keeps (its first ones)."""
_VERSION_NAME = re.compile(r"v\d{6}")


def _crash_point(step: str) -> None:
    """A boundary between two steps of :meth:`Index.save`: the tests take a snapshot of the folder
    here, which is what a process killed at that instant leaves on disk."""


class _UnitCosine(PairScorer):
    """Cosine similarity of rows that are unit vectors already: the index normalises items once,
    when they are added, and queries in :meth:`Index.search`; normalising the whole gallery again
    at every call would cost a pass over it however few the queries."""

    def __init__(self) -> None:
        super().__init__("cosine", normalize=True)

    def prepare_side(self, semantic: Tensor, uncertainty: Tensor | None = None) -> PreparedSide:
        return PreparedSide(semantic.float().contiguous(), None)


class IndexFormatError(ValueError):
    """An index folder that is missing, corrupt, or does not fit what it is used with."""


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
        """Write the index as a new version of ``folder`` and make it current (module docstring).

        Without ``overwrite`` a folder that already holds an index is refused. The folder's lock
        is held throughout (use :func:`writing` to hold it from reading an index to saving its
        extension); ``log`` hears of a dead writer's lock taken over.
        """
        folder = Path(folder)
        with writing(folder, log=log):
            held = holds_index(folder)
            if held and not overwrite:
                raise FileExistsError(
                    f"{folder} already holds an index; pass --add to extend it, or choose another "
                    "folder"
                )
            if not held and folder.exists() and _foreign_entries(folder):
                raise IndexFormatError(
                    f"{folder} exists and is not an index (it holds "
                    f"{', '.join(sorted(_foreign_entries(folder))[:3])}); refusing to write into "
                    "it. Choose another --out"
                )
            self._write_version(folder)
        return folder

    def _write_version(self, folder: Path) -> None:
        """Write a new version into ``folder`` (locked by the caller) and switch ``current``."""
        files = self._files()
        previous = _current_version(folder)
        number = max([_version_number(v) for v in _versions(folder)] + [0]) + 1
        name = f"v{number:06d}"
        tmp = folder / f".{name}.tmp-{os.getpid()}"
        needed = sum(len(b) for b in files.values())
        if previous is not None:
            kept = f"the index stays at its current version {previous} "
            kept += f"({_count(folder, previous)} items)"
        elif (folder / MANIFEST).is_file():
            kept = f"the index stays as it was ({_count(folder, None)} items, first format)"
        else:
            kept = "no index was written"
        try:
            remove_quietly(tmp)
            tmp.mkdir()
            write_new_files(tmp, files)
            _crash_point("version written")
            os.replace(tmp, folder / name)
            fsync_folder(folder)
            _crash_point("version in place")
            write_file(folder / CURRENT, (name + "\n").encode(), kept=kept)
        except OSError as err:
            remove_quietly(tmp)
            if _current_version(folder) != name:
                remove_quietly(folder / name)
            raise write_failure(err, folder, f"index version {name}", needed, kept) from err
        _crash_point("current switched")
        # The previous version stays until the next write: a reader that read `current` just
        # before the switch still finds its files. Older versions and first-format files go.
        keep = {name, previous}
        for version in _versions(folder):
            if version not in keep:
                remove_quietly(folder / version)
        for entry in (MANIFEST, EMBEDDINGS_FILE, ITEMS_FILE, FAISS_FILE):
            if (folder / entry).is_file():
                (folder / entry).unlink()  # a first-format index, now replaced by the versions
        for stray in folder.glob(".v*.tmp-*"):
            remove_quietly(stray)  # a dead writer's half version, never current
        _crash_point("old versions removed")

    def _files(self) -> dict[str, bytes]:
        """The file contents of one version, the manifest last (it holds the others' hashes)."""
        vectors = (
            {"embeddings": self.embeddings.contiguous()}
            if self.embeddings is not None
            else {"spot": (self.spot if self.spot is not None else torch.zeros(0, self.dim))}
        )
        files = {
            EMBEDDINGS_FILE: safetensors_bytes({**vectors, "uncertainty": self.uncertainty}),
            ITEMS_FILE: json.dumps(
                {"ids": self.ids, "paths": self.paths, "labels": self.labels}
            ).encode(),
        }
        if self.backend == "faiss":
            import faiss

            files[FAISS_FILE] = faiss.serialize_index(self.faiss_index).tobytes()
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **self.describe(),
            "root": None if self.root is None else str(self.root),
            "allow_outside_root": self.allow_outside_root,
            "files": {
                name: {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
                for name, data in files.items()
            },
        }
        files[MANIFEST] = (json.dumps(manifest, indent=2) + "\n").encode()
        return files

    @classmethod
    def load(cls, folder: str | Path, search_parameters: str | None = None) -> Index:
        """Read and verify an index folder (module docstring); ``search_parameters`` override the
        saved faiss ones."""
        folder = Path(folder)
        for attempt in range(3):
            version = _current_version(folder)
            try:
                return cls._load_version(folder, version, search_parameters)
            except (FileNotFoundError, IndexFormatError):
                # Writers switched versions twice and removed the one being read: read the new one.
                if attempt == 2 or version is None or _current_version(folder) == version:
                    raise
        raise AssertionError("unreachable")

    @classmethod
    def _load_version(
        cls, folder: Path, version: str | None, search_parameters: str | None
    ) -> Index:
        where = folder if version is None else folder / version
        manifest = read_manifest(folder, version)
        data = {
            name: _verified_bytes(where, name, entry) for name, entry in manifest["files"].items()
        }
        for required in (EMBEDDINGS_FILE, ITEMS_FILE) + (
            (FAISS_FILE,) if manifest["backend"] == "faiss" else ()
        ):
            if required not in data:
                raise IndexFormatError(
                    f"{where / MANIFEST}: lists no {required}; rebuild the index"
                )
        emb, unc, spot = _read_embeddings(where / EMBEDDINGS_FILE, data[EMBEDDINGS_FILE], manifest)
        ids, paths, labels = _read_items(where / ITEMS_FILE, data[ITEMS_FILE], len(unc))
        dim = manifest["dim"]
        model = None
        if manifest.get("model") is not None:
            try:
                model = ModelInfo.from_dict(manifest["model"], str(where / MANIFEST))
            except (TypeError, ValueError) as err:
                raise IndexFormatError(f"{err}; rebuild the index") from None
            if model.embedding_dim != dim:
                raise IndexFormatError(
                    f"{where / MANIFEST}: the model embeds in {model.embedding_dim} dimensions "
                    f"but the embeddings have {dim}; they are not its embeddings. "
                    "Rebuild the index"
                )
        backend = manifest["backend"]
        params = search_parameters or manifest.get("search_parameters")
        faiss_index = None
        if backend == "faiss":
            faiss_index = _read_faiss(where / FAISS_FILE, data[FAISS_FILE], (len(unc), dim))
            faiss_parameters(faiss_index, params)
        elif emb is None:
            raise IndexFormatError(
                f"{where / EMBEDDINGS_FILE}: an exact index needs its 'embeddings'; rebuild it"
            )
        root = manifest.get("root")
        return cls(
            emb,
            unc,
            ids,
            paths,
            labels,
            model,
            backend,
            manifest.get("faiss_factory") or "HNSW32",
            params,
            faiss_index,
            None if root is None else Path(root),
            bool(manifest.get("allow_outside_root", False)),
            spot,
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


@contextmanager
def writing(folder: str | Path, log: Callable[[str], object] = lambda _: None) -> Iterator[Path]:
    """Hold the lock of index folder ``folder`` (created if missing) while the block runs: read
    the current index, extend it and :meth:`Index.save` it with no other writer in between. A
    second writer is refused naming this process; a dead writer's lock is taken over and
    ``log`` says so. A folder this call created is removed again if no index was written."""
    from idml.app.run_folder import make_folder

    folder = Path(folder)
    created = not folder.exists()
    make_folder(folder, "index folder")
    try:
        with folder_lock(folder, "index", "choose another --out", on_stale=log):
            yield folder
    finally:
        if created and not holds_index(folder):
            remove_quietly(folder)


def holds_index(folder: Path) -> bool:
    """Whether ``folder`` holds an index (of either format)."""
    return (folder / CURRENT).is_file() or (folder / MANIFEST).is_file()


def read_manifest(folder: Path, version: str | None = None) -> dict[str, Any]:
    """The manifest of an index folder's ``version`` (``None``: a first-format index, whose files
    are in the folder itself), validated for format, version and keys."""
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such index folder; build one with `idml index`")
    where = folder if version is None else folder / version
    path = where / MANIFEST
    manifest = read_json_file(
        path,
        missing=IndexFormatError(
            f"{folder}: not an index (no {CURRENT} or {MANIFEST}); build one with `idml index`"
            if version is None
            else f"{path}: missing; the index is incomplete, rebuild it"
        ),
        redo="rebuild the index",
        error=IndexFormatError,
    )
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise IndexFormatError(f"{path}: not an idml index manifest (format != {FORMAT!r})")
    if manifest.get("version") not in READABLE_VERSIONS:
        raise IndexFormatError(
            f"{path}: index format version {manifest.get('version')!r}, this idml reads "
            f"{list(READABLE_VERSIONS)}; rebuild the index with this version"
        )
    for key in ("files", "backend", "count", "dim"):
        if key not in manifest:
            raise IndexFormatError(f"{path}: manifest lacks {key!r}; rebuild the index")
    if manifest["backend"] not in BACKENDS:
        raise IndexFormatError(
            f"{path}: unknown backend {manifest['backend']!r}; valid: {BACKENDS}"
        )
    files = manifest["files"]
    known = {EMBEDDINGS_FILE, ITEMS_FILE, FAISS_FILE}
    if not isinstance(files, dict) or not all(
        isinstance(e, dict) and isinstance(e.get("sha256"), str) and isinstance(e.get("bytes"), int)
        for e in files.values()
    ):
        raise IndexFormatError(f"{path}: 'files' must map file names to sha256 and bytes")
    strange = sorted(name for name in files if name not in known)
    if strange:  # a name such as "../x" or "/etc/passwd" never leads out of the folder
        raise IndexFormatError(
            f"{path}: lists files {strange[:3]} that are not index files ({sorted(known)}); "
            "rebuild the index"
        )
    for key in ("count", "dim"):
        if (
            isinstance(manifest[key], bool)
            or not isinstance(manifest[key], int)
            or manifest[key] < 0
        ):
            raise IndexFormatError(f"{path}: {key!r} must be a non-negative integer")
    root = manifest.get("root")
    if root is not None and (not isinstance(root, str) or not os.path.isabs(root)):
        raise IndexFormatError(f"{path}: 'root' must be an absolute folder path or null")
    return manifest


def _current_version(folder: Path) -> str | None:
    """The version ``current`` names (a plain ``v000123`` inside ``folder``), or ``None`` for a
    first-format index (no pointer)."""
    pointer = folder / CURRENT
    try:
        name = pointer.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as err:
        raise IndexFormatError(f"cannot read {pointer}: {err}; rebuild the index") from None
    if (
        not _VERSION_NAME.fullmatch(name)
        or not (folder / name).is_dir()
        or (folder / name).is_symlink()
    ):
        raise IndexFormatError(
            f"{pointer} names {name[:40]!r}, which is not a version folder of this index (it must "
            f"name a folder such as v000001 in {folder}); rebuild the index"
        )
    return name


def _versions(folder: Path) -> list[str]:
    return sorted(
        p.name for p in folder.iterdir() if _VERSION_NAME.fullmatch(p.name) and p.is_dir()
    )


def _version_number(name: str) -> int:
    return int(name[1:])


def _count(folder: Path, version: str | None) -> Any:
    try:
        return read_manifest(folder, version)["count"]
    except (OSError, ValueError):
        return "?"


def _foreign_entries(folder: Path) -> set[str]:
    """What a folder holds besides an index's own entries."""
    own = {CURRENT, LOCK_FILE, MANIFEST, EMBEDDINGS_FILE, ITEMS_FILE, FAISS_FILE}
    return {
        p.name
        for p in folder.iterdir()
        if p.name not in own and not _VERSION_NAME.fullmatch(p.name) and not p.name.startswith(".v")
    }


def _verified_bytes(where: Path, name: str, entry: dict[str, Any]) -> bytes:
    path = where / name
    if not path.is_file():
        if not where.is_dir():
            raise FileNotFoundError(path)  # the version went away under a reader: read again
        raise IndexFormatError(f"{path}: missing; the index is incomplete, rebuild it")
    data = path.read_bytes()
    if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise IndexFormatError(
            f"{path}: checksum mismatch with {where / MANIFEST} ({len(data)} bytes, "
            f"{entry['bytes']} expected); the file was truncated or modified. Rebuild the "
            "index with `idml index`"
        )
    return data


def _read_embeddings(
    path: Path, data: bytes, manifest: dict[str, Any]
) -> tuple[Tensor | None, Tensor, Tensor | None]:
    """The stored vectors (``None`` for an index without them), ``||u||`` and, without vectors,
    the first items' exact vectors."""
    try:
        tensors = safetensors_load(data)
    except Exception as err:  # safetensors raises its own error types for malformed headers
        raise IndexFormatError(
            f"{path}: not a readable safetensors file ({str(err).splitlines()[0][:200]}); "
            "rebuild the index"
        ) from None
    stored = bool(manifest.get("vectors", True))
    name = "embeddings" if stored else "spot"
    emb, unc = tensors.get(name), tensors.get("uncertainty")
    if emb is None or unc is None:
        raise IndexFormatError(f"{path}: needs tensors {name!r} and 'uncertainty'; rebuild it")
    rows = manifest["count"] if stored else min(manifest["count"], SPOT_VECTORS)
    if (
        emb.dtype != torch.float32
        or emb.dim() != 2
        or unc.dtype != torch.float32
        or unc.shape != (manifest["count"],)
    ):
        raise IndexFormatError(
            f"{path}: {name!r} must be float32 (N, d) and 'uncertainty' float32 (N,) of the "
            f"manifest's {manifest['count']} items, got {emb.dtype} {tuple(emb.shape)} and "
            f"{unc.dtype} {tuple(unc.shape)}; rebuild the index"
        )
    if (emb.shape[0], emb.shape[1]) != (rows, manifest["dim"]):
        raise IndexFormatError(
            f"{path}: holds {emb.shape[0]} × {emb.shape[1]} {name} but the manifest says "
            f"{rows} × {manifest['dim']}; rebuild the index"
        )
    if not bool(torch.isfinite(emb).all()) or not bool(torch.isfinite(unc).all()):
        raise IndexFormatError(f"{path}: holds NaN or inf; rebuild the index")
    norms = emb.norm(dim=1)
    off = ((norms - 1).abs() > UNIT_NORM_TOLERANCE).nonzero().flatten().tolist()
    if off:
        raise IndexFormatError(
            f"{path}: the embeddings of items at positions {off[:5]} are not unit vectors (norm "
            f"{float(norms[off[0]]):.4g}); an index stores normalised embeddings, so this file "
            "was not written by `idml index`. Rebuild the index"
        )
    return (emb, unc, None) if stored else (None, unc, emb)


def _read_items(
    path: Path, data: bytes, n: int
) -> tuple[list[str], list[str | None], list[str | None]]:
    try:
        items = json.loads(data)
    except ValueError as err:
        raise IndexFormatError(f"{path}: not valid JSON ({err}); rebuild the index") from None
    if not isinstance(items, dict):
        raise IndexFormatError(f"{path}: must be a JSON object with ids, paths and labels")
    columns = []
    for key, nullable in (("ids", False), ("paths", True), ("labels", True)):
        column = items.get(key)
        if not isinstance(column, list) or len(column) != n:
            raise IndexFormatError(
                f"{path}: {key!r} must be a list of {n} entries (one per embedding); rebuild it"
            )
        bad = [
            i for i, v in enumerate(column) if not (isinstance(v, str) or (nullable and v is None))
        ]
        if bad:
            kind = "strings or null" if nullable else "strings"
            raise IndexFormatError(
                f"{path}: {key!r} must hold {kind}; entry {bad[0]} is {column[bad[0]]!r}. "
                "Rebuild the index"
            )
        columns.append(column)
    if len(set(columns[0])) != n:
        raise IndexFormatError(f"{path}: item ids are not unique; rebuild the index")
    return columns[0], columns[1], columns[2]


def _read_faiss(path: Path, data: bytes, shape: tuple[int, int]) -> Any:
    try:
        import faiss
        import numpy as np
    except ImportError as err:
        raise IndexFormatError(
            f"{path.parent} is a faiss index; install the faiss extra (`pip install idml[faiss]`)"
        ) from err
    try:
        index = faiss.deserialize_index(np.frombuffer(data, dtype=np.uint8))
    except (RuntimeError, ValueError) as err:
        raise IndexFormatError(
            f"{path}: not a faiss index faiss can read ({str(err).strip().splitlines()[-1][:200]}); "
            "rebuild the index"
        ) from None
    if index.ntotal != shape[0] or index.d != shape[1]:
        raise IndexFormatError(
            f"{path}: holds {index.ntotal} vectors of dimension {index.d}, the embeddings "
            f"{shape[0]} of {shape[1]}; rebuild the index"
        )
    return index


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
