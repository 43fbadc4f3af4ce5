"""Extra cost of SSR per training iteration, against the expected forward-backward ratio.

With SSR on (``p_task = 1``), each iteration also pushes ``M·(N+1)`` views through the backbone, so
the expected cost ratio is ``1 + M·(N+1)/B`` (B = metric batch). The script times full
``Trainer.train_step`` calls with SSR off and on in the same process, interleaved, and reports the
measured ratio next to the expected one, plus the time of the graded transforms alone and the peak
host memory of each setting (peak RSS growth of a child process; on CUDA this is host memory, not
GPU memory — GPU memory is not measured).

Run: ``python benchmarks/bench_ssr.py [--backbone resnet18] [--size 64] [--batch 120] [--steps 5]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from idml.app.config import load_config
from idml.app.training import Trainer


def overrides(args: argparse.Namespace, ssr: bool) -> list[str]:
    p = 5  # the offline datasets have 5 training classes
    items = [
        "data.dataset=fashion_mnist" if args.data == "fashion_mnist" else "data.dataset=digits",
        f"data.image_size={args.size}",
        "data.resize_size=null",
        "data.num_workers=0",
        f"data.samples_per_class={args.per_class}",
        f"model.backbone={args.backbone}",
        "model.pretrained=false",
        "model.embedding_dim=128",
        f"sampler.classes_per_batch={p}",
        f"sampler.images_per_class={args.batch // p}",
        "sampler.replacement=true",
        "loss.name=multi_similarity",
        "optim.amp=false",
        "tensorboard=false",
    ]
    if ssr:
        items += ["ssr.enabled=true", "ssr.task.p_task=1.0", f"ssr.task.num_images={args.m}"]
    return items


def build(args: argparse.Namespace, ssr: bool, root: Path) -> tuple[Trainer, list]:
    cfg = load_config(None, overrides(args, ssr))
    trainer = Trainer(cfg, root / ("ssr" if ssr else "plain"), progress=False)
    from idml.app import build as b

    loader = b.train_loader(cfg, trainer.data, 0, torch.Generator().manual_seed(0))
    batches = [next(iter(loader)) for _ in range(2)]
    return trainer, batches


def step_time(trainer: Trainer, batch: list, gen: torch.Generator) -> float:
    images, labels, _ = batch
    images, labels = images.to(trainer.device), labels.to(trainer.device)
    if trainer.device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    trainer.train_step(images, labels, gen, gen, ssr_on=trainer.ssr is not None)
    if trainer.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def peak_memory_child(args: argparse.Namespace, ssr: bool) -> float:
    """Peak RSS growth (MiB) of a fresh process over 2 training steps (settings don't mix)."""
    cmd = [sys.executable, __file__, "--child", "ssr" if ssr else "plain", *args.argv]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_mib"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backbone", default="resnet18")
    parser.add_argument("--data", default="fashion_mnist", choices=["fashion_mnist", "digits"])
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=120)
    parser.add_argument("--m", type=int, default=20)
    parser.add_argument("--per-class", type=int, default=200)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--child", choices=["plain", "ssr"], default=None)
    args, _ = parser.parse_known_args()
    args.argv = [a for a in sys.argv[1:] if a not in ("--child", "plain", "ssr")]
    tmp = Path(tempfile.mkdtemp())
    gen = torch.Generator().manual_seed(0)
    if args.child:
        trainer, batches = build(args, args.child == "ssr", tmp)
        # Reset the high-water mark so dataset loading doesn't mask the training step's peak.
        Path("/proc/self/clear_refs").write_text("5")
        base = _status_mib("VmRSS")
        for batch in batches:
            step_time(trainer, batch, gen)
        print(json.dumps({"peak_mib": _status_mib("VmHWM") - base}))
        return
    plain, plain_batches = build(args, False, tmp)
    ssr, ssr_batches = build(args, True, tmp)
    assert ssr.ssr is not None
    times: dict[str, list[float]] = {"plain": [], "ssr": []}
    for _ in range(1):  # warm-up
        step_time(plain, plain_batches[0], gen)
        step_time(ssr, ssr_batches[0], gen)
    for i in range(args.steps):
        times["plain"].append(step_time(plain, plain_batches[i % 2], gen))
        times["ssr"].append(step_time(ssr, ssr_batches[i % 2], gen))
    images = ssr_batches[0][0][: args.m].to(ssr.device)
    t = time.perf_counter()
    for _ in range(3):
        ssr.ssr.views(images, gen)
    transform_ms = (time.perf_counter() - t) / 3 * 1000
    med = {k: statistics.median(v) for k, v in times.items()}
    n = ssr.ssr.num_levels
    expected = 1 + args.m * (n + 1) / args.batch
    measured = med["ssr"] / med["plain"]
    mem = {"plain": peak_memory_child(args, False), "ssr": peak_memory_child(args, True)}
    print(
        f"backbone={args.backbone} size={args.size} B={args.batch} M={args.m} N={n} device={plain.device}"
    )
    print("| setting | step (ms) | peak memory of a step, above the loaded data (MiB) |")
    print("| --- | --- | --- |")
    print(f"| SSR off | {med['plain'] * 1000:.0f} | {mem['plain']:.0f} |")
    print(f"| SSR on (p_task=1) | {med['ssr'] * 1000:.0f} | {mem['ssr']:.0f} |")
    print(
        f"measured ratio {measured:.2f}  expected 1 + M(N+1)/B = {expected:.2f}  "
        f"(graded transforms alone: {transform_ms:.0f} ms per batch of {args.m})"
    )


if __name__ == "__main__":
    main()
