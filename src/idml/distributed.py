"""Data-parallel training on several processes with ``torchrun`` and DistributedDataParallel.

``torchrun --nproc_per_node=G -m idml train CONFIG`` starts ``G`` processes (*ranks*); each owns one
GPU (NCCL) or CPU share (gloo). This module holds what the trainer needs to make ``R`` ranks train
like one process with the whole batch (Li et al. 2020, "PyTorch Distributed: Experiences on
Accelerating Data Parallel Training", VLDB — the design of DDP):

- :class:`DistributedContext` / :func:`init_distributed`: rank, world size, local rank and device from
  torchrun's environment variables; a single-process context when they are absent.
- :func:`all_gather_with_grad`: the **global batch** for the loss. Pair- and proxy-based DML losses
  need every pair of the batch, so each rank gathers all ranks' embeddings (and label sets, see
  :func:`gather_batch`); positives and negatives then cross ranks, as the negatives of large-batch
  contrastive training come from the whole multi-device batch (SimCLR, Chen et al. 2020, §2.2).
- :class:`ShardPlan`: which shards of the global batch this process computes, and their random
  streams (Mixup, degradations and SSR draw per shard; see "Augmentation" below).
- :func:`gather_embeddings` and :func:`contiguous_shard`: distributed evaluation.

**Gradient scaling (derivation).** Let rank ``r`` embed its shard, ``z_r = f_θ(x_r)``, and let every
rank compute the *same* loss ``L(z_1, …, z_R)`` on the gathered batch. The backward of
``torch.distributed.nn.functional.all_gather`` *sums* the incoming gradients over ranks
(reduce-scatter), so rank ``r`` receives ``g_r = Σ_q ∂L/∂z_r = R·∂L/∂z_r`` and its parameter gradient
is ``R·J_rᵀ ∂L/∂z_r`` (``J_r = ∂z_r/∂θ``). DDP all-reduces and *averages*:

    (1/R) · Σ_r R·J_rᵀ ∂L/∂z_r = Σ_r J_rᵀ ∂L/∂z_r = ∇_θ L,

exactly the gradient of one process on the whole batch — **no loss scaling is needed**. (A gather
whose backward returns only the local slice, without the sum, would give ``∇_θ L / R`` and need the
loss multiplied by ``R``.) Loss parameters (proxies, learnable proxy uncertainty, margins) get the
identical ``∂L/∂P`` on every rank, which DDP's average keeps; they live in the DDP-wrapped module so
they also stay bit-consistent when kernels are not deterministic. Per-rank terms follow DDP's usual
rule: the SSR ranking loss of rank ``r``'s ``M_r`` images is weighted by ``R·M_r/M`` so that the
average over ranks is the mean over all ``M`` images. If ranks compute *different* losses ``L_q``
(a loss that samples with each rank's own random state), the same algebra gives the gradient of
``(1/R)·Σ_q L_q``: still an unbiased estimate, just not bit-identical to one process.

**Augmentation.** Mixup partners come from the rank's own shard, so no images travel between ranks
(only embeddings are gathered); each rank augments its own shard, with a random stream per *shard* (:meth:`ShardPlan.generators`). One
process can reproduce an ``R``-process run exactly by computing all ``R`` shards itself
(``ShardPlan.create(context, num_shards=R)``): the batch it builds equals the gathered one row for row.
In ``mixup.mode=interpolate`` the loss needs one ``λ`` for the batch, so all shards share one stream.

Example (one process: everything is the identity):
    >>> import torch
    >>> context = init_distributed()
    >>> context.world_size, context.is_main
    (1, True)
    >>> all_gather_with_grad(torch.ones(2, 3)).shape
    torch.Size([2, 3])
    >>> [len(x) for x in ShardPlan.create(context, num_shards=2).split(torch.arange(5))]
    [3, 2]
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import Dataset, Subset

from idml.augment import AugmentedBatch, MixupInfo, MixupMode, UncertaintyAugmentation
from idml.embeddings import Embeddings
from idml.relations import LabelSets, pad_label_width

T = TypeVar("T")

ENV_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
"""What torchrun (``python -m torch.distributed.run``) sets for every process it starts."""

_SHARD_STREAM = 0x5EED
"""Key that separates per-shard random streams from any other stream derived from the same seed."""


# --------------------------------------------------------------------------- context
@dataclass(frozen=True)
class DistributedContext:
    """Where this process sits in a data-parallel job.

    Attributes:
        rank: global index of this process, ``0..world_size−1``.
        world_size: number of processes ``R`` (1: no process group).
        local_rank: index on this machine (selects the GPU ``cuda:local_rank``).
        device: this process's device; also where collectives' tensors live (NCCL needs CUDA).
        backend: ``nccl``, ``gloo`` or ``None`` for a single process.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None

    @property
    def is_distributed(self) -> bool:
        """More than one process: collectives are needed."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that writes files and prints."""
        return self.rank == 0

    def barrier(self) -> None:
        """Wait for every rank (no-op for one process)."""
        if self.is_distributed:
            dist.barrier()

    def broadcast_object(self, value: T) -> T:
        """Rank 0's ``value`` on every rank (pickled; for small objects such as a metrics dict)."""
        if not self.is_distributed:
            return value
        box: list[Any] = [value if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def mean(self, values: Mapping[str, float]) -> dict[str, float]:
        """Average each value over ranks (one all-reduce; every rank must pass the same keys).

        Values each rank computed identically come back unchanged; per-rank estimates become their mean.
        """
        if not self.is_distributed or not values:
            return dict(values)
        keys = sorted(values)  # the same packing on every rank, whatever the insertion order
        packed = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
        packed = packed.to(self.device)
        dist.all_reduce(packed)
        means = dict(zip(keys, (v / self.world_size for v in packed.cpu().tolist())))
        return {k: means[k] for k in values}


def _env_int(name: str) -> int:
    text = os.environ[name]
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"environment variable {name}={text!r} must be an integer; start the processes with "
            "torchrun (python -m torch.distributed.run), which sets it"
        ) from None


def resolve_device(device: str | torch.device, local_rank: int = 0) -> torch.device:
    """``auto`` → ``cuda:local_rank`` when CUDA is available, else ``cpu``; ``cuda`` → ``cuda:local_rank``."""
    name = str(device)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    resolved = torch.device(name)
    if resolved.type != "cuda":
        return resolved
    if not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available; use device=cpu or auto")
    index = local_rank if resolved.index is None else resolved.index
    if index >= torch.cuda.device_count():
        raise ValueError(
            f"process with LOCAL_RANK={local_rank} needs GPU {index}, but only "
            f"{torch.cuda.device_count()} are visible; start at most that many processes per node "
            "(torchrun --nproc_per_node) or fix CUDA_VISIBLE_DEVICES"
        )
    return torch.device("cuda", index)


def init_distributed(
    backend: str | None = None,
    device: str | torch.device = "auto",
    init_method: str | None = None,
) -> DistributedContext:
    """Join the process group torchrun set up, or return a single-process context.

    Reads ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` (set by torchrun on every node; multi-node
    rendezvous also uses ``MASTER_ADDR``/``MASTER_PORT`` or ``--rdzv_endpoint``). When none is set, no
    process group is created and the context has ``world_size = 1``.

    Args:
        backend: ``nccl`` or ``gloo``; ``None`` = NCCL on CUDA, gloo on CPU.
        device: ``auto`` (``cuda:LOCAL_RANK`` when CUDA is available, else CPU), ``cpu``, ``cuda``.
        init_method: rendezvous URL (default ``env://``); tests use ``file://…``.

    An already initialised default process group is reused (its rank and size win).
    """
    present = [name for name in ENV_VARIABLES if name in os.environ]
    if not present and not (dist.is_available() and dist.is_initialized()):
        return DistributedContext(device=resolve_device(device))
    if present and len(present) != len(ENV_VARIABLES) and not dist.is_initialized():
        missing = sorted(set(ENV_VARIABLES) - set(present))
        raise ValueError(
            f"environment variables {present} are set but {missing} are not; start the run with "
            "torchrun (python -m torch.distributed.run), or unset them for a single process"
        )
    if not dist.is_available():
        raise ValueError("this PyTorch build has no torch.distributed; run a single process")
    local_rank = _env_int("LOCAL_RANK") if "LOCAL_RANK" in os.environ else 0
    resolved = resolve_device(device, local_rank)
    if backend is None:
        backend = "nccl" if resolved.type == "cuda" else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl', 'gloo' or None, got {backend!r}")
    if backend == "nccl" and resolved.type != "cuda":
        raise ValueError(
            f"backend='nccl' needs CUDA devices but this process runs on {resolved}; use "
            "backend='gloo' (or None) for CPU processes"
        )
    if resolved.type == "cuda":
        torch.cuda.set_device(resolved)
    if not dist.is_initialized():
        rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"RANK={rank} and WORLD_SIZE={world_size} must satisfy 0 <= RANK < WORLD_SIZE"
            )
        dist.init_process_group(
            backend, init_method=init_method or "env://", rank=rank, world_size=world_size
        )
    return DistributedContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        device=resolved,
        backend=str(dist.get_backend()),
    )


def destroy_distributed(context: DistributedContext) -> None:
    """Leave the process group (no-op for a single process)."""
    if context.is_distributed and dist.is_initialized():
        dist.destroy_process_group()


def derived_seed(seed: int, *keys: int) -> int:
    """A 63-bit seed hashed from ``seed`` and ``keys`` (NumPy ``SeedSequence``): unrelated streams."""
    state = np.random.SeedSequence([seed % 2**64, *keys]).generate_state(1, dtype=np.uint64)[0]
    return int(state) >> 1


def rank_seed(seed: int, rank: int) -> int:
    """``seed`` for rank 0, an unrelated seed for every other rank.

    Per-sample pixel transforms draw from it, so ranks do not apply the same crop sequence.
    """
    return seed if rank == 0 else derived_seed(seed, rank)


def rank_generator(generator: torch.Generator, rank: int) -> torch.Generator:
    """``generator`` itself for rank 0, else a fresh one seeded by :func:`rank_seed`."""
    if rank == 0:
        return generator
    return torch.Generator(generator.device).manual_seed(rank_seed(generator.initial_seed(), rank))


# --------------------------------------------------------------------------- gathers
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


# --------------------------------------------------------------------------- batches
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


# --------------------------------------------------------------------------- shard plan
@dataclass(frozen=True)
class ShardPlan:
    """How a step's global batch is cut into shards, and which of them this process computes.

    The global batch is split into ``num_shards`` contiguous parts (``tensor_split``, exactly as
    the batch samplers hand rank ``r`` its share). With ``R`` processes, rank ``r`` owns shard ``r``;
    one process may own all ``R`` shards to reproduce an ``R``-process run. Every shard augments
    with its own random stream and ranks its own share of SSR's ``M`` images.
    """

    num_shards: int = 1
    owned: tuple[int, ...] = (0,)
    context: DistributedContext = field(default_factory=DistributedContext)

    @classmethod
    def create(cls, context: DistributedContext, num_shards: int | None = None) -> ShardPlan:
        """One shard per process, or ``num_shards`` shards all computed by a single process."""
        count = context.world_size if num_shards is None else num_shards
        if count < 1:
            raise ValueError(f"num_shards must be >= 1, got {count}")
        if context.is_distributed:
            if count != context.world_size:
                raise ValueError(
                    f"num_shards={count} with {context.world_size} processes: each process "
                    "computes one shard, so leave num_shards unset"
                )
            return cls(count, (context.rank,), context)
        return cls(count, tuple(range(count)), context)

    def generators(self, base: torch.Generator, shared: bool = False) -> list[torch.Generator]:
        """One generator per owned shard: ``[base]`` for a single shard, else streams derived from it.

        Shard ``s`` draws from ``derived_seed(base seed, s)`` whichever process computes it, which is
        what makes a one-process run with ``num_shards = R`` equal an ``R``-process run. ``base``
        itself is left to draws every rank makes alike (e.g. the SSR task gate). ``shared=True``
        gives every shard the same stream (one Mixup ``λ`` for the whole batch).
        """
        if self.num_shards == 1:
            return [base]
        seed = base.initial_seed()
        return [
            torch.Generator(base.device).manual_seed(
                derived_seed(seed, _SHARD_STREAM, 0 if shared else shard)
            )
            for shard in self.owned
        ]

    def split(self, local: Tensor) -> list[Tensor]:
        """This process's rows cut into its owned shards."""
        return list(local.tensor_split(len(self.owned)))

    def augment(
        self,
        augment: UncertaintyAugmentation,
        images: Tensor,
        labels: Tensor,
        generators: Sequence[torch.Generator],
    ) -> AugmentedBatch:
        """Augment each owned shard with its generator; several shards are merged (:func:`merge_rows`)."""
        if len(generators) != len(self.owned):
            raise ValueError(
                f"generators: need one per owned shard ({len(self.owned)}), got {len(generators)}"
            )
        if len(self.owned) == 1:
            return augment(images, labels, generators[0])
        batches = [
            augment(x, y, g)
            for x, y, g in zip(self.split(images), self.split(labels), generators, strict=True)
        ]
        merged = merge_rows(batches)
        return merged.batch(torch.cat([b.images for b in batches])[merged.order])

    def gather(
        self, embeddings: Embeddings, batch: AugmentedBatch
    ) -> tuple[Embeddings, AugmentedBatch]:
        """The global batch for the loss (:func:`gather_batch`); unchanged in one process."""
        return gather_batch(embeddings, batch, self.context)

    def ranking_shares(self, num_images: int, local_batch: int) -> list[tuple[int, float]]:
        """``(M_s, weight_s)`` for each owned shard: SSR images to rank and the loss weight.

        ``M`` images are split over the shards like the batch (``tensor_split`` counts), each capped
        by its shard's size, as ``select_images`` takes a whole batch smaller than ``M``. The weight
        ``R_proc·M_s/M`` (``R_proc`` processes) makes DDP's average over ranks — or the plain sum in
        one process — the mean over all ``M`` images (module docstring).
        """
        if num_images < 1:
            raise ValueError(f"num_images must be >= 1, got {num_images}")
        global_batch = local_batch * self.context.world_size
        shard_sizes = _split_counts(global_batch, self.num_shards)
        planned = _split_counts(num_images, self.num_shards)
        counts = [min(p, n) for p, n in zip(planned, shard_sizes)]
        total = sum(counts)
        if any(counts[s] == 0 for s in self.owned):
            raise ValueError(
                f"ssr.task.num_images={num_images} leaves shards without ranking images "
                f"({self.num_shards} shards of {shard_sizes} images); use at least one image per "
                "process"
            )
        return [(counts[s], self.context.world_size * counts[s] / total) for s in self.owned]


def _split_counts(total: int, parts: int) -> list[int]:
    return [len(chunk) for chunk in torch.arange(total).tensor_split(parts)]


# --------------------------------------------------------------------------- DDP
class ParallelModules(nn.Module):
    """The trainable modules of a run (model, loss with its proxies, SSR head) as one module.

    DistributedDataParallel synchronises the gradients of the parameters of the module it wraps and
    expects every backward to follow one forward *through the wrapper*. The training step's
    differentiable part (model forward, gather, loss, ranking loss) is a closure over these modules,
    so :meth:`forward` just runs it: one DDP forward per backward, covering every parameter.
    """

    def __init__(self, modules: Mapping[str, nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleDict(dict(modules))

    def forward(self, compute: Callable[[], T]) -> T:
        """Run ``compute()`` (the step's loss computation over :attr:`parts`)."""
        return compute()


def wrap_ddp(
    modules: Mapping[str, nn.Module],
    context: DistributedContext,
    find_unused_parameters: bool = False,
) -> nn.parallel.DistributedDataParallel | None:
    """Wrap ``modules`` in one DDP (rank 0's parameters and buffers are broadcast to every rank).

    ``None`` for a single process. On CUDA, BatchNorm layers become SyncBatchNorm first, so batch
    statistics are those of the global batch as in one process (frozen BatchNorm is unaffected); on
    CPU SyncBatchNorm is unavailable and a trainable BatchNorm sees only its rank's shard (a warning
    says so). ``find_unused_parameters`` is needed when some parameters get no gradient in a step
    (warm-up, SSR steps that are skipped, an unused head) and costs one graph traversal per step.
    """
    if not context.is_distributed:
        return None
    container = ParallelModules(modules)
    batchnorms = [m for m in container.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if context.device.type == "cuda":
        container = nn.SyncBatchNorm.convert_sync_batchnorm(container)
    elif any(m.training for m in batchnorms):
        warnings.warn(
            "BatchNorm layers train in batch-statistics mode, but SyncBatchNorm needs CUDA: on CPU "
            f"each of the {context.world_size} processes normalises with its own shard's statistics",
            stacklevel=2,
        )
    device_ids = [context.device.index] if context.device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(
        container, device_ids=device_ids, find_unused_parameters=find_unused_parameters
    )


# --------------------------------------------------------------------------- evaluation
def contiguous_shard(dataset: Dataset, context: DistributedContext) -> Dataset:
    """Rank ``r``'s contiguous part of ``dataset`` (``tensor_split`` counts: no padding duplicates).

    Labels are those of the full dataset (a ``Subset``, not a re-labelled copy).
    """
    if not context.is_distributed:
        return dataset
    indices = torch.arange(len(dataset)).tensor_split(context.world_size)[context.rank]  # type: ignore[arg-type]
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
