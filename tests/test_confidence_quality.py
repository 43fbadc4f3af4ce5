"""R-AUROC, AURC, selective R@1 and ECE against brute force, and the evaluation report's confidence.

Tolerances: every quantity here is a float64 ratio of counts or a mean of at most a few hundred
such ratios or probabilities (each ≤ 1), so implementations that sum in different orders agree to
a few ε; 1e-12 is far above that and far below any real difference (≥ 1/(n_wrong·n_right) ≈ 1e-4
for AUROC, ≥ 1/n for the others).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from idml.evaluation import EvaluationSettings, evaluate_embeddings
from idml.evaluation.confidence import (
    aurc,
    error_auroc,
    oracle_aurc,
    r_auroc,
    score_quality,
    selective_accuracy,
)
from idml.evaluation.reliability import probability_bins
from idml.evaluation.reranking import KReciprocal


def _brute_auroc(uncertainty: list[float], errors: list[bool]) -> float:
    wrong = [u for u, e in zip(uncertainty, errors, strict=True) if e]
    right = [u for u, e in zip(uncertainty, errors, strict=True) if not e]
    wins = sum((a > b) + 0.5 * (a == b) for a, b in itertools.product(wrong, right))
    return wins / (len(wrong) * len(right))


def _brute_aurc(confidence: list[float], errors: list[bool]) -> float:
    """mean_i (errors among {j: c_j ≥ c_i}) / |{j: c_j ≥ c_i}|."""
    total = 0.0
    for c in confidence:
        kept = [e for d, e in zip(confidence, errors, strict=True) if d >= c]
        total += sum(kept) / len(kept)
    return total / len(confidence)


def _brute_selective(confidence: list[float], errors: list[bool], coverage: float) -> float:
    """Mean accuracy of the m most confident over every order of the tied answers."""
    n = len(confidence)
    m = math.ceil(round(coverage * n, 9))
    accuracies = []
    for order in itertools.permutations(range(n)):
        ranked = sorted(order, key=lambda i: -confidence[i])  # stable: ties in this order
        accuracies.append(sum(not errors[i] for i in ranked[:m]) / m)
    return sum(accuracies) / len(accuracies)


def test_auroc_and_aurc_hand_cases() -> None:
    # Perfect, reversed and uninformative scores.
    errors = torch.tensor([True, True, False, False])
    assert error_auroc(torch.tensor([3.0, 2.0, 1.0, 0.0]), errors) == 1.0
    assert error_auroc(torch.tensor([0.0, 1.0, 2.0, 3.0]), errors) == 0.0
    assert error_auroc(torch.ones(4), errors) == 0.5
    # R-AUROC is the same area seen from the confidence: larger = surer.
    assert r_auroc(torch.tensor([0.0, 1.0, 2.0, 3.0]), errors) == 1.0
    # Answer the two right ones first: risks 0, 0, 1/3, 1/2.
    assert aurc(torch.tensor([0.0, 0.1, 0.9, 0.8]), errors) == pytest.approx(
        (1 / 3 + 1 / 2) / 4, abs=1e-15
    )
    assert oracle_aurc(errors) == pytest.approx((1 / 3 + 1 / 2) / 4, abs=1e-15)
    # All tied: every coverage level is the whole set, risk 1/2.
    assert aurc(torch.ones(4), errors) == pytest.approx(0.5)
    assert math.isnan(error_auroc(torch.rand(3), torch.zeros(3, dtype=torch.bool)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auroc_and_aurc_against_brute_force_with_ties(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    n = 37
    scores = torch.randint(0, 6, (n,), generator=g).double()  # many ties
    errors = torch.rand(n, generator=g) < 0.4
    s, e = scores.tolist(), errors.tolist()
    assert error_auroc(scores, errors) == pytest.approx(_brute_auroc(s, e), abs=1e-12)
    assert r_auroc(scores, errors) == pytest.approx(_brute_auroc([-v for v in s], e), abs=1e-12)
    assert aurc(scores, errors) == pytest.approx(_brute_aurc(s, e), abs=1e-12)
    assert oracle_aurc(errors) <= aurc(scores, errors) + 1e-12
    quality = score_quality(errors, {"a": scores, "b": 2 * scores + 1})
    # A monotone transform changes neither (the same float64 computation on equal ranks).
    assert quality["a"] == quality["b"]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_selective_accuracy_against_every_order_of_the_ties(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    confidence = torch.randint(0, 3, (7,), generator=g).double()
    errors = torch.rand(7, generator=g) < 0.5
    for coverage in (0.2, 0.5, 0.7, 1.0):
        expected = _brute_selective(confidence.tolist(), errors.tolist(), coverage)
        assert selective_accuracy(confidence, errors, coverage) == pytest.approx(
            expected, abs=1e-12
        )


def test_ece_and_reliability_diagram_against_brute_force() -> None:
    g = torch.Generator().manual_seed(4)
    p = torch.rand(500, generator=g).double()
    p[:5] = torch.tensor([0.0, 1.0, 1 / 15, 2 / 15, 0.5])  # bin edges: ((m−1)/M, m/M]
    right = torch.rand(500, generator=g) < p
    bins = probability_bins(p, right, 15)
    total = 0.0
    for m in range(15):
        low, high = m / 15, (m + 1) / 15
        member = [i for i in range(500) if (low < p[i] <= high) or (m == 0 and p[i] == 0)]
        if member:
            conf = sum(float(p[i]) for i in member) / len(member)
            acc = sum(bool(right[i]) for i in member) / len(member)
            total += len(member) / 500 * abs(acc - conf)
            assert float(bins.accuracy[m]) == pytest.approx(acc, abs=1e-12)
        assert int(bins.counts[m]) == len(member)
    assert bins.ece == pytest.approx(total, abs=1e-12)
    assert len(bins.to_dict()["mean_confidence"]) == 15


# --------------------------------------------------------------------------- in the evaluation
def _clusters(n: int = 150, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % 6
    x = torch.randn(n, 8, generator=g) + 2 * torch.nn.functional.one_hot(labels, 8)
    return x, labels, torch.randn(n, 3, generator=g)


def test_evaluation_reports_every_score_against_the_top1_answers() -> None:
    x, labels, u = _clusters()
    report = evaluate_embeddings(x, labels, EvaluationSettings(nmi=False), uncertainty=u)
    metrics = report.metrics
    scores = ("top1", "margin@10", "agreement@5", "agreement@10", "csls@10", "norm_u")
    for key in scores:
        assert f"r_auroc_{key}" in metrics and f"aurc_{key}" in metrics
    assert report.confidence is not None and report.confidence.kind == "top1"
    assert report.settings["confidence_kind"] == "top1"
    assert "ece" not in metrics  # only a calibrated confidence has one
    correct = report.confidence.correct
    top1 = report.retrieval.neighbor_indices[:, 0]
    assert correct.tolist() == (labels[top1] == labels).double().tolist()
    errors = (correct == 0).tolist()
    for key in ("top1", "norm_u"):
        values = report.confidence.values[key]
        assert metrics[f"r_auroc_{key}"] == pytest.approx(
            _brute_auroc((-values).tolist(), errors), abs=1e-12
        )
    assert metrics["r_auroc_norm_u"] == pytest.approx(
        _brute_auroc(u.norm(dim=1).double().tolist(), errors), abs=1e-12
    )
    assert metrics["selective_recall@1_cov90"] == pytest.approx(
        selective_accuracy(report.confidence.values["top1"], correct == 0, 0.9), abs=1e-12
    )
    plain = evaluate_embeddings(x, labels, EvaluationSettings(nmi=False))
    assert "r_auroc_norm_u" not in plain.metrics and "r_auroc_top1" in plain.metrics
    assert (
        "r_auroc_top1"
        not in evaluate_embeddings(
            x, labels, EvaluationSettings(nmi=False, confidence=None)
        ).metrics
    )


def test_a_query_whose_class_the_gallery_lacks_is_left_out() -> None:
    x, labels, _ = _clusters()
    query = (x[:10], torch.cat([labels[:9], torch.tensor([99])]))
    report = evaluate_embeddings(x[10:], labels[10:], EvaluationSettings(nmi=False), query=query)
    assert report.confidence is not None
    assert math.isnan(float(report.confidence.correct[9]))
    assert not math.isnan(float(report.confidence.values["top1"][9]))  # it still has a confidence


def test_re_ranking_with_lambda_one_reports_the_plain_metrics() -> None:
    """k-reciprocal with λ = 1 is the cosine order: the re-ranked lists give the same R@1 and
    MAP@R (from lists deep enough for every R) as the exact search's ranks."""
    x, labels, _ = _clusters(120, seed=2)
    plain = evaluate_embeddings(x, labels, EvaluationSettings(nmi=False))
    same = evaluate_embeddings(
        x, labels, EvaluationSettings(nmi=False, reranking=KReciprocal(lambda_value=1.0))
    )
    for key in ("recall@1", "recall@4", "map@r", "r_precision", "r_auroc_top1"):
        assert same.metrics[key] == pytest.approx(plain.metrics[key], abs=1e-12), key
    assert "map" not in same.metrics  # ranks past the lists are unknown
    assert same.settings["reranking"].startswith("k_reciprocal")
    with pytest.raises(ValueError, match="re-ranking works on the exact search's cosine"):
        EvaluationSettings(metric="euclidean", reranking=KReciprocal())


def test_confidence_with_query_and_gallery_roles() -> None:
    """With roles the report's neighbours are rows of the embeddings; the confidence is judged on
    the same answers (the top-1 row's label against the query's)."""
    x, labels, _ = _clusters(90, seed=3)
    roles = ["query" if i % 4 == 0 else "gallery" for i in range(90)]
    report = evaluate_embeddings(x, labels, EvaluationSettings(nmi=False), roles=roles)
    assert report.confidence is not None
    queries = torch.tensor([i for i in range(90) if i % 4 == 0])
    top1_rows = report.retrieval.neighbor_indices[:, 0]
    assert all(roles[int(r)] == "gallery" for r in top1_rows)
    expected = (labels[top1_rows] == labels[queries]).double()
    assert report.confidence.correct.tolist() == expected.tolist()
