"""Gathers across ranks: the global batch for the loss (embeddings with their gradient, label sets,
Mixup records) and the test-set embeddings of distributed evaluation (:mod:`idml.app.distributed`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.data import Dataset, Subset

from idml.app.distributed._context import DistributedContext
from idml.augment import AugmentedBatch, MixupInfo, MixupMode
from idml.data.datasets import dataset_length
from idml.embeddings import Embeddings
from idml.relations import LabelSets, pad_label_width

T = TypeVar("T")


def gather_sizes(count: int, context: DistributedContext | None = None) -> list[int]:
    """Every rank's ``count``, in rank order (one small all-gather)."""
    return [int(row[0]) for row in _gather_ints([count], context)]


def _gather_ints(values: Sequence[int], context: DistributedContext | None) -> list[list[int]]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [list(values)]
    device = context.device if context is not None else _comm_device()
    local = torch.tensor(list(values), dtype=torch.long, device=device)
    out = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(out, local)
    return [t.cpu().tolist() for t in out]


def _comm_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _pad_rows(tensor: Tensor, rows: int) -> Tensor:
    if tensor.shape[0] == rows:
        return tensor
    return torch.cat([tensor, tensor.new_zeros((rows - tensor.shape[0], *tensor.shape[1:]))])


def all_gather_with_grad(tensor: Tensor, sizes: Sequence[int] | None = None) -> Tensor:
    """Concatenate every rank's ``tensor`` along dim 0, in rank order, keeping autograd.

    Built on ``torch.distributed.nn.functional.all_gather``, whose backward sums the gradients of
    all ranks' copies (see the module docstring: with DDP's average this reproduces one process's
    gradient exactly, so the loss is *not* rescaled). Ranks may hold different numbers of rows:
    pass ``sizes`` (every rank's row count, e.g. from :func:`gather_sizes`) or it is gathered first;
    rows are zero-padded to the largest count for the collective and trimmed after. Trailing
    dimensions must agree. With one process the tensor is returned unchanged.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return tensor
    from torch.distributed.nn.functional import all_gather

    if sizes is None:
        sizes = gather_sizes(tensor.shape[0])
    if len(sizes) != dist.get_world_size() or sizes[dist.get_rank()] != tensor.shape[0]:
        raise ValueError(
            f"sizes {list(sizes)} must list every rank's row count, with this rank's "
            f"({tensor.shape[0]}) at index {dist.get_rank()}"
        )
    largest = max(sizes)
    pieces = all_gather(_pad_rows(tensor, largest))
    return torch.cat([piece[:n] for piece, n in zip(pieces, sizes)])


def all_gather_rows(tensor: Tensor, sizes: Sequence[int] | None = None) -> Tensor:
    """:func:`all_gather_with_grad` without autograd (labels, masks, indices): one collective."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return tensor
    if sizes is None:
        sizes = gather_sizes(tensor.shape[0])
    padded = _pad_rows(tensor.detach().contiguous(), max(sizes))
    out = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(out, padded)
    return torch.cat([piece[:n] for piece, n in zip(out, sizes)])


@dataclass(frozen=True)
class MergedRows:
    """Label sets, masks and Mixup details of several shards' batches, as one batch.

    ``order`` maps the rows of the plain concatenation (shard by shard, each shard's originals then
    its mixed rows) to the merged batch, which lists **all originals, then all mixed rows** (shard
    order kept within each group) — the layout :class:`~idml.augment.AugmentedBatch` promises.
    Mixup ``index_a``/``index_b`` are shifted to rows of the merged batch.
    """

    labels: LabelSets
    mixed: Tensor
    degraded: Tensor
    mixup: MixupInfo | None
    order: Tensor

    def batch(self, images: Tensor) -> AugmentedBatch:
        """The merged :class:`~idml.augment.AugmentedBatch` with ``images`` (already in merged order)."""
        return AugmentedBatch(images, self.labels, self.mixed, self.degraded, self.mixup)


def merge_rows(batches: Sequence[AugmentedBatch]) -> MergedRows:
    """Merge shard batches: see :class:`MergedRows`. Raises if Mixup is present in only some.

    In ``interpolate`` mode every shard must have drawn the same ``λ`` (the loss weights the whole
    batch by one ``λ``): a clear error otherwise.
    """
    if not batches:
        raise ValueError("batches must hold at least one shard's batch")
    width = max(b.labels.labels.shape[1] for b in batches)
    labels = torch.cat([pad_label_width(b.labels.labels, width) for b in batches])
    mixed = torch.cat([b.mixed for b in batches])
    degraded = torch.cat([b.degraded for b in batches])
    # A stable sort on the mixed flag moves every shard's mixed rows behind all originals.
    order = torch.argsort(mixed.to(torch.int8), stable=True)
    infos = [b.mixup for b in batches]
    if any(i is None for i in infos) and not all(i is None for i in infos):
        raise ValueError(
            "some shards ran Mixup and others did not; every shard must use the same augmentations"
        )
    mixup = None
    if infos[0] is not None:
        originals = torch.tensor([int((~b.mixed).sum()) for b in batches])
        offsets = (torch.cumsum(originals, 0) - originals).tolist()
        present = [i for i in infos if i is not None]
        shift = [torch.full_like(i.index_a, off) for i, off in zip(present, offsets, strict=True)]
        mixup = MixupInfo(
            lam=torch.cat([i.lam for i in present]),
            index_a=torch.cat([i.index_a + s for i, s in zip(present, shift)]),
            index_b=torch.cat([i.index_b + s for i, s in zip(present, shift)]),
            labels_a=torch.cat([i.labels_a for i in present]),
            labels_b=torch.cat([i.labels_b for i in present]),
            mode=present[0].mode,
        )
        if (
            mixup.mode is MixupMode.INTERPOLATE
            and mixup.lam.numel()
            and bool((mixup.lam != mixup.lam[0]).any())
        ):
            raise ValueError(
                "mixup.mode=interpolate weights the whole batch by one λ, but the shards drew "
                "different λ; draw every shard's Mixup from one stream "
                "(ShardPlan.generators(..., shared=True))"
            )
    return MergedRows(LabelSets(labels[order]), mixed[order], degraded[order], mixup, order)


def gather_batch(
    embeddings: Embeddings, batch: AugmentedBatch, context: DistributedContext
) -> tuple[Embeddings, AugmentedBatch]:
    """The global batch from every rank's embeddings and augmented batch, for the loss.

    Embeddings (semantic and uncertainty, one autograd-aware collective) are gathered with gradient;
    label sets, masks and Mixup details without. Rows are merged as in :func:`merge_rows`, so the
    result equals what one process computing every shard builds. The images are **not** gathered
    (they are never needed after the forward): the returned batch holds a zero-stride placeholder
    of the global shape. With one process both are returned unchanged.
    """
    if not context.is_distributed:
        return embeddings, batch
    local = len(batch.labels)
    width = batch.labels.labels.shape[1]
    has_mixup = batch.mixup is not None
    mixed_count = 0 if batch.mixup is None else batch.mixup.lam.shape[0]
    table = _gather_ints([local, width, int(has_mixup), mixed_count], context)
    sizes = [row[0] for row in table]
    if len({row[2] for row in table}) != 1:
        raise ValueError("some ranks ran Mixup and others did not; use one config on every rank")
    semantic, uncertainty = embeddings.semantic, embeddings.uncertainty
    packed = semantic if uncertainty is None else torch.cat([semantic, uncertainty], dim=1)
    gathered = all_gather_with_grad(packed, sizes)
    widest = max(row[1] for row in table)
    rows = torch.cat(
        [
            pad_label_width(batch.labels.labels, widest),
            batch.mixed.long().unsqueeze(1),
            batch.degraded.long().unsqueeze(1),
        ],
        dim=1,
    )
    all_rows = all_gather_rows(rows.to(context.device), sizes).to(batch.mixed.device)
    pieces: list[AugmentedBatch] = []
    placeholder = batch.images[:0]
    counts = [row[3] for row in table]
    mixups = None if batch.mixup is None else _gather_mixup(batch.mixup, counts, context)
    start = 0
    for rank, n in enumerate(sizes):
        part = all_rows[start : start + n]
        start += n
        pieces.append(
            AugmentedBatch(
                placeholder,
                LabelSets(part[:, :widest]),
                part[:, widest].bool(),
                part[:, widest + 1].bool(),
                None if mixups is None else mixups[rank],
            )
        )
    merged = merge_rows(pieces)
    gathered = gathered[merged.order.to(gathered.device)]
    dim = semantic.shape[1]
    global_embeddings = Embeddings(
        gathered[:, :dim], None if uncertainty is None else gathered[:, dim:]
    )
    images = batch.images.new_zeros(()).expand(len(merged.order), *batch.images.shape[1:])
    return global_embeddings, merged.batch(images)


def _gather_mixup(
    info: MixupInfo, counts: list[int], context: DistributedContext
) -> list[MixupInfo]:
    """Every rank's Mixup details (``counts`` mixed rows each), as one :class:`MixupInfo` per rank."""
    ints = torch.stack([info.index_a, info.index_b, info.labels_a, info.labels_b], dim=1)
    ints = all_gather_rows(ints.long().to(context.device), counts).to(info.lam.device)
    lam = all_gather_rows(info.lam.to(context.device), counts).to(info.lam.device)
    out, start = [], 0
    for n in counts:
        a, b, la, lb = ints[start : start + n].unbind(1)
        out.append(MixupInfo(lam[start : start + n], a, b, la, lb, info.mode))
        start += n
    return out


def contiguous_shard(dataset: Dataset[T], context: DistributedContext) -> Dataset[T]:
    """Rank ``r``'s contiguous part of ``dataset`` (``tensor_split`` counts: no padding duplicates).

    ``dataset`` is map-style: it has a length. Labels are those of the full dataset (a ``Subset``,
    not a re-labelled copy).
    """
    if not context.is_distributed:
        return dataset
    size = dataset_length(dataset, f"sharding evaluation over {context.world_size} processes")
    indices = torch.arange(size).tensor_split(context.world_size)[context.rank]
    return Subset(dataset, indices.tolist())


def gather_embeddings(
    embeddings: Embeddings, labels: Tensor, context: DistributedContext
) -> tuple[Embeddings, Tensor]:
    """Every rank's evaluation embeddings and labels, concatenated in rank order (dataset order).

    Ranks hold different counts when the dataset does not divide evenly: rows are padded for the
    collective and the padding is cut off by the true counts, so no image appears twice.
    """
    if not context.is_distributed:
        return embeddings, labels
    sizes = gather_sizes(len(labels), context)
    device = context.device

    def gather(x: Tensor) -> Tensor:
        return all_gather_rows(x.to(device), sizes).cpu()

    uncertainty = None if embeddings.uncertainty is None else gather(embeddings.uncertainty)
    return Embeddings(gather(embeddings.semantic), uncertainty), gather(labels)


def gather_shards(tensor: Tensor, context: DistributedContext) -> list[Tensor] | None:
    """Every rank's ``tensor`` (rows may differ in number), in rank order, on rank 0; ``None`` on
    the other ranks. One process: ``[tensor]``. Unlike :func:`all_gather_rows` only rank 0 holds
    the whole (a gallery's embeddings need not fit every process), and the pieces stay apart."""
    if not context.is_distributed:
        return [tensor]
    sizes = gather_sizes(int(tensor.shape[0]), context)
    device = context.device
    padded = _pad_rows(tensor.contiguous().to(device), max(sizes))
    pieces = [torch.empty_like(padded) for _ in sizes] if context.is_main else None
    dist.gather(padded, pieces, dst=0)
    if pieces is None:
        return None
    return [piece[:n].cpu() for piece, n in zip(pieces, sizes, strict=True)]
