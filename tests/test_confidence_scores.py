"""Confidence scores against brute force: hand-computed lists, then dense score matrices.

The brute-force side ranks a dense float32 similarity matrix (the same products as the search's
tiles on these small sets: one matrix product per pair set) by score descending, index ascending
on ties, and applies each score's definition literally with Python loops. Scores are compared at
1e-6: they are sums and means of at most 10 float32 similarities of unit vectors (≤ 1 each) done
in float64 on one side and in another order on the other, a few float32 ulps (6e-8) apart.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from idml.evaluation.confidence import (
    AnswerNeighbors,
    HubnessCorrectedSimilarity,
    KnnAgreement,
    LabelMargin,
    NegativeUncertaintyLevel,
    ReferenceHubness,
    Top1Similarity,
    score_from_key,
)
from idml.evaluation.search import NeighborLists, exact_search, neighbors_only

TOL = 1e-6


def _answers(indices, scores, labels=None, **kwargs) -> AnswerNeighbors:
    lists = NeighborLists(torch.tensor(indices), torch.tensor(scores))
    ref = None if labels is None else torch.tensor(labels)
    return AnswerNeighbors.from_search(lists, ref, **kwargs)


def test_scores_on_hand_made_lists() -> None:
    # Query 0: neighbours 0 (label 7), 1 (label 8), 2 (label 7), 3 (label 7); scores tie at 0.75.
    # Query 1: every neighbour of label 7 (a single-class neighbourhood).
    # Query 2: no neighbour at all (an empty gallery row): NaN everywhere.
    answers = _answers(
        [[0, 1, 2, 3], [0, 2, 3, 4], [-1, -1, -1, -1]],
        [[1.0, 0.75, 0.75, 0.25], [0.5, 0.5, 0.25, 0.0], [0.0] * 4],
        [7, 8, 7, 7, 7],
    )
    assert Top1Similarity()(answers)[:2].tolist() == [1.0, 0.5]
    # The best other-label score is 0.75; with none in the list, the last score bounds it.
    assert LabelMargin(4)(answers)[:2].tolist() == [0.25, 0.5]
    assert LabelMargin(2)(answers)[:2].tolist() == [0.25, 0.0]  # 0.5 − 0.5 (k-th score)
    assert KnnAgreement(4)(answers)[:2].tolist() == [0.75, 1.0]
    assert KnnAgreement(1)(answers)[:2].tolist() == [1.0, 1.0]
    for score in (Top1Similarity(), LabelMargin(4), KnnAgreement(4)):
        assert torch.isnan(score(answers)[2])


def test_csls_and_uncertainty_by_hand() -> None:
    # References 0, 1 have mean 2-NN scores 0.5 and 0.25 (hubness).
    gallery = NeighborLists(
        torch.tensor([[1, 2], [0, 2], [0, 1]]),
        torch.tensor([[0.75, 0.25], [0.25, 0.25], [0.5, 0.5]]),
    )
    hub = ReferenceHubness.from_neighbors(gallery, 2)
    assert hub.values.tolist() == [0.5, 0.25, 0.5]
    answers = _answers(
        [[0, 1], [1, 0]],
        [[0.75, 0.25], [0.75, 0.5]],
        hubness=hub,
        uncertainty_level=torch.tensor([2.0, 0.5]),
    )
    # 2·0.75 − mean(0.75, 0.25) − r(0) = 1.5 − 0.5 − 0.5; 1.5 − 0.625 − 0.25.
    assert HubnessCorrectedSimilarity(2)(answers).tolist() == [0.5, 0.625]
    assert NegativeUncertaintyLevel()(answers).tolist() == [-2.0, -0.5]


def _brute_scores(sim: torch.Tensor, ref_labels: list[int], same_set: bool, k: int, gallery_sim):
    """Each score by definition from dense similarities (module docstring)."""
    out: dict[str, list[float]] = {"top1": [], "margin": [], "agreement": [], "csls": []}

    def ranked(row: torch.Tensor, exclude: int | None) -> list[int]:
        return sorted(
            (j for j in range(len(row)) if j != exclude), key=lambda j: (-float(row[j]), j)
        )

    def mean_top(row: torch.Tensor, exclude: int | None) -> float:
        order = ranked(row, exclude)[:k]
        return sum(float(row[j]) for j in order) / len(order)

    for q in range(sim.shape[0]):
        order = ranked(sim[q], q if same_set else None)[:k]
        s = [float(sim[q, j]) for j in order]
        y = [ref_labels[j] for j in order]
        out["top1"].append(s[0])
        others = [v for v, lab in zip(s, y) if lab != y[0]]
        out["margin"].append(s[0] - (max(others) if others else s[-1]))
        out["agreement"].append(sum(lab == y[0] for lab in y) / len(y))
        hub = mean_top(gallery_sim[order[0]], order[0])
        out["csls"].append(2 * s[0] - sum(s) / len(s) - hub)
    return out


def _compare(answers: AnswerNeighbors, expected: dict[str, list[float]], k: int) -> None:
    got = {
        "top1": Top1Similarity()(answers),
        "margin": LabelMargin(k)(answers),
        "agreement": KnnAgreement(k)(answers),
        "csls": HubnessCorrectedSimilarity(k)(answers),
    }
    for key, values in expected.items():
        assert got[key].tolist() == pytest.approx(values, abs=TOL), key


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_scores_against_brute_force_with_ties_and_duplicates(seed: int) -> None:
    """A same-set gallery with exact duplicates (tied scores) and coarse coordinates."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(-2, 3, (20, 4), generator=g).float()
    x = F.normalize(
        torch.cat([base, base[:8]]) + 0.01 * (torch.arange(28) % 3 == 0).float()[:, None], dim=1
    )
    labels = (torch.arange(28) % 4).tolist()
    k = 6
    sim = x @ x.T
    out = exact_search(x, torch.tensor(labels), k)
    hub = ReferenceHubness.from_neighbors(out.neighbors, k)
    answers = AnswerNeighbors.from_search(out.neighbors, torch.tensor(labels), hub)
    _compare(answers, _brute_scores(sim, labels, True, k, sim), k)


def test_single_class_gallery_and_absent_query_class() -> None:
    """Separate queries against a gallery of one class (agreement 1, margin bounded by the k-th
    score), and a query whose class the gallery lacks: scores never read the query's label."""
    g = torch.Generator().manual_seed(5)
    gallery = F.normalize(torch.randn(15, 5, generator=g), dim=1)
    queries = F.normalize(torch.randn(6, 5, generator=g), dim=1)
    ref_labels = [3] * 15
    k = 5
    lists = exact_search(
        queries, torch.tensor([3, 3, 3, 9, 9, 9]), k, gallery, torch.tensor(ref_labels)
    ).neighbors
    hub = ReferenceHubness.from_neighbors(neighbors_only(gallery, k), k)
    answers = AnswerNeighbors.from_search(lists, torch.tensor(ref_labels), hub)
    expected = _brute_scores(queries @ gallery.T, ref_labels, False, k, gallery @ gallery.T)
    _compare(answers, expected, k)
    assert KnnAgreement(k)(answers).tolist() == [1.0] * 6


def test_scores_explain_what_they_miss() -> None:
    answers = _answers([[0, 1]], [[0.5, 0.25]])
    with pytest.raises(ValueError, match="needs the labels of the references"):
        LabelMargin(2)(answers)
    with pytest.raises(ValueError, match="hubness at k=2"):
        HubnessCorrectedSimilarity(2)(answers)
    with pytest.raises(ValueError, match="uncertainty level"):
        NegativeUncertaintyLevel()(answers)
    labelled = _answers([[0, 1]], [[0.5, 0.25]], [0, 1, 1, 1])
    with pytest.raises(ValueError, match="reads 5 neighbours per query but the lists hold 2"):
        KnnAgreement(5)(labelled)
    # A gallery of three references holds at most two other ones: k beyond that is fine.
    assert KnnAgreement(5)(_answers([[0, 1]], [[0.5, 0.25]], [0, 1, 1])).tolist() == [0.5]


def test_score_keys_round_trip_and_bad_keys_are_explained() -> None:
    for score in (
        Top1Similarity(),
        LabelMargin(3),
        KnnAgreement(7),
        HubnessCorrectedSimilarity(4),
        NegativeUncertaintyLevel(),
    ):
        assert score_from_key(score.key) == score
    with pytest.raises(
        ValueError,
        match=r"unknown confidence score 'cosine'; known: agreement@k, csls@k, margin@k, norm_u, top1",
    ):
        score_from_key("cosine")
    with pytest.raises(ValueError, match="write it agreement@k"):
        score_from_key("agreement")
    with pytest.raises(ValueError, match="takes no @k"):
        score_from_key("top1@3")
    with pytest.raises(ValueError, match="k must be an integer >= 1"):
        LabelMargin(0)


def test_registration_takes_k_only_through_neighbour_score() -> None:
    """A score's one parameter is ``k``, and only a :class:`NeighbourScore` (whose ``key`` and
    ``depth`` carry it) may have it: a ``k`` elsewhere would never reach the key or the search
    depth."""
    from dataclasses import dataclass

    from idml.evaluation.confidence import CONFIDENCE_SCORES, ConfidenceScore, register_score
    from idml.evaluation.confidence.base import NeighbourScore

    @dataclass(frozen=True)
    class StrayK(Top1Similarity):
        name = "stray_k"
        k: int = 3

    @dataclass(frozen=True)
    class TwoParameters(NeighbourScore):
        name = "two_parameters"
        weight: float = 1.0

        def __call__(self, answers: AnswerNeighbors) -> torch.Tensor:
            return answers.scores[:, 0].double()

    for cls in (StrayK, TwoParameters):
        with pytest.raises(ValueError, match="only parameter is k, in a NeighbourScore"):
            register_score(cls)
        assert cls.name not in CONFIDENCE_SCORES
    assert issubclass(CONFIDENCE_SCORES["margin"], NeighbourScore)
    assert (LabelMargin(3).key, LabelMargin(3).depth) == ("margin@3", 3)
    assert (Top1Similarity().key, Top1Similarity().depth) == ("top1", 1)
    assert not issubclass(CONFIDENCE_SCORES["top1"], NeighbourScore)
    assert issubclass(CONFIDENCE_SCORES["top1"], ConfidenceScore)
