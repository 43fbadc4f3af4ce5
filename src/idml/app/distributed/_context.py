"""A process's place in a ``torchrun`` job (:class:`DistributedContext`), joining and leaving the
process group, the device, and the random seeds derived per rank (:mod:`idml.app.distributed`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

T = TypeVar("T")

ENV_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
"""What torchrun (``python -m torch.distributed.run``) sets for every process it starts."""


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

    def average(self, tensor: Tensor) -> Tensor:
        """``tensor`` averaged over ranks (one all-reduce; unchanged for one process); it stays on
        the device, so nothing waits for it until it is read."""
        if not self.is_distributed:
            return tensor
        out = tensor.to(self.device).clone()
        dist.all_reduce(out)
        return out / self.world_size

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
