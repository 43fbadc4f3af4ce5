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

from idml.app.distributed._context import (
    ENV_VARIABLES,
    DistributedContext,
    derived_seed,
    destroy_distributed,
    init_distributed,
    rank_generator,
    rank_seed,
    resolve_device,
)
from idml.app.distributed._gather import (
    MergedRows,
    all_gather_rows,
    all_gather_with_grad,
    contiguous_shard,
    gather_batch,
    gather_embeddings,
    gather_shards,
    gather_sizes,
    merge_rows,
)
from idml.app.distributed._shards import (
    ParallelModules,
    ShardPlan,
    wrap_ddp,
)

__all__ = [
    "ENV_VARIABLES",
    "DistributedContext",
    "MergedRows",
    "ParallelModules",
    "ShardPlan",
    "all_gather_rows",
    "all_gather_with_grad",
    "contiguous_shard",
    "derived_seed",
    "destroy_distributed",
    "gather_batch",
    "gather_embeddings",
    "gather_shards",
    "gather_sizes",
    "init_distributed",
    "merge_rows",
    "rank_generator",
    "rank_seed",
    "resolve_device",
    "wrap_ddp",
]
