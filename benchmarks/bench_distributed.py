"""Data-parallel scaling: training images/s with 1 and with R processes, and what communication costs.

Each process runs the trainer's step on synthetic images already in memory (no data loading):
Mixup per shard → forward → all-gather of embeddings, label sets and Mixup details
(:func:`idml.app.distributed.gather_batch`) → ProxyAnchor + ISM on the global batch → backward (DDP
all-reduces the gradients of model and proxies) → AdamW step. This mirrors
``Trainer.train_step``; it is written out here so the autocast dtype can be chosen (bf16 on GPUs).

Reported per setting, medians over the timed steps after warm-up:

- ``step``: the whole step; ``images/s`` = global batch of *original* images / step (the network also
  sees as many Mixup images with the default ``--mixup-fraction 1``);
- ``no-sync``: the same step inside ``DistributedDataParallel.no_sync()`` — no gradient all-reduce —
  so ``step − no-sync`` is the all-reduce time the backward does not hide;
- ``gather``: the batch all-gather alone (its backward, a reduce-scatter of the embedding gradient,
  is inside ``step``);
- ``all-reduce``: one all-reduce of a buffer as large as all gradients (what DDP moves per step, in
  25 MB buckets overlapped with the backward; an upper bound on the exposed cost).

CPU mode (this file): a fixed global batch shared by 1 or 2 gloo processes, compared with one process
using as many threads (strong scaling on the same cores). GPU mode: ``bench_distributed_gpu.py``.

Run: ``python benchmarks/bench_distributed.py [--processes 1 2] [--markdown]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent


# --------------------------------------------------------------------------- worker (one rank)
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _median_seconds(
    fn: Callable[[], object], steps: int, warmup: int, device: torch.device
) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def worker(args: argparse.Namespace) -> None:
    """One rank: time the step, its no-sync variant, the gather and a gradient-sized all-reduce."""
    import torch.distributed as dist

    from idml.app.distributed import ShardPlan, init_distributed, wrap_ddp
    from idml.augment import Mixup
    from idml.embeddings import Embeddings
    from idml.losses import ProxyAnchorLoss
    from idml.metrics import CosineSimilarity, IntrospectiveMetric
    from idml.models import build_model

    warnings.simplefilter("ignore")  # freeze_bn on random weights warns; irrelevant for timing
    torch.set_num_threads(args.threads)
    context = init_distributed(device=args.device)
    device = context.device
    torch.manual_seed(0)
    model = build_model(
        args.backbone,
        pretrained=False,
        embedding_dim=512,
        uncertainty=True,
        freeze_bn=True,
    ).to(device)
    metric = IntrospectiveMetric(CosineSimilarity(), gamma=0.0, tau=5.0)
    loss_fn = ProxyAnchorLoss(args.classes, 512, metric).to(device)
    params = [*model.parameters(), *loss_fn.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    ddp = wrap_ddp({"model": model, "loss": loss_fn}, context)
    plan = ShardPlan.create(context)
    augment = Mixup(fraction=args.mixup_fraction)
    per_rank = args.global_batch // context.world_size
    g = torch.Generator().manual_seed(context.rank)
    images = torch.rand(per_rank, 3, args.image_size, args.image_size, generator=g).to(device)
    labels = torch.randint(0, args.classes, (per_rank,), generator=g).to(device)
    aug_gen = plan.generators(torch.Generator().manual_seed(1))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[args.precision]

    def forward() -> torch.Tensor:
        batch = plan.augment(augment, images, labels, aug_gen)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            out = model(batch.images)
            emb = Embeddings(out.semantic.float(), out.uncertainty.float())
            emb, merged = plan.gather(emb, batch)
            return merged.loss(loss_fn, emb)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = ddp(forward) if ddp is not None else forward()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 10.0)
        optimizer.step()

    def step_no_sync() -> None:
        assert ddp is not None
        with ddp.no_sync():
            step()

    result: dict[str, Any] = {
        "world_size": context.world_size,
        "threads": args.threads,
        "global_batch": per_rank * context.world_size,
        "step": _median_seconds(step, args.steps, args.warmup, device),
    }
    if ddp is not None:
        result["no_sync"] = _median_seconds(step_no_sync, args.steps, args.warmup, device)
        with torch.no_grad():
            out = model(images)
        batch = plan.augment(augment, images, labels, aug_gen)
        emb = Embeddings(
            out.semantic.float().repeat(2, 1)[: len(batch.labels)],
            out.uncertainty.float().repeat(2, 1)[: len(batch.labels)],
        )
        result["gather"] = _median_seconds(
            lambda: plan.gather(emb, batch), args.steps, args.warmup, device
        )
        flat = torch.zeros(sum(p.numel() for p in params), device=device)
        result["all_reduce"] = _median_seconds(
            lambda: dist.all_reduce(flat), args.steps, args.warmup, device
        )
        result["gradient_mb"] = flat.numel() * 4 / 2**20
    result["images_per_s"] = result["global_batch"] / result["step"]
    if context.is_main:
        Path(args.result).write_text(json.dumps(result))
    if context.is_distributed:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- launcher
def launch(
    script: Path, processes: int, threads: int, options: list[str], env: dict[str, str]
) -> dict[str, Any]:
    """Run ``script --worker`` under torchrun with ``processes`` ranks; rank 0's measurements."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += [f"--nproc_per_node={processes}", str(script), "--worker"]
        command += ["--threads", str(threads), "--result", str(result), *options]
        run_env = {**env, "OMP_NUM_THREADS": str(threads)}
        done = subprocess.run(command, env=run_env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(
                f"{processes}-process run failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
            )
        return json.loads(result.read_text())


def table(rows: list[dict[str, Any]], markdown: bool) -> str:
    head = ["processes", "threads/proc", "global batch", "step ms", "images/s", "speed-up"]
    head += ["no-sync ms", "exposed all-reduce ms", "gather ms", "all-reduce ms (grad MB)"]
    base = rows[0]["images_per_s"]
    lines = []
    for r in rows:
        dist_cols = ["–"] * 4
        if "no_sync" in r:
            dist_cols = [
                f"{1e3 * r['no_sync']:.1f}",
                f"{1e3 * (r['step'] - r['no_sync']):.1f}",
                f"{1e3 * r['gather']:.2f}",
                f"{1e3 * r['all_reduce']:.1f} ({r['gradient_mb']:.0f})",
            ]
        lines.append(
            [
                str(r["world_size"]),
                str(r["threads"]),
                str(r["global_batch"]),
                f"{1e3 * r['step']:.1f}",
                f"{r['images_per_s']:.1f}",
                f"{r['images_per_s'] / base:.2f}",
                *dist_cols,
            ]
        )
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        out += ["| " + " | ".join(line) + " |" for line in lines]
        return "\n".join(out)
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([fmt.format(*head), *(fmt.format(*line) for line in lines)])


def worker_options(args: argparse.Namespace) -> list[str]:
    """The model/batch options a launcher forwards to its workers."""
    return [
        "--device", args.device, "--backbone", args.backbone, "--image-size", str(args.image_size),
        "--global-batch", str(args.global_batch), "--classes", str(args.classes),
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--precision", args.precision,
        "--mixup-fraction", str(args.mixup_fraction),
    ]  # fmt: skip


def parser(defaults: dict[str, Any]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--device", default=defaults["device"])
    p.add_argument("--backbone", default=defaults["backbone"])
    p.add_argument("--image-size", type=int, default=defaults["image_size"])
    p.add_argument("--global-batch", type=int, default=defaults["global_batch"])
    p.add_argument("--classes", type=int, default=100, help="proxies of ProxyAnchor")
    p.add_argument("--steps", type=int, default=defaults["steps"])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default=defaults["precision"])
    p.add_argument("--mixup-fraction", type=float, default=1.0)
    p.add_argument("--markdown", action="store_true")
    return p


def environment() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent / "src"), env.get("PYTHONPATH", "")])
    return env


def main() -> None:
    defaults = {
        "device": "cpu",
        "backbone": "resnet18",
        "image_size": 64,
        "global_batch": 32,
        "steps": 10,
        "precision": "fp32",
    }
    p = parser(defaults)
    p.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    cores = max(args.processes)
    rows = []
    for processes in sorted(set(args.processes)):
        rows.append(launch(Path(__file__), processes, 1, worker_options(args), environment()))
        if processes == 1 and cores > 1:
            # The same cores as the largest job, used by one process's intra-op threads instead.
            rows.append(launch(Path(__file__), 1, cores, worker_options(args), environment()))
    print(
        f"{args.backbone} at {args.image_size} px, global batch {args.global_batch} (+ Mixup), "
        f"ProxyAnchor + ISM, {args.precision}, {args.device}; {platform.processor() or 'cpu'}, "
        f"{os.cpu_count()} logical CPUs, torch {torch.__version__}"
    )
    print(table(rows, args.markdown))


if __name__ == "__main__":
    main()
