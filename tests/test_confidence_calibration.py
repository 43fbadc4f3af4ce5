"""Calibrators: the logistic fit is the penalised maximum-likelihood optimum, isotonic matches
scikit-learn, the JSON file round-trips exactly and bad files are explained, and the evaluation
reports ECE and abstention outcomes of a calibrated confidence.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.isotonic import IsotonicRegression

from idml.evaluation import EvaluationSettings, evaluate_embeddings
from idml.evaluation.confidence import (
    AnswerNeighbors,
    ConfidenceCalibration,
    IsotonicCalibrator,
    KnnAgreement,
    LabelMargin,
    LogisticCalibrator,
    Top1Similarity,
    answer_confidence,
    candidate_thresholds,
    fit_calibration,
    precision_threshold,
    score_matrix,
)
from idml.evaluation.reliability import probability_bins
from idml.evaluation.search import NeighborLists

FEATURES = (Top1Similarity(), LabelMargin(3), KnnAgreement(3))


def _answers(n: int, seed: int) -> tuple[AnswerNeighbors, torch.Tensor]:
    """Random sorted lists over a 40-reference gallery of 4 classes; "right" more likely when the
    top-1 stands out and its label agrees with the others."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(n, 3, generator=g).sort(1, descending=True).values
    ids = torch.randint(0, 40, (n, 3), generator=g)
    answers = AnswerNeighbors.from_search(NeighborLists(ids, scores), torch.arange(40) % 4)
    x = score_matrix(answers, FEATURES)
    logit = -2 + 3 * x[:, 0] + 4 * x[:, 1] + 1.5 * x[:, 2]
    right = torch.rand(n, generator=g).double() < torch.sigmoid(logit)
    return answers, right


def _gradient(cal: LogisticCalibrator, x: torch.Tensor, right: torch.Tensor):
    """The gradient of Σ log-loss + ½‖w‖² in (w, b) on the standardised features."""
    z = (x - torch.tensor(cal.mean, dtype=torch.float64)) / torch.tensor(
        cal.scale, dtype=torch.float64
    )
    residual = right.double() - cal.predict(x)
    weights = torch.tensor(cal.weights, dtype=torch.float64)
    return weights - z.T @ residual, -float(residual.sum())


def test_logistic_fit_is_the_constrained_penalised_likelihood_optimum() -> None:
    """KKT conditions of min Σ log-loss + ½‖w‖² over w ≥ 0 (b free): the gradient vanishes in b
    and in every positive weight and is ≥ 0 where a weight sits at 0. L-BFGS-B stops at a
    projected gradient of 1e-10 on sums of 600 terms ≤ 1: checked at 1e-5. A useless (negatively
    related) score is given weight 0."""
    answers, right = _answers(600, 0)
    useless = score_matrix(answers, FEATURES)
    x = torch.cat([useless, -useless[:, :1]], dim=1)  # the top-1 similarity, negated
    cal = LogisticCalibrator.fit((*FEATURES, FEATURES[0]), x, right)
    grad_w, grad_b = _gradient(cal, x, right)
    assert abs(grad_b) < 1e-5
    for w, g in zip(cal.weights, grad_w.tolist(), strict=True):
        assert (abs(g) < 1e-5) if w > 0 else (g > -1e-5)
    assert cal.weights[-1] == 0.0 and min(cal.weights[:3]) > 0
    torch.testing.assert_close(
        torch.tensor(cal.mean, dtype=torch.float64), x.mean(0), atol=1e-12, rtol=0
    )


def test_logistic_fit_matches_scikit_learn_when_the_constraint_is_idle() -> None:
    """With every score positively related, the non-negativity bound is inactive and the fit is
    scikit-learn's penalised logistic regression (both optimise to ~1e-10: weights at 1e-6)."""
    from sklearn.linear_model import LogisticRegression

    answers, right = _answers(800, 5)
    x = score_matrix(answers, FEATURES)
    cal = LogisticCalibrator.fit(FEATURES, x, right)
    z = (x - x.mean(0)) / x.std(0, unbiased=False)
    reference = LogisticRegression(C=1.0, tol=1e-12, max_iter=100_000).fit(z.numpy(), right.numpy())
    np.testing.assert_allclose(cal.weights, reference.coef_[0], atol=1e-6)
    assert cal.bias == pytest.approx(float(reference.intercept_[0]), abs=1e-6)


def test_isotonic_matches_scikit_learn() -> None:
    answers, right = _answers(400, 1)
    x = score_matrix(answers, (LabelMargin(3),))
    cal = IsotonicCalibrator.fit((LabelMargin(3),), x, right)
    reference = IsotonicRegression(y_min=0.0, y_max=1.0, out_of_bounds="clip").fit(
        x[:, 0].numpy(), right.double().numpy()
    )
    probe = torch.linspace(-0.2, 1.2, 301, dtype=torch.float64).unsqueeze(1)
    # Both interpolate the same float64 breakpoints linearly: equal to rounding (1e-12).
    np.testing.assert_allclose(
        cal.predict(probe).numpy(), reference.predict(probe[:, 0].numpy()), atol=1e-12
    )
    assert bool(torch.isnan(cal.predict(torch.tensor([[math.nan]])))[0])


@pytest.mark.parametrize("calibrator", [LogisticCalibrator, IsotonicCalibrator])
def test_calibration_file_round_trip(calibrator, tmp_path: Path) -> None:
    answers, right = _answers(500, 2)
    features = FEATURES if calibrator is LogisticCalibrator else (KnnAgreement(3),)
    cal = fit_calibration(answers, right, features, calibrator, provenance={"source": "synthetic"})
    path = cal.save(tmp_path / "calibration.json")
    data = json.loads(path.read_text())
    assert data["format"] == "idml.confidence_calibration" and data["version"] == 1
    assert data["calibrator"]["features"] == [f.key for f in features]
    loaded = ConfidenceCalibration.load(path)
    # JSON writes float64 with repr precision: the loaded calibrator is the same function.
    assert torch.equal(loaded.confidence(answers), cal.confidence(answers))
    assert loaded.calibrator == cal.calibrator and loaded.provenance == {"source": "synthetic"}
    assert torch.equal(loaded.testing_set.confidence, cal.testing_set.confidence)
    assert loaded.threshold(0.8) == cal.threshold(0.8)
    # The threshold is certified on the testing half with candidates from the ordering half.
    direct = precision_threshold(
        cal.testing_set.confidence,
        cal.testing_set.correct,
        candidate_thresholds(cal.ordering_set.confidence, cal.ordering_set.correct, 0.8),
        0.8,
    )
    assert cal.threshold(0.8) == direct
    # The halves split the usable queries.
    assert len(cal.ordering_set.correct) + len(cal.testing_set.correct) == 500


def test_bad_calibration_files_are_explained(tmp_path: Path) -> None:
    answers, right = _answers(300, 3)
    good = fit_calibration(answers, right, FEATURES).to_dict()
    cases = {
        "other.json": ({"format": "something"}, "not an idml confidence calibration"),
        "future.json": ({**good, "version": 2}, "version 2 is not supported"),
        "kind.json": (
            {**good, "calibrator": {**good["calibrator"], "kind": "svm"}},
            "unknown calibrator kind 'svm'",
        ),
        "feature.json": (
            {
                **good,
                "calibrator": {
                    **good["calibrator"],
                    "features": ["cosine", "margin@3", "agreement@3"],
                },
            },
            "unknown confidence score 'cosine'",
        ),
        "short.json": (
            {**good, "calibrator": {**good["calibrator"], "weights": [1.0]}},
            "one mean, scale and weight per feature",
        ),
    }
    for name, (data, message) in cases.items():
        (tmp_path / name).write_text(json.dumps(data))
        with pytest.raises(ValueError, match=message) as error:
            ConfidenceCalibration.load(tmp_path / name)
        assert name in str(error.value)
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        ConfidenceCalibration.load(tmp_path / "broken.json")
    with pytest.raises(ValueError, match="no such calibration file"):
        ConfidenceCalibration.load(tmp_path / "missing.json")


def test_fit_needs_right_and_wrong_answers_and_the_fallback_says_what_it_is() -> None:
    answers, right = _answers(100, 4)
    with pytest.raises(ValueError, match=r"\(50 right, 0 wrong\).*at least 5 right and 5 wrong"):
        fit_calibration(answers, torch.ones(100, dtype=torch.bool), FEATURES)
    few = torch.ones(100, dtype=torch.bool)
    few[:4] = False  # four wrong answers in all: fewer than 5 in the fit half, whatever the split
    with pytest.raises(ValueError, match="at least 5 right and 5 wrong"):
        fit_calibration(answers, few, FEATURES)
    with pytest.raises(ValueError, match="calibrator must be one of LogisticCalibrator"):
        fit_calibration(answers, right, FEATURES, dict)  # type: ignore[arg-type]
    fallback = answer_confidence(answers)
    assert fallback.kind == "top1" and torch.equal(fallback.values, Top1Similarity()(answers))
    assert answer_confidence(answers, fallback=KnnAgreement(3)).kind == "agreement@3"
    calibrated = answer_confidence(answers, fit_calibration(answers, right, FEATURES))
    assert calibrated.kind == "calibrated"
    assert bool(((calibrated.values > 0) & (calibrated.values < 1)).all())


def test_evaluation_with_a_calibration_reports_ece_and_abstention() -> None:
    g = torch.Generator().manual_seed(0)
    labels = torch.arange(400) % 8
    x = torch.randn(400, 8, generator=g) + 1.5 * torch.nn.functional.one_hot(labels, 8)
    # Calibrate on classes 0-3, evaluate on the unseen classes 4-7 (the intended use).
    seen = labels < 4
    validation = evaluate_embeddings(x[seen], labels[seen], EvaluationSettings(nmi=False))
    assert validation.confidence is not None
    cal = validation.confidence.fit_calibration()
    report = evaluate_embeddings(
        x[~seen], labels[~seen], EvaluationSettings(nmi=False), calibration=cal
    )
    metrics = report.metrics
    assert report.confidence is not None and report.confidence.kind == "calibrated"
    assert "r_auroc_calibrated" in metrics and "ece" in metrics
    confidence, correct = report.confidence.values["calibrated"], report.confidence.correct
    assert metrics["ece"] == pytest.approx(
        probability_bins(confidence, correct == 1).ece, abs=1e-12
    )
    for target in (0.8, 0.9, 0.95):
        threshold = cal.threshold(target)
        answered = confidence >= threshold.threshold
        coverage = float(answered.double().mean())
        assert metrics[f"conformal_coverage@{target:g}"] == pytest.approx(coverage, abs=1e-12)
        if answered.any():
            precision = float(correct[answered].mean())
            assert metrics[f"conformal_precision@{target:g}"] == pytest.approx(precision, abs=1e-12)
    data = json.loads(report.to_json())
    assert data["confidence"]["confidence_kind"] == "calibrated"
    assert len(data["confidence"]["reliability_diagram"]["counts"]) == 15
    assert set(data["confidence"]["thresholds"]) == {"0.8", "0.9", "0.95"}
