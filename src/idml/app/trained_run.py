"""Load a trained retrieval model from a run, and export embeddings of arbitrary images.

Exported models hold only what retrieval needs: the :class:`~idml.models.EmbeddingModel` weights
(``model.safetensors``). Loss proxies and SSR's ranking head live in ``training.safetensors`` and are
never loaded here.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save as safetensors_bytes
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
from idml.app.distributed import DistributedContext, contiguous_shard, gather_embeddings
from idml.app.storage import write_file
from idml.data import FileImageDataset, ImageRecords, build_transforms, read_images
from idml.embeddings import Embeddings
from idml.evaluation import EvaluationReport
from idml.evaluation.clustering import KMeansBackend
from idml.evaluation.reranking import Reranker
from idml.models import EmbeddingModel, embed_dataset


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
    from idml.app.training.compute import uses_channels_last

    # The memory format the run's evaluations ran in on the CPU: the other layout sums the same
    # products in another order, and the run's own numbers would not come back exactly.
    if uses_channels_last(cfg.optim, torch.device("cpu")):
        model.to(memory_format=torch.channels_last)
    return TrainedRun(cfg, model, ckpt, which, state)


def load_trained_model(path: Path, which: str = "best") -> tuple[Config, EmbeddingModel]:
    """The config and the retrieval model of a run folder (see :func:`load_trained_run`)."""
    run = load_trained_run(path, which)
    return run.config, run.model


def read_split(images: Path, split: str | None = None) -> ImageRecords:
    """The records of an image folder or CSV (:func:`idml.data.read_images`), only those of
    ``split`` when given (a CSV's split column, or ``train/``, ``val/``, ``test/`` folders)."""
    records = read_images(images)
    if split is None:
        return records
    if records.splits is None:
        raise ValueError(
            f"--split {split!r} needs a CSV with a split column or a folder of train/, val/ and "
            f"test/ folders; {images} gives no split"
        )
    found = sorted(set(records.splits.tolist()))
    keep = records.splits == split
    if not keep.any():
        raise ValueError(f"--split {split!r}: {images} has no such images; splits: {found}")
    return records.take(keep)


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
    distributed: DistributedContext | None = None,
) -> int:
    """Embed the images of a folder or CSV (:func:`read_split`) and save semantic embeddings and
    ``||u||`` to ``out``.

    With a ``distributed`` context of several processes (``torchrun``) every process embeds its
    contiguous share and rank 0 gathers them in order and writes the file (the others return
    the count without writing).

    ``out`` is ``.npz``/``.pt`` (with ``paths`` and ``classes``) or ``.safetensors`` (both in the
    metadata). Keys:
    ``embeddings`` ``(N, d)``, ``uncertainty`` ``(N,)`` (``||u||``; zeros without an uncertainty
    head), ``labels`` when the source has them (``classes`` names them: the source's labels, as
    training reads them) and ``roles`` when it gives query/gallery roles (``idml evaluate`` then
    searches the queries against the gallery).

    ``extras`` adds what a run's task writes besides: arrays with one row per image and lists of
    names, from the embeddings (:meth:`idml.app.tasks.LoadedRun.extra_outputs`; a classification
    run's ``logits``, ``probabilities`` and ``logit_classes``).
    """
    out = Path(out)
    suffix = out.suffix.lower()
    if suffix not in (".npz", ".pt", ".safetensors"):
        # Checked before embedding: a wrong name must not cost the whole pass.
        raise ValueError(f"--out {out}: use a .npz, .pt or .safetensors file name")
    records = read_split(Path(images), split)
    paths = [str(p) for p in records.paths]
    transform = build_transforms(False, cfg.data.image_size, cfg.data.resize_size)
    dataset = FileImageDataset(records, transform)
    device = next(model.parameters()).device
    context = distributed if distributed is not None else DistributedContext()
    emb, labels = embed_dataset(
        model, contiguous_shard(dataset, context), batch_size, device, progress=progress
    )
    emb, labels = gather_embeddings(emb, labels, context)
    if not context.is_main:
        return len(records)
    level = (
        torch.zeros(emb.semantic.shape[0])
        if emb.uncertainty is None  # a baseline without an uncertainty head
        else model.uncertainty_level(emb)
    )
    payload = {"embeddings": emb.semantic, "uncertainty": level}
    classes = list(dataset.class_names) if records.labelled else []
    if records.labelled:
        payload["labels"] = labels
    text: dict[str, list[str]] = {"paths": paths, "classes": classes}
    if records.roles is not None:
        text["roles"] = [str(r) for r in records.roles]
    if extras is not None:
        arrays, names_of = extras(emb)
        payload.update(arrays)
        text.update(names_of)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Serialized in memory, then written atomically (idml.app.storage): a full disk names the
    # folder and the bytes needed and leaves a previous file of that name as it was.
    buffer = io.BytesIO()
    if suffix == ".npz":
        columns: dict[str, Any] = {k: v.numpy() for k, v in payload.items()}
        columns |= {k: np.array(v, dtype=str) for k, v in text.items()}
        np.savez(buffer, **columns)
    elif suffix == ".pt":
        torch.save({**payload, **text}, buffer)
    elif suffix == ".safetensors":
        meta = {k: json.dumps(v) for k, v in text.items()}
        buffer.write(
            safetensors_bytes({k: v.contiguous() for k, v in payload.items()}, metadata=meta)
        )
    write_file(out, buffer.getvalue(), what=f"embeddings {out.name}")
    return len(records)


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
    full_ranking: bool | None = None,
    block_size: int | None = None,
    seed: int = 1234,
    reranking: Reranker | None = None,
    calibration: Path | None = None,
) -> EvaluationReport:
    """Evaluate a trained run on its own test split, with its config's evaluation settings.

    ``ks`` (when not empty), ``introspective``, ``nmi`` and ``nmi_backend`` override ``eval.ks``,
    ``eval.introspective``, ``eval.nmi`` and ``eval.nmi_backend`` when given; ``full_ranking``
    (when given), ``block_size``, ``seed`` (k-means) and ``reranking`` are passed to
    :func:`~idml.evaluation.evaluate_embeddings`. The calibrated confidence judged is
    ``calibration`` (a file; an error when it was fitted for other weights or another
    re-ranking), else the run's ``calibration.json`` when it applies
    (:func:`~idml.app.calibration.find_calibration`); ``settings["calibration"]`` of the report
    says which, or why there is none.
    """
    from idml.app.calibration import find_calibration, reranking_name
    from idml.app.inference import weights_sha256

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
    found = find_calibration(
        [Path(path)], weights_sha256(model), reranking_name(reranking), calibration
    )
    device = torch.device(device) if device is not None else torch.device("cpu")
    model.to(device)
    data = build.build_data(cfg)
    emb, labels = embed_dataset(model, data.test, cfg.eval.batch_size, device, progress=progress)
    report = build.evaluate(
        cfg,
        emb,
        labels,
        device,
        progress,
        data.test.roles,
        calibration=found.calibration,
        block_size=block_size,
        seed=seed,
        reranking=reranking,
        **({} if full_ranking is None else {"full_ranking": full_ranking}),
    )
    report.settings["calibration"] = found.note
    # Per-class results by the dataset's class names (the test side's labels are renumbered
    # 0..C−1, so a label would not say which class it is).
    report.class_names = data.test.class_names
    return report
