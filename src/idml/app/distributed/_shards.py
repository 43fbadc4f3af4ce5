"""The :class:`ShardPlan` (which shards of the global batch a process computes, and their random
streams) and the one DistributedDataParallel over a run's trainable modules (:func:`wrap_ddp`)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch import Tensor, nn

from idml.app.distributed._context import DistributedContext, derived_seed
from idml.app.distributed._gather import gather_batch, merge_rows
from idml.augment import AugmentedBatch, UncertaintyAugmentation
from idml.embeddings import Embeddings

T = TypeVar("T")

_SHARD_STREAM = 0x5EED
"""Key that separates per-shard random streams from any other stream derived from the same seed."""


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
