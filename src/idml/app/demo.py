"""``idml demo``: baseline vs IDML on scikit-learn's bundled digits, side by side, with no download.

A small CNN learns an embedding on digits 0–2 and is evaluated on the seven unseen digits 3–9 (the
zero-shot protocol: train and test classes are disjoint). The baseline uses Multi-Similarity on
cosine; IDML adds the uncertainty head, the introspective similarity metric and Mixup set labels,
everything else equal.

Why three training classes: with the usual 0–4 / 5–9 split both arms reach R@1 ≈ 97–98 %, at the
ceiling, where no difference can show. Seeing fewer classes makes the unseen ones harder (baseline
R@1 ≈ 94 %, MAP@R ≈ 34 %), and it needs no other data than what scikit-learn ships. The measured
table and the other setting tried are in ``benchmarks/RESULTS.md`` ("idml demo").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from idml.app.config import Config, fragment_overrides, load_config
from idml.app.metric_display import beyond_spread
from idml.app.training import Trainer
from idml.app.training.epoch_log import TrainResult

DEMO_BASE: list[str] = [
    "name=demo",
    *fragment_overrides("dataset/digits_demo"),
    *fragment_overrides("backbone/small_cnn"),
    "model.embedding_dim=64",
    "sampler.classes_per_batch=3",
    "sampler.images_per_class=20",
    "loss.name=multi_similarity",
    "optim.lr=0.003",
    "optim.weight_decay=0.0001",
    "optim.scheduler=cosine",
    "optim.amp=false",
    "eval.ks=[1,2,4,8]",
    "eval.every=4",
    "tensorboard=false",
]
"""Shared settings of both demo runs (digits are 8×8; upscaled to 16 px for the CNN)."""

DEMO_SETTING = "Digits 0-2 train, unseen digits 3-9 test; small CNN, Multi-Similarity loss"
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
        """Mean ± std over seeds of each metric, the difference, and whether it exceeds the larger
        of the two standard deviations (with one seed there is no spread to compare)."""
        rows = [("metric", "baseline", "IDML", "Δ", "beyond seed spread")]
        for key in DEMO_METRICS:
            a = [r.final_metrics[key] for r in self.baseline if key in r.final_metrics]
            b = [r.final_metrics[key] for r in self.idml if key in r.final_metrics]
            if not b:
                continue
            (ma, sa), (mb, sb) = _mean_std(a), _mean_std(b)
            delta = "" if math.isnan(ma) else f"{mb - ma:+.4f}"
            beyond = {None: "n/a", True: "yes", False: "no"}[beyond_spread(mb - ma, (sa, sb))]
            rows.append((key, _cell(ma, sa), _cell(mb, sb), delta, beyond))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        seeds = len(self.baseline)
        lines.append(
            f"mean ± std over {seeds} seed(s), last epoch; r_auroc_*: right top-1 vs wrong"
        )
        return "\n".join(lines)


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
            runs.append(Trainer(cfg, folder / arm, progress=progress).fit(overwrite=True))
    return result
