"""The ``calibration`` section: the calibrated confidence ``idml train`` fits after its last epoch.

A calibrated confidence, ``P(top-1 right)``, must be fitted on classes the model did not train on,
like the unseen classes it will meet (:mod:`idml.evaluation.confidence`). ``idml train`` fits one
on the run's *held-out training classes* — the ``val`` side a dataset names, or the share
``held_out_classes`` of the training classes kept out of training — and writes
``RUN/calibration.json`` (:mod:`idml.app.calibration`). Holding classes out costs the model those
classes, so it is off by default: a run trained on all its classes (the papers' protocol) has no
calibration until ``idml calibrate`` fits one on labelled images, and its answers carry the
label-free top-1 similarity, saying so.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from idml.app.config.sections import Section
from idml.evaluation.confidence import DEFAULT_FEATURES, score_from_key


class CalibrationConfig(Section):
    """The calibrated confidence fitted after the last epoch (module docstring)."""

    held_out_classes: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="share of the training classes kept out of training to fit the calibrated "
        "confidence on after the last epoch (0: none; a val side the dataset names is used "
        "instead when it has one; without either, fit one later with `idml calibrate`)",
    )
    calibrator: Literal["logistic", "isotonic"] = Field(
        "logistic", description="logistic regression on the features, or isotonic on one"
    )
    features: list[str] = Field(
        default_factory=lambda: [score.key for score in DEFAULT_FEATURES],
        description="confidence scores the calibrator reads (top1, margin@k, agreement@k, "
        "csls@k, norm_u)",
    )
    threshold_share: float = Field(
        0.5,
        gt=0.0,
        lt=1.0,
        description="share of the calibration queries kept out of the fit to certify abstention "
        "thresholds (idml search --target-precision)",
    )

    @field_validator("features")
    @classmethod
    def _known_scores(cls, features: list[str]) -> list[str]:
        if not features:
            raise ValueError("calibration.features needs at least one score, e.g. [top1]")
        for key in features:
            score_from_key(key)  # a ValueError naming the known scores
        return features

    @model_validator(mode="after")
    def _one_feature_for_isotonic(self) -> CalibrationConfig:
        if self.calibrator == "isotonic" and len(self.features) != 1:
            raise ValueError(
                "calibration.calibrator=isotonic reads one score; set calibration.features to "
                f"one of {self.features}"
            )
        return self
