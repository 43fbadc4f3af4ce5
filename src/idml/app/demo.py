"""``idml demo``: baseline vs IDML on scikit-learn's bundled digits, side by side, with no download.

A small CNN learns an embedding on digits 0–4 and is evaluated on the unseen digits 5–9 (the
zero-shot protocol of the literature's small benchmarks: the first half of the classes trains, the
second half tests). The baseline uses Multi-Similarity on cosine; IDML adds the uncertainty head,
the introspective similarity metric and Mixup set labels, everything else equal.

Nothing here was chosen by its test outcome: the split is the standard one, and the recipe (8
epochs; 16 were no better) was chosen for the baseline on held-out *training* classes
(``benchmarks/study_idml.py validate --setting demo``, whose ``demo`` setting this is). The table
gives the paired difference of each metric over seeds that share their initialisation, with its 95 %
interval and a Holm-adjusted p-value; the evidence with ten seeds and the controls that isolate ISM
is ``benchmarks/study/idml_demo.md``.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path

from idml.app.config import Config, fragment_overrides, load_config
from idml.app.training import Trainer
from idml.app.training.epoch_log import TrainResult
from idml.app.training.level_probe import DRIFT_FACTOR, LevelDriftWarning, drift_ratio
from idml.statistics import compare_paired, holm

DEMO_BASE: list[str] = [
    "name=demo",
    *fragment_overrides("dataset/digits_demo"),
    *fragment_overrides("backbone/small_cnn"),
    "model.embedding_dim=64",
    "sampler.classes_per_batch=5",
    "sampler.images_per_class=12",
    "loss.name=multi_similarity",
    "optim.lr=0.003",
    "optim.weight_decay=0.0001",
    "optim.scheduler=cosine",
    "optim.grad_clip=10",
    "optim.amp=false",
    "eval.ks=[1,2,4,8]",
    "eval.every=4",
    "tensorboard=false",
]
"""Shared settings of both demo runs (digits are 8×8; upscaled to 16 px for the CNN)."""

DEMO_SETTING = "Digits 0-4 train, unseen digits 5-9 test; small CNN, Multi-Similarity loss"
"""One line for the demo's output: what was trained and tested."""

DEMO_IDML: list[str] = [
    *fragment_overrides("method/idml"),
    "metric.gamma=0.0",
    "metric.tau=5.0",
    "mixup.fraction=0.5",
]
"""What IDML changes: an uncertainty head, ISM, and Mixup images with set labels (the packaged
``method/idml`` fragment), with the demo's γ, τ and Mixup fraction."""


DEMO_METRICS = ("recall@1", "map@r", "nmi", "r_auroc_top1", "r_auroc_norm_u")
"""The rows of the demo's table: retrieval (R@1 is near its ceiling on digits, MAP@R and NMI are
not), then how well the top-1 cosine and ||u|| rank right top-1 answers above wrong ones (R-AUROC)."""


@dataclass
class DemoResult:
    """Both arms of the demo, one :class:`TrainResult` per seed each."""

    baseline: list[TrainResult]
    idml: list[TrainResult]

    @property
    def run_dirs(self) -> list[Path]:
        """Every run folder, the baselines first (what ``idml report`` groups by seed)."""
        return [r.run_dir for r in (*self.baseline, *self.idml)]

    def table(self) -> str:
        """Mean ± std over seeds of each metric, and IDML − baseline paired over the seeds (seed
        ``s`` of both arms shares its initialisation and batches): the mean difference, its 95 %
        interval and the paired t-test's p-value, Holm-adjusted over the table's rows."""
        compared = {}
        for key in DEMO_METRICS:
            pairs = [
                (a.final_metrics[key], b.final_metrics[key])
                for a, b in zip(self.baseline, self.idml, strict=True)
                if key in a.final_metrics and key in b.final_metrics
            ]
            if pairs:
                baseline, idml = zip(*pairs, strict=True)
                compared[key] = compare_paired(baseline, idml)
        adjusted = dict(zip(compared, holm([c.p_value for c in compared.values()]), strict=True))
        rows = [("metric", "baseline", "IDML", "Δ [95 % CI]", "p (Holm)")]
        for key in DEMO_METRICS:
            a = [r.final_metrics[key] for r in self.baseline if key in r.final_metrics]
            b = [r.final_metrics[key] for r in self.idml if key in r.final_metrics]
            if not b:
                continue
            c = compared.get(key)
            if c is None:  # ||u|| exists for IDML alone
                rows.append((key, "–", _cell(*_mean_std(b)), "", ""))
                continue
            interval = "" if math.isnan(c.low) else f" [{c.low:+.4f}, {c.high:+.4f}]"
            p = adjusted[key]
            rows.append(
                (
                    key,
                    _cell(*_mean_std(a)),
                    _cell(*_mean_std(b)),
                    f"{c.difference:+.4f}{interval}",
                    "n/a" if math.isnan(p) else f"{p:.3g}",
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        lines.append(
            f"mean ± std over {len(self.baseline)} seed(s), last epoch; Δ paired over seeds; "
            "r_auroc_*: right top-1 vs wrong. A toy: the evidence is benchmarks/study/idml_demo.md"
        )
        drift = self.level_drift()
        if drift:
            shown = ", ".join(f"{r:.2f}" for r in drift)
            lines.append(
                f"||u|| of training images at test / in training, IDML's last epoch: {shown} (a "
                f"ratio beyond {DRIFT_FACTOR:g} either way means r_auroc_norm_u reads a u that "
                "training never used: README, 'Is the u at test the u that trained?')"
            )
        return "\n".join(lines)

    def level_drift(self) -> list[float]:
        """Per IDML seed, the last epoch's eval-mode ``||u||`` of training images over the trained
        one (:func:`~idml.app.training.level_probe.drift_ratio`), where the run logged both."""
        ratios = [drift_ratio(r.history[-1]) if r.history else None for r in self.idml]
        return [r for r in ratios if r is not None]


def _mean_std(values: list[float]) -> tuple[float, float]:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return math.nan, math.nan
    mean = sum(finite) / len(finite)
    if len(finite) < 2:
        return mean, math.nan
    return mean, math.sqrt(sum((v - mean) ** 2 for v in finite) / (len(finite) - 1))


def _cell(mean: float, std: float) -> str:
    if math.isnan(mean):
        return "n/a"
    return f"{mean:.4f}" if math.isnan(std) else f"{mean:.4f} ± {std:.4f}"


def demo_configs(
    epochs: int, seed: int = 0, extra: list[str] | None = None
) -> tuple[Config, Config]:
    common = [*DEMO_BASE, f"optim.epochs={epochs}", f"seed={seed}", *(extra or [])]
    baseline = load_config(None, [*common, "name=demo-baseline"])
    idml = load_config(None, [*common, *DEMO_IDML, "name=demo-idml"])
    return baseline, idml


def run_demo(
    out_dir: Path, epochs: int = 8, seed: int = 0, progress: bool = True, seeds: int = 3
) -> DemoResult:
    """Train both arms for ``seeds`` seeds (``seed``, ``seed + 1``, …) under ``out_dir``:
    ``baseline`` and ``idml`` hold the first seed's runs, ``seed<k>/{baseline,idml}`` the others.

    The demo is meant to be run again: the runs of an earlier demo in ``out_dir`` are moved aside
    (``baseline.replaced-<time>``, as ``idml train --overwrite`` does), not deleted.
    """
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    result = DemoResult([], [])
    for k in range(seeds):
        baseline_cfg, idml_cfg = demo_configs(epochs, seed + k)
        folder = out_dir if k == 0 else out_dir / f"seed{seed + k}"
        for cfg, arm, runs in (
            (baseline_cfg, "baseline", result.baseline),
            (idml_cfg, "idml", result.idml),
        ):
            with warnings.catch_warnings():
                # The table reports the drift of every IDML seed in one line instead.
                warnings.simplefilter("ignore", LevelDriftWarning)
                runs.append(Trainer(cfg, folder / arm, progress=progress).fit(overwrite=True))
    return result
