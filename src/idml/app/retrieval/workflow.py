"""What ``idml index``, ``idml search`` and ``idml serve`` do: read galleries and queries, embed
them with the index's model, and build, extend or search an :class:`~idml.app.retrieval.Index`.

Galleries and queries are read from

* an image file, an image folder or a CSV of ``path[,label]``, read by :mod:`idml.data.reader`
  as training reads them (a folder's label is the path below it, e.g. ``Alphabet/character01``;
  images at several depths are an error); an item's id is its path relative to the folder (or to
  the CSV's folder), or
* an embeddings file of ``idml embed`` (``.npz``, ``.pt``, ``.safetensors``; ids = its recorded
  paths, else the row numbers).

Images are embedded with the model the index was built with: the run (or export) folder recorded
in its manifest, or one given explicitly, whose weights must hash to the manifest's
``weights_sha256``. Embeddings of another model are refused, as their similarities to the gallery
would be meaningless; and since a manifest can be edited, a few gallery images are embedded again
and compared with their stored embeddings (:func:`check_embeddings`). Where and how fast that goes
(device, batch size, progress) is a :class:`Runtime`.

Every source has a root folder (the image folder, the CSV's folder, the folder of an image file,
or for an embeddings file the deepest folder holding all its recorded paths); an index records
paths relative to it and refuses items outside it unless built with ``allow_outside_root``.

How a loaded index answers — its re-ranking and the confidence and abstention of each answer — is
an :class:`Answering` (:func:`prepare_answering`), the same for ``idml search`` and ``idml serve``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from idml.app.calibration import find_calibration, reranking_name
from idml.app.distributed import DistributedContext, gather_shards
from idml.app.inference import Encoder, ModelInfo
from idml.app.retrieval.confidence import AnswerPolicy
from idml.app.retrieval.index import Index, relative_to_root
from idml.app.retrieval.index_folder import IndexFormatError, holds_index, writing
from idml.app.retrieval.output import result_records
from idml.app.retrieval.reranking import GalleryReranking
from idml.data import IMAGE_EXTENSIONS
from idml.data import read_images as read_records
from idml.evaluation.reranking import Reranker
from idml.evaluation.search.faiss_backend import new_index, training_positions


@dataclass(frozen=True)
class Runtime:
    """Where and how fast :func:`build_index` and :func:`search_source` go; none of it changes the
    index they write or the neighbours they find (the ``--batch-size``, ``--device`` and
    ``--no-progress`` of ``idml index`` and ``idml search``)."""

    batch_size: int = 64
    """Images per forward pass of the model."""
    device: str | None = None
    """Where the model runs when one is loaded, and the index is searched: ``cpu`` (default),
    ``cuda``, ``cuda:N``."""
    progress: bool = False
    """Report progress while images are embedded (on stderr)."""


@dataclass
class ItemSource:
    """Items to index or to query: ids, paths and labels, and either image files or embeddings."""

    ids: list[str]
    paths: list[str | None]
    labels: list[str | None]
    images: list[Path] | None = None
    embeddings: Tensor | None = None
    uncertainty: Tensor | None = None  # ||u|| per item, when read from a file
    root: Path | None = None
    """The folder the items' paths are taken relative to in an index (module docstring)."""

    def __len__(self) -> int:
        return len(self.ids)

    def share(self, start: int, stop: int) -> ItemSource:
        """Items ``start..stop-1`` (one process's share of a gallery)."""
        part = slice(start, stop)
        return ItemSource(
            self.ids[part],
            self.paths[part],
            self.labels[part],
            None if self.images is None else self.images[part],
            None if self.embeddings is None else self.embeddings[part],
            None if self.uncertainty is None else self.uncertainty[part],
            self.root,
        )


def read_images(source: str | Path) -> ItemSource:
    """An image file, a folder of images or a CSV of ``path[,label]`` (see the module docstring)."""
    source = Path(source)
    if source.is_file() and source.suffix.lower() in IMAGE_EXTENSIONS:
        return ItemSource(
            [source.name], [str(source.resolve())], [None], [source], root=source.resolve().parent
        )
    records = read_records(source)
    files = [Path(p) for p in records.paths]
    root = (source if source.is_dir() else source.parent).resolve()
    # The id is the path relative to the root, as written (an outside CSV row keeps its ``..``:
    # an id never reveals an absolute path).
    ids = [Path(os.path.relpath(os.path.abspath(f), root)).as_posix() for f in files]
    labels: list[str | None] = [None] * len(files)
    if records.labelled:
        labels = [records.class_names[int(c)] for c in records.class_ids]
    return ItemSource(ids, [os.path.abspath(f) for f in files], labels, files, root=root)


def read_embeddings(path: str | Path) -> ItemSource:
    """An ``idml embed`` file (or any file :func:`~idml.evaluation.io.load_embedding_file` reads)."""
    from idml.evaluation.io import load_embedding_file

    f = load_embedding_file(path)
    n = f.semantic.shape[0]
    unc = f.uncertainty
    if unc is not None and unc.dim() == 2:
        unc = unc.float().norm(dim=1)  # uncertainty vectors: their norm is the level
    labels: list[str | None] = [None] * n
    if f.labels is not None:
        ids = f.labels.reshape(-1).tolist()
        names = f.classes
        labels = [names[i] if names and 0 <= i < len(names) else str(i) for i in ids]
    paths: list[str | None] = list(f.paths) if f.paths is not None else [None] * n
    item_ids = list(f.paths) if f.paths is not None else [str(i) for i in range(n)]
    root = None
    if f.paths is not None and n:
        root = Path(os.path.commonpath([os.path.abspath(p) for p in f.paths]))
        if len(f.paths) == 1 or not root.is_dir():
            root = root.parent
    return ItemSource(
        item_ids, paths, labels, embeddings=f.semantic.float(), uncertainty=unc, root=root
    )


def read_source(path: str | Path) -> ItemSource:
    """:func:`read_embeddings` for ``.npz/.npy/.pt/.safetensors`` files, else :func:`read_images`."""
    suffix = Path(path).suffix.lower()
    if Path(path).is_file() and suffix in (".npz", ".npy", ".pt", ".pth", ".safetensors"):
        return read_embeddings(path)
    return read_images(path)


def encode(
    source: ItemSource, encoder: Encoder | None, batch_size: int = 64, progress: bool = False
) -> tuple[Tensor, Tensor | None]:
    """The source's embeddings and ``||u||``: read from its file, or computed by ``encoder``."""
    if source.embeddings is not None:
        return source.embeddings, source.uncertainty
    if encoder is None:
        raise ValueError("embedding images needs a model; give --checkpoint RUN")
    assert source.images is not None
    out = encoder.embed(source.images, batch_size=batch_size, progress=progress)
    return out.embeddings, out.uncertainty


def encoder_for_index(
    index: Index,
    checkpoint: str | Path | None = None,
    which: str = "best",
    device: str | None = None,
) -> Encoder:
    """The index's model (``checkpoint`` if given, else the folder in its manifest), verified."""
    if checkpoint is None:
        if index.model is None:
            raise IndexFormatError(
                "this index was built from embeddings without a model; give --checkpoint RUN to "
                "embed query images, or give an embeddings file of `idml embed` as the queries"
            )
        checkpoint = index.model.source
        if not Path(checkpoint).exists():
            raise FileNotFoundError(
                f"the index's model {checkpoint} no longer exists; give --checkpoint RUN (the same "
                "weights, e.g. an `idml export` folder of it)"
            )
    encoder = Encoder.load(checkpoint, which=which, device=device)
    check_model(index, encoder.info)
    check_embeddings(index, encoder)
    return encoder


SPOT_CHECK_ITEMS = 4
"""Gallery items :func:`check_embeddings` embeds again."""
SPOT_CHECK_MIN_COSINE = 0.999
"""The same model on the same image gives the same unit vector up to float32 summation order
(cosine ≥ 1 − 1e-6 in practice); another model's, or an edited file's, is far below this."""


def check_embeddings(index: Index, encoder: Encoder, sample: int = SPOT_CHECK_ITEMS) -> None:
    """Embed up to ``sample`` gallery images (the first that can be opened, inside the index's
    root) and refuse the index when their stored embeddings are not the model's: a manifest's
    model and checksums can be rewritten after an edit, the images' embeddings cannot."""
    picked = []
    # An index without vectors keeps the exact ones of its first items only.
    if index.embeddings is not None:
        candidates = len(index)
    else:
        candidates = 0 if index.spot is None else len(index.spot)
    for position in range(candidates):
        path = index.item_file(position)
        if path is not None and path.is_file():
            picked.append((position, path))
        if len(picked) == sample:
            break
    if not picked:
        return  # an index of embeddings without files: nothing to compare
    try:
        fresh = encoder.embed([p for _, p in picked], batch_size=len(picked))
    except (OSError, ValueError):
        return  # an unreadable image is the search's concern, not evidence against the index
    stored = index.stored_vectors([i for i, _ in picked])
    cosine = (fresh.embeddings.float() * stored).sum(dim=1)
    worst = int(torch.argmin(cosine))
    if float(cosine[worst]) < SPOT_CHECK_MIN_COSINE:
        position, path = picked[worst]
        raise IndexFormatError(
            f"the index's embedding of item {index.ids[position]!r} is not what model "
            f"{encoder.info.source} (weights {encoder.info.weights_sha256[:12]}) gives for "
            f"{path} (cosine {float(cosine[worst]):.3f}): the index was built with another model, "
            "or edited, or its images changed since. Rebuild it with `idml index`"
        )


def check_model(index: Index, info: ModelInfo) -> None:
    """Refuse a model whose weights or dimension differ from the index's."""
    if info.embedding_dim != index.dim:
        raise IndexFormatError(
            f"model {info.source} embeds in {info.embedding_dim} dimensions but the index has "
            f"{index.dim}; use the model the index was built with"
        )
    if index.model is not None and not info.same_model(index.model):
        raise IndexFormatError(
            f"model {info.source} (weights {info.weights_sha256[:12]}) is not the index's model "
            f"{index.model.source} (weights {index.model.weights_sha256[:12]}); embeddings of "
            "different models are not comparable. Use the index's run, or rebuild the index"
        )


def build_index(
    gallery: str | Path,
    out: str | Path,
    checkpoint: str | Path | None = None,
    *,
    which: str = "best",
    add: bool = False,
    backend: str = "exact",
    faiss_factory: str = "HNSW32",
    search_parameters: str | None = None,
    root: str | Path | None = None,
    allow_outside_root: bool = False,
    store_vectors: bool = True,
    train_size: int | None = None,
    runtime: Runtime | None = None,
    log: Callable[[str], object] = lambda _: None,
    distributed: DistributedContext | None = None,
) -> Index | None:
    """Embed ``gallery`` with ``checkpoint`` and write an index to ``out`` (or extend it: ``add``).

    ``backend``, ``faiss_factory``, ``search_parameters``, ``allow_outside_root``,
    ``store_vectors`` and ``train_size`` are those of :meth:`Index.create
    <idml.app.retrieval.index.Index.create>`, ``root`` its gallery root (default: the source's,
    see the module docstring); an extended index keeps its own. ``runtime`` [``Runtime()``] says
    on which device the model runs, in which batches. The folder's lock is held from reading the
    index to writing the new version, so two writers never drop each other's items: the second is
    refused.

    With a ``distributed`` context of several processes (``torchrun``), every process embeds its
    contiguous share of the gallery and rank 0 merges the shares in order with :meth:`Index.add`
    (a trained faiss index learns from the sample of the whole gallery that one process would
    take), so the index equals one process's; rank 0 returns it, the others ``None``.
    """
    runtime = runtime if runtime is not None else Runtime()
    context = distributed if distributed is not None else DistributedContext()
    out = Path(out)
    if context.is_main:
        if add and not holds_index(out):
            Index.load(out)  # the error that says what ``out`` is not
        if not add and holds_index(out):
            raise FileExistsError(f"{out} already holds an index; pass --add to extend it")
    lock = writing(out, log=log) if context.is_main else contextlib.nullcontext(out)
    with lock:
        existing = Index.load(out) if add and context.is_main else None
        source = read_source(gallery)
        device = str(context.device) if context.is_distributed else runtime.device
        encoder = None
        if checkpoint is not None:
            encoder = Encoder.load(checkpoint, which=which, device=device)
            if existing is not None:
                check_model(existing, encoder.info)
                check_embeddings(existing, encoder)
        elif add and source.embeddings is None:
            if existing is not None:
                encoder = encoder_for_index(existing, which=which, device=device)
            # The other processes load the model rank 0 found in the index's manifest.
            model_source = context.broadcast_object(
                None if encoder is None else encoder.info.source
            )
            if encoder is None:
                # Rank 0's encoder_for_index found the index's model or raised.
                assert model_source is not None
                encoder = Encoder.load(model_source, which=which, device=device)
        if (
            source.embeddings is not None
            and encoder is not None
            and source.embeddings.shape[1] != encoder.info.embedding_dim
        ):
            raise ValueError(
                f"{gallery}: embeddings of dimension {source.embeddings.shape[1]}, but model "
                f"{encoder.info.source} has {encoder.info.embedding_dim}; they are not its "
                "embeddings"
            )
        item_root = Path(root).resolve() if root is not None else source.root
        if existing is not None:
            item_root, allow_outside_root = existing.root, existing.allow_outside_root
        if item_root is not None:  # before the embedding pass: an outside item must not cost it
            for path in source.paths:
                relative_to_root(path, item_root, allow_outside_root, adding=existing is not None)
        log(f"embedding {len(source)} items from {gallery}")
        shares = _shares(len(source), context)
        mine = source.share(*shares[context.rank])
        emb, unc = encode(mine, encoder, runtime.batch_size, runtime.progress and context.is_main)
        unc = torch.zeros(emb.shape[0]) if unc is None else unc.float()
        embedded = gather_shards(emb.float().cpu(), context)
        levels = gather_shards(unc.cpu(), context)
        if embedded is None or levels is None:
            context.barrier()  # rank 0 merges and writes meanwhile
            return None
        model = encoder.info if encoder is not None else None
        pieces = [
            Index.create(e, u, *_items(source.share(*shares[r])), model)
            for r, (e, u) in enumerate(zip(embedded, levels, strict=True))
        ]
        if existing is not None:
            index = existing
        else:
            sample = None
            if backend == "faiss":
                # Trained on the rows one process would take from the whole gallery.
                empty = new_index(faiss_factory, pieces[0].dim)
                positions = training_positions(len(source), empty, train_size)
                sample = _rows(pieces, positions) if len(positions) else None
            # The first share as given (normalised once, as one process normalises it).
            pieces.pop(0)
            index = Index.create(
                embedded[0],
                levels[0],
                *_items(source.share(*shares[0])),
                model,
                backend=backend,
                faiss_factory=faiss_factory,
                search_parameters=search_parameters,
                root=item_root,
                allow_outside_root=allow_outside_root,
                store_vectors=store_vectors,
                train_vectors=sample,
            )
        del embedded
        for piece in pieces:
            index = index.add(piece)
        index.save(out, overwrite=add, log=log)
    context.barrier()
    return index


@dataclass(frozen=True)
class Answering:
    """How a loaded index answers its queries: re-ranking (``None``: none) and the answers'
    confidence and abstention (:class:`~idml.app.retrieval.confidence.AnswerPolicy`)."""

    policy: AnswerPolicy = AnswerPolicy()  # noqa: RUF009 (frozen, immutable)
    reranking: GalleryReranking | None = None

    def describe(self, reveal_paths: bool = True) -> dict[str, Any]:
        """The policy's description and the re-ranking (``idml search --json``, ``/info``)."""
        name = None if self.reranking is None else self.reranking.name
        return {**self.policy.describe(reveal_paths), "reranking": name}


def prepare_answering(
    index: Index,
    folder: str | Path,
    *,
    reranker: Reranker | None = None,
    calibration: str | Path | None = None,
    min_confidence: float | None = None,
    target_precision: float | None = None,
    delta: float = 0.1,
    device: str | None = None,
) -> Answering:
    """How ``index`` (loaded from ``folder``) will answer: ``reranker``'s gallery side prepared,
    and the calibration that applies — ``calibration`` if given, else ``calibration.json`` of
    the index folder or of the index's model folder (:func:`~idml.app.calibration.find_calibration`)
    — with the abstention cut-off (:meth:`AnswerPolicy.create
    <idml.app.retrieval.confidence.AnswerPolicy.create>`)."""
    folders = [Path(folder)]
    if index.model is not None and Path(index.model.source).is_dir():
        folders.append(Path(index.model.source))
    found = find_calibration(
        folders,
        None if index.model is None else index.model.weights_sha256,
        reranking_name(reranker),
        None if calibration is None else Path(calibration),
    )
    policy = AnswerPolicy.create(
        found, min_confidence=min_confidence, target_precision=target_precision, delta=delta
    )
    reranking = None if reranker is None else GalleryReranking.prepare(index, reranker, device)
    return Answering(policy, reranking)


def _shares(count: int, context: DistributedContext) -> list[tuple[int, int]]:
    """Each rank's contiguous ``[start, stop)`` of ``count`` items (``tensor_split`` sizes)."""
    sizes = [len(part) for part in torch.arange(count).tensor_split(context.world_size)]
    starts = [sum(sizes[:r]) for r in range(len(sizes))]
    return [(start, start + size) for start, size in zip(starts, sizes, strict=True)]


def _items(source: ItemSource) -> tuple[list[str], list[str | None], list[str | None]]:
    return source.ids, source.paths, source.labels


def _rows(pieces: list[Index], positions: Tensor) -> Tensor:
    """Rows ``positions`` of the concatenated embeddings of ``pieces`` (never concatenated)."""
    sizes = torch.tensor([len(piece) for piece in pieces])
    starts = torch.cumsum(sizes, 0) - sizes
    which = torch.searchsorted(starts, positions, right=True) - 1
    rows = []
    for p, piece in enumerate(pieces):
        assert piece.embeddings is not None
        rows.append(piece.embeddings[positions[which == p] - starts[p]])
    return torch.cat(rows)


def search_source(
    index: Index,
    queries: ItemSource,
    k: int = 10,
    encoder: Encoder | None = None,
    *,
    answering: Answering | None = None,
    runtime: Runtime | None = None,
) -> list[dict]:
    """Search ``index`` with ``queries`` (images need ``encoder``) → one record per query;
    ``answering`` [``Answering()``: no re-ranking, the top-1 similarity, no abstention] says how
    answers are re-ranked and scored, ``runtime`` [``Runtime()``] the batches images are embedded
    in and the search's device."""
    runtime = runtime if runtime is not None else Runtime()
    answering = answering if answering is not None else Answering()
    emb, unc = encode(queries, encoder, runtime.batch_size, runtime.progress)
    if emb.shape[1] != index.dim:
        raise ValueError(
            f"query embeddings have dimension {emb.shape[1]} but the index has {index.dim}; "
            "they come from another model"
        )
    result = index.search(
        emb,
        k,
        unc,
        policy=answering.policy,
        reranking=answering.reranking,
        device=runtime.device,
    )
    return result_records(result, index, queries.ids, queries.paths)


__all__ = [
    "Answering",
    "ItemSource",
    "Runtime",
    "build_index",
    "check_embeddings",
    "check_model",
    "encode",
    "encoder_for_index",
    "prepare_answering",
    "read_embeddings",
    "read_images",
    "read_source",
    "search_source",
]
