"""An index folder on disk: the format that :class:`~idml.app.retrieval.index.Index` saves and
loads, written atomically under a lock and read back verified.

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

**Writing** (:func:`save_version`, which :meth:`~idml.app.retrieval.index.Index.save` calls)
holds the lock (a second writer is refused naming the first), writes the new version into a hidden
folder, flushes it to disk, renames it into place and then replaces ``current`` with one atomic
rename: a kill at any instant leaves ``current`` naming a complete version, the old or the new one.
A full disk is reported with the folder and the bytes needed; the temporary folder is removed and
the old version stays current.

**Reading** (:func:`read_current`, which :meth:`~idml.app.retrieval.index.Index.load` calls)
distrusts the folder: ``current`` and every file name in the manifest must name an entry inside the
folder; every file's SHA-256 and size are checked; the contents must be what the manifest says
(count, dimension, finite unit vectors, ids unique strings, a faiss index of the same size); a
malformed file is a one-line :class:`IndexFormatError` naming it.
An index of the first format (the files directly in the folder, absolute paths) still loads.

Example:
    >>> import tempfile
    >>> import torch
    >>> from idml.app.retrieval import Index
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     _ = Index.create(torch.eye(2), ids=["a", "b"]).save(Path(tmp) / "gallery")
    ...     contents, where = read_current(Path(tmp) / "gallery")
    ...     sorted(p.name for p in where.iterdir())
    ['embeddings.safetensors', 'items.json', 'manifest.json']
    >>> where.name, contents.ids, contents.description.count, contents.description.backend
    ('v000001', ['a', 'b'], 2, 'exact')
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args

import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_bytes
from torch import Tensor

from idml.app.inference import read_json_file
from idml.app.run_folder import LOCK_FILE, folder_lock
from idml.app.storage import (
    fsync_folder,
    remove_quietly,
    write_failure,
    write_file,
    write_new_files,
)

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
Backend = Literal["exact", "faiss"]
BACKENDS: tuple[str, ...] = get_args(Backend)
UNIT_NORM_TOLERANCE = 1e-3
"""How far a stored embedding's norm may be from 1: float32 normalisation leaves ~1e-7; an
index whose vectors were written unnormalised (an edited file) is refused."""
SPOT_VECTORS = 16
"""Items whose exact vectors an index without vectors keeps (its first ones)."""
_VERSION_NAME = re.compile(r"v\d{6}")


class IndexFormatError(ValueError):
    """An index folder that is missing, corrupt, or does not fit what it is used with."""


_MANIFEST_OWN_KEYS = ("format", "version", "created", "files")
"""The manifest's keys about the file rather than the index."""


@dataclass(frozen=True)
class IndexDescription:
    """What a manifest says of its index, beside its format, version, creation time and
    checksums: how many items of what dimension, searched how, embedded by which model, with
    paths relative to which gallery root.

    :meth:`from_manifest` checks every key's type, so a hand-edited ``"allow_outside_root":
    "no"`` is refused rather than read as true. Keys an older index lacks take their defaults (the
    first format has no ``root`` or ``allow_outside_root``; indexes before ``--no-vectors`` have
    no ``vectors``). ``model`` is a :class:`~idml.app.inference.ModelInfo` as a dict, checked
    where it is used.
    """

    count: int
    dim: int
    backend: Backend
    metric: Literal["cosine"] = "cosine"
    faiss_factory: str | None = None
    search_parameters: str | None = None
    vectors: bool = True
    model: dict[str, Any] | None = None
    root: str | None = None
    allow_outside_root: bool = False

    _ON_DISK: ClassVar[tuple[str, ...]] = (  # the manifest's key order since the first format
        "count", "dim", "metric", "backend", "faiss_factory", "search_parameters", "vectors",
        "model", "root", "allow_outside_root",
    )  # fmt: skip

    def manifest_items(self) -> dict[str, Any]:
        """The description's manifest keys, in the order the manifest has always had."""
        return {key: getattr(self, key) for key in self._ON_DISK}

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any], path: Path) -> IndexDescription:
        """The description a manifest (read from ``path``) holds, each key checked."""

        def refuse(what: str) -> IndexFormatError:
            return IndexFormatError(f"{path}: {what}; rebuild the index")

        keys = set(cls._ON_DISK)
        unknown = sorted(set(manifest) - keys - set(_MANIFEST_OWN_KEYS))
        if unknown:
            valid = ", ".join(sorted(keys | set(_MANIFEST_OWN_KEYS)))
            raise refuse(f"unknown keys {unknown} (valid: {valid})")
        for key in ("backend", "count", "dim"):
            if key not in manifest:
                raise refuse(f"manifest lacks {key!r}")
        for key in ("count", "dim"):
            value = manifest[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise refuse(f"{key!r} must be a non-negative integer, got {value!r}")
        if manifest["backend"] not in BACKENDS:
            raise refuse(f"unknown backend {manifest['backend']!r} (valid: {', '.join(BACKENDS)})")
        if manifest.get("metric", "cosine") != "cosine":
            raise refuse(f"'metric' is {manifest['metric']!r}; an index searches by 'cosine'")
        for key in ("faiss_factory", "search_parameters"):
            if not isinstance(manifest.get(key), (str, type(None))):
                raise refuse(f"{key!r} must be a string or null, got {manifest[key]!r}")
        for key in ("vectors", "allow_outside_root"):
            if key in manifest and not isinstance(manifest[key], bool):
                raise refuse(f"{key!r} must be true or false, got {manifest[key]!r}")
        if not isinstance(manifest.get("model"), (dict, type(None))):
            raise refuse(f"'model' must be an object or null, got {manifest['model']!r}")
        root = manifest.get("root")
        if root is not None and (not isinstance(root, str) or not os.path.isabs(root)):
            raise refuse(f"'root' must be an absolute folder path or null, got {root!r}")
        return cls(**{key: manifest[key] for key in cls._ON_DISK if key in manifest})


@dataclass(frozen=True)
class VersionContents:
    """What one version of an index folder holds: the index's description and its items.

    ``embeddings`` is ``None`` for an index without vectors, which keeps ``spot``, its first
    items' exact vectors, instead; ``faiss_index`` is the faiss index of backend ``"faiss"``.
    """

    description: IndexDescription
    embeddings: Tensor | None
    spot: Tensor | None
    uncertainty: Tensor
    ids: list[str]
    paths: list[str | None]
    labels: list[str | None]
    faiss_index: Any = None


def _crash_point(step: str) -> None:
    """A boundary between two steps of :func:`save_version`: the tests take a snapshot of the
    folder here, which is what a process killed at that instant leaves on disk."""


# --------------------------------------------------------------------------- writing
def save_version(
    folder: str | Path,
    contents: VersionContents,
    overwrite: bool = False,
    log: Callable[[str], object] = lambda _: None,
) -> Path:
    """Write ``contents`` as a new version of ``folder`` and make it current (module docstring).

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
        foreign = set() if held else _foreign_entries(folder)  # writing() made the folder
        if foreign:
            raise IndexFormatError(
                f"{folder} exists and is not an index (it holds "
                f"{', '.join(sorted(foreign)[:3])}); refusing to write into it. Choose another "
                "--out"
            )
        _write_version(folder, _version_files(contents))
    return folder


def _write_version(folder: Path, files: dict[str, bytes]) -> None:
    """Write a new version of ``files`` into ``folder`` (locked by the caller) and switch
    ``current``."""
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


def _version_files(contents: VersionContents) -> dict[str, bytes]:
    """The file contents of one version, the manifest last (it holds the others' hashes)."""
    vectors = (
        {"embeddings": contents.embeddings.contiguous()}
        if contents.embeddings is not None
        else {
            "spot": (
                contents.spot
                if contents.spot is not None
                else torch.zeros(0, contents.description.dim)
            )
        }
    )
    files = {
        EMBEDDINGS_FILE: safetensors_bytes({**vectors, "uncertainty": contents.uncertainty}),
        ITEMS_FILE: json.dumps(
            {"ids": contents.ids, "paths": contents.paths, "labels": contents.labels}
        ).encode(),
    }
    if contents.description.backend == "faiss":
        import faiss

        files[FAISS_FILE] = faiss.serialize_index(contents.faiss_index).tobytes()
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **contents.description.manifest_items(),
        "files": {
            name: {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
            for name, data in files.items()
        },
    }
    files[MANIFEST] = (json.dumps(manifest, indent=2) + "\n").encode()
    return files


# --------------------------------------------------------------------------- reading
def read_current(folder: str | Path) -> tuple[VersionContents, Path]:
    """The current version of index folder ``folder``, read and verified (module docstring),
    with the folder it was read from (for messages that name its files)."""
    folder = Path(folder)
    for attempt in range(3):
        version = _current_version(folder)
        try:
            return _read_version(folder, version)
        except (FileNotFoundError, IndexFormatError):
            # Writers switched versions twice and removed the one being read: read the new one.
            if attempt == 2 or version is None or _current_version(folder) == version:
                raise
    raise AssertionError("unreachable")


def _read_version(folder: Path, version: str | None) -> tuple[VersionContents, Path]:
    where = folder if version is None else folder / version
    description, files = read_manifest(folder, version)
    data = {name: _verified_bytes(where, name, entry) for name, entry in files.items()}
    for required in (EMBEDDINGS_FILE, ITEMS_FILE) + (
        (FAISS_FILE,) if description.backend == "faiss" else ()
    ):
        if required not in data:
            raise IndexFormatError(f"{where / MANIFEST}: lists no {required}; rebuild the index")
    emb, unc, spot = _read_embeddings(where / EMBEDDINGS_FILE, data[EMBEDDINGS_FILE], description)
    ids, paths, labels = _read_items(where / ITEMS_FILE, data[ITEMS_FILE], len(unc))
    faiss_index = None
    if description.backend == "faiss":
        faiss_index = _read_faiss(where / FAISS_FILE, data[FAISS_FILE], (len(unc), description.dim))
    elif emb is None:
        raise IndexFormatError(
            f"{where / EMBEDDINGS_FILE}: an exact index needs its 'embeddings'; rebuild it"
        )
    contents = VersionContents(description, emb, spot, unc, ids, paths, labels, faiss_index)
    return contents, where


@contextmanager
def writing(folder: str | Path, log: Callable[[str], object] = lambda _: None) -> Iterator[Path]:
    """Hold the lock of index folder ``folder`` (created if missing) while the block runs: read
    the current index, extend it and :meth:`~idml.app.retrieval.index.Index.save` it with no other writer in between. A
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


def read_manifest(
    folder: Path, version: str | None = None
) -> tuple[IndexDescription, dict[str, dict[str, Any]]]:
    """The manifest of an index folder's ``version`` (``None``: a first-format index, whose files
    are in the folder itself), validated for format, version and keys: the index's description
    and its files (name → ``sha256`` and ``bytes``)."""
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
    if "files" not in manifest:
        raise IndexFormatError(f"{path}: manifest lacks 'files'; rebuild the index")
    description = IndexDescription.from_manifest(manifest, path)
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
    return description, files


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


def _count(folder: Path, version: str | None) -> int | str:
    try:
        return read_manifest(folder, version)[0].count
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
    path: Path, data: bytes, description: IndexDescription
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
    stored, count, dim = description.vectors, description.count, description.dim
    name = "embeddings" if stored else "spot"
    emb, unc = tensors.get(name), tensors.get("uncertainty")
    if emb is None or unc is None:
        raise IndexFormatError(f"{path}: needs tensors {name!r} and 'uncertainty'; rebuild it")
    rows = count if stored else min(count, SPOT_VECTORS)
    if (
        emb.dtype != torch.float32
        or emb.dim() != 2
        or unc.dtype != torch.float32
        or unc.shape != (count,)
    ):
        raise IndexFormatError(
            f"{path}: {name!r} must be float32 (N, d) and 'uncertainty' float32 (N,) of the "
            f"manifest's {count} items, got {emb.dtype} {tuple(emb.shape)} and "
            f"{unc.dtype} {tuple(unc.shape)}; rebuild the index"
        )
    if (emb.shape[0], emb.shape[1]) != (rows, dim):
        raise IndexFormatError(
            f"{path}: holds {emb.shape[0]} × {emb.shape[1]} {name} but the manifest says "
            f"{rows} × {dim}; rebuild the index"
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
