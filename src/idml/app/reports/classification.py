"""The report's test-set analysis of a classification run (``task: classification``).

:func:`analyse_classification_run` (what :func:`~idml.app.reports.runs.analyse_run` does for a
classification run, through :meth:`idml.app.tasks.classification.Classification.analyse`) takes
the run's loaded checkpoint (model and classifier) and measures on the test split:

- the metrics ``idml evaluate --checkpoint`` prints (top-k, ECE, NLL, ``||u||`` probes), computed by
  the same pass with the run's own evaluation settings, so the page and the CLI agree;
- the confusion matrix ``M[t, p]`` (images of true class ``t`` predicted as ``p``);
- the reliability diagram (Guo et al. 2017, §2): the softmax confidences
  ``p̂_i = max_c softmax(z_i)_c`` in the ECE's ``M`` equal-width bins ``B_m = ((m−1)/M, m/M]``, each
  bin's accuracy ``acc(B_m) = |B_m|⁻¹ Σ_{i∈B_m} 1[ŷ_i = y_i]`` against its mean confidence
  ``conf(B_m) = |B_m|⁻¹ Σ_{i∈B_m} p̂_i``; a calibrated classifier has ``acc(B_m) = conf(B_m)``;
- selective classification (Geifman & El-Yaniv 2017): for a confidence score ``κ``, answering only
  the images with ``κ ≥ c`` gives the coverage ``φ(c)`` (share answered) and the risk ``r(c)``
  (share of those answered wrong); the risk–coverage curve traces ``(φ, r)`` over the thresholds
  and ``AURC = Σ_levels r(c)·Δφ(c)`` is the mean risk over coverage (lower is better; the oracle
  AURC answers every right image first). Scores: the maximum softmax probability (Hendrycks &
  Gimpel 2017), ``−||u||`` with an uncertainty head, and the mean of their normalised ranks; each
  also gets the AUROC of ``−κ`` for detecting a wrong prediction;
- ``||u||`` of clean and altered test images (:func:`~idml.diagnostics.uncertainty_probe`);
- the most confident mistakes, with their pixels for a grid.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from idml.app.reports.runs import AnalysisOptions, _load_images
from idml.diagnostics import UncertaintyProbe, uncertainty_probe
from idml.evaluation.classification import CalibrationBins, calibration_bins, confusion_matrix
from idml.evaluation.confidence import (
    ConfidenceQuality,
    oracle_aurc,
    rank_combination,
    risk_coverage,
    score_quality,
)

if TYPE_CHECKING:
    from idml.app.tasks.classification import ClassificationRun

CONFIDENCE_SCORES = {
    "max_prob": "max softmax probability",
    "norm_u": "−||u|| of the image",
    "combined": "mean rank of both",
}
"""Key → description of the confidence scores of a classification run (larger = surer)."""


@dataclass
class SelectiveClassification:
    """How well each confidence score picks out the wrong predictions (module docstring)."""

    quality: dict[str, ConfidenceQuality]
    """Score key (:data:`CONFIDENCE_SCORES`) → AUROC (wrong prediction) and AURC."""
    curves: dict[str, tuple[np.ndarray, np.ndarray]]
    """Score key → ``(coverage, risk)`` at each distinct confidence level, most confident first."""
    oracle_aurc: float
    """The lowest AURC any score reaches at this error rate."""


def selective_classification(
    logits: Tensor, labels: Tensor, uncertainty: Tensor | None = None
) -> SelectiveClassification:
    """AUROC, AURC and risk–coverage curves of the max softmax probability, of ``−||u||`` (when
    ``uncertainty`` is given) and of their rank combination, for "the top-1 class is wrong".

    Args:
        logits: ``(N, C)`` logits.
        labels: ``(N,)`` true classes.
        uncertainty: ``(N,)`` ``||u||`` of each image.
    """
    probs = torch.softmax(logits.double(), dim=1)
    confidence, predicted = probs.max(dim=1)
    errors = predicted != torch.as_tensor(labels).long()
    scores = {"max_prob": confidence}
    if uncertainty is not None:
        level = torch.as_tensor(uncertainty).double().flatten()
        if len(level) != len(confidence):
            raise ValueError(
                f"uncertainty has {len(level)} values but there are {len(confidence)} images"
            )
        scores["norm_u"] = -level
        scores["combined"] = rank_combination(confidence, -level)
    curves = {}
    for name, score in scores.items():
        coverage, risk = risk_coverage(score, errors)
        curves[name] = (coverage.numpy(), risk.numpy())
    return SelectiveClassification(score_quality(errors, scores), curves, oracle_aurc(errors))


@dataclass
class ClassificationAnalysis:
    """Test-split measurements of one classification checkpoint (arrays are NumPy, on the CPU)."""

    checkpoint: str
    """Which checkpoint was analysed: ``best`` or ``latest``."""
    epoch: int
    """Its epoch (numbered from 1)."""
    metrics: dict[str, float]
    """What ``idml evaluate --checkpoint`` prints for this checkpoint."""
    class_names: tuple[str, ...]
    """Name of each class (classifier column)."""
    labels: np.ndarray
    """``(N,)`` true class of each test image."""
    predicted: np.ndarray
    """``(N,)`` predicted class (largest logit)."""
    confidence: np.ndarray
    """``(N,)`` max softmax probability."""
    confusion: np.ndarray
    """``(C, C)`` counts: row = true class, column = predicted class."""
    calibration: CalibrationBins
    """The ECE's bins: counts, confidence and correct sums (the reliability diagram)."""
    selective: SelectiveClassification
    probe: UncertaintyProbe | None = None
    """``||u||`` of a sample of test images clean and altered (``None`` without uncertainty)."""
    mistakes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """Test indices of the most confident wrong predictions, most confident first."""
    mistake_images: np.ndarray = field(default_factory=lambda: np.zeros((0, 1, 1, 3)))
    """``(len(mistakes), H, W, C)`` their pixels in [0, 1]."""
    notes: list[str] = field(default_factory=list)

    @property
    def normalized_confusion(self) -> np.ndarray:
        """The confusion matrix with each row divided by its true class's count (a row of a class
        with no test image stays 0)."""
        totals = self.confusion.sum(axis=1, keepdims=True)
        return np.divide(
            self.confusion, totals, out=np.zeros(self.confusion.shape), where=totals > 0
        )

    def most_confused(self, count: int = 10) -> list[tuple[int, int, int]]:
        """The ``count`` largest off-diagonal cells ``(true, predicted, images)``, largest first
        (ties in row-major order), cells with no image left out."""
        off = self.confusion.copy()
        np.fill_diagonal(off, 0)
        flat = np.argsort(-off, axis=None, kind="stable")[:count]
        pairs = [(int(i // off.shape[1]), int(i % off.shape[1])) for i in flat]
        return [(t, p, int(off[t, p])) for t, p in pairs if off[t, p] > 0]


def analyse_classification_run(
    loaded: ClassificationRun, options: AnalysisOptions, device: torch.device, progress: bool
) -> ClassificationAnalysis:
    """Measure a loaded classification run on its test split (module docstring): what
    :func:`~idml.app.reports.runs.analyse_run` does for a classification run."""
    from idml.app.tasks.classification import evaluation_settings

    cfg = loaded.config
    settings = evaluation_settings(cfg)
    test = cfg.task.spec.build_data(cfg).test
    outputs = loaded.outputs(test, device, progress)
    metrics = outputs.metrics(settings.ks, settings.ece_bins)
    num_classes = outputs.logits.shape[1]
    probs = torch.softmax(outputs.logits.double(), dim=1)
    confidence, predicted = probs.max(dim=1)

    notes: list[str] = []
    probe = None
    if loaded.run.model.uncertainty_head is not None:
        if len(test) >= 2:
            probe = uncertainty_probe(
                loaded.run.model,
                test,
                seed=options.seed,
                device=device,
                batch_size=options.batch_size,
            )
        else:
            notes.append("||u|| probe skipped: it needs at least 2 test images.")

    wrong = torch.nonzero(predicted != outputs.labels).flatten()
    order = torch.argsort(confidence[wrong], descending=True, stable=True)
    mistakes = wrong[order][: options.mistakes].numpy()
    if len(wrong) == 0:
        notes.append("Every test image is classified right: there are no mistakes to show.")
    return ClassificationAnalysis(
        checkpoint=loaded.run.which,
        epoch=int(loaded.run.state.get("epoch", 0)),
        metrics=metrics,
        class_names=loaded.class_names,
        labels=outputs.labels.numpy(),
        predicted=predicted.numpy(),
        confidence=confidence.numpy(),
        confusion=confusion_matrix(predicted, outputs.labels, num_classes).numpy(),
        calibration=calibration_bins(outputs.logits, outputs.labels, settings.ece_bins),
        selective=selective_classification(outputs.logits, outputs.labels, outputs.uncertainty),
        probe=probe,
        mistakes=mistakes,
        mistake_images=_load_images(test, mistakes),
        notes=notes,
    )
