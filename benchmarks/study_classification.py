"""IDML for classification, measured: baseline vs ISM-baseline, Mixup vs IDML-Mixup, CutMix vs
IDML-CutMix on Fashion-MNIST with EfficientNet-Lite0, every arm for several seeds on one budget.

The six arms are the rows of the IDML authors' classification table (ResNet-50, CutMix setting):
the plain cosine classifier and the introspective one (ISM, ``metric.introspective``), each with no
mixing, Mixup and CutMix (λ-weighted set labels; a batch is mixed with probability 0.5, the CutMix
paper's CIFAR recipe). Here on the standard Fashion-MNIST split (every class in train and test),
subsampled and shrunk to 32 px so the whole study fits a 2-core CPU machine: Lite0 from its shipped
ImageNet weights (BatchNorm frozen), one torch thread per process (``--threads``; see
``benchmarks/RESULTS.md`` for why). Every (arm, seed) runs through
:func:`idml.app.ablation.run_ablation` (finished runs are reused on a re-run); the table of top-1, top-5,
ECE and the ``||u||`` probes (mean ± std over seeds) goes to ``benchmarks/study/classification.md``.

Run: ``python benchmarks/study_classification.py [--seeds 5] [--quick]``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from idml.app.ablation import parse_grid, run_ablation

REPO = Path(__file__).resolve().parents[1]

SETTINGS = [
    "task=classification",
    "data.dataset=fashion_mnist",
    "data.samples_per_class=120",
    "task.test_samples_per_class=50",
    "data.image_size=32",
    "data.resize_size=null",
    "data.train_crop_scale=[0.7, 1.0]",
    "data.num_workers=0",
    "sampler.batch_size=50",
    "model.backbone=efficientnet_lite0",
    "model.pretrained=true",
    "model.embedding_dim=128",
    # ISM arms: u starts near 0 (ISM ≈ the cosine classifier) and its head learns at 0.01 × lr, so
    # ||u|| cannot outgrow the semantic distances within the short budget (the arms without ISM have
    # no uncertainty head; these keys do nothing there).
    "model.uncertainty.form=linear",
    "model.uncertainty.init_std=0.001",
    "optim.uncertainty_lr_mult=0.01",
    "task.scale=16",
    "mixup.probability=0.5",
    "optim.epochs=1",
    "optim.lr=0.0003",
    "optim.head_lr_mult=10",
    "optim.proxy_lr_mult=10",
    "optim.scheduler=none",
    "optim.amp=false",
    "tensorboard=false",
]
MIXES = ("none", "mixup", "cutmix")
GRID = ["metric=plain,ism", "mix=" + ",".join(MIXES)]
METRICS = ["top1", "top5", "ece", "nll", "u_clean", "u_mixup", "u_cutmix", "u_lowres"]


def summary(out: Path) -> str:
    """Markdown tables from the runs' ``result.json``: each arm's mean ± std (top-1, top-5, ECE in
    %, NLL in nats, ``||u||`` as is), then ISM − plain per mixing as paired differences over seeds
    (seed ``k`` of both arms shares the data subsample and the batch order) with a paired t-test."""
    import json

    import numpy as np
    from scipy import stats

    runs: dict[tuple[str, str], dict[int, dict[str, float]]] = {}
    for path in sorted(out.glob("cells/*/seed*/result.json")):
        record = json.loads(path.read_text())
        arm = (record["assignment"]["metric"], record["assignment"]["mix"])
        runs.setdefault(arm, {})[int(record["seed"])] = {
            **record["final_metrics"],
            "seconds": record["wall_seconds"],
        }
    scale = {"top1": 100, "top5": 100, "ece": 100}
    columns = [*METRICS, "seconds"]
    lines = [
        "| metric | mix | seeds | " + " | ".join(columns) + " |",
        "|" + "---|" * (len(columns) + 3),
    ]
    for (metric, mix), seeds in sorted(
        runs.items(), key=lambda kv: (MIXES.index(kv[0][1]), kv[0][0] != "plain")
    ):
        cells = []
        for key in columns:
            values = [r[key] * scale.get(key, 1) for r in seeds.values() if key in r]
            cells.append(
                f"{np.mean(values):.2f} ± {np.std(values, ddof=1):.2f}" if len(values) > 1 else "–"
            )
        lines.append(f"| {metric} | {mix} | {len(seeds)} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "ISM − plain, paired by seed (mean ± std of the differences; two-sided paired t-test):",
        "",
        "| mix | Δ top1 (pp) | p | Δ ECE (pp) | p |",
        "|---|---|---|---|---|",
    ]
    for mix in MIXES:
        plain, ism = runs.get(("plain", mix), {}), runs.get(("ism", mix), {})
        shared = sorted(set(plain) & set(ism))
        if len(shared) < 2:
            continue
        row = [mix]
        for key in ("top1", "ece"):
            diff = np.array([100 * (ism[s][key] - plain[s][key]) for s in shared])
            p = stats.ttest_rel(
                [ism[s][key] for s in shared], [plain[s][key] for s in shared]
            ).pvalue
            row += [f"{diff.mean():+.2f} ± {diff.std(ddof=1):.2f}", f"{p:.2f}"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="3 steps on a tiny subsample")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "study" / "classification")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument(
        "--tables-only",
        action="store_true",
        help="train nothing; tabulate the finished runs (also runs of an older config schema)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    extra = ["optim.max_steps_per_epoch=3", "data.samples_per_class=20"] if args.quick else []
    start = time.perf_counter()
    out = args.out.with_name(args.out.name + "_quick") if args.quick else args.out
    if not args.tables_only:  # --tables-only: tabulate every finished result.json as it is
        run_ablation(
            None,
            parse_grid(GRID),
            seeds=args.seeds,
            out_dir=out,
            overrides=[*SETTINGS, *extra],
            metrics=METRICS,
            progress=False,
        )
    minutes = (time.perf_counter() - start) / 60
    if args.tables_only:
        import json

        results = out.glob("cells/*/seed*/result.json")
        minutes = sum(json.loads(p.read_text())["wall_seconds"] for p in results) / 60
    tables = REPO / "benchmarks" / "study"
    tables.mkdir(parents=True, exist_ok=True)
    suffix = "_quick" if args.quick else ""
    text = "\n".join(
        [
            "# Classification study: Fashion-MNIST, EfficientNet-Lite0\n",
            "Settings: `" + " ".join([*SETTINGS, *extra]) + "`\n",
            "Grid: `" + " ".join(GRID) + f"`, {args.seeds} seeds\n",
            summary(out),
            f"\nTotal wall time of the runs: {minutes:.1f} min ({args.threads} thread(s)).\n",
        ]
    )
    (tables / f"classification{suffix}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
