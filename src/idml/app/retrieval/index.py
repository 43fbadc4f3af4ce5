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

On disk an index is a folder (no pickle anywhere)::

    manifest.json            format, version, count, dimension, backend, the model, file checksums
    embeddings.safetensors   "embeddings" (N, d) float32 unit vectors, "uncertainty" (N,) float32
    items.json               "ids", "paths", "labels" (one per item; paths/labels may be null)
    faiss.index              only for backend "faiss" (faiss's own binary format)

Every file's SHA-256 and size are in the manifest and checked on load, so a truncated, replaced or
edited file is refused rather than silently searched. Saving writes a new folder next to the old one
and swaps it in with renames, so an interrupted save leaves the previous index intact.

Example:
    >>> import torch
    >>> gallery = torch.eye(3)
    >>> index = Index.create(gallery, torch.tensor([0.5, 1.0, 2.0]), ids=["a", "b", "c"])
    >>> result = index.search(torch.tensor([[0.9, 0.1, 0.0]]), k=2)
    >>> [index.ids[i] for i in result.indices[0].tolist()]
    ['a', 'b']
    >>> result.confidence_kind
    'top1_cosine'
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from idml.app.inference import ModelInfo, file_sha256, read_json_file
from idml.app.retrieval.confidence import confidence
from idml.evaluation.scoring import PairScorer, PreparedSide
from idml.evaluation.search import SearchExecution, neighbors_only
from idml.evaluation.search.faiss_backend import faiss_build, faiss_parameters

FORMAT = "idml-index"
VERSION = 1
MANIFEST = "manifest.json"
EMBEDDINGS_FILE = "embeddings.safetensors"
ITEMS_FILE = "items.json"
FAISS_FILE = "faiss.index"
BACKENDS = ("exact", "faiss")


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
    """Top-``k`` neighbours of ``Q`` queries.

    ``indices[q, r]`` is the item position of the ``r``-th neighbour (``-1`` where the gallery has
    fewer than ``k`` items), ``similarities`` their cosine similarities; ``query_uncertainty`` the
    queries' ``||u||`` (NaN when the queries were given as bare embeddings); ``confidence`` the
    answer's confidence, of kind ``confidence_kind`` (see :mod:`idml.app.retrieval.confidence`).
    """

    indices: Tensor
    similarities: Tensor
    query_uncertainty: Tensor
    confidence: Tensor
    confidence_kind: str

    def __len__(self) -> int:
        return int(self.indices.shape[0])


@dataclass(eq=False, repr=False)
class Index:
    """Unit-normalised gallery embeddings with their uncertainty, items and model (see module doc).

    Build one with :meth:`create` (which checks and normalises the items) or :meth:`load`.
    """

    embeddings: Tensor
    """``(N, d)`` float32 unit vectors."""
    uncertainty: Tensor
    """``(N,)`` float32 ``||u||`` of each item."""
    ids: list[str]
    """Unique item ids."""
    paths: list[str | None]
    labels: list[str | None]
    model: ModelInfo | None
    """The model that embedded the items (checked when the index is extended or searched)."""
    backend: str = "exact"
    faiss_factory: str = "HNSW32"
    search_parameters: str | None = None
    faiss_index: Any = None
    """The faiss index of :attr:`embeddings` (backend ``"faiss"``), else ``None``."""

    # ----------------------------------------------------------------- building
    @classmethod
    def create(
        cls,
        embeddings: Tensor,
        uncertainty: Tensor | None = None,
        ids: Sequence[str] | None = None,
        paths: Sequence[str | None] | None = None,
        labels: Sequence[str | None] | None = None,
        model: ModelInfo | None = None,
        *,
        backend: str = "exact",
        faiss_factory: str = "HNSW32",
        search_parameters: str | None = None,
    ) -> Index:
        """An index of ``embeddings`` ``(N, d)`` (normalised here) and their ``||u||`` ``(N,)``.

        ``ids`` default to the row numbers; they must be unique. ``model`` is recorded and checked
        whenever the index is extended or searched with images.
        """
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        emb, unc, items = _check_items(embeddings, uncertainty, ids, paths, labels)
        index = cls(emb, unc, *items, model, backend, faiss_factory, search_parameters)
        if backend == "faiss":
            index.faiss_index = faiss_build(emb, faiss_factory, search_parameters)
        return index

    def add(self, other: Index) -> Index:
        """A new index with the items of ``other`` appended (this one is left unchanged), e.g.
        ``index.add(Index.create(embeddings, uncertainty, ids, model=model))``.

        Refused when ``other``'s model differs from this index's model, when the dimension differs,
        or when an id is already in the index: the result equals a fresh index of the union, with
        this index's backend and settings.
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
        clash = set(other.ids).intersection(self.ids)
        if clash:
            raise IndexFormatError(
                f"{len(clash)} id(s) are already in the index, e.g. {sorted(clash)[:3]}; "
                "an item can be added once (give other ids, or build a new index)"
            )
        faiss_index = None
        if self.backend == "faiss":
            import faiss

            faiss_index = faiss.clone_index(self.faiss_index)
            faiss_index.add(other.embeddings.numpy())
            faiss_parameters(faiss_index, self.search_parameters)
        return Index(
            torch.cat([self.embeddings, other.embeddings]),
            torch.cat([self.uncertainty, other.uncertainty]),
            self.ids + other.ids,
            self.paths + other.paths,
            self.labels + other.labels,
            self.model if self.model is not None else model,
            self.backend,
            self.faiss_factory,
            self.search_parameters,
            faiss_index,
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
        return int(self.embeddings.shape[0])

    @property
    def dim(self) -> int:
        return int(self.embeddings.shape[1])

    def describe(self) -> dict[str, Any]:
        """Size, dimension, backend and model, as ``idml serve``'s ``/info`` reports them."""
        return {
            "count": len(self),
            "dim": self.dim,
            "metric": "cosine",
            "backend": self.backend,
            "faiss_factory": self.faiss_factory if self.backend == "faiss" else None,
            "search_parameters": self.search_parameters if self.backend == "faiss" else None,
            "model": None if self.model is None else self.model.to_dict(),
        }

    # ----------------------------------------------------------------- search
    def search(
        self,
        queries: Tensor,
        k: int = 10,
        query_uncertainty: Tensor | None = None,
        *,
        block_size: int | None = None,
        device: torch.device | str | None = None,
    ) -> SearchResult:
        """Top-``k`` items of each query embedding ``(Q, d)`` by cosine similarity.

        ``query_uncertainty`` ``(Q,)``: the queries' ``||u||`` (reported, and passed to
        :func:`~idml.app.retrieval.confidence.confidence`); NaN when not given.
        """
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
        if k < 1:
            raise ValueError(f"k (neighbours per query) must be >= 1, got {k}")
        q = torch.nn.functional.normalize(queries.float(), dim=1)
        n_q = q.shape[0]
        if query_uncertainty is None:
            q_unc = torch.full((n_q,), float("nan"))
        else:
            q_unc = torch.as_tensor(query_uncertainty, dtype=torch.float32).reshape(-1)
            if q_unc.shape[0] != n_q:
                raise ValueError(f"query_uncertainty has {q_unc.shape[0]} values for {n_q} queries")
        k_eff = min(k, len(self))
        if k_eff == 0:
            ids = torch.full((n_q, k), -1, dtype=torch.long)
            sims = torch.full((n_q, k), float("nan"))
        elif self.backend == "faiss":
            distances, found = self.faiss_index.search(q.numpy(), k_eff)
            ids, sims = torch.from_numpy(found).long(), torch.from_numpy(distances).float()
            sims = torch.where(ids < 0, torch.full_like(sims, float("nan")), sims)
        else:
            found = neighbors_only(
                q,
                k_eff,
                self.embeddings,
                metric=_UnitCosine(),
                execution=SearchExecution(block_size=block_size, device=device),
            )
            ids, sims = found.indices.cpu().long(), found.scores.cpu().float()
        if ids.shape[1] < k:  # fewer items than k: pad as "no neighbour"
            pad = k - ids.shape[1]
            ids = torch.cat([ids, torch.full((n_q, pad), -1, dtype=torch.long)], 1)
            sims = torch.cat([sims, torch.full((n_q, pad), float("nan"))], 1)
        score, kind = confidence(sims[:, 0], q_unc)
        return SearchResult(ids, sims, q_unc, score, kind)

    # ----------------------------------------------------------------- files
    def save(self, folder: str | Path, overwrite: bool = False) -> Path:
        """Write the index folder (see the module docstring); ``overwrite`` replaces one that exists."""
        folder = Path(folder)
        if folder.exists() and not overwrite:
            raise FileExistsError(
                f"{folder} already exists; pass --add to extend it, or choose another folder"
            )
        if folder.exists() and not (folder / MANIFEST).is_file():
            raise IndexFormatError(
                f"{folder} exists and is not an index (no {MANIFEST}); refusing to replace it"
            )
        tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(
            {"embeddings": self.embeddings.contiguous(), "uncertainty": self.uncertainty},
            str(tmp / EMBEDDINGS_FILE),
        )
        items = {"ids": self.ids, "paths": self.paths, "labels": self.labels}
        (tmp / ITEMS_FILE).write_text(json.dumps(items))
        files = [EMBEDDINGS_FILE, ITEMS_FILE]
        if self.backend == "faiss":
            import faiss

            faiss.write_index(self.faiss_index, str(tmp / FAISS_FILE))
            files.append(FAISS_FILE)
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **self.describe(),
            "files": {
                name: {"sha256": file_sha256(tmp / name), "bytes": (tmp / name).stat().st_size}
                for name in files
            },
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
        if folder.exists():
            os.replace(folder, old)
        os.replace(tmp, folder)
        shutil.rmtree(old, ignore_errors=True)
        return folder

    @classmethod
    def load(cls, folder: str | Path, search_parameters: str | None = None) -> Index:
        """Read and verify an index folder; ``search_parameters`` override the saved faiss ones."""
        folder = Path(folder)
        manifest = read_manifest(folder)
        for name, entry in manifest["files"].items():
            path = folder / name
            if not path.is_file():
                raise IndexFormatError(f"{path}: missing; the index is incomplete, rebuild it")
            size = path.stat().st_size
            if size != entry["bytes"] or file_sha256(path) != entry["sha256"]:
                raise IndexFormatError(
                    f"{path}: checksum mismatch with {folder / MANIFEST} ({size} bytes, "
                    f"{entry['bytes']} expected); the file was truncated or modified. Rebuild the "
                    "index with `idml index`"
                )
        tensors = load_file(str(folder / EMBEDDINGS_FILE))
        items = json.loads((folder / ITEMS_FILE).read_text())
        model = None
        if manifest.get("model") is not None:
            model = ModelInfo.from_dict(manifest["model"], str(folder / MANIFEST))
        backend = manifest["backend"]
        params = search_parameters or manifest.get("search_parameters")
        faiss_index = None
        if backend == "faiss":
            try:
                import faiss
            except ImportError as err:
                raise IndexFormatError(
                    f"{folder} is a faiss index; install the faiss extra (`pip install idml[faiss]`)"
                ) from err
            faiss_index = faiss.read_index(str(folder / FAISS_FILE))
            faiss_parameters(faiss_index, params)
        emb, unc = tensors["embeddings"], tensors["uncertainty"]
        n = emb.shape[0]
        if any(len(items[key]) != n for key in ("ids", "paths", "labels")) or unc.shape != (n,):
            raise IndexFormatError(f"{folder}: items and embeddings disagree in length; rebuild it")
        return cls(
            emb,
            unc,
            list(items["ids"]),
            list(items["paths"]),
            list(items["labels"]),
            model,
            backend,
            manifest.get("faiss_factory") or "HNSW32",
            params,
            faiss_index,
        )


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest of an index folder, validated for format and version."""
    path = folder / MANIFEST
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such index folder; build one with `idml index`")
    manifest = read_json_file(
        path,
        missing=IndexFormatError(
            f"{folder}: not an index (no {MANIFEST}); build one with `idml index`"
        ),
        redo="rebuild the index",
        error=IndexFormatError,
    )
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise IndexFormatError(f"{path}: not an idml index manifest (format != {FORMAT!r})")
    if manifest.get("version") != VERSION:
        raise IndexFormatError(
            f"{path}: index format version {manifest.get('version')}, this idml reads {VERSION}; "
            "rebuild the index with this version"
        )
    for key in ("files", "backend", "count", "dim"):
        if key not in manifest:
            raise IndexFormatError(f"{path}: manifest lacks {key!r}; rebuild the index")
    if manifest["backend"] not in BACKENDS:
        raise IndexFormatError(
            f"{path}: unknown backend {manifest['backend']!r}; valid: {BACKENDS}"
        )
    return manifest


def _check_items(
    embeddings: Tensor,
    uncertainty: Tensor | None,
    ids: Sequence[str] | None,
    paths: Sequence[str | None] | None,
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
    emb = torch.nn.functional.normalize(embeddings.detach().float().cpu(), dim=1).contiguous()
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
        seen: set[str] = set()
        dup = next(x for x in id_list if x in seen or seen.add(x))  # type: ignore[func-returns-value]
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
