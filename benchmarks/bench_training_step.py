"""Where a training step's time goes: data loading, forward, loss, backward, optimizer, monitor.

Two settings, each with IDML off and on:
- ``demo``: the ``idml demo`` network (small CNN on 16 px digits, batch 60);
- ``resnet50``: ResNet-50 at 224 px, batch 32 (P=8 × K=4), on a synthetic folder of JPEG files
  decoded by 2 loader workers, so the pixel pipeline (decode, RandomResizedCrop, flip) is real.

"loading" is the time the training loop waits for the next batch (workers prefetch in parallel);
the data pipeline keeps up when that wait is a small share of the step (target ≤ 10%).
"monitor" is the ISM saturation monitor's extra no-gradient pass the trainer makes every step with
an introspective metric (:meth:`~idml.app.training.monitoring.WeakeningMonitor.record`); 0 without
ISM.

Run: ``python benchmarks/bench_training_step.py [--steps 6] [--only demo|resnet50] [--set KEY=VALUE]``
(``--set``, repeatable, adds a config override to every setting, e.g. ``--set loss.name=proxy_anchor``;
``--clock cpu`` times with this process's CPU time instead of wall time, which on a machine shared
with other jobs leaves out the time the scheduler runs them; "loading" then counts only the main
process's own work, not the wait for the workers).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from idml.app import build
from idml.app.config import load_config
from idml.app.demo import DEMO_BASE
from idml.app.training.monitoring import WeakeningMonitor
from idml.embeddings import Embeddings

IDML = ["model.uncertainty.enabled=true", "metric.introspective=true", "mixup.enabled=true"]


def make_jpeg_folder(root: Path, classes: int = 16, per_class: int = 12, size: int = 320) -> None:
    rng = np.random.default_rng(0)
    for c in range(classes):
        folder = root / f"class_{c:03d}"
        folder.mkdir(parents=True)
        base = rng.integers(0, 255, (1, 1, 3))
        for i in range(per_class):
            noise = rng.integers(0, 60, (size, size, 3))
            img = np.clip(base + noise, 0, 255).astype(np.uint8)
            Image.fromarray(img).save(folder / f"{i}.jpg", quality=90)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def profile(
    overrides: list[str], steps: int, device: torch.device, clock: str = "wall"
) -> dict[str, float]:
    now = time.perf_counter if clock == "wall" else time.process_time
    cfg = load_config(None, overrides)
    data = build.build_data(cfg)
    model = build.build_model(cfg).to(device)
    loss_fn = build.build_loss(cfg, data.num_train_classes).to(device)
    augment = build.build_augmentations(cfg)
    params = list(model.parameters()) + list(loss_fn.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.optim.lr)
    loader = build.train_loader(cfg, data, 0, torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    times: dict[str, list[float]] = {
        k: [] for k in ("loading", "forward", "loss", "backward", "optimizer", "monitor")
    }
    monitor = WeakeningMonitor()
    it = iter(loader)
    model.train()
    for step in range(steps + 1):  # the first step warms up (worker start, allocator)
        t0 = now()
        try:
            images, labels, _ = next(it)
        except StopIteration:
            it = iter(loader)
            images, labels, _ = next(it)
        images, labels = images.to(device), labels.to(device)
        t1 = now()
        batch = augment(images, labels, gen)
        emb = model(batch.images)
        if not cfg.metric.introspective:
            emb = Embeddings(emb.semantic)
        sync(device)
        t2 = now()
        loss = batch.loss(loss_fn, emb)
        sync(device)
        t3 = now()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        sync(device)
        t4 = now()
        opt.step()
        sync(device)
        t5 = now()
        if cfg.metric.introspective:  # the trainer's per-step pass
            monitor.record(loss_fn, emb, batch.labels)
        sync(device)
        t6 = now()
        if step:
            for key, value in zip(
                times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5), strict=True
            ):
                value_ms = value * 1000
                times[key].append(value_ms)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--only", choices=["demo", "resnet50"], default=None)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override added to every setting (repeatable)",
    )
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"device={device}, torch threads={torch.get_num_threads()}, clock={args.clock}")
    settings: list[tuple[str, list[str]]] = []
    tmp = tempfile.TemporaryDirectory()
    if args.only in (None, "demo"):
        settings.append(("demo", [*DEMO_BASE, "optim.epochs=1", "data.num_workers=2"]))
    if args.only in (None, "resnet50"):
        root = Path(tmp.name) / "jpegs"
        make_jpeg_folder(root)
        settings.append(
            (
                "resnet50",
                [
                    "data.dataset=folder",
                    f"data.root={root}",
                    "data.num_workers=2",
                    "model.backbone=resnet50",
                    "model.pretrained=false",
                    "sampler.classes_per_batch=8",
                    "sampler.images_per_class=4",
                    "loss.name=proxy_anchor",
                ],
            )
        )
    rows = []
    for name, base in settings:
        for variant, extra in (("plain", []), ("IDML", [*IDML, "mixup.fraction=0.5"])):
            med = profile([*base, *extra, *args.set], args.steps, device, args.clock)
            total = sum(med.values())
            rows.append((name, variant, med, total))
            print(
                f"{name:9s} {variant:5s} " + "  ".join(f"{k} {v:8.1f} ms" for k, v in med.items())
            )
    print()
    print(
        "| setting | IDML | loading | forward | loss | backward | optimizer | monitor | step "
        "| loading share | monitor share |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, variant, med, total in rows:
        cells = " | ".join(
            f"{med[k]:.1f}"
            for k in ("loading", "forward", "loss", "backward", "optimizer", "monitor")
        )
        print(
            f"| {name} | {variant} | {cells} | {total:.1f} | {100 * med['loading'] / total:.1f}% "
            f"| {100 * med['monitor'] / total:.1f}% |"
        )
    tmp.cleanup()


if __name__ == "__main__":
    main()
