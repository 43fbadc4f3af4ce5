"""``idml demo``: baseline vs IDML on scikit-learn's bundled digits, side by side, with no download.

A small CNN learns an embedding on digits 0–4 and is evaluated on the unseen digits 5–9 (the zero-shot
DML protocol of SPEC §8). The baseline uses Multi-Similarity on cosine; IDML adds the uncertainty head,
the introspective similarity metric and Mixup set labels, everything else equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from idml.config import Config, load_config
from idml.training import Trainer, TrainResult

DEMO_BASE: list[str] = [
    "name=demo",
    "data.dataset=digits",
    "data.image_size=16",
    "data.resize_size=null",
    "data.train_crop_scale=[0.7, 1.0]",
    "data.horizontal_flip=false",
    "data.num_workers=0",
    "model.backbone=small_cnn",
    "model.pretrained=false",
    "model.embedding_dim=64",
    "sampler.classes_per_batch=5",
    "sampler.images_per_class=12",
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

DEMO_IDML: list[str] = [
    "model.uncertainty.enabled=true",
    "metric.introspective=true",
    "metric.gamma=0.0",
    "metric.tau=5.0",
    "mixup.enabled=true",
    "mixup.fraction=0.5",
]
"""What IDML changes: an uncertainty head, ISM, and Mixup images with set labels."""


@dataclass
class DemoResult:
    baseline: TrainResult
    idml: TrainResult

    def table(self) -> str:
        keys = [k for k in self.baseline.final_metrics if k in self.idml.final_metrics]
        rows = [("metric", "baseline", "IDML", "Δ")]
        for key in keys:
            a, b = self.baseline.final_metrics[key], self.idml.final_metrics[key]
            rows.append((key, f"{a:.4f}", f"{b:.4f}", f"{b - a:+.4f}"))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


def demo_configs(
    epochs: int, seed: int = 0, extra: list[str] | None = None
) -> tuple[Config, Config]:
    common = [*DEMO_BASE, f"optim.epochs={epochs}", f"seed={seed}", *(extra or [])]
    baseline = load_config(None, [*common, "name=demo-baseline"])
    idml = load_config(None, [*common, *DEMO_IDML, "name=demo-idml"])
    return baseline, idml


def run_demo(out_dir: Path, epochs: int = 8, seed: int = 0, progress: bool = True) -> DemoResult:
    """Train both demo runs under ``out_dir`` and return their results.

    The demo is meant to be run again: the runs of an earlier demo in ``out_dir`` are moved aside
    (``baseline.replaced-<time>``, as ``idml train --overwrite`` does), not deleted.
    """
    baseline_cfg, idml_cfg = demo_configs(epochs, seed)
    baseline = Trainer(baseline_cfg, out_dir / "baseline", progress=progress).fit(overwrite=True)
    idml = Trainer(idml_cfg, out_dir / "idml", progress=progress).fit(overwrite=True)
    return DemoResult(baseline, idml)
