"""Reading embeddings and labels from ``.npy``, ``.npz``, ``.pt`` and ``.safetensors`` files.

* ``.npy``: one array — the embeddings (or the labels, for a labels file).
* ``.npz`` / ``.safetensors`` / ``.pt`` (a dict of tensors, or a bare tensor): named entries.
  Semantic embeddings are found under ``embeddings`` or ``semantic``, uncertainty embeddings under
  ``uncertainty``, labels under ``labels``; other names can be given explicitly. A missing entry is
  a ``ValueError`` that lists the keys the file does have.

``.pt`` files are read with ``torch.load(weights_only=True)``: tensors and plain containers only,
never arbitrary pickled code.

Text entries are metadata, not arrays: ``idml embed`` stores each image's path (a string array in
``.npz``, a list in ``.pt``, JSON in the ``.safetensors`` metadata), the class names and, when the
images have query/gallery roles, each image's role. They are read into
:attr:`EmbeddingFile.paths`, :attr:`EmbeddingFile.classes` and :attr:`EmbeddingFile.roles` and
never mistaken for numeric entries.

Example:
    >>> import tempfile, pathlib, numpy as np
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "emb.npz"
    >>> np.savez(path, semantic=np.eye(3, dtype=np.float32), labels=np.array([0, 0, 1]))
    >>> f = load_embedding_file(path)
    >>> tuple(f.semantic.shape), f.labels.tolist(), f.uncertainty is None
    ((3, 3), [0, 0, 1], True)
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

SEMANTIC_KEYS: tuple[str, ...] = ("embeddings", "semantic")
UNCERTAINTY_KEYS: tuple[str, ...] = ("uncertainty",)
LABEL_KEYS: tuple[str, ...] = ("labels",)
SUFFIXES: tuple[str, ...] = (".npy", ".npz", ".pt", ".pth", ".safetensors")


@dataclass
class EmbeddingFile:
    """What a file provides: semantic embeddings, and optionally uncertainty and labels."""

    path: Path
    semantic: Tensor
    uncertainty: Tensor | None
    labels: Tensor | None
    keys: tuple[str, ...]
    paths: list[str] | None = None  # one per row, when the file records them (``idml embed``)
    classes: list[str] | None = None  # label id -> class name, when recorded
    roles: list[str] | None = None  # "query", "gallery" or "" per row, when recorded


TEXT_KEYS: tuple[str, ...] = ("paths", "classes", "roles")
"""Entries that hold text (image paths, class names) rather than numbers."""


def _is_text(value: object) -> bool:
    if isinstance(value, np.ndarray):
        return value.dtype.kind in "US"
    return isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)


def _as_tensor(value: object, path: Path, key: str) -> Tensor:
    if isinstance(value, Tensor):
        return value.detach().cpu()
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            raise ValueError(f"{path}: entry {key!r} is an object array; save numeric arrays only")
        if value.dtype.kind in "USV":  # strings or raw bytes: class names are not class ids
            raise ValueError(
                f"{path}: entry {key!r} holds {'strings' if value.dtype.kind == 'U' else 'bytes'}"
                f" ({value.dtype}); save numeric arrays, e.g. labels as integer ids from "
                "np.unique(names, return_inverse=True)[1]"
            )
        return torch.from_numpy(np.ascontiguousarray(value))
    raise ValueError(
        f"{path}: entry {key!r} is a {type(value).__name__}, expected an array or tensor"
    )


def read_entries(path: str | Path) -> dict[str, Tensor]:
    """All named arrays of a file (a single-array file gives the one key ``""``); text entries
    (see :func:`read_text_entries`) are left out."""
    return _read(Path(path))[0]


def read_text_entries(path: str | Path) -> dict[str, list[str]]:
    """The text entries of a file: string arrays (``.npz``), lists of strings (``.pt``) and
    JSON lists of strings in the metadata (``.safetensors``), e.g. ``paths`` and ``classes``."""
    return _read(Path(path))[1]


def _read(path: Path) -> tuple[dict[str, Tensor], dict[str, list[str]]]:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise ValueError(
            f"{path}: unsupported file type {suffix!r}; use one of {', '.join(SUFFIXES)}"
        )
    try:
        if suffix == ".npy":
            return {"": _as_tensor(np.load(path, allow_pickle=False), path, "")}, {}
        if suffix == ".npz":
            with np.load(path, allow_pickle=False) as archive:
                arrays = {key: archive[key] for key in archive.files}
            return _split_text(arrays, path)
        if suffix == ".safetensors":
            from safetensors import safe_open
            from safetensors.torch import load_file

            with safe_open(str(path), framework="pt") as handle:
                metadata = handle.metadata() or {}
            return dict(load_file(str(path))), _metadata_text(metadata)
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        # weights_only refused (or could not parse) the pickle: never executed, never trusted.
        raise ValueError(
            f"{path}: refused to load: the .pt file holds Python objects beyond tensors and plain "
            "containers, which could run code; save a dict of tensors, or .npz/.safetensors"
        ) from err
    except (OSError, ValueError, RuntimeError) as err:
        if isinstance(err, ValueError) and str(err).startswith(str(path)):
            raise
        raise ValueError(f"{path}: cannot read the file ({err})") from err
    except Exception as err:  # safetensors' SafetensorError derives from Exception only
        if type(err).__name__ != "SafetensorError":
            raise
        raise ValueError(f"{path}: not a valid safetensors file ({err})") from None
    if isinstance(loaded, Mapping):
        return _split_text({str(key): value for key, value in loaded.items()}, path)
    return {"": _as_tensor(loaded, path, "")}, {}


def _split_text(
    values: Mapping[str, object], path: Path
) -> tuple[dict[str, Tensor], dict[str, list[str]]]:
    entries: dict[str, Tensor] = {}
    text: dict[str, list[str]] = {}
    for key, value in values.items():
        if _is_text(value):
            items: Any = value.reshape(-1) if isinstance(value, np.ndarray) else value
            text[key] = [str(v) for v in items]
        else:
            entries[key] = _as_tensor(value, path, key)
    return entries, text


def _metadata_text(metadata: Mapping[str, str]) -> dict[str, list[str]]:
    """JSON lists of strings in safetensors metadata (other metadata values are not text entries)."""
    import json

    text: dict[str, list[str]] = {}
    for key, raw in metadata.items():
        try:
            value = json.loads(raw)
        except ValueError:
            continue
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            text[key] = value
    return text


def _pick(
    entries: Mapping[str, Tensor],
    path: Path,
    what: str,
    explicit: str | None,
    candidates: Sequence[str],
    required: bool,
) -> Tensor | None:
    if explicit is not None:
        if explicit not in entries:
            raise ValueError(
                f"{path}: no entry {explicit!r} for the {what}; keys found: {_key_list(entries)}"
            )
        return entries[explicit]
    for key in candidates:
        if key in entries:
            return entries[key]
    if required:
        names = " or ".join(repr(k) for k in candidates)
        raise ValueError(
            f"{path}: no {what} entry (looked for {names}); keys found: {_key_list(entries)}. "
            f"Name the entry explicitly (e.g. --embeddings-key)"
        )
    return None


def _key_list(entries: Mapping[str, Tensor]) -> str:
    shown = [f"{k!r} {tuple(v.shape)}" for k, v in entries.items() if k]
    return ", ".join(shown) if shown else "(a single unnamed array)"


@dataclass(frozen=True)
class EntryNames:
    """Which entries of an embedding file hold what. ``None`` looks for the usual names, in order:
    :data:`SEMANTIC_KEYS`, :data:`UNCERTAINTY_KEYS`, :data:`LABEL_KEYS` (the command line's
    ``--embeddings-key``, ``--uncertainty-key`` and ``--labels-key``)."""

    embeddings: str | None = None
    uncertainty: str | None = None
    labels: str | None = None


USUAL_ENTRIES = EntryNames()
"""The usual entry names only (no entry named explicitly)."""


def load_embedding_file(path: str | Path, entry_names: EntryNames = USUAL_ENTRIES) -> EmbeddingFile:
    """Read semantic embeddings (required), uncertainty and labels (if present) from one file,
    from the entries ``entry_names`` names (or the usual names)."""
    names = entry_names
    path = Path(path)
    entries, text = _read(path)
    if set(entries) == {""}:
        semantic: Tensor | None = entries[""]
        uncertainty = labels = None
    else:
        semantic = _pick(entries, path, "embeddings", names.embeddings, SEMANTIC_KEYS, True)
        uncertainty = _pick(
            entries, path, "uncertainty", names.uncertainty, UNCERTAINTY_KEYS, False
        )
        labels = _pick(entries, path, "labels", names.labels, LABEL_KEYS, False)
    assert semantic is not None
    if semantic.dim() != 2 or not semantic.dtype.is_floating_point:
        raise ValueError(
            f"{path}: embeddings must be a floating (N, d) array, got dtype {semantic.dtype} "
            f"and shape {tuple(semantic.shape)}"
        )
    for name, values in (("embeddings", semantic), ("uncertainty", uncertainty)):
        if values is None or not values.dtype.is_floating_point or len(values) == 0:
            continue
        bad = ~torch.isfinite(values.reshape(len(values), -1)).all(dim=1)
        if bool(bad.any()):
            count = int(bad.sum())
            raise ValueError(
                f"{path}: {name!r} holds NaN or inf in {count} row{'s' * (count > 1)} (the first: "
                f"{bad.nonzero().flatten()[:5].tolist()}); the model that wrote them diverged or "
                "the file is damaged: write it again"
            )
    for key in ("paths", "roles"):
        rows = text.get(key)
        if rows is not None and len(rows) != semantic.shape[0]:
            raise ValueError(
                f"{path}: {key!r} has {len(rows)} entries but there are {semantic.shape[0]} "
                "embeddings; the file is inconsistent, write it again"
            )
    return EmbeddingFile(
        path,
        semantic,
        uncertainty,
        labels,
        tuple(k for k in entries if k),
        paths=text.get("paths"),
        classes=text.get("classes"),
        roles=text.get("roles"),
    )


def load_labels(path: str | Path, key: str | None = None) -> Tensor:
    """Read an integer label vector ``(N,)`` from a file (a bare array or a ``labels`` entry)."""
    path = Path(path)
    entries = read_entries(path)
    if set(entries) == {""}:
        labels = entries[""]
    else:
        picked = _pick(entries, path, "labels", key, LABEL_KEYS, True)
        assert picked is not None
        labels = picked
    return check_labels(labels, f"{path}: labels")


def check_labels(labels: Tensor, name: str = "labels") -> Tensor:
    """A 1-D integer label vector (integral floats are accepted and converted), else ``ValueError``."""
    labels = torch.as_tensor(labels)
    if labels.dim() == 2 and labels.shape[1] == 1:
        labels = labels[:, 0]
    if labels.dim() != 1:
        raise ValueError(
            f"{name} must be a 1-D vector of class ids, got shape {tuple(labels.shape)}"
        )
    if labels.dtype == torch.bool:
        raise ValueError(f"{name} must be integer class ids, got booleans")
    if labels.dtype.is_floating_point and not (
        bool(torch.isfinite(labels).all()) and bool((labels == labels.round()).all())
    ):
        raise ValueError(f"{name} must be integer class ids, got non-integer values")
    return labels.long()
