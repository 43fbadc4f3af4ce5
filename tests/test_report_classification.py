"""The report's analysis of classification runs: reliability bins, confusion matrix, selective
classification, metric units, the page, ``idml report`` and ``idml embed`` with logits."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from idml.app.metric_display import (
    format_delta,
    format_metric,
    metric_direction,
    metric_heading,
    metric_unit,
    table_decimals,
)
from idml.app.reports.classification import selective_classification
from idml.evaluation.classification import calibration_bins, confusion_matrix
from tiny_run import CLASSIFICATION

# Five images, three classes; each row's softmax is a ratio of small integers, so the max
# probabilities are 0.4, 0.8, 0.8, 0.6 and 0.9 (row i: p = a_i / sum of the row's exponentials).
HAND_LOGITS = torch.tensor(
    [
        [math.log(2.0), math.log(1.5), math.log(1.5)],  # p 0.4, predicts 0
        [math.log(8.0), 0.0, 0.0],  # p 0.8, predicts 0
        [0.0, math.log(8.0), 0.0],  # p 0.8, predicts 1
        [math.log(3.0), 0.0, 0.0],  # p 0.6, predicts 0
        [math.log(18.0), 0.0, 0.0],  # p 0.9, predicts 0
    ],
    dtype=torch.float64,
)
HAND_LABELS = torch.tensor([0, 1, 1, 2, 0])  # right, wrong, right, wrong, right


def test_reliability_bins_hand_case() -> None:
    bins = calibration_bins(HAND_LOGITS, HAND_LABELS, num_bins=4)
    # Bins (0, .25], (.25, .5], (.5, .75], (.75, 1]: 0.4 → 1, 0.6 → 2, 0.8, 0.8, 0.9 → 3.
    assert bins.counts.tolist() == [0.0, 1.0, 1.0, 3.0]
    assert bins.correct_sum.tolist() == [0.0, 1.0, 0.0, 2.0]
    assert bins.edges.tolist() == [0.0, 0.25, 0.5, 0.75, 1.0]
    # float64 softmax of three terms, then sums of at most three of them: 1e-12.
    torch.testing.assert_close(
        bins.confidence_sum,
        torch.tensor([0.0, 0.4, 0.6, 2.5], dtype=torch.float64),
        atol=1e-12,
        rtol=0,
    )
    assert math.isnan(bins.accuracy[0]) and math.isnan(bins.mean_confidence[0])  # empty bin
    assert bins.accuracy[1:].tolist() == [1.0, 0.0, 2.0 / 3.0]
    # ECE = (|0.4 − 1| + |0.6 − 0| + |2.5 − 2|) / 5 = 0.34; float64 sums of 4 terms: 1e-12.
    assert bins.ece == pytest.approx(0.34, abs=1e-12)


def test_confusion_matrix_hand_case() -> None:
    predicted = HAND_LOGITS.argmax(dim=1)
    assert predicted.tolist() == [0, 0, 1, 0, 0]
    assert confusion_matrix(predicted, HAND_LABELS, 3).tolist() == [[2, 0, 0], [1, 1, 0], [1, 0, 0]]
    with pytest.raises(ValueError, match=r"labels must lie in 0\.\.2"):
        confusion_matrix(predicted, torch.tensor([0, 1, 1, 3, 0]), 3)


def _brute_force_auroc(confidence: list[float], errors: list[bool]) -> float:
    """P(wrong less confident than right) + ½·P(tie) over all (wrong, right) pairs."""
    wins = 0.0
    pairs = 0
    for cw, ew in zip(confidence, errors, strict=True):
        for cr, er in zip(confidence, errors, strict=True):
            if ew and not er:
                pairs += 1
                wins += 1.0 if cw < cr else 0.5 if cw == cr else 0.0
    return wins / pairs


def _brute_force_aurc(confidence: list[float], errors: list[bool]) -> float:
    """Σ over distinct thresholds c (highest first) of risk(κ ≥ c) × the share newly answered."""
    total, answered_before = 0.0, 0
    for c in sorted(set(confidence), reverse=True):
        kept = [e for k, e in zip(confidence, errors, strict=True) if k >= c]
        total += sum(kept) / len(kept) * (len(kept) - answered_before) / len(confidence)
        answered_before = len(kept)
    return total


def test_max_softmax_auroc_and_aurc_against_brute_force() -> None:
    result = selective_classification(HAND_LOGITS, HAND_LABELS)
    assert set(result.quality) == {"max_prob"}  # no ||u|| given: no −||u|| or combined score
    confidence = torch.softmax(HAND_LOGITS, dim=1).max(dim=1).values.tolist()
    errors = [False, True, False, True, False]
    quality = result.quality["max_prob"]
    # The same float64 confidences compared and summed over ≤ 6 pairs or 4 levels: 1e-12.
    assert quality.auroc == pytest.approx(_brute_force_auroc(confidence, errors), abs=1e-12)
    assert quality.aurc == pytest.approx(_brute_force_aurc(confidence, errors), abs=1e-12)
    # By hand: AUROC (0 + ½ + 1 + 0 + 1 + 1)/6 = 7/12; AURC 0·.2 + ⅓·.4 + ½·.2 + .4·.2 = 47/150.
    # float64 ratios and sums of ≤ 6 such terms: a few ε, abs 1e-12 (also the oracle below).
    assert quality.auroc == pytest.approx(7 / 12, abs=1e-12)
    assert quality.aurc == pytest.approx(47 / 150, abs=1e-12)
    # Oracle: the 3 right answers first, then risks 1/4 and 2/5 over 5 images = 0.13.
    assert result.oracle_aurc == pytest.approx(0.13, abs=1e-12)
    coverage, risk = result.curves["max_prob"]
    assert coverage.tolist() == [0.2, 0.6, 0.8, 1.0]
    assert risk.tolist() == pytest.approx([0.0, 1 / 3, 0.5, 0.4], abs=1e-12)  # as above


def test_uncertainty_scores_join_with_an_uncertainty_head() -> None:
    # ||u|| largest on the two wrong images: −||u|| separates them perfectly (AUROC 1).
    level = torch.tensor([0.1, 0.9, 0.2, 0.8, 0.3])
    result = selective_classification(HAND_LOGITS, HAND_LABELS, level)
    assert list(result.quality) == ["max_prob", "norm_u", "combined"]
    assert result.quality["norm_u"].auroc == 1.0  # exact: every pair is ordered
    assert result.quality["norm_u"].aurc == pytest.approx(result.oracle_aurc, abs=1e-12)  # float64
    with pytest.raises(ValueError, match="uncertainty has 4 values but there are 5 images"):
        selective_classification(HAND_LOGITS, HAND_LABELS, level[:4])


def test_metric_units_are_a_property_of_the_key() -> None:
    assert format_metric("nll", 0.35) == "0.350" and metric_heading("nll") == "NLL (nats)"
    assert format_metric("top1", 0.35) == "35.00" and metric_heading("top1") == "top1 (%)"
    assert format_metric("ece", 0.0412) == "4.12" and metric_heading("ece") == "ECE (%)"
    assert format_metric("u_mixup", 1.25) == "1.250" and metric_heading("u_mixup") == "||u|| mixup"
    assert format_metric("recall@1", 0.6, 0.01) == "60.00 ± 1.00"
    # One unit per page: (R-)AUROC and AURC in % beside R@1 and MAP@R.
    assert format_metric("r_auroc_top1", 0.75) == "75.00"
    assert metric_heading("r_auroc") == "R-AUROC (%)" and metric_heading("auroc") == "AUROC (%)"
    assert metric_heading("aurc_top1") == "AURC top-1 (%)"
    directions = [metric_direction(k) for k in ("map@r", "r_auroc_top1", "aurc_oracle", "ece")]
    assert directions == [1, 1, -1, -1]
    assert [metric_direction(k) for k in ("nll", "u_clean", "seconds")] == [-1, 0, 0]
    assert format_delta("nll", -0.05) == "-0.050" and format_delta("map@r", 0.012) == "+1.20"
    assert [metric_unit(k) for k in ("aurc_oracle", "map", "nmi", "nll", "u_clean")] == [
        "%",
        "%",
        "%",
        "nats",
        "||u||",
    ]


# --------------------------------------------------------------------------- a tiny run
TINY = [
    *CLASSIFICATION,
    "data.samples_per_class=8",
    "model.embedding_dim=16",
    "model.uncertainty.enabled=true",
    "metric.introspective=true",
    "sampler.batch_size=16",
    "optim.epochs=2",
    "optim.max_steps_per_epoch=2",
]


@pytest.fixture(scope="module")
def classification_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from idml.app.config import load_config
    from idml.app.training import Trainer

    run = tmp_path_factory.mktemp("cls") / "run"
    Trainer(load_config(None, TINY), run, progress=False).fit()
    return run


@pytest.mark.slow
def test_a_classification_run_mixes_images_through_its_own_settings(tmp_path: Path) -> None:
    from idml.app.config import load_config
    from idml.app.reports.runs import RunLog

    def mixes(*overrides: str) -> bool:
        return RunLog(tmp_path, load_config(None, [*CLASSIFICATION, *overrides]), ()).mixup_enabled

    # CutMix / Mixup of the classification task count as mixing: the one mixup section.
    assert mixes("mixup.enabled=true", "mixup.kind=cutmix") and mixes("mixup.enabled=true")
    assert not mixes()
    assert RunLog(tmp_path, load_config(None, ["mixup.enabled=true"]), ()).mixup_enabled


def test_report_of_a_classification_run_has_its_section_and_figures(
    classification_run: Path, tmp_path: Path
) -> None:
    from idml.app.reports import AnalysisOptions, analyse_run, read_run, write_report
    from idml.app.reports.classification import ClassificationAnalysis
    from idml.app.tasks import TASKS, EvaluationRequest

    task = TASKS["classification"]
    expected = task.evaluate_run(classification_run, "best", EvaluationRequest()).metrics
    analysis = analyse_run(read_run(classification_run), AnalysisOptions())
    assert isinstance(analysis, ClassificationAnalysis)
    assert analysis.metrics == expected  # the same pass with the run's own settings: exact
    assert analysis.confusion.sum() == len(analysis.labels)
    assert analysis.calibration.counts.sum() == len(analysis.labels)
    assert analysis.calibration.ece == expected["ece"]  # the same binning code: exact
    assert np.array_equal(
        np.diag(analysis.confusion).sum(), (analysis.labels == analysis.predicted).sum()
    )
    assert analysis.probe is not None and {"max_prob", "norm_u", "combined"} == set(
        analysis.selective.quality
    )

    page = write_report([classification_run], tmp_path / "report")
    text = page.read_text()
    for heading in ("Test metrics", "Calibration", "Confusion matrix", "Most confident mistakes"):
        assert f"<h3>{heading}</h3>" in text
    assert "Retrieval examples" not in text and "precision–recall" not in text
    for part in ("reliability", "confusion", "risk-coverage", "uncertainty-conditions", "mistakes"):
        name = f"figures/01-run-{part}.png"
        assert (page.parent / name).is_file() and f'src="{name}"' in text
    # Every metric is on the page as the task's evaluate_run computes it, in its unit, the
    # ||u|| levels with one precision that tells them apart.
    digits = table_decimals({key: [value] for key, value in expected.items()})
    for key, value in expected.items():
        assert f"<td>{format_metric(key, value, **digits[key])}</td>" in text
    assert f"<td>{100 * expected['nll']:.2f}</td>" not in text  # NLL is not a percentage
    assert "NLL (nats)" in text


@pytest.mark.slow
def test_cli_report_and_embed_of_a_classification_run(
    classification_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from idml.app.cli import main
    from idml.app.tasks.classification import Classification
    from idml.classification import ClassifierEvaluationSettings, classify_dataset
    from idml.data import FileImageDataset, build_transforms, read_images
    from idml.evaluation.io import read_entries, read_text_entries
    from tiny_run import write_images

    out = tmp_path / "rep"
    argv = ["report", str(classification_run), "--out", str(out), "--no-progress"]
    assert main(argv) == 0, capsys.readouterr().err
    assert "<h3>Confusion matrix</h3>" in (out / "index.html").read_text()

    images = write_images(tmp_path / "images", classes=3, per_class=4)
    loaded = Classification().load_run(classification_run)
    cfg = loaded.config
    dataset = FileImageDataset(
        read_images(images), build_transforms(False, cfg.data.image_size, cfg.data.resize_size)
    )
    # One batch of 12 images, as embed's pass: the same computation, so the logits are equal.
    reference = classify_dataset(
        loaded.run.model,
        loaded.classifier,
        dataset,
        64,
        torch.device("cpu"),
        introspective=True,
        settings=ClassifierEvaluationSettings(uncertainty_probes=False),
    ).logits
    saved = {}
    for suffix in (".npz", ".pt", ".safetensors"):
        path = tmp_path / f"emb{suffix}"
        argv = ["embed", "--checkpoint", str(classification_run), "--images", str(images)]
        assert main([*argv, "--out", str(path), "--no-progress"]) == 0
        assert "with logits and probabilities" in capsys.readouterr().out
        entries, text = read_entries(path), read_text_entries(path)
        assert entries["logits"].shape == (12, 10) and entries["probabilities"].shape == (12, 10)
        assert text["logit_classes"] == list(loaded.class_names)
        assert text["classes"] == ["a", "b", "c"]  # the source's labels, unchanged
        assert torch.equal(entries["logits"], reference)
        # float32 storage of a float64 softmax of the float32 logits: 1e-6.
        torch.testing.assert_close(
            entries["probabilities"],
            torch.softmax(reference.double(), 1).float(),
            atol=1e-6,
            rtol=0,
        )
        saved[suffix] = entries
    assert torch.equal(saved[".npz"]["logits"], saved[".safetensors"]["logits"])
