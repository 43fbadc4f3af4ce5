"""Training throughput in *unique* images per second: what each data path can deliver, and what a
full training step consumes, for the IDML recipe and its plain baseline.

IDML's Mixup appends half a batch of mixed images to every forward and backward pass, so its step
processes 1.5 × the batch; the figure that matters is unique (loaded) images per second. Measured,
on synthetic CUB-sized JPEGs (500 × 375, quality 90: a smooth colour field, sharp-edged shapes
and grain, ~53 KiB each, like CUB's photographs):

1. **per core** (one process, one thread): decoding with Pillow (the reference) and with
   torchvision's ``decode_jpeg``, the per-image train crop + flip + float conversion, a read from
   the ``uint8`` cache, and the batched crop of ``idml.data.batches`` (on ``--device``);
2. **loader ceiling** per data path (``--workers`` loader processes, no model): the train loader
   the trainer uses (``idml.app.build.train_loader``), ``--loader-batches`` batches at the steady
   rate (each epoch's first batch, which waits for the workers to start, is not timed);
3. **model step** per method and compute plan: ``Trainer.train_step`` on one batch already on the
   device (``--backbone``, default ResNet-50, from scratch, ``--image-size``, batch ``--batch`` as
   30 classes × 4 images at the default 120; the presets
   ``configs/idml/cub_proxy_anchor_{baseline,idml}.yaml``), each plan's rate also as a multiple
   of the first plan's (``--compute``; by default the float32 eager step in the contiguous layout,
   the step before the compute plans existed);
4. with ``--end-to-end``: whole training steps (loader + step, ``Trainer.train_epoch``) per
   method and data path.

The data paths (``data.decode`` / ``data.augment_on`` / ``data.cache``): ``reference`` (Pillow +
per-image transforms in the workers), ``torchvision`` (decode_jpeg in the workers), ``cache``
(the ``idml cache`` copy, per-image transforms), ``device`` (JPEG bytes to the device, decoded
and cropped there per batch), ``device+cache`` (cached pixels, cropped on the device).

Usage::

    # this 2-core machine, small: ResNet-50 at 224 px but batch 16
    python benchmarks/bench_throughput.py --device cpu --batch 16 --images 320 --steps 2 --workers 2
    # the CPU step alone, the study's Lite0 at 32 px (channels-last against the contiguous layout)
    python benchmarks/bench_throughput.py --device cpu --sections step --backbone efficientnet_lite0 \
        --image-size 32 --batch 60 --images 480 --steps 6 --repeats 3 --compute fp32-eager,auto
    # an accelerator, the recipe's sizes (batch 120, 224 px), 16 loader workers
    python benchmarks/bench_throughput.py --device cuda --workers 16 --end-to-end

Anchor for the per-core decode rate: JPEG decoding runs at 540–860 images/s per x86 core
(decode only, full-size ImageNet images, issue 26).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFilter

if TYPE_CHECKING:  # for annotations only: idml is imported in the functions that use it
    from idml.app.config import Config

REPO = Path(__file__).resolve().parents[1]
PATHS = {
    "reference": [],
    "torchvision": ["data.decode=torchvision"],
    "cache": ["data.cache={cache}"],
    "device": ["data.decode=device", "data.augment_on=device"],
    "device+cache": ["data.cache={cache}", "data.augment_on=device"],
}
METHODS = {
    "baseline": REPO / "configs/idml/cub_proxy_anchor_baseline.yaml",
    "idml": REPO / "configs/idml/cub_proxy_anchor_idml.yaml",
}
ANCHOR = "540–860 img/s per x86 core (decode only, full-size ImageNet JPEGs)"


def natural_like(rng: np.random.Generator, height: int = 375, width: int = 500) -> Image.Image:
    """A photograph-like image: smooth colour field, sharp-edged shapes and lines, grain."""
    low = rng.uniform(0, 255, (height // 25 + 2, width // 25 + 2, 3)).astype(np.uint8)
    image = Image.fromarray(low).resize((width, height), Image.Resampling.BICUBIC)
    draw = ImageDraw.Draw(image)
    for _ in range(12):
        x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
        box = [x0, y0, x0 + int(rng.integers(20, 200)), y0 + int(rng.integers(20, 150))]
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=colour)
    for _ in range(8):
        ends = [tuple(int(v) for v in rng.integers(0, (width, height))) for _ in range(2)]
        draw.line(ends, fill=tuple(int(c) for c in rng.integers(0, 256, 3)), width=3)
    image = image.filter(ImageFilter.GaussianBlur(1.0))
    grain = np.asarray(image).astype(np.int16) + rng.normal(0, 6, (height, width, 3)).astype(int)
    return Image.fromarray(np.clip(grain, 0, 255).astype(np.uint8))


def write_dataset(root: Path, images: int, classes: int, seed: int = 0) -> list[Path]:
    """``root/class<c>/<i>.jpg``: ``images`` JPEGs in ``classes`` folders (quality 90)."""
    rng = np.random.default_rng(seed)
    files = []
    for i in range(images):
        path = root / f"class{i % classes:03d}" / f"{i:05d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        natural_like(rng).save(path, quality=90)
        files.append(path)
    return files


def rate(fn: Callable[[int], object], count: int, repeats: int = 2) -> float:
    """Items per second of ``fn(i)`` for ``i < count`` (best of ``repeats`` passes, after one)."""
    fn(0)
    best = np.inf
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(count):
            fn(i)
        best = min(best, time.perf_counter() - start)
    return count / best


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def per_core(files: list[Path], cache_dir: Path, device: torch.device, size: int) -> list[tuple]:
    """Single-thread rates of each stage (table 1)."""
    from idml.data.batches import BatchCrops, decode_on
    from idml.data.cache import open_cache
    from idml.data.decoding import decode_image_file
    from idml.data.transforms import build_transforms

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        paths = [str(f) for f in files[:200]]
        n = len(paths)
        decoded = [decode_image_file(p, 3) for p in paths]
        train = build_transforms(True, size, crop_scale=(0.16, 1.0))
        cache = open_cache(cache_dir, verify=False)
        rows = [
            ("decode: Pillow (reference)", rate(lambda i: decode_image_file(paths[i], 3), n)),
            (
                "decode: torchvision decode_jpeg (CPU)",
                rate(lambda i: decode_image_file(paths[i], 3, decoder="torchvision"), n),
            ),
            ("per-image crop + flip + float (v2)", rate(lambda i: train(decoded[i]), n)),
            ("read from the uint8 cache", rate(lambda i: cache.image(paths[i]), n)),
            (
                "reference item: Pillow + crop + flip + float",
                rate(lambda i: train(decode_image_file(paths[i], 3)), n),
            ),
        ]
        crops = BatchCrops(size, scale=(0.16, 1.0))
        batch = 32
        encoded = [
            torch.frombuffer(bytearray(Path(p).read_bytes()), dtype=torch.uint8) for p in paths
        ]
        no_box = [torch.zeros(0, dtype=torch.long)] * batch
        gen = torch.Generator().manual_seed(0)

        def device_batch(b: int) -> None:
            part = [encoded[(b * batch + j) % n] for j in range(batch)]
            crops(decode_on(part, [True] * batch, no_box, 3, device), gen)
            sync(device)

        def crops_only(b: int) -> None:
            part = [decoded[(b * batch + j) % n].as_subclass(torch.Tensor) for j in range(batch)]
            crops([p.to(device) for p in part], gen)
            sync(device)

        rows.append((f"batched crop + flip on {device} (per image)", rate(crops_only, 4) * batch))
        rows.append(
            (f"decode + batched crop on {device} (per image)", rate(device_batch, 4) * batch)
        )
    finally:
        torch.set_num_threads(threads)
    return rows


def config(
    method: str,
    args: argparse.Namespace,
    root: Path,
    cache: Path,
    path: str,
    compute: list[str] | None = None,
) -> Config:
    from idml.app.config import load_config

    per_class = 4
    overrides = [
        "data.dataset=folder",
        f"data.root={root}",
        f"data.image_size={args.image_size}",
        f"data.resize_size={round(args.image_size * 256 / 224)}",
        f"data.num_workers={args.workers}",
        f"sampler.batch_size={args.batch}",
        f"sampler.classes_per_batch={args.batch // per_class}",
        f"sampler.images_per_class={per_class}",
        "sampler.replacement=true",
        f"model.backbone={args.backbone}",
        "model.pretrained=false",
        "optim.warmup_epochs=0",
        f"optim.amp={str(args.amp).lower()}",
        f"device={args.device}",
        "eval.nmi=false",
        "tensorboard=false",
        *(o.format(cache=cache) for o in PATHS[path]),
        *(compute or []),
    ]
    return load_config(METHODS[method], overrides)


def loader_ceiling(cfg: Config, batches: int, device: torch.device) -> float:
    """Steady images per second of the train loader alone: each epoch's first batch (which
    waits for the workers to start) is not timed; epochs are chained until ``batches`` are."""
    from idml.app import build

    data = build.build_data(cfg)
    timed, seconds, epoch = 0, 0.0, 0
    while timed < batches:
        gen = torch.Generator().manual_seed(epoch)
        loader = build.train_loader(cfg, data, epoch, gen, device=device)
        if len(loader) < 2:
            raise ValueError("an epoch holds fewer than 2 batches; write more --images")
        batches_of_epoch = iter(loader)
        next(batches_of_epoch)[0].to(device)
        sync(device)
        start = time.perf_counter()
        for images, _, _ in batches_of_epoch:
            images.to(device, non_blocking=True)
            timed += 1
            if timed >= batches:
                break
        sync(device)
        seconds += time.perf_counter() - start
        epoch += 1
    return timed * cfg.sampler.effective_batch_size / seconds


SECTIONS = {"core", "loader", "step"}

COMPUTE = {
    "fp32-eager": [
        "optim.amp=false",
        "optim.channels_last=false",
        "optim.fused=false",
        "optim.sync_every=1",
    ],
    "auto": [],
    "auto+fused": ["optim.fused=true"],
    "auto+compile": ["optim.compile=default"],
}
"""The step's compute plans (``idml.app.training.compute``) measured: float32 eager read every step
(the step before the plan existed), the device's defaults, those with the fused optimizer (the
default on an accelerator already; on the CPU it isolates that kernel), and those with a compiled
backbone."""


def model_step(
    cfg: Config, steps: int, device: torch.device, run_dir: Path
) -> tuple[float, int, str]:
    """Unique images per second of ``Trainer.step`` on one batch kept on the device, as the epoch
    loop runs it (the host reads the step's values every ``optim.sync_every`` steps), the rows the
    model sees per step (batch + Mixup's images for IDML), and the compute plan."""
    from idml.app import build
    from idml.app.training import Trainer
    from idml.app.training.step_values import StepValues
    from idml.checks import value_checks

    trainer = Trainer(cfg, run_dir, progress=False)
    loader = build.train_loader(cfg, trainer.data, 0, torch.Generator().manual_seed(0))
    images, labels, _ = next(iter(loader))
    images, labels = images.to(device), labels.to(device)
    gen = torch.Generator().manual_seed(0)
    rows = trainer.plan.augment(trainer.augment, images, labels, [gen]).images.shape[0]
    trainer.model.train()
    images = trainer.compute.prepare_images(images)
    values = StepValues()
    for _ in range(2):  # warm-up (and compilation, with optim.compile)
        trainer.step(images, labels, gen, gen, False, values, 0)
    sync(device)
    start = time.perf_counter()
    for step in range(steps):
        reads = trainer.compute.reads_at(step, steps)
        with value_checks(reads):
            trainer.step(images, labels, gen, gen, False, values, step if reads else None)
    sync(device)
    seconds = time.perf_counter() - start
    return steps * images.shape[0] / seconds, int(rows), trainer.compute.describe() or "float32"


def end_to_end(cfg: Config, steps: int, run_dir: Path) -> float:
    """Unique images per second of whole training steps (``Trainer.train_epoch``)."""
    from idml.app.training import Trainer

    cfg.optim.max_steps_per_epoch = steps
    trainer = Trainer(cfg, run_dir, progress=False)
    record = trainer.train_epoch(0)
    return record.steps * cfg.sampler.effective_batch_size / record.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    parser.add_argument("--batch", type=int, default=120, help="unique images per step (÷ 4)")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--images", type=int, default=1920, help="synthetic JPEGs written")
    parser.add_argument("--classes", type=int, default=None, help="default: images / 8")
    parser.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    parser.add_argument(
        "--steps", type=int, default=10, help="timed model steps per method (0: no model step)"
    )
    parser.add_argument("--loader-batches", type=int, default=12)
    parser.add_argument(
        "--repeats", type=int, default=1, help="model-step measurements per plan (median shown)"
    )
    parser.add_argument("--paths", default=",".join(PATHS), help="data paths to measure")
    parser.add_argument("--methods", default="baseline,idml")
    parser.add_argument("--amp", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--compute",
        default=",".join(COMPUTE),
        help=f"compute plans of the model step, of {', '.join(COMPUTE)}",
    )
    parser.add_argument(
        "--backbone", default="resnet50", help="the model step's backbone (untrained weights)"
    )
    parser.add_argument(
        "--sections",
        default="core,loader,step",
        help="what to measure, of core (1. per core), loader (2.), step (3.)",
    )
    parser.add_argument("--end-to-end", action="store_true", help="also loader + step together")
    parser.add_argument("--data", type=Path, default=None, help="reuse this synthetic folder")
    args = parser.parse_args()
    unknown = sorted(set(args.compute.split(",")) - set(COMPUTE))
    if unknown:
        parser.error(f"--compute {','.join(unknown)}: choose among {', '.join(COMPUTE)}")
    sections = set(args.sections.split(","))
    if sections - SECTIONS:
        parser.error(
            f"--sections {','.join(sorted(sections - SECTIONS))}: choose among "
            f"{', '.join(sorted(SECTIONS))}"
        )
    from bench_evaluation import cpu_model  # the one reading of the CPU's model name

    if args.batch % 4:
        parser.error("--batch must be a multiple of 4 (P classes × 4 images)")
    device = torch.device(args.device)
    paths, methods = args.paths.split(","), args.methods.split(",")
    print(
        f"machine: {cpu_model()}, {os.cpu_count()} CPUs, device {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
        + f", torch {torch.__version__}, load average {os.getloadavg()[0]:.2f}"
    )
    work = Path(tempfile.mkdtemp(prefix="idml-throughput-"))
    try:
        root = args.data or work / "images"
        if args.data is None:
            start = time.perf_counter()
            classes = args.classes or max(args.images // 8, 2 * args.batch // 4)
            write_dataset(root, args.images, classes)
            print(
                f"wrote {args.images} JPEGs in {classes} classes in {time.perf_counter() - start:.0f} s"
            )
        files = sorted(root.rglob("*.jpg"))
        cache = work / "cache"
        from idml.app.image_cache import cache_dataset

        start = time.perf_counter()
        cache_dataset(
            config("baseline", args, root, cache, "reference"), cache, 512, progress=False
        )
        print(f"idml cache: {len(files)} images in {time.perf_counter() - start:.1f} s")

        if "core" in sections:
            print(f"\n1. per core (one thread); anchor: {ANCHOR}\n")
            print("| stage | images/s per core |\n| --- | --- |")
            for what, value in per_core(files, cache, device, args.image_size):
                print(f"| {what} | {value:,.0f} |")

        if "loader" in sections:
            print(f"\n2. loader ceiling ({args.workers} workers, batch {args.batch}, no model)\n")
            print("| data path | unique images/s |\n| --- | --- |")
            for path in paths:
                value = loader_ceiling(
                    config("baseline", args, root, cache, path), args.loader_batches, device
                )
                print(f"| {path} | {value:,.0f} |", flush=True)

        if "step" in sections and args.steps > 0:
            plans = args.compute.split(",")
            print(
                f"\n3. model step ({args.backbone}, {args.image_size} px, batch {args.batch}, amp "
                f"{args.amp}; median of {args.repeats} interleaved repeats, × against "
                f"{plans[0]})\n"
            )
            print(
                "| method | compute | rows per step | unique images/s | × |\n"
                "| --- | --- | --- | --- | --- |"
            )
            for method in methods:
                rates: dict[str, list[float]] = {plan: [] for plan in plans}
                seen: dict[str, tuple[int, str]] = {}
                # Plans interleaved: a slow spell of a shared machine then hits every plan alike.
                for repeat in range(args.repeats):
                    for plan in plans:
                        cfg = config(method, args, root, cache, "reference", COMPUTE[plan])
                        value, rows, described = model_step(
                            cfg, args.steps, device, work / f"run-{method}-{plan}-{repeat}"
                        )
                        rates[plan].append(value)
                        seen[plan] = (rows, described)
                first = statistics.median(rates[plans[0]])
                for plan in plans:
                    rows, described = seen[plan]
                    value = statistics.median(rates[plan])
                    print(
                        f"| {method} | {plan}: {described} | {rows} | {value:,.1f} | "
                        f"{value / first:.2f} |",
                        flush=True,
                    )

        if args.end_to_end:
            print("\n4. end to end (loader + step, Trainer.train_epoch)\n")
            print("| method | data path | unique images/s |\n| --- | --- | --- |")
            for method in methods:
                for path in paths:
                    cfg = config(method, args, root, cache, path)
                    value = end_to_end(cfg, args.steps, work / f"e2e-{method}-{path}")
                    print(f"| {method} | {path} | {value:,.1f} |", flush=True)
        print(f"\nload average at the end: {os.getloadavg()[0]:.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
