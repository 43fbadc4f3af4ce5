"""Can a retrieval answer's confidence be trusted? The calibration ``idml train`` writes, judged on
unseen classes, against every score, other calibrators, abstention targets and re-ranking.

Settings (``--only``; each with a baseline arm — Multi-Similarity, plain metric — and an IDML arm —
ISM + Mixup — and ``--seeds`` seeds):

- ``demo``: ``idml demo``'s small CNN on scikit-learn's digits at 16 px; digits 0–5 are the
  training classes, of which 2–5 are held out (``calibration.held_out_classes=0.6``) and 0–1
  learned; 6–9 test. (The demo's own split, learn 0–2, leaves too few wrong answers on held-out
  classes to fit a calibrator.)
- ``omniglot_cnn``, ``omniglot_lite0``, ``fashion_lite0``: the recipes of
  ``benchmarks/study_idml.py`` (same data, model, schedule), with a quarter of Omniglot's 136
  training characters (the last 34 by id: the Latin alphabet and part of Korean) or two of
  Fashion-MNIST's five training classes (3 and 4) held out. ``--set
  calibration.held_out_order=spread`` (every fourth character: each training alphabet lends
  some) measures the other choice; ``--name`` keeps its tables apart.

Each run is trained by :class:`~idml.app.training.Trainer` with ``calibration.held_out_classes``:
the product's path. After the last epoch it writes ``calibration.json``, a logistic calibrator on
(top-1, margin@10, agreement@10) fitted on half of the held-out *training* classes' queries, the
other half certifying abstention thresholds (:mod:`idml.app.calibration`). ``eval.every`` is set
past the last epoch, so the ``best`` checkpoint it calibrates is the last one (no selection on test
classes). On the *test* classes, never seen by the model nor by a calibrator, this script reports
(mean ± std over seeds):

1. R-AUROC and AURC of every confidence score (:mod:`idml.evaluation.confidence`);
2. the product calibration's R-AUROC, AURC and ECE (15 bins), and those of other calibrators
   fitted on the same held-out classes (isotonic on one score; CSLS or −||u|| added; Platt);
3. for targets 0.8 / 0.9 / 0.95 at δ = 0.1: the precision and coverage the certified threshold
   reaches on the test classes, and in how many seed × target cells the precision met the target;
   and the same with the guarantee's condition met (exchangeable): a calibration fitted on a random
   half of the test queries, judged on the other half;
4. R@1 and MAP@R without and with re-ranking (k-reciprocal, αQE, αQE + DBA), with the time of the
   whole evaluation (the per-query cost at SOP and 1M scale is ``bench_confidence.py``'s);
5. the issue's criteria: calibrated R-AUROC ≥ top-1's + 5 points (mean over seeds), ECE ≤ 0.05
   (mean, and the worst seed), targets met in ≥ 90 % of the cells.

The held-out training classes are not exchangeable with the test classes, so the conformal guarantee
is not a theorem here: the table measures whether it holds anyway.

Run (finished runs under ``--out`` are reused; ``--epochs`` shortens every setting)::

    python benchmarks/study_confidence.py --only demo --seeds 5
    python benchmarks/study_confidence.py --only omniglot_cnn --only omniglot_lite0 \\
        --only fashion_lite0 --seeds 5 --omniglot-root ../shared/data/omniglot

or ``--runs RUN …`` on run folders trained with ``calibration.held_out_classes`` (or a dataset's
``val`` side). Writes ``benchmarks/study/confidence_<setting>_<arm>.md`` and prints a summary row
per setting and arm.
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
from scipy.stats import binom

from idml.app import build
from idml.app.calibration import CALIBRATION_FILE, model_levels
from idml.app.config import config_difference, config_to_dict, fragment_overrides, load_config
from idml.app.demo import DEMO_BASE, DEMO_IDML
from idml.app.trained_run import load_trained_run
from idml.app.training import Trainer
from idml.embeddings import Embeddings
from idml.evaluation import EvaluationSettings, evaluate_embeddings
from idml.evaluation.confidence import (
    DEFAULT_FEATURES,
    ConfidenceCalibration,
    ConfidenceReport,
    ConfidenceSettings,
    HubnessCorrectedSimilarity,
    IsotonicCalibrator,
    KnnAgreement,
    LabelMargin,
    NegativeUncertaintyLevel,
    Top1Similarity,
    fit_calibration,
)
from idml.evaluation.reliability import probability_bins
from idml.evaluation.reranking import KReciprocal, QueryExpansion, Reranker
from idml.models import embed_dataset
from idml_study.design import DEFAULT_OMNIGLOT
from idml_study.design import SETTINGS as IDML_SETTINGS

REPO = Path(__file__).resolve().parents[1]


def idml_setting(name: str) -> list[str]:
    """The overrides of ``study_idml``'s setting ``name`` with its step budget."""
    setting = IDML_SETTINGS[name]
    return [*setting.overrides, f"optim.epochs={setting.epochs}"]


SETTINGS: dict[str, list[str]] = {
    "demo": [
        *DEMO_BASE,
        "data.num_train_classes=6",
        "calibration.held_out_classes=0.6",
        "sampler.classes_per_batch=2",
        "sampler.images_per_class=30",
        "optim.epochs=8",
    ],
    "omniglot_cnn": [*idml_setting("omniglot_cnn"), "calibration.held_out_classes=0.25"],
    "omniglot_lite0": [*idml_setting("omniglot_lite0"), "calibration.held_out_classes=0.25"],
    "fashion_lite0": [
        *idml_setting("fashion_lite0"),
        "calibration.held_out_classes=0.4",
        # Three classes left to learn: the batch of 60 as 3 × 20.
        "sampler.classes_per_batch=3",
        "sampler.images_per_class=20",
    ],
}
ARMS: dict[str, dict[str, list[str]]] = {
    "baseline": {setting: ["loss.name=multi_similarity"] for setting in SETTINGS},
    "idml": {
        setting: [
            "loss.name=multi_similarity",
            *(DEMO_IDML if setting == "demo" else fragment_overrides("method/idml")),
        ]
        for setting in SETTINGS
    },
}
TARGETS = (0.8, 0.9, 0.95)
DELTA = 0.1
PRODUCT = "logistic (top1, margin@10, agreement@10): idml train's calibration.json"
CALIBRATORS: dict[str, dict] = {
    "logistic (+ csls@10)": {"features": (*DEFAULT_FEATURES, HubnessCorrectedSimilarity(10))},
    "logistic (+ −||u||)": {"features": (*DEFAULT_FEATURES, NegativeUncertaintyLevel())},
    "logistic (top1 only: Platt scaling)": {"features": (Top1Similarity(),)},
    "isotonic (agreement@10)": {"features": (KnnAgreement(10),), "calibrator": IsotonicCalibrator},
    "isotonic (margin@10)": {"features": (LabelMargin(10),), "calibrator": IsotonicCalibrator},
}
"""Calibrators fitted here on the same held-out classes, to compare with the product's."""
RERANKERS: dict[str, Reranker | None] = {
    "none": None,
    "k-reciprocal (k1 20, k2 6, λ 0.3)": KReciprocal(),
    "αQE (n 2, α 3)": QueryExpansion(query_neighbors=2),
    "αQE + DBA (n 2, 2, α 3)": QueryExpansion(query_neighbors=2, database_neighbors=2),
}
SCORES = ConfidenceSettings(precision_targets=TARGETS, delta=DELTA)


@dataclass
class Cells:
    """Values per row and column, one per seed."""

    values: dict[str, dict[str, list[float]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(list))
    )

    def add(self, row: str, column: str, value: float) -> None:
        self.values[row][column].append(value)

    def get(self, row: str, column: str) -> list[float]:
        return [v for v in self.values.get(row, {}).get(column, []) if not math.isnan(v)]

    def table(self, columns: list[str], scale: dict[str, float]) -> str:
        lines = ["| | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
        for row, cells in self.values.items():
            parts = []
            for column in columns:
                got = [v for v in cells.get(column, []) if not math.isnan(v)]
                parts.append(mean_std(got, scale.get(column, 1.0)))
            lines.append(f"| {row} | " + " | ".join(parts) + " |")
        return "\n".join(lines)


def mean_std(values: list[float], factor: float = 100.0) -> str:
    if not values:
        return "–"
    if len(values) == 1:
        return f"{factor * values[0]:.1f}"
    return f"{factor * statistics.mean(values):.1f} ± {factor * statistics.stdev(values):.1f}"


@dataclass
class Counts:
    cells: int = 0
    met: int = 0
    abstained: int = 0
    uncalibrated: int = 0
    exchangeable_cells: int = 0
    exchangeable_met: int = 0
    consistent: int = 0
    exchangeable_consistent: int = 0
    exchangeable_unfitted: int = 0


def consistent(right: int, answered: int, target: float, level: float = 0.05) -> int:
    """1 if ``right`` of ``answered`` is consistent with a precision of at least ``target``
    (one-sided binomial test at ``level``: the guarantee is about the population precision, which
    a finite set's precision scatters around), or nothing was answered."""
    return int(answered == 0 or binom.cdf(right, answered, target) > level)


def train_or_reuse(overrides: list[str], run_dir: Path) -> Path:
    """Train the run under ``run_dir`` unless a finished one (with its calibration step done:
    ``calibration.json``, or a log that ended) of the same config is there.

    A finished run whose config differs from today's (an override changed, or a default the
    library changed since it was trained, such as the uncertainty head's) is trained again, and
    the differences are printed: reusing it would report a model this command no longer trains."""
    wanted = load_config(None, overrides)
    if (run_dir / "config.yaml").exists() and (run_dir / "metrics.jsonl").exists():
        try:
            load_trained_run(run_dir, "latest")
            cfg = load_config(run_dir / "config.yaml")
            lines = (run_dir / "metrics.jsonl").read_text().splitlines()
            finished = len([line for line in lines if line.strip()]) == cfg.optim.epochs
        except Exception:  # an unfinished run: train it again
            finished = False
        else:
            changed = config_difference(config_to_dict(cfg), config_to_dict(wanted))
            if finished and not changed:
                return run_dir
            if finished:
                print(f"{run_dir}: trained with another config, training again: {changed}")
    Trainer(wanted, run_dir, progress=False).fit(overwrite=True)
    return run_dir


def study_run(run_dir: Path, cells: dict[str, Cells], counts: Counts) -> None:
    run = load_trained_run(run_dir, "best")
    data = build.build_data(run.config)
    if data.val is None:
        raise SystemExit(
            f"{run_dir}: no held-out training classes to calibrate on; train with "
            "calibration.held_out_classes=0.25 (or a dataset with a val side)"
        )
    device = torch.device("cpu")

    def embed(side: torch.utils.data.Dataset) -> tuple[Embeddings, torch.Tensor]:
        emb, labels = embed_dataset(run.model, side, 256, device)
        return Embeddings(emb.semantic, model_levels(run.model, emb)), labels

    (val, val_labels), (test, test_labels) = embed(data.val), embed(data.test)
    settings = EvaluationSettings(ks=(1,), nmi=False, confidence=SCORES)
    validation = evaluate_embeddings(val, val_labels, settings).confidence
    base = evaluate_embeddings(test, test_labels, settings).confidence
    assert validation is not None and base is not None
    for name, quality in base.quality.items():
        cells["scores"].add(name, "R-AUROC", quality.auroc)
        cells["scores"].add(name, "AURC", quality.aurc)
    exchangeable(base, run.config.seed, cells, counts)
    path = run_dir / CALIBRATION_FILE
    calibrations: dict[str, ConfidenceCalibration] = {}
    if path.is_file():
        calibrations[PRODUCT] = ConfidenceCalibration.load(path)
    else:
        counts.uncalibrated += 1
        print(f"{run_dir}: no {CALIBRATION_FILE} (too few wrong answers on the held-out classes)")
    for name, options in CALIBRATORS.items():
        if any(f.needs_uncertainty for f in options["features"]) and val.uncertainty is None:
            continue
        try:
            calibrations[name] = validation.fit_calibration(**options)
        except ValueError as error:  # too few wrong answers on the validation classes
            print(f"{run_dir}: {name}: no calibration ({error})")
    for name, calibration in calibrations.items():
        confidence: ConfidenceReport = evaluate_embeddings(  # type: ignore[assignment]
            test, test_labels, settings, calibration=calibration
        ).confidence
        quality = confidence.quality["calibrated"]
        cells["calibrators"].add(name, "R-AUROC", quality.auroc)
        cells["calibrators"].add(name, "AURC", quality.aurc)
        assert confidence.reliability is not None
        cells["calibrators"].add(name, "ECE", confidence.reliability.ece)
        if name != PRODUCT:
            continue
        gain = quality.auroc - base.quality["top1"].auroc
        cells["criteria"].add("calibrated − top-1 R-AUROC", "value", gain)
        cells["criteria"].add("ECE", "value", confidence.reliability.ece)
        for target, outcome in confidence.thresholds.items():
            row = f"target {target:g}"
            cells["conformal"].add(row, "precision", outcome.precision)
            cells["conformal"].add(row, "coverage", outcome.coverage)
            cells["conformal"].add(row, "held-out coverage", outcome.threshold.calibration_coverage)
            counts.cells += 1
            met = not math.isnan(outcome.precision) and outcome.precision >= target
            counts.met += int(met or outcome.coverage == 0)
            answered = round(outcome.coverage * int((~torch.isnan(base.correct)).sum()))
            right = round(outcome.precision * answered) if answered else 0
            counts.consistent += consistent(right, answered, target)
            counts.abstained += int(outcome.coverage == 0)
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


def exchangeable(
    base: ConfidenceReport, seed: int, cells: dict[str, Cells], counts: Counts
) -> None:
    """The guarantee's own condition: calibrate on a random half of the *test* queries (a
    labelled sample of the deployed classes, what ``idml calibrate --index`` fits on) and judge
    the other half, searched against the same gallery."""
    counted = torch.nonzero(~torch.isnan(base.correct)).flatten()
    order = counted[torch.randperm(len(counted), generator=torch.Generator().manual_seed(seed))]
    fit, judged = order[: len(order) // 2], order[len(order) // 2 :]
    try:
        calibration = fit_calibration(base.answers.take(fit), base.correct[fit] == 1)
    except ValueError as error:  # an easy setting: too few wrong answers in the fit half
        counts.exchangeable_unfitted += 1
        print(f"seed {seed}: no exchangeable calibration: {error}")
        return
    confidence = calibration.confidence(base.answers.take(judged))
    right = base.correct[judged] == 1
    cells["exchangeable ECE"].add("ECE", "value", probability_bins(confidence, right).ece)
    for target in TARGETS:
        answered = calibration.threshold(target, DELTA).answer(confidence)
        precision = float(right[answered].double().mean()) if answered.any() else math.nan
        row = f"target {target:g}"
        cells["exchangeable"].add(row, "precision", precision)
        cells["exchangeable"].add(row, "coverage", float(answered.double().mean()))
        counts.exchangeable_cells += 1
        counts.exchangeable_met += int(not answered.any() or precision >= target)
        counts.exchangeable_consistent += consistent(
            int(right[answered].sum()), int(answered.sum()), target
        )


def verdict(cells: dict[str, Cells], counts: Counts) -> tuple[str, str]:
    """The issue's three criteria: ``(markdown lines, one summary row)``."""
    gain = cells["criteria"].get("calibrated − top-1 R-AUROC", "value")
    ece = cells["criteria"].get("ECE", "value")
    share = counts.met / counts.cells if counts.cells else math.nan
    checks = [
        (
            f"calibrated R-AUROC − top-1's: {mean_std(gain)} points",
            bool(gain) and statistics.mean(gain) >= 0.05,
            "≥ 5",
        ),
        (
            f"ECE on the test classes: {mean_std(ece)} (worst seed "
            f"{100 * max(ece) if ece else math.nan:.1f})",
            bool(ece) and statistics.mean(ece) <= 0.05,
            "≤ 5",
        ),
        (
            f"targets met: {counts.met} of {counts.cells} seed × target cells",
            counts.cells > 0 and share >= 0.9,
            "≥ 90 %",
        ),
    ]
    lines = [
        f"- {text} (criterion {bar}): {'met' if ok else 'NOT met'}" for text, ok, bar in checks
    ]
    row = " | ".join(
        [mean_std(gain), mean_std(ece), f"{counts.met}/{counts.cells}"]
        + [("✓" if ok else "✗") for _, ok, _ in checks]
        + [
            f"{counts.consistent}/{counts.cells}",
            f"{counts.exchangeable_met}/{counts.exchangeable_cells}",
            f"{counts.exchangeable_consistent}/{counts.exchangeable_cells}",
        ]
    )
    return "\n".join(lines), row


def write_tables(name: str, cells: dict[str, Cells], counts: Counts, note: str) -> str:
    pct = {
        c: 100.0
        for c in (
            "R-AUROC",
            "AURC",
            "ECE",
            "precision",
            "coverage",
            "held-out coverage",
            "R@1",
            "MAP@R",
            "R-AUROC top1",
            "R-AUROC agreement@10",
        )
    }
    criteria, _ = verdict(cells, counts)
    parts = [
        f"# Confidence study: {name}\n",
        note,
        "\n## The issue's criteria (test classes)\n",
        criteria,
        "\n## Confidence scores on the test classes (×100; AURC lower is better)\n",
        cells["scores"].table(["R-AUROC", "AURC"], pct),
        "\n## Calibrators fitted on the held-out training classes, on the test classes (×100)\n",
        cells["calibrators"].table(["R-AUROC", "AURC", "ECE"], pct),
        f"\n## Abstention with idml train's calibration (δ = {DELTA}), on the test classes (%)\n",
        cells["conformal"].table(["precision", "coverage", "held-out coverage"], pct),
        f"\nTarget met (or every query abstained) in {counts.met} of {counts.cells} seed × "
        f"target cells ({counts.abstained} abstained on everything); consistent with the target "
        f"(one-sided binomial test at 5 %: the guarantee is about the population precision) in "
        f"{counts.consistent}; runs without a calibration (too few wrong held-out answers): "
        f"{counts.uncalibrated}.",
        "\n## Abstention calibrated on the test classes themselves (exchangeable: half of the test "
        "queries calibrate, the other half is judged; %)\n",
        cells["exchangeable"].table(["precision", "coverage"], pct),
        f"\nTarget met (or every query abstained) in {counts.exchangeable_met} of "
        f"{counts.exchangeable_cells} cells, consistent with it (binomial test at 5 %) in "
        f"{counts.exchangeable_consistent}; ECE of that calibration on the judged half: "
        f"{mean_std(cells['exchangeable ECE'].get('ECE', 'value'))}; seeds whose fit half had "
        f"too few wrong answers to fit one (not counted): {counts.exchangeable_unfitted}.",
        "\n## Re-ranking on the test classes (×100; time: the whole evaluation, s)\n",
        cells["reranking"].table(
            ["R@1", "MAP@R", "R-AUROC top1", "R-AUROC agreement@10", "time (s)"], pct
        ),
    ]
    return "\n".join(parts) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(SETTINGS), action="append", default=None)
    parser.add_argument("--arms", default="baseline,idml", help="comma-separated: baseline, idml")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=None, help="override every setting's")
    parser.add_argument("--omniglot-root", type=Path, default=DEFAULT_OMNIGLOT)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "study_confidence")
    parser.add_argument("--runs", type=Path, nargs="+", help="study these run folders instead")
    parser.add_argument(
        "--name", default=None, help="suffix of the tables and run folders of a variant (--set)"
    )
    parser.add_argument(
        "--set",
        dest="extra",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an override added to every run (e.g. calibration.held_out_order=spread)",
    )
    args = parser.parse_args()
    start = time.perf_counter()
    groups: dict[str, list[Path]] = {}
    notes: dict[str, str] = {}
    command = f"`python benchmarks/study_confidence.py {' '.join(sys.argv[1:])}`"
    if args.runs:
        groups["runs"] = list(args.runs)
        notes["runs"] = f"Runs: {', '.join(str(r) for r in args.runs)}. Command: {command}."
    for setting in [] if args.runs else args.only or ["demo"]:
        for arm in args.arms.split(","):
            overrides = [*SETTINGS[setting], *ARMS[arm][setting], "eval.every=1000"]
            if "data.dataset=omniglot" in overrides:
                overrides.append(f"data.root={args.omniglot_root}")
            if args.epochs is not None:
                overrides.append(f"optim.epochs={args.epochs}")
            overrides += args.extra
            seeds = range(args.first_seed, args.first_seed + args.seeds)
            tag = f"{setting}_{arm}" + (f"_{args.name}" if args.name else "")
            groups[tag] = [
                train_or_reuse(
                    [*overrides, f"seed={seed}", f"name=confidence-{setting}-{arm}"],
                    args.out / setting / tag.removeprefix(f"{setting}_") / f"seed{seed}",
                )
                for seed in seeds
            ]
            cfg = load_config(None, overrides)
            notes[tag] = (
                f"Setting `{setting}`, arm `{arm}`: {cfg.optim.epochs} epochs, seeds "
                f"{seeds.start}–{seeds.stop - 1}, {cfg.calibration.held_out_classes:g} of the "
                f"training classes held out for calibration. Overrides: `{' '.join(overrides)}`. "
                f"Command: {command}."
            )
    tables = REPO / "benchmarks" / "study"
    tables.mkdir(parents=True, exist_ok=True)
    summary = [
        "| setting / arm | ΔR-AUROC (points) | ECE ×100 | targets met | Δ ≥ 5 | ECE ≤ 5 | ≥ 90 % "
        "| consistent | exchangeable: met | consistent |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for tag, runs in groups.items():
        cells: dict[str, Cells] = defaultdict(Cells)
        counts = Counts()
        for run_dir in runs:
            study_run(run_dir, cells, counts)
        minutes = (time.perf_counter() - start) / 60
        note = f"{notes[tag]} Mean ± std over {len(runs)} runs; wall time so far {minutes:.1f} min."
        path = tables / f"confidence_{tag}.md"
        path.write_text(write_tables(tag, cells, counts, note))
        print(path.read_text())
        summary.append(f"| {tag} | {verdict(cells, counts)[1]} |")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
