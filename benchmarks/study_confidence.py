"""Can a retrieval answer's confidence be trusted? Scores, calibrators, abstention and re-ranking.

For each trained run (baseline and IDML with the demo's model on digits, ``--seeds`` seeds; or the run folders
given with ``--runs``), with three class-disjoint splits:

* **train**: the classes the model learns (digits 0–1);
* **validation**: held-out *training* classes (digits 2–5; ``data.protocol=validation``, which the
  run trains under) — the calibrators are fitted here and the abstention thresholds certified here;
* **test**: the unseen test classes (digits 6–9), never seen by the model nor by a calibrator.

On the test classes it reports, as mean ± std over seeds:

1. R-AUROC and AURC of every confidence score (:mod:`idml.evaluation.confidence`);
2. for each calibrator variant: its R-AUROC, AURC and ECE (15 bins), and for the default
   calibrator, for targets 0.8 / 0.9 / 0.95 at δ = 0.1: the precision and coverage the certified
   threshold reaches, and in how many seed × target cells the precision met the target;
3. R@1 and MAP@R without and with re-ranking (k-reciprocal, αQE, αQE + DBA), with the evaluation
   time.

The validation classes are not exchangeable with the test classes, so the conformal guarantee is
not a theorem here: the table measures whether it holds anyway.

Run: ``python benchmarks/study_confidence.py [--seeds 2] [--epochs 8]`` (the demo setting: a few
minutes on a laptop CPU; finished runs under ``--out`` are reused), or
``python benchmarks/study_confidence.py --runs RUN [RUN …]`` on run folders trained with
``data.protocol=validation``. Writes ``benchmarks/study/confidence_<name>.md``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from idml.app import build
from idml.app.config import Config, load_config
from idml.app.demo import DEMO_BASE, DEMO_IDML
from idml.app.trained_run import load_trained_run
from idml.app.training import Trainer
from idml.embeddings import Embeddings
from idml.evaluation import EvaluationSettings, evaluate_embeddings
from idml.evaluation.confidence import (
    DEFAULT_FEATURES,
    ConfidenceReport,
    HubnessCorrectedSimilarity,
    IsotonicCalibrator,
    KnnAgreement,
    LabelMargin,
    NegativeUncertaintyLevel,
    Top1Similarity,
)
from idml.evaluation.reranking import KReciprocal, QueryExpansion, Reranker
from idml.models import embed_dataset

REPO = Path(__file__).resolve().parents[1]
SPLITS = [
    "data.num_train_classes=6",
    "data.protocol=validation",
    "data.validation_classes=0.6",
    "sampler.classes_per_batch=2",
    "sampler.images_per_class=30",
]
"""Digits 0–5 are the training classes, of which 2–5 are held out for validation (the model learns
0–1, batches of 2 × 30); 6–9 test. The demo's own split (learn 0–2) leaves 2–8 wrong answers on
held-out classes, too few to fit a calibrator (:data:`~idml.evaluation.confidence.calibration.MIN_EACH`)."""
TARGETS = (0.8, 0.9, 0.95)
DELTA = 0.1
CALIBRATORS: dict[str, dict] = {
    "logistic (top1, margin@10, agreement@10)": {"features": DEFAULT_FEATURES},
    "logistic (+ csls@10)": {"features": (*DEFAULT_FEATURES, HubnessCorrectedSimilarity(10))},
    "logistic (+ −||u||)": {"features": (*DEFAULT_FEATURES, NegativeUncertaintyLevel())},
    "logistic (top1 only: Platt scaling)": {"features": (Top1Similarity(),)},
    "isotonic (agreement@10)": {"features": (KnnAgreement(10),), "calibrator": IsotonicCalibrator},
    "isotonic (margin@10)": {"features": (LabelMargin(10),), "calibrator": IsotonicCalibrator},
    "isotonic (csls@10)": {
        "features": (HubnessCorrectedSimilarity(10),),
        "calibrator": IsotonicCalibrator,
    },
}
DEFAULT_CALIBRATOR = "logistic (top1, margin@10, agreement@10)"
RERANKERS: dict[str, Reranker | None] = {
    "none": None,
    "k-reciprocal (k1 20, k2 6, λ 0.3)": KReciprocal(),
    "αQE (n 2, α 3)": QueryExpansion(query_neighbors=2),
    "αQE + DBA (n 2, 2, α 3)": QueryExpansion(query_neighbors=2, database_neighbors=2),
}


@dataclass
class Cells:
    """Values per row and column, one per seed."""

    values: dict[str, dict[str, list[float]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(list))
    )

    def add(self, row: str, column: str, value: float) -> None:
        self.values[row][column].append(value)

    def table(self, columns: list[str], scale: dict[str, float]) -> str:
        lines = ["| | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
        for row, cells in self.values.items():
            parts = []
            for column in columns:
                got = [v for v in cells.get(column, []) if not math.isnan(v)]
                factor = scale.get(column, 1.0)
                if not got:
                    parts.append("–")
                elif len(got) == 1:
                    parts.append(f"{factor * got[0]:.1f}")
                else:
                    parts.append(
                        f"{factor * statistics.mean(got):.1f} ± {factor * statistics.stdev(got):.1f}"
                    )
            lines.append(f"| {row} | " + " | ".join(parts) + " |")
        return "\n".join(lines)


def train_or_reuse(overrides: list[str], run_dir: Path) -> Path:
    """Train the run under ``run_dir`` unless a finished one is there."""
    if (run_dir / "config.yaml").exists() and (run_dir / "metrics.jsonl").exists():
        try:
            load_trained_run(run_dir, "latest")
            return run_dir
        except Exception:  # an unfinished run: train it again
            pass
    Trainer(load_config(None, overrides), run_dir, progress=False).fit(overwrite=True)
    return run_dir


def embed_split(cfg: Config, run_dir: Path, protocol: str) -> tuple[Embeddings, torch.Tensor]:
    """The run's model's embeddings of the held-out split under ``protocol`` (``validation``: the
    validation classes; ``test``: the test classes)."""
    split_cfg = load_config(run_dir / "config.yaml", [f"data.protocol={protocol}"])
    model = load_trained_run(run_dir, "latest").model
    data = build.build_data(split_cfg)
    return embed_dataset(model, data.test, 256, torch.device("cpu"))


def study_run(run_dir: Path, cells: dict[str, Cells], counts: dict[str, int]) -> None:
    cfg = load_config(run_dir / "config.yaml")
    if cfg.data.protocol != "validation":
        raise SystemExit(
            f"{run_dir}: trained with data.protocol={cfg.data.protocol}; the calibrator needs "
            "held-out training classes: train with data.protocol=validation"
        )
    settings = EvaluationSettings(ks=(1,), nmi=False)
    val, val_labels = embed_split(cfg, run_dir, "validation")
    test, test_labels = embed_split(cfg, run_dir, "test")
    validation = evaluate_embeddings(
        val.semantic, val_labels, settings, uncertainty=val.uncertainty
    )
    assert validation.confidence is not None
    base = evaluate_embeddings(test.semantic, test_labels, settings, uncertainty=test.uncertainty)
    assert base.confidence is not None
    for name, quality in base.confidence.quality.items():
        cells["scores"].add(name, "R-AUROC", quality.auroc)
        cells["scores"].add(name, "AURC", quality.aurc)
    for name, options in CALIBRATORS.items():
        if any(f.needs_uncertainty for f in options["features"]) and val.uncertainty is None:
            continue
        try:
            calibration = validation.confidence.fit_calibration(**options)
        except ValueError as error:  # too few wrong answers on the validation classes
            counts["refused"] += 1
            print(f"{run_dir}: {name}: no calibration ({error})")
            continue
        report = evaluate_embeddings(
            test.semantic,
            test_labels,
            settings,
            uncertainty=test.uncertainty,
            calibration=calibration,
        )
        confidence: ConfidenceReport = report.confidence  # type: ignore[assignment]
        quality = confidence.quality["calibrated"]
        cells["calibrators"].add(name, "R-AUROC", quality.auroc)
        cells["calibrators"].add(name, "AURC", quality.aurc)
        assert confidence.reliability is not None
        cells["calibrators"].add(name, "ECE", confidence.reliability.ece)
        if name == DEFAULT_CALIBRATOR:
            for target, outcome in confidence.thresholds.items():
                row = f"target {target:g}"
                cells["conformal"].add(row, "precision", outcome.precision)
                cells["conformal"].add(row, "coverage", outcome.coverage)
                cells["conformal"].add(
                    row, "validation coverage", outcome.threshold.calibration_coverage
                )
                counts["cells"] += 1
                met = not math.isnan(outcome.precision) and outcome.precision >= target
                counts["met"] += int(met or outcome.coverage == 0)
                counts["abstained"] += int(outcome.coverage == 0)
    for name, reranker in RERANKERS.items():
        start = time.perf_counter()
        report = evaluate_embeddings(
            test.semantic,
            test_labels,
            EvaluationSettings(ks=(1,), nmi=False, reranking=reranker),
        )
        seconds = time.perf_counter() - start
        cells["reranking"].add(name, "R@1", report.metrics["recall@1"])
        cells["reranking"].add(name, "MAP@R", report.metrics["map@r"])
        cells["reranking"].add(name, "R-AUROC top1", report.metrics["r_auroc_top1"])
        cells["reranking"].add(name, "R-AUROC agreement@10", report.metrics["r_auroc_agreement@10"])
        cells["reranking"].add(name, "time (s)", seconds)


def write_tables(name: str, cells: dict[str, Cells], counts: dict[str, int], note: str) -> str:
    pct = {
        c: 100.0
        for c in (
            "R-AUROC",
            "AURC",
            "ECE",
            "precision",
            "coverage",
            "validation coverage",
            "R@1",
            "MAP@R",
            "R-AUROC top1",
            "R-AUROC agreement@10",
        )
    }
    parts = [
        f"# Confidence study: {name}\n",
        note,
        "\n## Confidence scores on the test classes (×100; AURC lower is better)\n",
        cells["scores"].table(["R-AUROC", "AURC"], pct),
        "\n## Calibrators fitted on the validation classes, on the test classes (×100)\n",
        cells["calibrators"].table(["R-AUROC", "AURC", "ECE"], pct),
        f"\n## Abstention with the default calibrator (δ = {DELTA}), on the test classes (%)\n",
        cells["conformal"].table(["precision", "coverage", "validation coverage"], pct),
        f"\nTarget met (or every query abstained) in {counts['met']} of {counts['cells']} seed × "
        f"target cells ({counts['abstained']} abstained on everything); calibrations refused "
        f"for too few wrong validation answers: {counts['refused']}.",
        "\n## Re-ranking on the test classes (×100; time: the whole evaluation, s)\n",
        cells["reranking"].table(
            ["R@1", "MAP@R", "R-AUROC top1", "R-AUROC agreement@10", "time (s)"], pct
        ),
    ]
    return "\n".join(parts) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "study_confidence")
    parser.add_argument("--runs", type=Path, nargs="+", help="study these run folders instead")
    parser.add_argument("--name", default=None, help="table name (default: demo, or runs)")
    args = parser.parse_args()
    start = time.perf_counter()
    groups: dict[str, list[Path]] = {}
    if args.runs:
        groups["runs"] = list(args.runs)
    else:
        for arm, extra in (("baseline", []), ("idml", DEMO_IDML)):
            groups[arm] = [
                train_or_reuse(
                    [
                        *DEMO_BASE,
                        *extra,
                        *SPLITS,
                        f"optim.epochs={args.epochs}",
                        f"seed={seed}",
                        f"name=confidence-{arm}",
                    ],
                    args.out / arm / f"seed{seed}",
                )
                for seed in range(args.seeds)
            ]
    tables = REPO / "benchmarks" / "study"
    tables.mkdir(parents=True, exist_ok=True)
    for arm, runs in groups.items():
        cells: dict[str, Cells] = defaultdict(Cells)
        counts = {"cells": 0, "met": 0, "abstained": 0, "refused": 0}
        for run_dir in runs:
            study_run(run_dir, cells, counts)
        minutes = (time.perf_counter() - start) / 60
        name = args.name or ("runs" if args.runs else f"demo_{arm}")
        if args.runs:
            setting = f"Runs: {', '.join(str(r) for r in runs)}"
        else:
            setting = (
                f"`idml demo`'s model and losses, {args.epochs} epochs, seeds 0–{args.seeds - 1}; "
                "digits 0–1 train, 2–5 validation (calibration), 6–9 test: "
                f"`{' '.join(SPLITS)}`"
            )
        note = (
            f"{setting}; mean ± std over {len(runs)} runs. Command: `python "
            f"benchmarks/study_confidence.py {' '.join(sys.argv[1:])}`. Wall time so far: "
            f"{minutes:.1f} min."
        )
        path = tables / f"confidence_{name}.md"
        path.write_text(write_tables(name, cells, counts, note))
        print(path.read_text())


if __name__ == "__main__":
    main()
