"""SemiHardMiner's (positive pairs × batch) search against the definition over all B³ triplets."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import idml.miners as miners
from idml.miners import SemiHardMiner, TripletIndices
from idml.relations import LabelSets


def brute_force(matrix: Tensor, labels: LabelSets, similarity: bool, margin: float) -> Tensor:
    """``(a, p, n)`` rows of every triplet with ``0 < S_ap − S_an < δ`` (``S = −D``), by loops."""
    s = matrix if similarity else -matrix
    pos, neg = labels.positive_mask(), labels.negative_mask()
    size = len(labels)
    rows = [
        (a, p, n)
        for a in range(size)
        for p in range(size)
        if pos[a, p]
        for n in range(size)
        if neg[a, n] and 0 < (s[a, p] - s[a, n]).item() < margin
    ]
    return torch.tensor(rows, dtype=torch.long).reshape(-1, 3)


def stacked(t: TripletIndices) -> Tensor:
    return torch.stack([t.anchor, t.positive, t.negative], dim=1)


def mixed_batch(seed: int, size: int = 14) -> tuple[Tensor, LabelSets]:
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 4, (size,), generator=generator)
    partner = torch.randint(0, 4, (size // 2,), generator=generator)
    sets = LabelSets.from_labels(labels[: size // 2]).cat(
        LabelSets.mixed(labels[size // 2 :], partner)
    )
    x = torch.nn.functional.normalize(torch.randn(size, 5, generator=generator), dim=1)
    return x, sets


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("similarity", [False, True])
@pytest.mark.parametrize("chunk_entries", [1 << 24, 1, 30])
def test_semihard_equals_the_definition_in_order_for_any_chunking(
    seed: int, similarity: bool, chunk_entries: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(miners, "_CHUNK_ENTRIES", chunk_entries)
    x, sets = mixed_batch(seed)
    matrix = x @ x.T if similarity else torch.cdist(x, x)
    margin = 0.3
    mined = SemiHardMiner(margin)(matrix, sets, similarity=similarity)
    assert isinstance(mined, TripletIndices)
    expected = brute_force(matrix, sets, similarity, margin)
    assert len(expected) > 0
    assert torch.equal(stacked(mined), expected)  # same triplets, same (a, p, n) order


def test_semihard_without_positives_or_negatives_mines_nothing() -> None:
    matrix = torch.rand(4, 4)
    for labels in (torch.arange(4), torch.zeros(4, dtype=torch.long)):
        mined = SemiHardMiner(0.5)(matrix, labels, similarity=True)
        assert isinstance(mined, TripletIndices)
        assert mined.size == 0
        assert all(t.dtype == torch.long for t in mined)
