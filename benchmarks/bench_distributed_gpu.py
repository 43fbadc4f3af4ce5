"""Multi-GPU throughput: training images/s of ResNet-50 at 224 px in bf16 on 1 GPU and on all visible GPUs.

The step is :mod:`bench_distributed`'s (Mixup per GPU → forward → all-gather → ProxyAnchor + ISM on the
global batch → backward with DDP's NCCL all-reduce → AdamW), on synthetic images already on the GPU,
so the numbers are the training step's ceiling without data loading. Weak scaling: every GPU keeps
``--per-gpu-batch`` original images (plus as many Mixup images), so the global batch grows with the
GPU count. Efficiency = images/s on ``G`` GPUs / (``G`` × images/s on one).

Run on a GPU machine: ``python benchmarks/bench_distributed_gpu.py [--per-gpu-batch 64] [--markdown]``.
Without a GPU it says so and exits 0; ``--tiny`` runs the same code on CPU (small CNN, 32 px, 1 and 2
gloo processes) to check the script itself.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_distributed import environment, launch, parser, table, worker, worker_options


def main() -> None:
    defaults = {
        "device": "cuda",
        "backbone": "resnet50",
        "image_size": 224,
        "global_batch": 64,
        "steps": 20,
        "precision": "bf16",
    }
    p = parser(defaults)
    p.add_argument("--per-gpu-batch", type=int, default=64, help="original images per GPU")
    p.add_argument("--tiny", action="store_true", help="check the script on CPU (no GPU needed)")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.tiny:
        args.device, args.backbone, args.image_size = "cpu", "small_cnn", 32
        args.per_gpu_batch, args.steps, args.warmup = 4, 2, 1
        counts = [1, 2]
    else:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus == 0:
            print("no CUDA GPU is visible: nothing to measure (--tiny checks the script on CPU)")
            return
        counts = sorted({1, gpus})
    rows = []
    for count in counts:
        args.global_batch = args.per_gpu_batch * count
        threads = 1 if args.device == "cpu" else int(os.environ.get("OMP_NUM_THREADS", "4"))
        rows.append(launch(Path(__file__), count, threads, worker_options(args), environment()))
    device = "CPU (--tiny)" if args.tiny else torch.cuda.get_device_name(0)
    print(
        f"{args.backbone} at {args.image_size} px, {args.per_gpu_batch} images per process "
        f"(+ Mixup), ProxyAnchor + ISM, {args.precision}; {device}, torch {torch.__version__}"
    )
    print(table(rows, args.markdown))
    single = rows[0]["images_per_s"]
    for row in rows[1:]:
        efficiency = row["images_per_s"] / (row["world_size"] * single)
        print(f"scaling efficiency on {row['world_size']} processes: {efficiency:.0%}")


if __name__ == "__main__":
    main()
