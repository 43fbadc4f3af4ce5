"""Batch samplers: random batches, and class-balanced batches of P classes × K images.

Pair- and proxy-based DML losses need positives in every batch; the class-balanced sampler
guarantees ``K`` images of each of ``P`` distinct classes per batch (the "P×K" batches of
Hermans et al. 2017, used by the SSR recipe).

Determinism and distribution: each sampler computes the **global** list of batches of an epoch as
a pure function of ``(seed, epoch)`` with its own :class:`torch.Generator`, so every process
computes the same list. With ``num_replicas = R`` each rank yields a contiguous ``1/R`` share of
every global batch — for P×K batches that is ``P/R`` whole classes, so positives stay on one rank.
Call :meth:`EpochBatchSampler.set_epoch` before iterating, as with ``DistributedSampler``; if it
is not called the epoch advances by one after each iteration, so batches never silently repeat.

Example:
    >>> import torch
    >>> labels = torch.arange(6).repeat_interleave(4)        # 6 classes × 4 images
    >>> sampler = ClassBalancedBatchSampler(labels, classes_per_batch=3, images_per_class=2, seed=0)
    >>> len(sampler)
    4
    >>> batch = next(iter(sampler))
    >>> rows = labels[batch].view(3, 2)                      # one row per class of the batch
    >>> bool((rows[:, 0] == rows[:, 1]).all()), rows[:, 0].unique().numel()
    (True, 3)
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import KW_ONLY, InitVar, dataclass, field
from enum import Enum

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Sampler

from idml.data.records import format_examples


def epoch_generator(seed: int, epoch: int) -> torch.Generator:
    """A generator seeded from ``(seed, epoch)`` through NumPy's ``SeedSequence`` hashing.

    Hashing (rather than ``seed + epoch``) keeps the streams of nearby seeds and epochs unrelated.
    """
    if seed < 0 or epoch < 0:
        raise ValueError(f"seed and epoch must be >= 0, got seed={seed}, epoch={epoch}")
    state = np.random.SeedSequence([seed, epoch]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(state))


@dataclass(eq=False, kw_only=True)
class EpochBatchSampler(Sampler[list[int]]):
    """Base of the batch samplers: batches are a function of ``(seed, epoch)``, sharded by rank.

    Subclasses implement :meth:`global_batches`. ``len()`` is the number of batches per epoch.
    """

    seed: int = 0
    """Seed of every epoch's batches (hashed with the epoch, :func:`epoch_generator`)."""
    num_replicas: int = 1
    """Processes that share every global batch."""
    rank: int = 0
    """This process, ``0..num_replicas−1``: it yields the ``rank``-th share of each batch."""
    epoch: int = field(default=0, init=False)
    """The epoch the next iteration yields (:meth:`set_epoch`)."""

    def __post_init__(self) -> None:
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.num_replicas < 1 or not 0 <= self.rank < self.num_replicas:
            raise ValueError(
                "need num_replicas >= 1 and 0 <= rank < num_replicas, got "
                f"{self.num_replicas}, {self.rank}"
            )

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the next iteration (call it with the same value on every rank)."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self.epoch = epoch

    def global_batches(self, epoch: int) -> list[Tensor]:
        """All batches of ``epoch`` across all replicas, as index tensors."""
        raise NotImplementedError

    def __iter__(self) -> Iterator[list[int]]:
        batches = self.global_batches(self.epoch)
        self.epoch += 1
        shares = [batch.tensor_split(self.num_replicas)[self.rank].tolist() for batch in batches]
        return iter(shares)

    def __len__(self) -> int:
        raise NotImplementedError


@dataclass(eq=False)
class RandomBatchSampler(EpochBatchSampler):
    """Batches of a fresh uniform random permutation of ``0..num_samples−1`` every epoch.

    With ``drop_last`` (the training default) every batch is full; otherwise the last batch holds
    the remainder. ``batch_size`` is the global batch, divided evenly among replicas.
    """

    num_samples: int
    batch_size: int
    _: KW_ONLY
    drop_last: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_samples < 1 or self.batch_size < 1:
            raise ValueError(
                "num_samples and batch_size must be >= 1, got "
                f"{self.num_samples}, {self.batch_size}"
            )
        if self.batch_size % self.num_replicas:
            raise ValueError(
                f"batch_size {self.batch_size} must be divisible by num_replicas "
                f"{self.num_replicas}"
            )
        if self.drop_last and self.batch_size > self.num_samples:
            raise ValueError(
                f"batch_size {self.batch_size} exceeds the {self.num_samples} samples, so "
                "drop_last leaves no batch; lower batch_size or pass drop_last=False"
            )

    def __len__(self) -> int:
        if self.drop_last:
            return self.num_samples // self.batch_size
        return math.ceil(self.num_samples / self.batch_size)

    def global_batches(self, epoch: int) -> list[Tensor]:
        order = torch.randperm(self.num_samples, generator=epoch_generator(self.seed, epoch))
        return list(order[: len(self) * self.batch_size].split(self.batch_size))


@dataclass(eq=False)
class ClassBalancedBatchSampler(EpochBatchSampler):
    """Batches of ``P`` distinct classes × ``K`` images each, laid out class by class.

    Per epoch, with ``C`` classes and ``n_c`` images in class ``c``:

    - **classes**: the batch sequence is cut from rounds; each round is a random permutation of
      the classes truncated to ``⌊C/P⌋·P`` and cut into ``⌊C/P⌋`` batches. So the ``P`` classes of a
      batch are distinct, and within a round every class appears at most once (all but ``C mod P``
      of them exactly once).
    - **images**: each class's images are shuffled once per epoch into a cycle; the ``o``-th time
      class ``c`` is drawn it contributes cycle positions ``o·K … o·K+K−1`` (mod ``n_c``). So all
      images of a class are used before any repeats, and the ``K`` images of a batch are distinct
      whenever ``n_c ≥ K``.

    A class with ``n_c < K`` is an error unless ``replacement=True``, in which case its cycle wraps
    inside the batch (images repeat). ``num_batches`` defaults to ``max(1, N // (P·K))``, one pass
    over the data's worth of batches.
    """

    labels: InitVar[Tensor | np.ndarray | Sequence[int]]
    classes_per_batch: int
    images_per_class: int
    _: KW_ONLY
    num_batches: int | None = None
    """Batches per epoch; ``None`` gives ``max(1, N // (P·K))`` (an ``int`` once constructed)."""
    replacement: bool = False
    classes: Tensor = field(init=False, repr=False)
    """The distinct labels, sorted; a batch's classes are positions in it."""
    _class_index: Tensor = field(init=False, repr=False)
    _counts: Tensor = field(init=False, repr=False)
    _starts: Tensor = field(init=False, repr=False)

    def __post_init__(self, labels: Tensor | np.ndarray | Sequence[int]) -> None:
        super().__post_init__()
        classes_per_batch, images_per_class = self.classes_per_batch, self.images_per_class
        labels_tensor = torch.as_tensor(np.asarray(labels)).long().reshape(-1)
        if classes_per_batch < 1 or images_per_class < 1:
            raise ValueError(
                f"classes_per_batch and images_per_class must be >= 1, got {classes_per_batch}, "
                f"{images_per_class}"
            )
        if classes_per_batch % self.num_replicas:
            raise ValueError(
                f"classes_per_batch {classes_per_batch} must be divisible by num_replicas "
                f"{self.num_replicas} so every rank gets whole classes"
            )
        classes, class_index, counts = torch.unique(
            labels_tensor, return_inverse=True, return_counts=True
        )
        if len(classes) < classes_per_batch:
            raise ValueError(
                f"classes_per_batch={classes_per_batch} but the labels have only {len(classes)} "
                "classes; lower classes_per_batch (or the batch size)"
            )
        small = counts < images_per_class
        if not self.replacement and bool(small.any()):
            listed = [
                f"label {int(c)} ({int(n)} images)" for c, n in zip(classes[small], counts[small])
            ]
            raise ValueError(
                f"{int(small.sum())} class(es) have fewer than images_per_class={images_per_class} "
                f"images: {format_examples(listed)}; lower images_per_class or pass "
                "replacement=True to repeat their images"
            )
        self.classes = classes
        self._class_index = class_index
        self._counts = counts
        self._starts = torch.cumsum(counts, 0) - counts
        if self.num_batches is None:
            self.num_batches = max(1, len(labels_tensor) // (classes_per_batch * images_per_class))
        if self.num_batches < 1:
            raise ValueError(f"num_batches must be >= 1, got {self.num_batches}")

    @property
    def batch_size(self) -> int:
        """Images per batch on this rank: ``P·K / num_replicas``."""
        return self.classes_per_batch * self.images_per_class // self.num_replicas

    def __len__(self) -> int:
        return self._num_batches

    @property
    def _num_batches(self) -> int:
        assert self.num_batches is not None  # resolved in __post_init__
        return self.num_batches

    def global_batches(self, epoch: int) -> list[Tensor]:
        return list(self.batch_matrix(epoch))

    def batch_matrix(self, epoch: int) -> Tensor:
        """The epoch's global batches as a ``(num_batches, P·K)`` index matrix."""
        generator = epoch_generator(self.seed, epoch)
        num_classes, p, k = len(self.classes), self.classes_per_batch, self.images_per_class
        batches_per_round = num_classes // p
        rounds = math.ceil(self._num_batches / batches_per_round)
        class_rounds = torch.rand(rounds, num_classes, generator=generator).argsort(dim=1)
        batch_classes = class_rounds[:, : batches_per_round * p].reshape(-1, p)[: self._num_batches]

        # Images grouped by class, in a fresh random order within each class: a random
        # permutation, then a stable sort by class.
        shuffled = torch.randperm(len(self._class_index), generator=generator)
        cycles = shuffled[torch.argsort(self._class_index[shuffled], stable=True)]

        # How many times each drawn class was already drawn earlier in the epoch.
        drawn = batch_classes.reshape(-1)
        by_class = torch.argsort(drawn, stable=True)
        sorted_drawn = drawn[by_class]
        rank_in_class = torch.arange(len(drawn)) - torch.searchsorted(sorted_drawn, sorted_drawn)
        occurrence = torch.empty_like(rank_in_class)
        occurrence[by_class] = rank_in_class

        positions = occurrence.unsqueeze(1) * k + torch.arange(k)
        positions = positions % self._counts[drawn].unsqueeze(1)
        indices = cycles[self._starts[drawn].unsqueeze(1) + positions]
        return indices.reshape(self._num_batches, p * k)


class SamplerKind(str, Enum):
    """Which batch sampler a training run uses."""

    RANDOM = "random"
    CLASS_BALANCED = "class_balanced"


def build_batch_sampler(
    kind: SamplerKind | str,
    labels: Tensor | np.ndarray | Sequence[int],
    batch_size: int,
    *,
    images_per_class: int = 4,
    num_batches: int | None = None,
    replacement: bool = False,
    drop_last: bool = True,
    seed: int = 0,
    num_replicas: int = 1,
    rank: int = 0,
) -> EpochBatchSampler:
    """A configured batch sampler over ``labels``; ``batch_size`` is the global batch.

    For ``class_balanced``, ``P = batch_size / images_per_class`` (must divide exactly).
    """
    try:
        kind = SamplerKind(kind)
    except ValueError:
        raise ValueError(
            f"unknown sampler {kind!r}; choose one of {[k.value for k in SamplerKind]}"
        ) from None
    if kind is SamplerKind.RANDOM:
        return RandomBatchSampler(
            len(labels),
            batch_size,
            drop_last=drop_last,
            seed=seed,
            num_replicas=num_replicas,
            rank=rank,
        )
    if images_per_class < 1 or batch_size % images_per_class:
        raise ValueError(
            f"batch_size {batch_size} must be a multiple of images_per_class {images_per_class} "
            "for class-balanced batches"
        )
    return ClassBalancedBatchSampler(
        labels,
        batch_size // images_per_class,
        images_per_class,
        num_batches=num_batches,
        replacement=replacement,
        seed=seed,
        num_replicas=num_replicas,
        rank=rank,
    )
