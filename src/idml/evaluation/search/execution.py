"""Execution: which tiles run where, one at a time or on a thread pool, and progress; the knobs
of all that are a :class:`SearchExecution`.

On CPU each worker thread takes whole tiles, single-threaded: its own matrix product, then the
candidate work. That has a higher throughput than one multi-threaded product followed by the
(short, poorly parallel) candidate work, because the product scales poorly over threads and the
candidate work not at all (``benchmarks/RESULTS.md``, Evaluation at SOP scale). A tile updates
the queries of its row block (and of its column block when it serves both); one lock per block
(:class:`BlockLocks`) keeps two tiles from updating the same queries at once. Results do not depend
on the order in which tiles finish: top-k merges keep the best ``k`` by (score, index) and counts
add up. On CUDA one tile at a time uses the whole device.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed, wait
from dataclasses import dataclass

import torch

from idml.evaluation.search.kernels import KERNEL_NAMES, KernelName

Tile = tuple[slice, slice, bool]
"""``(rows, cols, serves_columns_too)``, as :func:`idml.evaluation.search.layout.tiles` yields."""

DEFAULT_MAX_RANK_ENTRIES = 1 << 24


@dataclass(frozen=True)
class SearchExecution:
    """How :func:`~idml.evaluation.search.exact_search` runs: where, in which pieces, and what it
    reports while it does. None of these changes what it finds (neighbours, ranks, metrics), only
    its memory, speed and, for the score of a neighbour, the last bit of float rounding.

    Example:
        >>> SearchExecution(block_size=512).block_size_on(torch.device("cpu"))
        512
    """

    block_size: int | None = None
    """Tile side (default 2048 on CPU, 8192 on CUDA); memory is ``O(block²)``."""
    device: torch.device | str | None = None
    """Where to compute (default: the device of the query embeddings)."""
    max_rank_entries: int = DEFAULT_MAX_RANK_ENTRIES
    """Bound on ``queries × max relevant`` held at once; above it queries are chunked (and the
    symmetric saving is lost)."""
    progress: bool | Callable[[int], object] = False
    """``True`` for progress over tiles (:mod:`idml.progress`), or a callback receiving the tile
    count."""
    kernel: KernelName = "auto"
    """The products that compute scores (:mod:`~idml.evaluation.search.kernels`): ``auto``
    measures the candidates on this machine for a large search; ``torch``, ``openblas``,
    ``faiss`` or ``bf16`` (a screen re-scored exactly) force one."""

    def __post_init__(self) -> None:
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kernel not in KERNEL_NAMES:
            raise ValueError(f"kernel must be one of {KERNEL_NAMES}, got {self.kernel!r}")

    def device_for(self, data: torch.device) -> torch.device:
        """The device to compute on, for query embeddings on ``data``."""
        dev = torch.device(self.device) if self.device is not None else data
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {str(dev)!r} requested but CUDA is not available; use 'cpu'")
        return dev

    def block_size_on(self, device: torch.device) -> int:
        """The tile side on ``device``."""
        if self.block_size is not None:
            return self.block_size
        return 8192 if device.type == "cuda" else 2048


def search_workers(device: torch.device) -> int:
    """Tiles processed at once: one per intra-op thread on CPU, one (the whole device) on CUDA."""
    return torch.get_num_threads() if device.type == "cpu" else 1


_POOLS: dict[int, ThreadPoolExecutor] = {}


def _pool(workers: int) -> ThreadPoolExecutor:
    """A process-wide pool of ``workers`` threads for tile work: threads are started once, not at
    every search (the trainer evaluates after each epoch)."""
    if workers not in _POOLS:
        _POOLS[workers] = ThreadPoolExecutor(workers, thread_name_prefix="idml-search")
    return _POOLS[workers]


def _single_threaded(fn: Callable[..., None], *args: object) -> None:
    """Run ``fn`` with one intra-op thread (the setting is per thread under OpenMP and MKL)."""
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)
    fn(*args)


def run_tiles(
    tiles: Sequence[Tile], process: Callable[[slice, slice, bool], None], workers: int
) -> Iterator[None]:
    """Call ``process`` on every tile, yielding once per finished tile (for progress).

    With ``workers > 1`` the tiles run on the pool, each single-threaded; the first failure is
    raised and the tiles not yet started are cancelled.
    """
    if workers <= 1 or len(tiles) <= 1:
        for rows, cols, both in tiles:
            process(rows, cols, both)
            yield
        return
    pool = _pool(workers)
    futures = [pool.submit(_single_threaded, process, *tile) for tile in tiles]
    try:
        for future in as_completed(futures):
            future.result()
            yield
    finally:
        for future in futures:
            future.cancel()
        wait(futures)


class BlockLocks:
    """One lock per query block, created on first use (``locks[block_start]``)."""

    def __init__(self) -> None:
        self._locks: dict[int, threading.Lock] = {}
        self._guard = threading.Lock()

    def __getitem__(self, block_start: int) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(block_start, threading.Lock())


class Progress:
    """A progress bar or plain lines (:class:`idml.progress.Progress`), a user callback, or
    nothing, advanced once per tile."""

    def __init__(self, progress: bool | Callable[[int], object], total: int) -> None:
        self._bar = None
        self._callback: Callable[[int], object] | None = None
        if callable(progress):
            self._callback = progress
        elif progress:
            from idml.progress import Progress as Bar

            self._bar = Bar(total, "retrieval", unit="tile")

    def __call__(self, n: int, close: bool = False) -> None:
        if self._bar is not None:
            self._bar.update(n)
            if close:
                self._bar.close()
        elif self._callback is not None and n:
            self._callback(n)
