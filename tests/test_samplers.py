"""Batch samplers: P×K structure, coverage, determinism in (seed, epoch), sharding, errors."""

from __future__ import annotations

import functools
from collections import Counter

import numpy as np
import pytest
import torch

from idml.data import (
    ClassBalancedBatchSampler,
    RandomBatchSampler,
    SamplerKind,
    build_batch_sampler,
)


def uneven_labels() -> torch.Tensor:
    """12 classes with 4..15 images, shuffled, with arbitrary (non-contiguous) label values."""
    counts = list(range(4, 16))
    labels = torch.tensor(np.repeat(np.arange(12) * 3 + 100, counts))
    return labels[torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))]


def test_pk_structure() -> None:
    labels = uneven_labels()
    sampler = ClassBalancedBatchSampler(labels, classes_per_batch=4, images_per_class=3, seed=1)
    batches = list(sampler)
    assert len(batches) == len(sampler) == len(labels) // 12
    for batch in batches:
        assert len(batch) == 12 and len(set(batch)) == 12  # n_c >= K: no repeated image
        rows = labels[batch].view(4, 3)
        assert bool((rows == rows[:, :1]).all())  # K images of one class per row
        assert len(set(rows[:, 0].tolist())) == 4  # P distinct classes


def test_coverage_images_cycle_and_classes_rotate() -> None:
    labels = uneven_labels()
    sampler = ClassBalancedBatchSampler(
        labels, classes_per_batch=4, images_per_class=3, num_batches=60
    )
    picks = Counter(i for batch in sampler for i in batch)
    class_of = labels.tolist()
    for label in set(class_of):
        members = [i for i in range(len(labels)) if class_of[i] == label]
        seen = [picks.get(i, 0) for i in members]
        # Each class cycles through all its images before repeating any.
        assert max(seen) - min(seen) <= 1, (label, seen)
    # 12 classes, 4 per batch: each round of 3 batches uses every class exactly once.
    draws = Counter(class_of[batch[slot * 3]] for batch in sampler for slot in range(4))
    assert len(draws) == 12 and set(draws.values()) == {60 // 3}


def test_full_coverage_when_every_class_is_in_every_batch() -> None:
    labels = torch.tensor([0] * 5 + [1] * 7 + [2] * 6)
    sampler = ClassBalancedBatchSampler(
        labels, classes_per_batch=3, images_per_class=2, num_batches=4
    )
    seen = {i for batch in sampler for i in batch}
    assert seen == set(range(18))  # ceil(7 / 2) = 4 batches visit every image


def test_determinism_seed_epoch_and_set_epoch() -> None:
    labels = uneven_labels()

    def make(seed: int) -> ClassBalancedBatchSampler:
        return ClassBalancedBatchSampler(labels, classes_per_batch=4, images_per_class=2, seed=seed)

    first, second = make(7), make(7)
    epoch0 = list(first)
    assert epoch0 == list(second)
    epoch1 = list(first)  # no set_epoch: the epoch advanced by itself
    assert epoch1 != epoch0
    first.set_epoch(0)
    assert list(first) == epoch0
    second.set_epoch(1)
    assert list(second) == epoch1
    assert list(make(8)) != epoch0
    assert torch.equal(first.batch_matrix(3), make(7).batch_matrix(3))


def test_replicas_take_whole_class_shares_of_the_global_batch() -> None:
    labels = uneven_labels()
    sampler = functools.partial(
        ClassBalancedBatchSampler, classes_per_batch=4, images_per_class=3, seed=5
    )
    full = sampler(labels)
    shards = [sampler(labels, num_replicas=2, rank=r) for r in range(2)]
    assert shards[0].batch_size == 6
    for whole, part0, part1 in zip(full, *shards):
        assert part0 + part1 == whole
        assert not set(labels[part0].tolist()) & set(labels[part1].tolist())
    with pytest.raises(ValueError, match="divisible by num_replicas 3"):
        sampler(labels, num_replicas=3, rank=0)


def test_small_classes_error_or_replacement() -> None:
    labels = torch.tensor([0] * 5 + [1] * 2 + [2] * 6)
    with pytest.raises(
        ValueError,
        match=r"fewer than images_per_class=3 images: label 1 \(2 images\).*replacement=True",
    ):
        ClassBalancedBatchSampler(labels, classes_per_batch=2, images_per_class=3)
    sampler = ClassBalancedBatchSampler(
        labels, classes_per_batch=3, images_per_class=3, replacement=True, num_batches=2
    )
    for batch in sampler:
        rows = labels[batch].view(3, 3)
        assert bool((rows == rows[:, :1]).all())
        small = [i for i in batch if labels[i] == 1]
        assert set(small) == {5, 6}  # the 2-image class repeats its images to fill 3 slots
    with pytest.raises(ValueError, match="only 3 classes"):
        ClassBalancedBatchSampler(labels, classes_per_batch=4, images_per_class=1)


def test_random_batch_sampler() -> None:
    sampler = RandomBatchSampler(10, batch_size=4, drop_last=False, seed=2)
    batches = list(sampler)
    assert len(sampler) == len(batches) == 3 and [len(b) for b in batches] == [4, 4, 2]
    assert sorted(i for b in batches for i in b) == list(range(10))
    dropping = RandomBatchSampler(10, batch_size=4, seed=2)
    assert len(dropping) == 2 and list(dropping) == batches[:2]
    assert list(dropping) != batches[:2]  # next epoch, new permutation
    shards = [RandomBatchSampler(10, 4, seed=2, num_replicas=2, rank=r) for r in range(2)]
    assert [a + b for a, b in zip(*shards)] == batches[:2]
    with pytest.raises(ValueError, match="drop_last leaves no batch"):
        RandomBatchSampler(3, batch_size=4)


def test_build_batch_sampler() -> None:
    labels = uneven_labels()
    balanced = build_batch_sampler("class_balanced", labels, batch_size=12, images_per_class=3)
    assert isinstance(balanced, ClassBalancedBatchSampler) and balanced.classes_per_batch == 4
    plain = build_batch_sampler(SamplerKind.RANDOM, labels, batch_size=16)
    assert isinstance(plain, RandomBatchSampler) and len(plain) == len(labels) // 16
    with pytest.raises(ValueError, match="multiple of images_per_class 5"):
        build_batch_sampler("class_balanced", labels, batch_size=12, images_per_class=5)
    with pytest.raises(ValueError, match=r"unknown sampler 'mperclass'; choose one of \['random'"):
        build_batch_sampler("mperclass", labels, batch_size=12)
