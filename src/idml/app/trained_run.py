"""Load a trained retrieval model from a run, and export embeddings of arbitrary images.

Exported models hold only what retrieval needs: the :class:`~idml.models.EmbeddingModel` weights
(``model.safetensors``). Loss proxies and SSR's ranking head live in ``training.safetensors`` and are
never loaded here.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from torch import Tensor

from idml.app import build
from idml.app.checkpoint import (
    CheckpointError,
    CheckpointPointerError,
    load_model_weights,
    read_state,
    resolve_checkpoint,
)
from idml.app.config import Config, validate_config
from idml.data import IMAGE_EXTENSIONS, FileImageDataset, ImageRecords, build_transforms
from idml.embeddings import Embeddings
from idml.evaluation import EvaluationReport
from idml.evaluation.clustering import KMeansBackend
from idml.models import EmbeddingModel


@dataclass(frozen=True)
class TrainedRun:
    """A run folder's retrieval model as loaded from one checkpoint."""

    config: Config
    model: EmbeddingModel
    checkpoint: Path  # the checkpoint folder loaded
    which: str  # "best" or "latest": the pointer that was followed
    state: dict[str, Any]  # its state.json (epoch, config, …)


def load_trained_run(path: Path, which: str = "best") -> TrainedRun:
    """Load a run folder's ``which`` checkpoint (``"best"`` falls back to ``"latest"`` for a run
    that was never evaluated), its config and its retrieval model (in eval mode, on the CPU)."""
    path = Path(path)
    try:
        ckpt = resolve_checkpoint(path, which)
    except CheckpointPointerError:
        raise  # a pointer out of the run is refused, never worked around
    except CheckpointError:
        if which != "best":
            raise
        ckpt, which = resolve_checkpoint(path, "latest"), "latest"
    state = read_state(ckpt)
    if not isinstance(state.get("config"), dict):
        raise CheckpointError(
            f"{ckpt / 'state.json'} has no 'config' entry, so the model cannot be rebuilt; it was "
            "not written by `idml train` (or was edited): use the run's own checkpoint folder"
        )
    cfg = validate_config(state["config"], source=str(ckpt / "state.json"))
    # Never fetch pretrained weights just to overwrite them with the checkpoint's.
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"pretrained": False})})
    model = build.build_model(cfg)
    load_model_weights(ckpt, model)
    model.eval()
    return TrainedRun(cfg, model, ckpt, which, state)


def load_trained_model(path: Path, which: str = "best") -> tuple[Config, EmbeddingModel]:
    """The config and the retrieval model of a run folder (see :func:`load_trained_run`)."""
    run = load_trained_run(path, which)
    return run.config, run.model


def list_images(source: Path, split: str | None = None) -> tuple[list[Path], list[str] | None]:
    """Image files of a folder (recursively; labels = parent folder names) or of a CSV
    ``path[,label[,split]]`` (an optional header row names the columns).

    ``split`` keeps the CSV rows whose ``split`` column equals it (a CSV without that column, or a
    folder, is an error). Relative CSV paths are taken from the CSV's folder; absolute paths and
    ``..`` are allowed, as for a local dataset (:mod:`idml.data.loaders` documents the policy).
    """
    source = Path(source)
    if split is not None and not (source.is_file() and source.suffix.lower() == ".csv"):
        raise ValueError(f"--split {split!r} needs a CSV with a split column, not {source}")
    if source.is_dir():
        files = sorted(
            p for p in source.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file()
        )
        if not files:
            raise ValueError(
                f"{source} contains no images with extensions {sorted(IMAGE_EXTENSIONS)}"
            )
        return files, [p.parent.name for p in files]
    if source.is_file() and source.suffix.lower() == ".csv":
        with open(source, newline="", encoding="utf-8-sig") as fh:  # -sig: drop a BOM
            rows = [r for r in csv.reader(fh) if r and not r[0].startswith("#")]
        header = ["path", "label", "split"]
        if rows and rows[0][0].strip().lower() == "path":
            header, rows = [c.strip().lower() for c in rows[0]], rows[1:]
        if split is not None:
            if "split" not in header:
                raise ValueError(
                    f"--split {split!r}: {source} has no split column (header {header[:3]}); "
                    "add a header path,label,split or drop --split"
                )
            column = header.index("split")
            found = sorted({r[column].strip() for r in rows if len(r) > column})
            rows = [r for r in rows if len(r) > column and r[column].strip() == split]
            if not rows:
                raise ValueError(f"--split {split!r}: {source} has no such rows; splits: {found}")
        if not rows:
            raise ValueError(f"{source} lists no images; expected rows of path[,label]")
        files = [Path(r[0]) if Path(r[0]).is_absolute() else source.parent / r[0] for r in rows]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(
                f"{source} lists {len(missing)} missing image(s), e.g. {missing[:3]}; fix the paths "
                "(relative paths are taken from the CSV's folder)"
            )
        labels = [r[1] for r in rows] if all(len(r) > 1 for r in rows) else None
        return files, labels
    raise FileNotFoundError(f"{source} is neither an image folder nor a .csv file")


@torch.no_grad()
def embed_images(
    cfg: Config,
    model: EmbeddingModel,
    images: Path,
    out: Path,
    batch_size: int = 64,
    split: str | None = None,
    progress: bool = True,
    extras: Callable[[Embeddings], tuple[dict[str, Tensor], dict[str, list[str]]]] | None = None,
) -> int:
    """Embed every image under ``images`` and save semantic embeddings and ``||u||`` to ``out``.

    ``out`` is ``.npz``/``.pt`` (with ``paths`` and ``classes``) or ``.safetensors`` (both in the
    metadata). Keys:
    ``embeddings`` ``(N, d)``, ``uncertainty`` ``(N,)`` (``||u||``; zeros without an uncertainty
    head), ``labels`` when the source has them (``classes`` names them: the source's labels).

    ``extras`` adds what a run's task writes besides: arrays with one row per image and lists of
    names, from the embeddings (:meth:`idml.app.tasks.LoadedRun.extra_outputs`; a classification
    run's ``logits``, ``probabilities`` and ``logit_classes``).
    """
    out = Path(out)
    suffix = out.suffix.lower()
    if suffix not in (".npz", ".pt", ".safetensors"):
        # Checked before embedding: a wrong name must not cost the whole pass.
        raise ValueError(f"--out {out}: use a .npz, .pt or .safetensors file name")
    files, names = list_images(images, split)
    paths = [str(f) for f in files]
    if names:
        unique, ids = np.unique(np.array(names), return_inverse=True)
        classes = [str(c) for c in unique]
    else:
        classes, ids = [], np.zeros(len(files), int)
    records = ImageRecords(np.array(paths, dtype=object), ids)
    transform = build_transforms(False, cfg.data.image_size, cfg.data.resize_size)
    dataset = FileImageDataset(records, transform)
    device = next(model.parameters()).device
    emb, _ = build.embed_dataset(model, dataset, batch_size, device, progress=progress)
    level = (
        torch.zeros(emb.semantic.shape[0])
        if emb.uncertainty is None  # a baseline without an uncertainty head
        else model.uncertainty_level(emb)
    )
    payload = {"embeddings": emb.semantic, "uncertainty": level}
    if names:
        payload["labels"] = torch.as_tensor(ids)
    text: dict[str, list[str]] = {"paths": paths, "classes": classes}
    if extras is not None:
        arrays, names_of = extras(emb)
        payload.update(arrays)
        text.update(names_of)
    out.parent.mkdir(parents=True, exist_ok=True)
    if suffix == ".npz":
        columns: dict[str, Any] = {k: v.numpy() for k, v in payload.items()}
        columns |= {k: np.array(v, dtype=str) for k, v in text.items()}
        np.savez(out, **columns)
    elif suffix == ".pt":
        torch.save({**payload, **text}, out)
    elif suffix == ".safetensors":
        meta = {k: json.dumps(v) for k, v in text.items()}
        save_file({k: v.contiguous() for k, v in payload.items()}, str(out), metadata=meta)
    return len(files)


def evaluate_checkpoint(
    path: Path,
    which: str = "best",
    ks: tuple[int, ...] | None = None,
    introspective: bool | None = None,
    device: torch.device | str | None = None,
    progress: bool = False,
    *,
    nmi: bool | None = None,
    nmi_backend: KMeansBackend | None = None,
    block_size: int | None = None,
    seed: int = 1234,
) -> EvaluationReport:
    """Evaluate a trained run on its own test split, with its config's evaluation settings.

    ``ks`` (when not empty), ``introspective``, ``nmi`` and ``nmi_backend`` override ``eval.ks``,
    ``eval.introspective``, ``eval.nmi`` and ``eval.nmi_backend`` when given; ``block_size`` and
    ``seed`` (k-means) are passed to :func:`~idml.evaluation.evaluate_embeddings`.
    """
    cfg, model = load_trained_model(path, which)
    given = {
        "ks": ks or None,
        "introspective": introspective,
        "nmi": nmi,
        "nmi_backend": nmi_backend,
    }
    evaluation = cfg.eval.model_copy(update={k: v for k, v in given.items() if v is not None})
    if evaluation.introspective and not cfg.metric.introspective:
        raise ValueError(
            f"{path}: --introspective needs a run trained with ISM (metric.introspective=true)"
        )
    cfg = cfg.model_copy(update={"eval": evaluation})
    device = torch.device(device) if device is not None else torch.device("cpu")
    model.to(device)
    data = build.build_data(cfg)
    emb, labels = build.embed_dataset(model, data.test, cfg.eval.batch_size, device, progress)
    return build.evaluate(cfg, emb, labels, device, progress, block_size=block_size, seed=seed)
