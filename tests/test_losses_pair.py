"""Pair-based losses: oracle checks against pytorch-metric-learning 2.9, ISM, set labels, bad input.

Oracle configuration (our defaults, the pml reducer that matches our documented averaging):
- ContrastiveLoss()            ↔ pml ContrastiveLoss(pos_margin=0, neg_margin=0.5, reducer=MeanReducer())
- ContrastiveLoss(cosine)      ↔ pml ContrastiveLoss(pos_margin=1, neg_margin=0.875,
                                  distance=CosineSimilarity(), reducer=MeanReducer())
- MarginLoss(miner=fixed T)    ↔ pml MarginLoss(margin=0.2, beta=1.2) (DivisorReducer, its default)
                                  called with indices_tuple=T mined by our DistanceWeightedMiner
- MarginLoss(miner=None)       ↔ pml MarginLoss(margin=0.2, beta=1.2) with no miner (all triplets)
- MarginLoss(learn_boundary, num_classes=C) ↔ pml MarginLoss(learn_beta=True, num_classes=C, nu=0)
- TripletLoss()                ↔ pml TripletMarginLoss(margin=0.1, reducer=MeanReducer()) +
                                  TripletMarginMiner(margin=0.1, type_of_triplets="semihard")
- TripletLoss(miner=None)      ↔ pml TripletMarginLoss(margin=0.1, reducer=MeanReducer()), no miner
- MultiSimilarityLoss()        ↔ pml MultiSimilarityLoss(alpha=2, beta=50, base=0.5) (MeanReducer,
                                  its default) + MultiSimilarityMiner(epsilon=0.1)
All pml distances are their defaults (LpDistance(p=2, power=1, normalize_embeddings=True), or
CosineSimilarity() for multi-similarity), matching our EuclideanDistance / CosineSimilarity.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import pytest
import torch
from pytorch_metric_learning import distances as pml_distances
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning import miners as pml_miners
from pytorch_metric_learning import reducers as pml_reducers
from torch import Tensor

from idml.embeddings import Embeddings
from idml.losses.contrastive import ContrastiveLoss
from idml.losses.margin import MarginLoss
from idml.losses.multi_similarity import MultiSimilarityLoss
from idml.losses.triplet import TripletLoss
from idml.metrics import CosineSimilarity, EuclideanDistance, IntrospectiveMetric, Metric
from idml.miners import (
    DistanceWeightedMiner,
    Miner,
    MultiSimilarityMiner,
    PairIndices,
    SemiHardMiner,
    TripletIndices,
)
from idml.relations import LabelSets

# Oracle comparisons run in float64 on both sides (unit roundoff 1.1e-16). The oracle computes
# with other formulas (its own masks, log-sum-exp shifts, reduction order), so equality is not
# expected; a few hundred ops of float64 rounding stay below 1e-12 relative on any CPU or thread
# count. RTOL 1e-5 is far above that and far below what a wrong margin, scale or mask changes (more
# than 1e-2); ATOL covers gradient entries that are exactly zero on one side and ~1e-17 on the other.
RTOL = 1e-5
ATOL = 1e-10
SEEDS = [0, 1, 2]
BATCHES = {
    "7x3": [3] * 7,
    "4x5": [5] * 4,
    "unbalanced": [1, 2, 6, 3, 4],  # a class with one image has no positive at all
}
DIM = 16


def make_batch(kind: str, seed: int, dim: int = DIM) -> tuple[Tensor, Tensor]:
    """Float64 clustered embeddings (a leaf) and shuffled integer labels.

    Class centres plus noise spread the distances over (0, 2), so every miner finds something.
    """
    gen = torch.Generator().manual_seed(seed)
    counts = BATCHES[kind]
    labels = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    labels = labels[torch.randperm(len(labels), generator=gen)]
    centres = torch.randn(len(counts), dim, generator=gen, dtype=torch.float64)
    noise = torch.randn(len(labels), dim, generator=gen, dtype=torch.float64)
    emb = (centres[labels] + 0.8 * noise).requires_grad_(True)
    return emb, labels


def value_and_grad(loss: Tensor, inputs: list[Tensor]) -> tuple[float, list[Tensor]]:
    grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    return loss.item(), [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, grads)]


def assert_same(ours: Tensor, oracle: Tensor, inputs: list[Tensor]) -> None:
    v_ours, g_ours = value_and_grad(ours, inputs)
    v_oracle, g_oracle = value_and_grad(oracle, inputs)
    assert v_ours == pytest.approx(v_oracle, rel=RTOL, abs=ATOL)
    for a, b in zip(g_ours, g_oracle):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


class FixedMiner(Miner):
    """Returns pre-computed indices, to give our loss and the oracle the same triplets."""

    def __init__(self, indices: PairIndices | TripletIndices) -> None:
        self.indices = indices

    def mine(
        self, matrix: Tensor, labels: LabelSets, similarity: bool, dim: int | None
    ) -> PairIndices | TripletIndices:
        return self.indices


cases = pytest.mark.parametrize(("kind", "seed"), list(itertools.product(BATCHES, SEEDS)))


# ------------------------------------------------------------------------------------ oracles
@cases
def test_contrastive_matches_pml(kind: str, seed: int) -> None:
    emb, labels = make_batch(kind, seed)
    oracle = pml_losses.ContrastiveLoss(
        pos_margin=0.0, neg_margin=0.5, reducer=pml_reducers.MeanReducer()
    )
    assert_same(ContrastiveLoss()(emb, labels), oracle(emb, labels), [emb])


@cases
def test_contrastive_cosine_matches_pml(kind: str, seed: int) -> None:
    emb, labels = make_batch(kind, seed)
    ours = ContrastiveLoss(metric=CosineSimilarity())
    assert (ours.pos_margin, ours.neg_margin) == (1.0, 0.875)
    oracle = pml_losses.ContrastiveLoss(
        pos_margin=1.0,
        neg_margin=0.875,
        distance=pml_distances.CosineSimilarity(),
        reducer=pml_reducers.MeanReducer(),
    )
    assert_same(ours(emb, labels), oracle(emb, labels), [emb])


@cases
def test_margin_with_distance_weighted_triplets_matches_pml(kind: str, seed: int) -> None:
    emb, labels = make_batch(kind, seed)
    miner = DistanceWeightedMiner(generator=torch.Generator().manual_seed(seed))
    triplets = miner.mine_embeddings(emb, labels, EuclideanDistance())
    assert isinstance(triplets, TripletIndices)
    assert triplets.size > 0
    ours = MarginLoss(miner=FixedMiner(triplets))(emb, labels)
    oracle = pml_losses.MarginLoss(margin=0.2, beta=1.2)(emb, labels, indices_tuple=tuple(triplets))
    assert_same(ours, oracle, [emb])


@cases
def test_margin_all_triplets_matches_pml(kind: str, seed: int) -> None:
    emb, labels = make_batch(kind, seed)
    oracle = pml_losses.MarginLoss(margin=0.2, beta=1.2)
    assert_same(MarginLoss(miner=None)(emb, labels), oracle(emb, labels), [emb])


@cases
def test_margin_learnable_class_boundaries_match_pml(kind: str, seed: int) -> None:
    emb, labels = make_batch(kind, seed)
    num_classes = len(BATCHES[kind])
    ours = MarginLoss(learn_boundary=True, num_classes=num_classes, miner=None).double()
    oracle = pml_losses.MarginLoss(
        margin=0.2, beta=1.2, nu=0.0, learn_beta=True, num_classes=num_classes
    ).double()
    # Distinct boundaries per class, so a wrong class lookup changes the value.
    with torch.no_grad():
        spread = torch.linspace(0.9, 1.4, num_classes, dtype=torch.float64)
        ours.boundary.copy_(spread)
        oracle.beta.copy_(spread)
    v_ours, (g_emb, g_boundary) = value_and_grad(ours(emb, labels), [emb, ours.boundary])
    v_oracle, (o_emb, o_beta) = value_and_grad(oracle(emb, labels), [emb, oracle.beta])
    assert v_ours == pytest.approx(v_oracle, rel=RTOL)
    torch.testing.assert_close(g_emb, o_emb, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(g_boundary, o_beta, rtol=RTOL, atol=ATOL)
    assert g_boundary.abs().sum() > 0


@cases
def test_triplet_semihard_matches_pml(kind: str, seed: int) -> None:
    emb, labels = make_batch(kind, seed)
    miner = pml_miners.TripletMarginMiner(margin=0.1, type_of_triplets="semihard")
    oracle_loss = pml_losses.TripletMarginLoss(margin=0.1, reducer=pml_reducers.MeanReducer())
    indices = miner(emb, labels)
    assert len(indices[0]) > 0
    assert_same(TripletLoss()(emb, labels), oracle_loss(emb, labels, indices), [emb])


@cases
def test_triplet_all_triplets_matches_pml(kind: str, seed: int) -> None:
    emb, labels = make_batch(kind, seed)
    oracle = pml_losses.TripletMarginLoss(margin=0.1, reducer=pml_reducers.MeanReducer())
    assert_same(TripletLoss(miner=None)(emb, labels), oracle(emb, labels), [emb])


@cases
def test_multi_similarity_matches_pml(kind: str, seed: int) -> None:
    emb, labels = make_batch(kind, seed)
    miner = pml_miners.MultiSimilarityMiner(epsilon=0.1)
    oracle = pml_losses.MultiSimilarityLoss(alpha=2, beta=50, base=0.5)
    indices = miner(emb, labels)
    assert len(indices[0]) > 0 and len(indices[2]) > 0
    assert_same(MultiSimilarityLoss()(emb, labels), oracle(emb, labels, indices), [emb])


@cases
def test_multi_similarity_all_pairs_on_distance_matches_pml(kind: str, seed: int) -> None:
    # The mirrored (distance) form of the exponents, checked against pml's margin convention.
    emb, labels = make_batch(kind, seed)
    ours = MultiSimilarityLoss(metric=EuclideanDistance(), base=1.0, miner=None, beta=10)
    oracle = pml_losses.MultiSimilarityLoss(
        alpha=2, beta=10, base=1.0, distance=pml_distances.LpDistance()
    )
    assert_same(ours(emb, labels), oracle(emb, labels), [emb])


# ------------------------------------------------------------- independent brute-force references
def set_relations(sets: list[set[int]]) -> tuple[list[list[bool]], list[list[bool]]]:
    """Positive (intersecting, i ≠ j) and negative (disjoint) relations, from Python sets."""
    n = len(sets)
    pos = [[i != j and bool(sets[i] & sets[j]) for j in range(n)] for i in range(n)]
    neg = [[not (sets[i] & sets[j]) for j in range(n)] for i in range(n)]
    return pos, neg


def ref_contrastive(m: list[list[float]], sets: list[set[int]], mp: float, mn: float) -> float:
    pos, neg = set_relations(sets)
    n = len(sets)
    p = [max(m[i][j] - mp, 0.0) for i in range(n) for j in range(n) if pos[i][j]]
    q = [max(mn - m[i][j], 0.0) for i in range(n) for j in range(n) if neg[i][j]]
    return (sum(p) / len(p) if p else 0.0) + (sum(q) / len(q) if q else 0.0)


def ref_triplet_semihard(m: list[list[float]], sets: list[set[int]], delta: float) -> float:
    pos, neg = set_relations(sets)
    n = len(sets)
    terms = [
        m[a][p] - m[a][k] + delta
        for a in range(n)
        for p in range(n)
        for k in range(n)
        if pos[a][p] and neg[a][k] and m[a][p] < m[a][k] < m[a][p] + delta
    ]
    return sum(terms) / len(terms) if terms else 0.0


def ref_margin_all(m: list[list[float]], sets: list[set[int]], xi: float, omega: float) -> float:
    pos, neg = set_relations(sets)
    n = len(sets)
    terms = []
    for a, p, k in itertools.product(range(n), repeat=3):
        if pos[a][p] and neg[a][k]:
            terms += [max(xi + m[a][p] - omega, 0.0), max(xi - m[a][k] + omega, 0.0)]
    active = sum(t > 0 for t in terms)
    return sum(terms) / active if active else 0.0


def ref_multi_similarity(
    s: list[list[float]], sets: list[set[int]], alpha: float, beta: float, lam: float, eps: float
) -> float:
    pos, neg = set_relations(sets)
    n = len(sets)
    total = 0.0
    for i in range(n):
        ps = [s[i][k] for k in range(n) if pos[i][k]]
        ns = [s[i][k] for k in range(n) if neg[i][k]]
        kept_p = [v for v in ps if ns and v - eps < max(ns)]
        kept_n = [v for v in ns if ps and v + eps > min(ps)]
        total += math.log1p(sum(math.exp(-alpha * (v - lam)) for v in kept_p)) / alpha
        total += math.log1p(sum(math.exp(beta * (v - lam)) for v in kept_n)) / beta
    return total / n


def mixed_batch(seed: int) -> tuple[Embeddings, LabelSets, list[set[int]]]:
    """Originals of 3 classes plus Mixup images with two-label sets, with uncertainty."""
    gen = torch.Generator().manual_seed(seed)
    originals = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])
    labels = LabelSets.from_labels(originals).cat(
        LabelSets.mixed(torch.tensor([0, 1, 2]), torch.tensor([1, 2, 2]))
    )
    sets = [{int(v) for v in row if v >= 0} for row in labels.labels]
    centres = torch.randn(3, DIM, generator=gen, dtype=torch.float64)
    sem = torch.cat(
        [
            centres[originals] + 0.7 * torch.randn(9, DIM, generator=gen, dtype=torch.float64),
            0.5 * (centres[[0, 1, 2]] + centres[[1, 2, 2]]),
        ]
    )
    unc = 0.3 * torch.randn(12, 8, generator=gen, dtype=torch.float64)
    return Embeddings(sem.requires_grad_(True), unc.requires_grad_(True)), labels, sets


ISM_METRICS = {
    "ism-euclidean": lambda: IntrospectiveMetric(EuclideanDistance(), gamma=0.5, tau=5.0),
    "ism-cosine": lambda: IntrospectiveMetric(CosineSimilarity(), gamma=0.5, tau=5.0),
}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("metric_name", ["euclidean", "ism-euclidean"])
def test_distance_losses_with_ism_and_set_labels_match_reference(
    seed: int, metric_name: str
) -> None:
    emb, labels, sets = mixed_batch(seed)
    metric: Metric = (
        EuclideanDistance() if metric_name == "euclidean" else ISM_METRICS[metric_name]()
    )
    m = metric(emb.semantic, ux=emb.uncertainty).tolist()
    # float64 losses vs plain-Python float64 references on the same metric matrix: means of ≤ 12³
    # hinge terms summed in another order, ≲ 10³·ε ≈ 2e-13 relative: rel 1e-9 (also below).
    contrastive = ContrastiveLoss(metric=metric, neg_margin=1.0)(emb, labels)
    assert contrastive.item() == pytest.approx(ref_contrastive(m, sets, 0.0, 1.0), rel=1e-9)
    triplet = TripletLoss(metric=metric, margin=0.3)(emb, labels)
    assert triplet.item() == pytest.approx(ref_triplet_semihard(m, sets, 0.3), rel=1e-9)
    assert triplet.item() > 0
    margin = MarginLoss(metric=metric, miner=None)(emb, labels)
    assert margin.item() == pytest.approx(ref_margin_all(m, sets, 0.2, 1.2), rel=1e-9)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("metric_name", ["cosine", "ism-cosine"])
def test_multi_similarity_with_ism_and_set_labels_matches_reference(
    seed: int, metric_name: str
) -> None:
    emb, labels, sets = mixed_batch(seed)
    metric: Metric = CosineSimilarity() if metric_name == "cosine" else ISM_METRICS[metric_name]()
    s = metric(emb.semantic, ux=emb.uncertainty).tolist()
    loss = MultiSimilarityLoss(metric=metric)(emb, labels)
    # float64 vs a Python float64 reference: log-sum-exps with scale 50 amplify a similarity's ε by
    # 50, ≲ 50·12·ε ≈ 1e-13 relative: rel 1e-9.
    assert loss.item() == pytest.approx(ref_multi_similarity(s, sets, 2, 50, 0.5, 0.1), rel=1e-9)


LOSS_FACTORIES = {
    "contrastive": lambda metric: ContrastiveLoss(metric=metric),
    "margin": lambda metric: MarginLoss(
        metric=metric, miner=DistanceWeightedMiner(generator=torch.Generator().manual_seed(0))
    ),
    "triplet": lambda metric: TripletLoss(metric=metric, margin=0.3),
    "multi_similarity": lambda metric: MultiSimilarityLoss(metric=metric),
}


@pytest.mark.parametrize("metric_name", list(ISM_METRICS))
@pytest.mark.parametrize("loss_name", list(LOSS_FACTORIES))
def test_every_loss_trains_uncertainty_through_ism(loss_name: str, metric_name: str) -> None:
    emb, labels, _ = mixed_batch(0)
    assert emb.uncertainty is not None
    loss = LOSS_FACTORIES[loss_name](ISM_METRICS[metric_name]())(emb, labels)
    g_sem, g_unc = torch.autograd.grad(loss, [emb.semantic, emb.uncertainty])
    assert torch.isfinite(loss)
    assert torch.isfinite(g_sem).all() and torch.isfinite(g_unc).all()
    assert g_unc.abs().sum() > 0, "ISM must pass gradient to the uncertainty embeddings"


@pytest.mark.parametrize("loss_name", list(LOSS_FACTORIES))
def test_ism_without_uncertainty_or_bias_equals_plain_loss(loss_name: str) -> None:
    emb, labels, _ = mixed_batch(1)
    base: Metric = CosineSimilarity() if loss_name == "multi_similarity" else EuclideanDistance()
    ism = IntrospectiveMetric(type(base)(), gamma=0.0)
    assert emb.uncertainty is not None
    zero_u = Embeddings(emb.semantic, torch.zeros_like(emb.uncertainty))
    plain = LOSS_FACTORIES[loss_name](base)(emb.semantic, labels)
    introspective = LOSS_FACTORIES[loss_name](ism)(zero_u, labels)
    # float64, u = 0 and γ = 0 leave the ISM factor at 1 up to a rounding or two: rel 1e-12.
    assert introspective.item() == pytest.approx(plain.item(), rel=1e-12)


@pytest.mark.parametrize("loss_name", list(LOSS_FACTORIES))
def test_every_loss_with_plain_metric_on_mixed_batch_is_finite(loss_name: str) -> None:
    emb, labels, _ = mixed_batch(2)
    metric: Metric = CosineSimilarity() if loss_name == "multi_similarity" else EuclideanDistance()
    loss = LOSS_FACTORIES[loss_name](metric)(emb.semantic, labels)
    (grad,) = torch.autograd.grad(loss, [emb.semantic])
    assert torch.isfinite(loss) and loss > 0 and torch.isfinite(grad).all()


# ------------------------------------------------------------- hand-built Mixup case
def circle(*degrees: float) -> Tensor:
    rad = torch.tensor(degrees, dtype=torch.float64) * math.pi / 180
    return torch.stack([rad.cos(), rad.sin()], dim=1)


def chord(degrees: float) -> float:
    return 2 * math.sin(math.radians(degrees) / 2)


# a (class 0) at 0°, b (class 1) at 90°, m = mix of a and b at 30°, c (class 2) at 180°.
HAND_X = circle(0, 90, 30, 180)
HAND_SETS = LabelSets(torch.tensor([[0, -1], [1, -1], [0, 1], [2, -1]]))
HAND_ONLY_A = LabelSets(torch.tensor([[0], [1], [0], [2]]))


def test_contrastive_treats_mixed_image_as_positive_of_both_classes() -> None:
    loss = ContrastiveLoss()  # m_pos 0, m_neg 0.5: every negative here is farther than 0.5
    # Positive pairs: (a, m), (b, m) in both orders.
    expected = (chord(30) + chord(60)) / 2
    # float64 hand values (chords of unit vectors, a few terms): a few ε, rel 1e-12 (also below).
    assert loss(HAND_X, HAND_SETS).item() == pytest.approx(expected, rel=1e-12)
    # Labelled {0} only, (b, m) becomes a negative at 1.0 > 0.5: only (a, m) costs.
    assert loss(HAND_X, HAND_ONLY_A).item() == pytest.approx(chord(30), rel=1e-12)


def test_triplet_treats_mixed_image_as_positive_of_both_classes() -> None:
    loss = TripletLoss(margin=1.0, miner=None)
    # anchor m: p ∈ {a, b}, n = c;  anchor a: p = m, n ∈ {b, c};  anchor b: p = m, n ∈ {a, c}.
    terms = [
        chord(30) - chord(150) + 1,
        chord(60) - chord(150) + 1,
        chord(30) - chord(90) + 1,
        chord(30) - chord(180) + 1,
        chord(60) - chord(90) + 1,
        chord(60) - chord(90) + 1,
    ]
    expected = sum(max(t, 0.0) for t in terms) / len(terms)
    # float64 hand value from chords/cosines of unit vectors, a few terms: rel 1e-12.
    assert loss(HAND_X, HAND_SETS).item() == pytest.approx(expected, rel=1e-12)


def test_margin_treats_mixed_image_as_positive_of_both_classes() -> None:
    loss = MarginLoss(miner=None, margin=0.2, boundary=0.9)
    ap = [chord(30), chord(60), chord(30), chord(30), chord(60), chord(60)]
    an = [chord(150), chord(150), chord(90), chord(180), chord(90), chord(90)]
    terms = [max(0.2 + d - 0.9, 0.0) for d in ap] + [max(0.2 - d + 0.9, 0.0) for d in an]
    expected = sum(terms) / sum(t > 0 for t in terms)
    # float64 hand value from chords/cosines of unit vectors, a few terms: rel 1e-12.
    assert loss(HAND_X, HAND_SETS).item() == pytest.approx(expected, rel=1e-12)


def test_margin_class_boundary_of_a_mixed_anchor_is_the_mean_of_its_classes() -> None:
    loss = MarginLoss(num_classes=3, miner=None)
    with torch.no_grad():
        loss.boundary.copy_(torch.tensor([1.0, 1.4, 2.0], dtype=torch.float64))
    expected = torch.tensor([1.0, 1.4, 1.2, 2.0], dtype=torch.float64)
    # float64: the mixed anchor's boundary is (1.0 + 1.4)/2, one rounding off 1.2: atol 1e-12.
    torch.testing.assert_close(loss.anchor_boundary(HAND_SETS), expected, rtol=0, atol=1e-12)


def test_multi_similarity_treats_mixed_image_as_positive_of_both_classes() -> None:
    loss = MultiSimilarityLoss(miner=None)
    cos = {deg: math.cos(math.radians(deg)) for deg in (30, 60, 90, 150, 180)}

    def pos(*s: float) -> float:
        return math.log1p(sum(math.exp(-2 * (v - 0.5)) for v in s)) / 2

    def neg(*s: float) -> float:
        return math.log1p(sum(math.exp(50 * (v - 0.5)) for v in s)) / 50

    expected = (
        pos(cos[30]) + neg(cos[90], cos[180])  # a: positive m; negatives b, c
        + pos(cos[60]) + neg(cos[90], cos[90])  # b: positive m; negatives a, c
        + pos(cos[30], cos[60]) + neg(cos[150])  # m: positives a and b; negative c
        + neg(cos[180], cos[90], cos[150])  # c: no positive
    ) / 4  # fmt: skip
    # float64 hand value from chords/cosines of unit vectors, a few terms: rel 1e-12.
    assert loss(HAND_X, HAND_SETS).item() == pytest.approx(expected, rel=1e-12)


# ------------------------------------------------------------- bad input and edge cases
ALL_LOSSES = [ContrastiveLoss, MarginLoss, TripletLoss, MultiSimilarityLoss]


@pytest.mark.parametrize("loss_cls", ALL_LOSSES)
def test_mismatched_labels_raise(loss_cls: type) -> None:
    with pytest.raises(ValueError, match="labels"):
        loss_cls()(torch.randn(6, 4), torch.tensor([0, 0, 1, 1]))


@pytest.mark.parametrize("loss_cls", ALL_LOSSES)
def test_nan_embeddings_raise(loss_cls: type) -> None:
    x = torch.randn(4, 4)
    x[2, 1] = float("nan")
    with pytest.raises(ValueError, match="embeddings"):
        loss_cls()(x, torch.tensor([0, 0, 1, 1]))


@pytest.mark.parametrize("loss_cls", ALL_LOSSES)
def test_wrong_shapes_raise(loss_cls: type) -> None:
    with pytest.raises(ValueError, match="embeddings"):
        loss_cls()(torch.randn(4), torch.tensor([0, 0, 1, 1]))
    with pytest.raises(ValueError, match="uncertainty"):
        loss_cls()(Embeddings(torch.randn(4, 3), torch.randn(3, 3)), torch.tensor([0, 0, 1, 1]))


@pytest.mark.parametrize("loss_cls", ALL_LOSSES)
def test_batch_without_positives_gives_zero_with_a_graph(loss_cls: type) -> None:
    x = torch.randn(4, 8, requires_grad=True)
    loss = loss_cls()(x, torch.arange(4))
    loss.backward()
    assert loss.item() >= 0 and x.grad is not None and torch.isfinite(x.grad).all()
    if loss_cls is not ContrastiveLoss:  # contrastive still pushes negatives apart
        assert loss.item() == 0.0


@pytest.mark.parametrize(
    ("factory", "match"),
    [
        (lambda: ContrastiveLoss(pos_margin=float("nan")), "pos_margin"),
        (lambda: ContrastiveLoss(pos_margin=0.6), "cross for a distance"),
        (lambda: ContrastiveLoss(pos_margin=0.3, neg_margin=0.2), "pos_margin ≤ neg_margin"),
        (lambda: ContrastiveLoss(CosineSimilarity(), pos_margin=0.8), "cross for a similarity"),
        (lambda: TripletLoss(margin=-0.1), "margin"),
        (lambda: TripletLoss(margin=0.0), "semi-hard window"),
        (lambda: MarginLoss(boundary=0.0), "boundary"),
        (lambda: MarginLoss(num_classes=0), "num_classes"),
        (lambda: MultiSimilarityLoss(alpha=0), "alpha"),
        (lambda: MultiSimilarityLoss(beta=float("inf")), "beta"),
        # Bad input on purpose: neither is a miner nor "default".
        (lambda: MultiSimilarityLoss(miner="hardest"), "miner"),  # type: ignore[arg-type]
        (lambda: TripletLoss(miner=object()), "miner"),  # type: ignore[arg-type]
    ],
)
def test_bad_hyper_parameters_raise(factory: Callable[[], object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        factory()


def test_contrastive_margins_may_meet_but_not_cross() -> None:
    """Positives pulled inside m_pos, negatives pushed past m_neg: with m_pos = m_neg = 0.5 the loss
    is 0 only when every positive is nearer than every negative (the boundary between them); past
    that, a positive and a negative at the same distance both cost nothing."""
    x = torch.tensor([[1.0, 0.0], [0.6, 0.8], [0.0, 1.0]], dtype=torch.float64)
    labels = torch.tensor([0, 0, 1])
    # The positive pair at √0.8 costs √0.8 − 0.5 (both orders); the negatives at √0.4 ≈ 0.632 and
    # √2 lie past 0.5 and cost nothing.
    met = ContrastiveLoss(pos_margin=0.5, neg_margin=0.5)(x, labels)
    # float64, one square root and a mean of 2 equal terms: rel 1e-12.
    assert met.item() == pytest.approx(math.sqrt(0.8) - 0.5, rel=1e-12)
    assert ContrastiveLoss(CosineSimilarity(), pos_margin=0.875).pos_margin == 0.875


def test_triplet_with_zero_margin_over_all_triplets() -> None:
    x = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.6, 0.8], [0.0, 1.0]], dtype=torch.float64)
    # 8 triplets; only anchors 1 and 2 have a negative (D = √0.08) closer than their positive
    # (D = √0.4); the other negatives are at √0.8 or √2.
    loss = TripletLoss(margin=0.0, miner=None)(x, torch.tensor([0, 0, 1, 1]))
    # float64, two square roots and a mean of 8: a few ε, rel 1e-12.
    assert loss.item() == pytest.approx(2 * (math.sqrt(0.4) - math.sqrt(0.08)) / 8, rel=1e-12)


def test_margin_label_out_of_range_for_class_boundaries_raises() -> None:
    with pytest.raises(ValueError, match="labels"):
        MarginLoss(num_classes=2, miner=None)(torch.randn(4, 8), torch.tensor([0, 0, 2, 2]))


def test_default_hyper_parameters_follow_spec() -> None:
    c = ContrastiveLoss()
    assert (c.pos_margin, c.neg_margin) == (0.0, 0.5)
    m = MarginLoss()
    # Exact: the boundary is a float64 torch.full of 1.2, the same double as the literal.
    assert m.margin == 0.2 and m.boundary.tolist() == [1.2]
    assert isinstance(m.miner, DistanceWeightedMiner)
    assert (m.miner.cutoff, m.miner.nonzero_loss_cutoff) == (0.5, 1.4)
    t = TripletLoss()
    assert t.margin == 0.1 and isinstance(t.miner, SemiHardMiner) and t.miner.margin == 0.1
    ms = MultiSimilarityLoss()
    assert (ms.alpha, ms.beta, ms.base) == (2.0, 50.0, 0.5)
    assert isinstance(ms.metric, CosineSimilarity)
    assert isinstance(ms.miner, MultiSimilarityMiner) and ms.miner.epsilon == 0.1
