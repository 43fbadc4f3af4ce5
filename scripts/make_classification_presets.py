"""Write the classification presets under configs/classification/ (run from the repository root).

One preset per row of the IDML authors' classification table (ImageNet-1K, CIFAR-100, CIFAR-10 ×
baseline, ISM-baseline, Mixup, IDML-Mixup, CutMix, IDML-CutMix; ResNet-50, "CutMix setting"). The
training recipe is the CutMix paper's (Yun et al. 2019), as its released code runs it
(clovaai/CutMix-PyTorch, README commands and train.py):

- ImageNet-1K: 300 epochs, batch 256, SGD (momentum 0.9, Nesterov), lr 0.1 × 0.1 after epochs 75,
  150 and 225, weight decay 1e-4, RandomResizedCrop 224 + flip, test resize 256 / centre crop 224;
  CutMix β = 1 on every batch (``cutmix_prob 1.0``). Its baseline, Mixup and CutMix rows (76.32,
  77.42, 78.60 top-1) are the CutMix paper's Table 3 numbers, which the IDML table repeats.
- CIFAR-10/100: 300 epochs, batch 64, lr 0.25 × 0.1 after epochs 150 and 225, weight decay 1e-4,
  CutMix β = 1 on half of the batches (``cutmix_prob 0.5``). The code's pad-4 random crop is
  approximated by a RandomResizedCrop of area 0.75–1 at 32 px (this library has no padding crop).

Not stated by either paper, so chosen here: Mixup with α = 1 under the same schedule and
probability as CutMix; a 2048-d semantic head (the ResNet-50 feature width) under the cosine
classifier with scale s = 20 (1/T of the normalised softmax recipe, T = 0.05); for ISM, γ = 0,
τ = 5 (the metric-learning defaults) and the uncertainty head started at N(0, 0.001²) so ISM starts
as the cosine classifier. The backbone trains from scratch (BatchNorm trains), as in the CutMix code.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
# The recipe keys of this checkout, not those of some other installed idml.
sys.path.insert(0, str(REPO / "src"))

from idml.app.config import (  # noqa: E402
    config_to_dict,
    load_config,
    read_fragment,
    validate_config,
)
from idml.app.paper import recipe_of  # noqa: E402

OUT = REPO / "configs" / "classification"
# The authors' README table (top-1, top-5 in %; CIFAR-10 has no top-5 there).
PUBLISHED: dict[tuple[str, str], dict[str, float]] = {
    ("imagenet1k", "baseline"): {"top1": 76.32, "top5": 92.95},
    ("imagenet1k", "ism_baseline"): {"top1": 76.94, "top5": 93.24},
    ("imagenet1k", "mixup"): {"top1": 77.42, "top5": 93.60},
    ("imagenet1k", "idml_mixup"): {"top1": 77.95, "top5": 93.93},
    ("imagenet1k", "cutmix"): {"top1": 78.60, "top5": 94.08},
    ("imagenet1k", "idml_cutmix"): {"top1": 79.04, "top5": 94.47},
    ("cifar100", "baseline"): {"top1": 83.55, "top5": 96.31},
    ("cifar100", "ism_baseline"): {"top1": 84.08, "top5": 96.46},
    ("cifar100", "mixup"): {"top1": 84.22, "top5": 95.96},
    ("cifar100", "idml_mixup"): {"top1": 84.59, "top5": 96.79},
    ("cifar100", "cutmix"): {"top1": 85.53, "top5": 97.03},
    ("cifar100", "idml_cutmix"): {"top1": 85.65, "top5": 97.21},
    ("cifar10", "baseline"): {"top1": 96.15},
    ("cifar10", "ism_baseline"): {"top1": 96.43},
    ("cifar10", "mixup"): {"top1": 96.91},
    ("cifar10", "idml_mixup"): {"top1": 97.13},
    ("cifar10", "cutmix"): {"top1": 97.12},
    ("cifar10", "idml_cutmix"): {"top1": 97.32},
}

DATASETS: dict[str, dict[str, Any]] = {
    "imagenet1k": {
        "classes": 1000,
        "root": "data/imagenet",
        "image_size": 224,
        "resize_size": 256,
        "train_crop_scale": [0.08, 1.0],
        "batch_size": 256,
        "lr": 0.1,
        "milestones": [75, 150, 225],
        "mix_prob": 1.0,
        "eval_every": 5,
    },
    "cifar100": {
        "classes": 100,
        "root": "data/cifar100",
        "image_size": 32,
        "resize_size": None,
        "train_crop_scale": [0.75, 1.0],
        "batch_size": 64,
        "lr": 0.25,
        "milestones": [150, 225],
        "mix_prob": 0.5,
        "eval_every": 1,
    },
}
# CIFAR-10 follows the CIFAR-100 recipe of the CutMix code; only the folder differs.
DATASETS["cifar10"] = {**DATASETS["cifar100"], "classes": 10, "root": "data/cifar10"}
# Method → (mixing, ISM) and the packaged method fragment that switches those components on: the
# same fragments as the metric-learning presets, so `method/idml` means one thing everywhere.
FRAGMENT = {
    ("none", False): "method/plain",
    ("none", True): "method/ism",
    ("mixup", False): "method/mixup",
    ("mixup", True): "method/idml",
    ("cutmix", False): "method/mixup",
    ("cutmix", True): "method/idml",
}
METHODS: dict[str, tuple[str, bool]] = {
    "baseline": ("none", False),
    "ism_baseline": ("none", True),
    "mixup": ("mixup", False),
    "idml_mixup": ("mixup", True),
    "cutmix": ("cutmix", False),
    "idml_cutmix": ("cutmix", True),
}


def recipe(dataset: str, method: str, numbers: dict[str, float] | None) -> dict[str, Any]:
    """The whole recipe of one row, every key it sets spelled out."""
    d = DATASETS[dataset]
    mix, ism = METHODS[method]
    cfg: dict[str, Any] = {
        "name": f"{dataset}-{method}",
        "task": {"name": "classification", "scale": 20.0},
        "data": {
            "dataset": "folder",
            "root": d["root"],
            "image_size": d["image_size"],
            "resize_size": d["resize_size"],
            "train_crop_scale": d["train_crop_scale"],
            "num_workers": 8,
        },
        "sampler": {"kind": "random", "batch_size": d["batch_size"]},
        "model": {
            "backbone": "resnet50",
            "pretrained": False,
            "embedding_dim": 2048,
            "pooling": "avg",
            "freeze_bn": False,
            # The library's bounded uncertainty head: ISM starts as the plain softmax.
            "uncertainty": {"enabled": ism},
        },
        "metric": {"introspective": ism, "gamma": 0.0, "tau": 5.0},
        "mixup": {"enabled": mix != "none"},
        "optim": {
            "optimizer": "sgd",
            "momentum": 0.9,
            "nesterov": True,
            "epochs": 300,
            "lr": d["lr"],
            "weight_decay": 1e-4,
            "proxy_lr_mult": 1.0,
            "scheduler": "multistep",
            "milestones": d["milestones"],
            "step_gamma": 0.1,
            "grad_clip": None,
        },
        "eval": {"every": d["eval_every"]},
    }
    if mix != "none":
        cfg["mixup"] |= {"kind": mix, "alpha": 1.0, "probability": d["mix_prob"]}
    if numbers:
        # The data is a folder, so the number of classes tells CIFAR-10, CIFAR-100 and ImageNet
        # from any other folder of images.
        cfg["published"] = {
            "source": f"IDML authors' README, classification table, row '{dataset} {method}'",
            "metrics": numbers,
            "recipe": recipe_of(config_to_dict(validate_config(cfg))),
            "classes": d["classes"],
        }
    return cfg


def preset(dataset: str, method: str, numbers: dict[str, float] | None) -> dict[str, Any]:
    """The row as its method fragment plus the keys the fragment does not give."""
    full = recipe(dataset, method, numbers)
    mix, ism = METHODS[method]
    fragment = FRAGMENT[(mix, ism)]
    given = read_fragment(fragment)
    return {"include": [fragment], **_without(full, given)}


def _without(full: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """``full`` less the values ``given`` already sets (sections emptied by it are dropped)."""
    out: dict[str, Any] = {}
    for key, value in full.items():
        if isinstance(value, dict) and isinstance(given.get(key), dict):
            rest = _without(value, given[key])
            if rest:
                out[key] = rest
        elif given.get(key, object()) != value:
            out[key] = value
    return out


def main() -> None:
    numbers = PUBLISHED
    OUT.mkdir(parents=True, exist_ok=True)
    for dataset in DATASETS:
        for method in METHODS:
            cfg = preset(dataset, method, numbers.get((dataset, method)))
            header = (
                f"# IDML classification table: {dataset}, {method} (ResNet-50, CutMix setting)\n"
                "# Generated by scripts/make_classification_presets.py (recipe and sources in its\n"
                "# docstring); `published` is the authors' top-1/top-5 in %, documentation only, compared\n"
                "# with a run that keeps `published.recipe` and `published.classes`.\n"
                f"# data.root: train/<class>/ and val/<class>/ (README, classification data).\n"
            )
            path = OUT / f"{dataset}_{method}.yaml"
            path.write_text(header + yaml.safe_dump(cfg, sort_keys=False))
            full = recipe(dataset, method, numbers.get((dataset, method)))
            if load_config(path) != validate_config(full):
                raise SystemExit(f"{path} does not resolve to the recipe {full}")
            print(path.relative_to(REPO))


if __name__ == "__main__":
    main()
