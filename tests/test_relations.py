"""Label relations: positives iff label sets intersect, for pairs and proxies (IDML's set labels)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from idml.relations import PAD, LabelSets, pair_masks


def brute_force(sets: list[set[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    n = len(sets)
    pos = torch.tensor([[i != j and bool(sets[i] & sets[j]) for j in range(n)] for i in range(n)])
    neg = torch.tensor([[not (sets[i] & sets[j]) for j in range(n)] for i in range(n)])
    return pos, neg


def as_sets(labels: LabelSets) -> list[set[int]]:
    return [{int(v) for v in row if v != PAD} for row in labels.labels]


# ------------------------------------------------------------------------------ integer labels
def test_integer_label_masks() -> None:
    labels = torch.tensor([2, 0, 2, 1, 0])
    pos, neg = pair_masks(labels)
    same = labels[:, None] == labels[None, :]
    assert torch.equal(pos, same & ~torch.eye(5, dtype=torch.bool))
    assert torch.equal(neg, ~same)
    assert not pos.diagonal().any() and not neg.diagonal().any()
    assert pos.sum().item() == 4  # (0, 2), (1, 4) in both orders


def test_integer_label_proxy_mask_is_one_hot() -> None:
    labels = LabelSets.from_labels(torch.tensor([2, 0, 1]))
    assert labels.proxy_mask(3).int().tolist() == [[0, 0, 1], [1, 0, 0], [0, 1, 0]]
    assert labels.is_single and labels.primary.tolist() == [2, 0, 1]


# ------------------------------------------------------------------------------ set labels
def test_mixed_image_is_positive_of_both_source_classes() -> None:
    originals = LabelSets.from_labels(torch.tensor([0, 1, 2]))
    mixed = LabelSets.mixed(torch.tensor([0]), torch.tensor([1]))
    batch = originals.cat(mixed)  # rows: {0}, {1}, {2}, {0, 1}
    pos, neg = pair_masks(batch)
    assert pos[3].tolist() == [True, True, False, False]
    assert pos[:, 3].tolist() == [True, True, False, False]
    assert neg[3].tolist() == [False, False, True, False]
    assert not pos[0, 1] and neg[0, 1]  # the two sources stay negatives of each other
    assert batch.proxy_mask(3)[3].tolist() == [True, True, False]
    assert not batch.is_single


def test_two_mixed_images_sharing_one_class_are_positives() -> None:
    batch = LabelSets.mixed(torch.tensor([0, 1, 2]), torch.tensor([1, 3, 3]))  # {0,1} {1,3} {2,3}
    pos, neg = pair_masks(batch)
    assert pos.int().tolist() == [[0, 1, 0], [1, 0, 1], [0, 1, 0]]
    assert neg.int().tolist() == [[0, 0, 1], [0, 0, 0], [1, 0, 0]]


def test_mixing_an_image_with_its_own_class_gives_a_singleton() -> None:
    batch = LabelSets.mixed(torch.tensor([4, 1]), torch.tensor([4, 2]))
    assert batch.labels.tolist() == [[4, PAD], [1, 2]]
    assert as_sets(batch) == [{4}, {1, 2}]


def test_relation_against_another_batch() -> None:
    queries = LabelSets.mixed(torch.tensor([0]), torch.tensor([1]))
    refs = LabelSets.from_labels(torch.tensor([1, 2, 0]))
    assert queries.intersects(refs).tolist() == [[True, False, True]]
    # Against another batch the diagonal is a real pair, not "self".
    assert queries.positive_mask(refs).tolist() == [[True, False, True]]
    assert queries.negative_mask(refs).tolist() == [[False, True, False]]


def test_cat_pads_the_narrower_batch() -> None:
    batch = LabelSets.from_labels(torch.tensor([3])).cat(
        LabelSets.mixed(torch.tensor([0]), torch.tensor([1]))
    )
    assert batch.labels.tolist() == [[3, PAD], [0, 1]]
    assert batch[torch.tensor([1])].labels.tolist() == [[0, 1]]
    assert len(batch) == 2 and batch.max_label() == 3


def test_coerce_accepts_vectors_padded_tensors_and_label_sets() -> None:
    sets = LabelSets.from_labels(torch.tensor([0, 1]))
    assert LabelSets.coerce(sets) is sets
    assert LabelSets.coerce(torch.tensor([0, 1])).labels.tolist() == [[0], [1]]
    assert LabelSets.coerce(torch.tensor([[0, PAD], [0, 1]])).labels.tolist() == [[0, -1], [0, 1]]
    assert LabelSets.coerce([2, 3]).labels.tolist() == [[2], [3]]  # type: ignore[arg-type]


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.lists(st.integers(0, 5), min_size=1, max_size=2, unique=True), min_size=1, max_size=12
    )
)
def test_masks_match_set_intersection_property(rows: list[list[int]]) -> None:
    labels = LabelSets(torch.tensor([r + [PAD] * (2 - len(r)) for r in rows]))
    pos, neg = brute_force([set(r) for r in rows])
    assert torch.equal(labels.positive_mask(), pos)
    assert torch.equal(labels.negative_mask(), neg)
    member = labels.proxy_mask(6)
    expected = torch.tensor([[c in r for c in range(6)] for r in rows])
    assert torch.equal(member, expected)


# ------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: LabelSets(torch.zeros(2, 2, 2, dtype=torch.long)), "shape"),
        (lambda: LabelSets(torch.zeros(3, 1)), "integers"),
        (lambda: LabelSets(torch.zeros(3, 1, dtype=torch.bool)), "integers"),
        (lambda: LabelSets(torch.tensor([[0], [-1]])), "at least one label"),
        (lambda: LabelSets.from_labels(torch.zeros(2, 2, dtype=torch.long)), "1-D"),
        (lambda: LabelSets.mixed(torch.tensor([0, 1]), torch.tensor([0])), "labels_a"),
        (lambda: LabelSets.from_labels(torch.tensor([0, 3])).proxy_mask(3), "out of range"),
    ],
)
def test_bad_labels_raise_value_error(make: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()  # type: ignore[operator]


def test_non_tensor_labels_raise_type_error() -> None:
    with pytest.raises(TypeError, match="labels"):
        LabelSets([[0], [1]])  # type: ignore[arg-type]
