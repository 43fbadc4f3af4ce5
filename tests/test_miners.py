"""Miners: oracle checks against pytorch-metric-learning 2.9, set labels, sampling, bad input.

Oracle configuration:
- SemiHardMiner(0.1)          ↔ pml TripletMarginMiner(margin=0.1, type_of_triplets="semihard")
                                 (LpDistance default; CosineSimilarity for the similarity case)
- MultiSimilarityMiner(0.1)   ↔ pml MultiSimilarityMiner(epsilon=0.1) (CosineSimilarity default;
                                 LpDistance for the distance case)
- DistanceWeightedMiner(0.5, 1.4).probabilities ↔ the ``weights`` pml DistanceWeightedMiner(cutoff=0.5,
  nonzero_loss_cutoff=1.4) hands to its sampler (captured); sampling itself is stochastic and is
  checked for structure, reproducibility under a generator and frequencies.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from pytorch_metric_learning import distances as pml_distances
from pytorch_metric_learning import miners as pml_miners
from pytorch_metric_learning.utils import loss_and_miner_utils as pml_lmu
from torch import Tensor

from idml.embeddings import Embeddings
from idml.metrics import CosineSimilarity, EuclideanDistance, IntrospectiveMetric
from idml.miners import (
    DistanceWeightedMiner,
    Miner,
    MultiSimilarityMiner,
    PairIndices,
    SemiHardMiner,
    TripletIndices,
    all_pairs,
    all_triplets,
    as_pairs,
    as_triplets,
    to_distance,
)
from idml.relations import LabelSets

SEEDS = [0, 1, 2]
BATCHES = {"7x3": [3] * 7, "4x5": [5] * 4, "unbalanced": [1, 2, 6, 3, 4]}
DIM = 16


def make_batch(kind: str, seed: int, dim: int = DIM) -> tuple[Tensor, Tensor]:
    """Float64 clustered embeddings and shuffled integer labels (distances spread over (0, 2))."""
    gen = torch.Generator().manual_seed(seed)
    counts = BATCHES[kind]
    labels = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    labels = labels[torch.randperm(len(labels), generator=gen)]
    centres = torch.randn(len(counts), dim, generator=gen, dtype=torch.float64)
    noise = torch.randn(len(labels), dim, generator=gen, dtype=torch.float64)
    return centres[labels] + 0.8 * noise, labels


def triplet_set(indices: TripletIndices | tuple[Tensor, ...]) -> set[tuple[int, int, int]]:
    return set(zip(*(t.tolist() for t in indices)))


def pair_sets(indices: PairIndices | tuple[Tensor, ...]) -> tuple[set, set]:
    a1, p, a2, n = (t.tolist() for t in indices)
    return set(zip(a1, p)), set(zip(a2, n))


cases = pytest.mark.parametrize(("kind", "seed"), list(itertools.product(BATCHES, SEEDS)))


# ------------------------------------------------------------------------------------ oracles
@cases
@pytest.mark.parametrize("similarity", [False, True])
def test_semihard_matches_pml(kind: str, seed: int, similarity: bool) -> None:
    emb, labels = make_batch(kind, seed)
    metric = CosineSimilarity() if similarity else EuclideanDistance()
    distance = pml_distances.CosineSimilarity() if similarity else pml_distances.LpDistance()
    oracle = pml_miners.TripletMarginMiner(
        margin=0.1, type_of_triplets="semihard", distance=distance
    )
    ours = SemiHardMiner(0.1).mine_embeddings(emb, labels, metric)
    assert isinstance(ours, TripletIndices)
    assert ours.size > 0
    assert triplet_set(ours) == triplet_set(oracle(emb, labels))


@cases
@pytest.mark.parametrize("similarity", [True, False])
def test_multi_similarity_miner_matches_pml(kind: str, seed: int, similarity: bool) -> None:
    emb, labels = make_batch(kind, seed)
    metric = CosineSimilarity() if similarity else EuclideanDistance()
    distance = pml_distances.CosineSimilarity() if similarity else pml_distances.LpDistance()
    oracle = pml_miners.MultiSimilarityMiner(epsilon=0.1, distance=distance)
    ours = MultiSimilarityMiner(0.1).mine_embeddings(emb, labels, metric)
    assert isinstance(ours, PairIndices)
    ours_pos, ours_neg = pair_sets(ours)
    oracle_pos, oracle_neg = pair_sets(oracle(emb, labels))
    assert ours_pos and ours_neg
    assert ours_pos == oracle_pos and ours_neg == oracle_neg


def pml_distance_weights(emb: Tensor, labels: Tensor, monkeypatch: pytest.MonkeyPatch) -> Tensor:
    """The per-anchor weights pml's DistanceWeightedMiner passes to its sampler."""
    captured: dict[str, Tensor] = {}
    original = pml_lmu.get_random_triplet_indices

    def capture(*args: object, weights: Tensor, **kwargs: object) -> object:
        captured["weights"] = weights.clone()
        return original(*args, weights=weights, **kwargs)

    monkeypatch.setattr(pml_lmu, "get_random_triplet_indices", capture)
    pml_miners.DistanceWeightedMiner(cutoff=0.5, nonzero_loss_cutoff=1.4)(emb, labels)
    return captured["weights"]


@cases
def test_distance_weighted_probabilities_match_pml(
    kind: str, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    emb, labels = make_batch(kind, seed)
    oracle = pml_distance_weights(emb, labels, monkeypatch)
    distance = EuclideanDistance()(emb)
    ours = DistanceWeightedMiner().probabilities(distance, LabelSets.coerce(labels), dim=DIM)
    # pml divides an all-zero row by 0 (NaN) and then skips it; ours is an explicit zero row.
    empty = torch.isnan(oracle).all(dim=1)
    assert not empty.all()
    # float64: cdist (pml) vs our Gram expansion put a few ε on d² ≈ O(1); with d ≥ cutoff 0.5,
    # (n−2) = 14 times log d and a 21-term normalisation that is ≲ 1e-13 relative on every
    # probability (all ≥ 1e-3 here, so atol is moot): rtol 1e-10 (was float32's 1e-5).
    torch.testing.assert_close(ours[~empty], oracle[~empty], rtol=1e-10, atol=1e-12)
    assert (ours[empty] == 0).all()


# ------------------------------------------------------------- distance-weighted sampling
def brute_force_probabilities(
    d: Tensor, sets: list[set[int]], n: int, cutoff: float = 0.5, nonzero: float = 1.4
) -> list[list[float]]:
    """Wu et al. §4 literally: p ∝ min(φ, q(d)^{-1}) with φ = q^{-1}(cutoff), in plain floats."""

    def inv_q(x: float) -> float:
        return 1.0 / (x ** (n - 2) * (1 - x * x / 4) ** ((n - 3) / 2))

    phi = inv_q(cutoff)
    rows = []
    for i in range(len(sets)):
        w = [
            min(phi, inv_q(max(float(d[i, j]), 1e-9)))
            if not (sets[i] & sets[j]) and float(d[i, j]) < nonzero
            else 0.0
            for j in range(len(sets))
        ]
        total = sum(w)
        rows.append([v / total if total else 0.0 for v in w])
    return rows


def test_distance_weighted_probabilities_are_min_phi_inverse_q_with_set_labels() -> None:
    gen = torch.Generator().manual_seed(5)
    emb = torch.randn(10, 6, generator=gen, dtype=torch.float64)
    emb[1] = emb[0] + 0.01  # a very close pair: below the cutoff, capped at φ
    labels = LabelSets.from_labels(torch.tensor([0, 1, 1, 2, 2, 3, 3, 0])).cat(
        LabelSets.mixed(torch.tensor([0, 2]), torch.tensor([1, 3]))
    )
    sets = [{int(v) for v in row if v >= 0} for row in labels.labels]
    d = EuclideanDistance()(emb)
    ours = DistanceWeightedMiner().probabilities(d, labels, dim=6)
    expected = torch.tensor(brute_force_probabilities(d, sets, 6), dtype=torch.float64)
    # float64, the same d on both sides: log-space softmax vs plain powers and a 10-term sum in
    # Python, a few ε times |log q⁻¹| ≲ 3: ≲ 1e-14 relative, rtol 1e-12 (was 1e-9); zeros are
    # exact (same masks), atol only for them.
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)
    # The mixed {0, 1} image (row 8) may never draw images of class 0 or 1.
    assert (ours[8, [0, 1, 2, 7]] == 0).all()


def test_distance_weighted_is_finite_in_high_dimension() -> None:
    # n = 512: q^{-1} spans hundreds of orders of magnitude; the log-space softmax must not overflow.
    emb = torch.randn(24, 512, generator=torch.Generator().manual_seed(0))
    d = EuclideanDistance()(emb * torch.linspace(0.1, 1, 24).unsqueeze(1) + 1.0)
    probs = DistanceWeightedMiner().probabilities(
        d, LabelSets.from_labels(torch.arange(24) % 4), dim=512
    )
    assert torch.isfinite(probs).all()
    sums = probs.sum(dim=1)
    # float32 softmax of ≤ 24 admissible terms, then a ≤ 24-term sum: ≲ 27·ε ≈ 3e-6 worst case.
    assert ((sums - 1).abs() < 1e-5).logical_or(sums == 0).all()


def test_distance_weighted_triplets_cover_every_positive_pair_once() -> None:
    emb, labels = make_batch("unbalanced", 0)
    sets = LabelSets.coerce(labels)
    miner = DistanceWeightedMiner(generator=torch.Generator().manual_seed(0))
    d = EuclideanDistance()(emb)
    t = miner(d, sets, similarity=False, dim=DIM)
    assert isinstance(t, TripletIndices)
    probs = miner.probabilities(d, sets, dim=DIM)
    sampleable = probs.sum(dim=1) > 0
    expected_pairs = {
        (a, p) for a, p in sets.positive_mask().nonzero().tolist() if bool(sampleable[a])
    }
    pairs = list(zip(t.anchor.tolist(), t.positive.tolist()))
    assert len(pairs) == len(set(pairs)) and set(pairs) == expected_pairs
    assert (probs[t.anchor, t.negative] > 0).all()


def test_distance_weighted_is_reproducible_under_a_generator() -> None:
    emb, labels = make_batch("4x5", 1)
    d = EuclideanDistance()(emb)

    def mine(seed: int) -> TripletIndices:
        miner = DistanceWeightedMiner(generator=torch.Generator().manual_seed(seed))
        t = miner(d, labels, similarity=False, dim=DIM)
        assert isinstance(t, TripletIndices)
        return t

    first, again, other = mine(3), mine(3), mine(4)
    assert all(torch.equal(x, y) for x, y in zip(first, again))
    assert not torch.equal(first.negative, other.negative)


def test_distance_weighted_sampling_frequencies_follow_probabilities() -> None:
    # One anchor with 400 positives draws 400 negatives from its distribution per call.
    gen = torch.Generator().manual_seed(0)
    emb = torch.randn(406, 8, generator=gen, dtype=torch.float64)
    labels = torch.tensor([0] * 401 + [1, 2, 3, 4, 5])
    d = EuclideanDistance()(emb)
    miner = DistanceWeightedMiner(generator=torch.Generator().manual_seed(1))
    probs = miner.probabilities(d, LabelSets.coerce(labels), dim=8)[0, 401:]
    t = miner(d, labels, similarity=False, dim=8)
    assert isinstance(t, TripletIndices)
    first_anchor = t.negative[t.anchor == 0] - 401
    counts = torch.bincount(first_anchor, minlength=5).double()
    expected = 400 * probs
    # Generous 5-sigma band of a binomial count (two-sided p ≈ 6e-7 per count under the seeded
    # draw), +1 for the integer step of a count.
    sigma = (400 * probs * (1 - probs)).sqrt()
    assert ((counts - expected).abs() <= 5 * sigma + 1).all()


def test_distance_weighted_on_similarity_uses_chord_distance() -> None:
    emb, labels = make_batch("7x3", 2)
    sets = LabelSets.coerce(labels)
    miner = DistanceWeightedMiner()
    from_cos = miner.probabilities(CosineSimilarity()(emb), sets, dim=DIM, similarity=True)
    from_dist = miner.probabilities(EuclideanDistance()(emb), sets, dim=DIM)
    # float64: √(2 − 2S) vs the Gram-form distance differ by a few ε on d² = O(1); clamped at
    # d ≥ 0.5 and amplified (n−2) = 14 times in log q⁻¹: ≲ 1e-13 relative, rtol 1e-10 (was 1e-6).
    torch.testing.assert_close(from_cos, from_dist, rtol=1e-10, atol=1e-12)


def test_to_distance_of_cosine_is_euclidean_on_the_unit_sphere() -> None:
    emb, _ = make_batch("4x5", 0)
    # float64: 2 − 2S vs ||x̂||² + ||ŷ||² − 2x̂·ŷ (16-term dot products) differ by a few ε on
    # d² = O(1), ≲ 1e-14 relative on d: rtol 1e-12 (was 1e-6). The diagonal's rounding residue
    # (≲ 1e-14 ≤ 1e-12) is zeroed exactly by safe_norm_from_squares on both sides: atol 0 (was 1e-7).
    torch.testing.assert_close(
        to_distance(CosineSimilarity()(emb), similarity=True),
        EuclideanDistance()(emb),
        rtol=1e-12,
        atol=0,
    )


# ------------------------------------------------------------- set labels in every miner
def mixed_labels() -> tuple[LabelSets, list[set[int]]]:
    labels = LabelSets.from_labels(torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3])).cat(
        LabelSets.mixed(torch.tensor([0, 1, 2]), torch.tensor([1, 3, 0]))
    )
    return labels, [{int(v) for v in row if v >= 0} for row in labels.labels]


@pytest.mark.parametrize(
    "miner",
    [
        SemiHardMiner(0.3),
        MultiSimilarityMiner(0.1),
        DistanceWeightedMiner(generator=torch.Generator().manual_seed(0)),
    ],
    ids=["semihard", "multi_similarity", "distance_weighted"],
)
@pytest.mark.parametrize("ism", [False, True])
def test_miners_respect_set_labels(miner: Miner, ism: bool) -> None:
    labels, sets = mixed_labels()
    gen = torch.Generator().manual_seed(0)
    emb = Embeddings(
        torch.randn(len(sets), DIM, generator=gen, dtype=torch.float64),
        0.3 * torch.randn(len(sets), 4, generator=gen, dtype=torch.float64) if ism else None,
    )
    metric = IntrospectiveMetric(EuclideanDistance(), gamma=0.2) if ism else EuclideanDistance()
    pairs = as_pairs(miner.mine_embeddings(emb, labels, metric))
    assert len(pairs.anchor_pos) > 0 and len(pairs.anchor_neg) > 0
    for a, p in zip(pairs.anchor_pos.tolist(), pairs.positive.tolist()):
        assert a != p and sets[a] & sets[p]
    for a, n in zip(pairs.anchor_neg.tolist(), pairs.negative.tolist()):
        assert not sets[a] & sets[n]


def test_semihard_mixed_image_is_positive_of_both_classes() -> None:
    # a (class 0) at 0°, b (class 1) at 90°, m = mix {0, 1} at 30°, c (class 2) at 65°.
    # Chord distances: a–m 0.518, a–c 1.075, a–b 1.414, b–m 1.0, b–c 0.433, m–c 0.601.
    rad = torch.tensor([0.0, 90.0, 30.0, 65.0], dtype=torch.float64) * math.pi / 180
    x = torch.stack([rad.cos(), rad.sin()], dim=1)
    d = EuclideanDistance()(x)
    miner = SemiHardMiner(margin=0.8)
    as_set = LabelSets(torch.tensor([[0, -1], [1, -1], [0, 1], [2, -1]]))
    # a: (m, c) semi-hard; b: (m, a) semi-hard, c too close; m: (a, c) semi-hard, (b, c) too close.
    assert triplet_set(miner(d, as_set, similarity=False)) == {(0, 2, 3), (1, 2, 0), (2, 0, 3)}
    # Labelled {0} only, m loses b as a positive and gains it as a negative.
    only_a = LabelSets(torch.tensor([[0], [1], [0], [2]]))
    assert triplet_set(miner(d, only_a, similarity=False)) == {(0, 2, 3), (2, 0, 1), (2, 0, 3)}


# ------------------------------------------------------------- conversions
def test_all_pairs_and_triplets_enumerate_relations() -> None:
    labels = LabelSets.from_labels(torch.tensor([0, 0, 1]))
    pairs = all_pairs(labels)
    assert pair_sets(pairs) == ({(0, 1), (1, 0)}, {(0, 2), (1, 2), (2, 0), (2, 1)})
    assert triplet_set(all_triplets(labels)) == {(0, 1, 2), (1, 0, 2)}


def test_pair_triplet_conversions() -> None:
    t = TripletIndices(torch.tensor([0, 0]), torch.tensor([1, 1]), torch.tensor([2, 3]))
    p = as_pairs(t)
    assert pair_sets(p) == ({(0, 1)}, {(0, 2), (0, 3)})
    assert len(p.anchor_pos) == 2  # repeated pair kept: the pair loss weighs it as mined
    assert triplet_set(as_triplets(p, 4)) == {(0, 1, 2), (0, 1, 3)}
    assert as_triplets(t, 4) is t and as_pairs(p) is p
    pos, neg = p.masks(4)
    assert pos.sum() == 1 and neg.sum() == 2 and pos[0, 1] and neg[0, 3]


# ------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "miner", [SemiHardMiner(), MultiSimilarityMiner(), DistanceWeightedMiner()]
)
def test_bad_matrix_and_labels_raise(miner: Miner) -> None:
    call = miner.__call__
    with pytest.raises(ValueError, match="matrix"):
        call(torch.rand(4, 3), torch.tensor([0, 0, 1, 1]), similarity=False, dim=8)
    with pytest.raises(ValueError, match="labels"):
        call(torch.rand(4, 4), torch.tensor([0, 0, 1]), similarity=False, dim=8)
    bad = torch.rand(4, 4)
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match="matrix"):
        call(bad, torch.tensor([0, 0, 1, 1]), similarity=False, dim=8)


def test_bad_miner_parameters_raise() -> None:
    with pytest.raises(ValueError, match="margin"):
        SemiHardMiner(0.0)
    with pytest.raises(ValueError, match="epsilon"):
        MultiSimilarityMiner(-0.1)
    with pytest.raises(ValueError, match="cutoff"):
        DistanceWeightedMiner(cutoff=1.5, nonzero_loss_cutoff=1.4)
    with pytest.raises(ValueError, match="dim"):
        DistanceWeightedMiner()(torch.rand(4, 4), torch.tensor([0, 0, 1, 1]), similarity=False)


def test_mining_does_not_track_gradient() -> None:
    x = torch.randn(8, 4, requires_grad=True)
    d = EuclideanDistance()(x)
    t = SemiHardMiner(0.5)(d, torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]), similarity=False)
    assert isinstance(t, TripletIndices)
    assert not t.anchor.requires_grad and t.anchor.dtype == torch.long
