"""The calibrated confidence of a trained model: fitted, stored as ``calibration.json``, found again.

A calibrated confidence, ``P(top-1 right)``, is fitted on labelled queries of classes the model
did not train on (:mod:`idml.evaluation.confidence`): each query is searched exactly as ``idml
search`` will search (cosine similarity of normalised embeddings, the same re-ranking), and a
calibrator learns from the scores of its answer whether that answer was right. Three ways make one:

* ``idml train``, after its last epoch (:func:`calibrate_run`): on the run's *held-out training
  classes* — the ``val`` side its dataset names, or the share ``calibration.held_out_classes`` of
  its training classes kept out of training (:class:`~idml.app.config.CalibrationConfig`) — each
  image a query against the others (leave-one-out), with the ``best`` checkpoint's model (what
  ``idml index`` uses by default). Without held-out classes the run gets none and says so.
* ``idml calibrate RUN_OR_EXPORT --images LABELLED`` (:func:`calibrate_images`): any labelled
  images, searched among themselves, or with ``--index INDEX`` against that index's gallery.
* ``idml calibrate RUN`` without images: the run's held-out classes again (e.g. under a re-ranking).

Where it is written (:data:`CALIBRATION_FILE`): in the run folder, the export folder (``idml
export`` copies a run's), or the index folder (fitted against that index's gallery). ``idml
search`` and ``idml serve`` look in the index folder first, then in the folder of the index's model
(:func:`find_calibration`), and use a calibration only when it was fitted for the index's model
(``weights_sha256``) under the same re-ranking; otherwise the confidence falls back to the
label-free top-1 similarity and the answer says why.

The file is the library's JSON format (:meth:`~idml.evaluation.confidence.ConfidenceCalibration.save`),
whose ``provenance`` records here: ``model_weights_sha256``, ``model``, ``queries``, ``gallery``,
``reranking``, ``metric`` and ``idml_version``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from idml.app.storage import write_file
from idml.embeddings import Embeddings
from idml.evaluation import EvaluationSettings, evaluate_embeddings
from idml.evaluation.confidence import (
    CALIBRATORS,
    DEFAULT_FEATURES,
    CalibratorClass,
    ConfidenceCalibration,
    ConfidenceReport,
    ConfidenceScore,
    ConfidenceSettings,
    LogisticCalibrator,
    score_from_key,
)
from idml.evaluation.reranking import Reranker

if TYPE_CHECKING:
    from idml.app.config import CalibrationConfig
    from idml.app.retrieval.workflow import Runtime
    from idml.data.datasets import DMLSplit
    from idml.models import EmbeddingModel

CALIBRATION_FILE = "calibration.json"
"""The calibration's file name in a run, export or index folder."""

NO_HELD_OUT = (
    "no calibrated confidence: the run has no held-out training classes (data.protocol=test "
    "trains on every training class); its answers carry the top-1 similarity, which is not a "
    "probability. Fit one with `idml calibrate RUN --images LABELLED`, or train with "
    "calibration.held_out_classes=0.2"
)


@dataclass(frozen=True)
class CalibrationRecipe:
    """How a calibration is fitted: which scores, which calibrator, the threshold half's share,
    and the re-ranking the queries are searched with (the one search and serve must use)."""

    features: tuple[ConfidenceScore, ...] = DEFAULT_FEATURES
    calibrator: CalibratorClass = LogisticCalibrator
    threshold_share: float = 0.5
    reranker: Reranker | None = None

    @classmethod
    def from_config(
        cls, section: CalibrationConfig, reranker: Reranker | None = None
    ) -> CalibrationRecipe:
        """The ``calibration`` section of a run's config."""
        return cls(
            tuple(score_from_key(key) for key in section.features),
            CALIBRATORS[section.calibrator],
            section.threshold_share,
            reranker,
        )

    def settings(self) -> EvaluationSettings:
        """The evaluation that searches calibration queries as an index does: cosine similarity of
        normalised embeddings, this re-ranking, deep enough for every feature."""
        return EvaluationSettings(
            ks=(1,),
            nmi=False,
            reranking=self.reranker,
            confidence=ConfidenceSettings(scores=self.features),
        )


def recipe_for(
    model: Path,
    *,
    features: Sequence[str] | None = None,
    calibrator: str | None = None,
    threshold_share: float | None = None,
    reranker: Reranker | None = None,
) -> CalibrationRecipe:
    """The recipe ``idml calibrate`` fits with: the ``calibration`` section of the run's
    ``config.yaml`` (the defaults for an export), with the given fields replaced."""
    from dataclasses import replace

    from idml.app.config import load_config

    config = Path(model) / "config.yaml"
    base = CalibrationRecipe()
    if config.is_file():
        base = CalibrationRecipe.from_config(load_config(config).calibration)
    recipe = replace(base, reranker=reranker)
    if features is not None:
        recipe = replace(recipe, features=tuple(score_from_key(key) for key in features))
    if calibrator is not None:
        if calibrator not in CALIBRATORS:
            raise ValueError(f"calibrator must be one of {sorted(CALIBRATORS)}, got {calibrator!r}")
        recipe = replace(recipe, calibrator=CALIBRATORS[calibrator])
    if threshold_share is not None:
        recipe = replace(recipe, threshold_share=threshold_share)
    if recipe.calibrator is not LogisticCalibrator and len(recipe.features) != 1:
        raise ValueError(
            f"the {recipe.calibrator.kind} calibrator reads one score; give one with --features "
            f"(got {[f.key for f in recipe.features]})"
        )
    return recipe


def reranking_name(reranker: Reranker | None) -> str:
    """How a calibration records the re-ranking its queries were searched with (``"none"``)."""
    return "none" if reranker is None else f"{reranker.name}, shortlist {reranker.shortlist}"


def model_levels(model: EmbeddingModel, embeddings: Embeddings) -> Tensor | None:
    """Each image's uncertainty level as an index stores it (``None`` without a head), as the
    one-column uncertainty whose norm it is."""
    if embeddings.uncertainty is None:
        return None
    return model.uncertainty_level(embeddings).float().abs().unsqueeze(1)


def fit_on_embeddings(
    queries: Embeddings,
    labels: Tensor,
    recipe: CalibrationRecipe,
    provenance: dict[str, str],
    gallery: tuple[Tensor, Tensor] | None = None,
) -> tuple[ConfidenceCalibration, ConfidenceReport]:
    """Fit a calibration on labelled query embeddings (their ``uncertainty``: the one-column
    levels ``||u||``), searched among themselves (leave-one-out) or against ``gallery`` =
    ``(embeddings, labels)``; returns it with the report of the queries it was fitted on.

    Raises:
        ValueError: no query has another image of its class in the gallery, or too few right or
            wrong answers to fit (:func:`~idml.evaluation.confidence.fit_calibration`).
    """
    settings = recipe.settings()
    if gallery is None:
        report = evaluate_embeddings(queries, labels, settings)
    else:
        report = evaluate_embeddings(gallery[0], gallery[1], settings, query=(queries, labels))
    confidence = report.confidence
    if confidence is None:
        raise ValueError("no calibration query has an answer to judge")
    calibration = confidence.fit_calibration(
        recipe.features,
        recipe.calibrator,
        threshold_share=recipe.threshold_share,
        provenance={
            **provenance,
            "reranking": reranking_name(recipe.reranker),
            "metric": "cosine",
            "idml_version": _version(),
        },
    )
    return calibration, confidence


def save_calibration(calibration: ConfidenceCalibration, path: Path) -> Path:
    """Write ``calibration`` to ``path`` atomically (:mod:`idml.app.storage`)."""
    text = json.dumps(calibration.to_dict(), indent=1) + "\n"
    write_file(path, text.encode(), what="the calibration")
    return path


def describe_fit(calibration: ConfidenceCalibration, path: Path) -> str:
    """One line: where the calibration went and what it was fitted on."""
    both = torch.cat([calibration.ordering_set.correct, calibration.testing_set.correct])
    right = int(both.sum())
    features = ", ".join(f.key for f in calibration.features)
    return (
        f"calibrated confidence ({calibration.calibrator.kind} on {features}) fitted on "
        f"{len(both)} queries ({right} right, {len(both) - right} wrong), "
        f"{calibration.provenance.get('queries', '')}: {path}"
    )


def describe_outcome(report: ConfidenceReport, where: str) -> str:
    """One line: how the calibrated confidence did on ``where`` (R-AUROC against the top-1
    similarity's, ECE, and the precision and coverage at each target)."""
    from idml.app.metric_display import format_metric

    metrics = report.metrics()
    nan = float("nan")

    def percent(key: str, value: float) -> str:  # as the report's tables show it; "–": NaN
        text = format_metric(key, value, percent_digits=1)
        return text if value != value else f"{text} %"

    parts = [
        f"calibrated confidence on {where}: R-AUROC "
        f"{percent('r_auroc_calibrated', metrics.get('r_auroc_calibrated', nan))} (top-1 "
        f"similarity {percent('r_auroc_top1', metrics.get('r_auroc_top1', nan))})",
        f"ECE {percent('ece', metrics.get('ece', nan))}",
    ]
    for target, outcome in report.thresholds.items():
        if outcome.coverage == 0:
            parts.append(f"every query abstains at target precision {target:g}")
        else:
            parts.append(
                f"precision {percent(f'conformal_precision@{target:g}', outcome.precision)} at "
                f"coverage {percent(f'conformal_coverage@{target:g}', outcome.coverage)} for "
                f"target {target:g}"
            )
    return ", ".join(parts)


# --------------------------------------------------------------------------- a run's own classes
def calibrate_run(
    run_dir: Path,
    data: DMLSplit | None = None,
    *,
    which: str = "best",
    recipe: CalibrationRecipe | None = None,
    device: torch.device | str | None = None,
    progress: bool = False,
    log: Callable[[str], object] | None = None,
) -> ConfidenceCalibration | None:
    """Fit the calibrated confidence of a run on its held-out training classes (module
    docstring) and write ``run_dir/calibration.json``; then judge it on the test classes and
    ``log`` both (default: silently; the trainer's epoch log). ``data`` is the run's split
    (built from its config when not given), ``recipe`` how to fit (default: the config's
    ``calibration`` section, no re-ranking).

    Returns ``None``, logging why, when the run has no held-out classes or they give too few
    right or wrong answers to fit: its answers then carry the label-free top-1 similarity.

    Raises:
        ValueError: the run's task does not read the ``calibration`` section (a classification
            run; :attr:`idml.app.tasks.Task.reads`).
    """
    from idml.app import build
    from idml.app.config import reads_key
    from idml.app.inference import weights_sha256
    from idml.app.trained_run import load_trained_run
    from idml.models import embed_dataset

    log = log if log is not None else _silent
    run = load_trained_run(Path(run_dir), which)
    cfg = run.config
    if not reads_key(cfg.task.spec.reads, "calibration"):
        # e.g. a classifier: its answers carry its softmax probability, judged by its ECE.
        raise ValueError(
            f"{run_dir}: task {cfg.task.name} does not read the calibration section, so the run "
            "has no held-out classes to calibrate on; give --images LABELLED to fit a calibrated "
            "retrieval confidence on labelled images"
        )
    data = build.build_data(cfg) if data is None else data
    if data.val is None:
        log(NO_HELD_OUT)
        return None
    dev = torch.device("cpu") if device is None else torch.device(device)
    model = run.model.to(dev)
    emb, labels = embed_dataset(model, data.val, cfg.eval.batch_size, dev, progress=progress)
    recipe = CalibrationRecipe.from_config(cfg.calibration) if recipe is None else recipe
    provenance = {
        "model_weights_sha256": weights_sha256(run.model),
        "model": f"{Path(run.checkpoint).resolve()} (the run's {run.which} checkpoint)",
        "queries": f"{len(labels)} images of {data.val.num_classes} held-out training classes",
        "gallery": "the queries themselves (each searched among the others)",
    }
    try:
        calibration, _ = fit_on_embeddings(
            Embeddings(emb.semantic, model_levels(model, emb)), labels, recipe, provenance
        )
    except ValueError as err:
        log(f"no calibrated confidence: {err}; the answers carry the top-1 similarity")
        return None
    path = save_calibration(calibration, Path(run_dir) / CALIBRATION_FILE)
    log(describe_fit(calibration, path))
    test, test_labels = embed_dataset(model, data.test, cfg.eval.batch_size, dev, progress=progress)
    report = evaluate_embeddings(
        Embeddings(test.semantic, model_levels(model, test)),
        test_labels,
        recipe.settings(),
        roles=data.test.roles,
        calibration=calibration,
    ).confidence
    if report is not None:
        log(describe_outcome(report, "the test classes"))
    return calibration


# --------------------------------------------------------------------------- labelled images
def calibrate_images(
    model: Path,
    images: Path,
    *,
    index: Path | None = None,
    which: str = "best",
    recipe: CalibrationRecipe | None = None,
    out: Path | None = None,
    runtime: Runtime | None = None,
    log: Callable[[str], object] = print,
) -> tuple[ConfidenceCalibration, Path]:
    """Fit a calibration of ``model`` (a run, checkpoint or export folder) on labelled ``images``
    (an image folder labelled by its subfolders, or a CSV with a label column), each searched
    among the others, or with ``index`` against that index's gallery (whose items need labels and
    must not include the images). Writes it to ``out``, by default into the index folder (it
    belongs to that gallery) or else the model's folder, where search and serve find it.

    Raises:
        ValueError: unlabelled images or gallery, images that are gallery items, another model
            than the index's, or too few right or wrong answers to fit.
    """
    from idml.app.inference import Encoder
    from idml.app.retrieval.index import Index
    from idml.app.retrieval.workflow import Runtime, check_model, read_images

    runtime = Runtime() if runtime is None else runtime
    recipe = CalibrationRecipe() if recipe is None else recipe
    source = read_images(images)
    unlabelled = [i for i, label in zip(source.ids, source.labels) if label is None]
    if unlabelled:
        raise ValueError(
            f"{images}: calibration images need labels (a folder of class folders, or a CSV "
            f"with a label column); {unlabelled[0]} has none"
        )
    encoder = Encoder.load(model, which=which, device=runtime.device)
    names = [str(label) for label in source.labels]  # every one labelled (checked above)
    gallery_names: list[str] = []
    gallery_vectors = None
    gallery_note = "the queries themselves (each searched among the others)"
    if index is not None:
        gallery = Index.load(index)
        check_model(gallery, encoder.info)
        if any(label is None for label in gallery.labels):
            raise ValueError(
                f"index {index}: calibrating against a gallery needs each item's label; build "
                "the index from a labelled folder or CSV"
            )
        mine = {os.path.realpath(p) for p in source.paths if p is not None}
        inside = {os.path.realpath(p) for p in gallery.absolute_paths() if p is not None} & mine
        if inside:
            raise ValueError(
                f"{len(inside)} calibration image(s) are items of index {index} (e.g. "
                f"{sorted(inside)[0]}): each would find itself. Calibrate with labelled images "
                "that are not in the gallery"
            )
        gallery_names = [str(label) for label in gallery.labels]
        gallery_vectors = gallery.embeddings
        gallery_note = f"index {Path(index).resolve()} ({len(gallery)} items)"
    class_ids = {name: i for i, name in enumerate(sorted(set(names) | set(gallery_names)))}
    encoded = encoder.embed(source.images or [], runtime.batch_size, runtime.progress)
    levels = None if encoder.info.uncertainty == "none" else encoded.uncertainty.unsqueeze(1)
    provenance = {
        "model_weights_sha256": encoder.info.weights_sha256,
        "model": encoder.info.checkpoint or encoder.info.source,
        "queries": f"{len(names)} labelled images of {len(set(names))} classes from "
        f"{Path(images).resolve()}",
        "gallery": gallery_note,
    }
    gallery_pair = None
    if gallery_vectors is not None:
        gallery_pair = (gallery_vectors, torch.tensor([class_ids[n] for n in gallery_names]))
    calibration, _ = fit_on_embeddings(
        Embeddings(encoded.embeddings, levels),
        torch.tensor([class_ids[n] for n in names]),
        recipe,
        provenance,
        gallery_pair,
    )
    folder = Path(index) if index is not None else Path(encoder.info.source)
    path = save_calibration(calibration, out if out is not None else folder / CALIBRATION_FILE)
    log(describe_fit(calibration, path))
    return calibration, path


# --------------------------------------------------------------------------- finding one
@dataclass(frozen=True)
class FoundCalibration:
    """What :func:`find_calibration` found: a calibration that applies, or ``None`` and why."""

    calibration: ConfidenceCalibration | None
    path: Path | None
    note: str
    """Where the calibration came from, or why there is none (said with every answer)."""


def mismatch(calibration: ConfidenceCalibration, weights: str | None, reranking: str) -> str | None:
    """Why ``calibration`` does not apply to a model with ``weights`` (``weights_sha256``;
    ``None``: unknown) searched under ``reranking`` (:func:`reranking_name`); ``None`` if it
    applies."""
    fitted = calibration.provenance.get("model_weights_sha256")
    if weights is not None and fitted is not None and fitted != weights:
        return (
            f"it was fitted for model weights {fitted[:12]}, not this index's {weights[:12]} "
            "(e.g. the run's best checkpoint against an index of its latest)"
        )
    recorded = calibration.provenance.get("reranking", "none")
    if recorded != reranking:
        return (
            f"it was fitted with re-ranking {recorded!r} but the search uses {reranking!r}; a "
            "calibrator's probabilities hold only for the scores it was fitted on"
        )
    return None


def find_calibration(
    folders: Sequence[Path],
    weights: str | None,
    reranking: str,
    explicit: Path | None = None,
) -> FoundCalibration:
    """The calibration for a search (module docstring): ``explicit`` if given (an error when it
    does not apply), else the first :data:`CALIBRATION_FILE` of ``folders`` that applies.

    A file that is not a calibration is an error naming it; one for other weights or another
    re-ranking is passed over and the note says so.
    """
    fix = "fit one with `idml calibrate`"
    if explicit is not None:
        calibration = ConfidenceCalibration.load(explicit)
        reason = mismatch(calibration, weights, reranking)
        if reason is not None:
            raise ValueError(f"--calibration {explicit}: {reason}; {fix} for it")
        return FoundCalibration(calibration, explicit, f"calibrated confidence from {explicit}")
    passed: list[str] = []
    for folder in folders:
        path = folder / CALIBRATION_FILE
        if not path.is_file():
            continue
        calibration = ConfidenceCalibration.load(path)
        reason = mismatch(calibration, weights, reranking)
        if reason is None:
            return FoundCalibration(calibration, path, f"calibrated confidence from {path}")
        passed.append(f"{path} does not apply: {reason}")
    looked = " or ".join(str(folder / CALIBRATION_FILE) for folder in folders) or "none given"
    why = "; ".join(passed) if passed else f"no calibration (looked for {looked})"
    return FoundCalibration(
        None,
        None,
        f"{why}. The confidence is the top-1 cosine similarity (label-free fallback), not a "
        f"probability; {fix}",
    )


def _silent(_: str) -> None:
    pass


def _version() -> str:
    from idml import __version__

    return __version__
