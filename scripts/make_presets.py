"""Write the paper-recipe presets under configs/ (run from the repository root).

Each recipe is spelled out here in full (the method's keys read from its packaged fragment,
``method/<baseline|idml|ssr>``); a preset file lists the fragments of its dataset, backbone, loss
and method under ``include:`` and holds only the keys those fragments do not already give. Before
writing, every preset is checked to resolve to its full recipe. Re-run after changing a recipe or a fragment, and
commit the output; ``tests/test_published.py`` fails while the committed files differ from it.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1] / "configs"
# The fragments of this checkout, not those of some other installed idml.
sys.path.insert(0, str(ROOT.parent / "src"))

from idml.app.config import (  # noqa: E402
    config_difference,
    config_to_dict,
    merge_configs,
    read_fragment,
    validate_config,
)
from idml.app.paper import recipe_of  # noqa: E402

DATASETS: dict[str, dict[str, Any]] = {
    "cub": {
        "lr": 6e-4,
        "step_size": 5,
        "step_gamma": 0.5,
        "gamma": 0.0,
        "root": "data/CUB_200_2011",
    },
    "cars": {
        "lr": 2.5e-4,
        "step_size": 10,
        "step_gamma": 0.5,
        "gamma": 2.0,
        "root": "data/cars196",
    },
    "sop": {
        "lr": 6e-4,
        "step_size": 10,
        "step_gamma": 0.25,
        "gamma": 0.0,
        "root": "data/Stanford_Online_Products",
    },
}
# Losses of the IDML paper's Table I, with the sampler each one is trained with.
LOSSES: dict[str, dict[str, Any]] = {
    "triplet": {"sampler": "balanced"},
    "proxy_nca": {"sampler": "random"},
    "fastap": {"sampler": "balanced"},
    "contrastive": {"sampler": "balanced"},
    "margin": {"sampler": "balanced"},
    "multi_similarity": {"sampler": "balanced"},
    "proxy_anchor": {"sampler": "random"},
}
# Published numbers come from configs/published.json (written by scripts/parse_published.py from
# the papers' text); each preset names the source rows it copies. The IDML paper's Table I did not
# survive the text extraction, so only the ProxyAnchor rows its text states are filled; the other
# rows are left empty rather than guessed.
TABLES: list[dict[str, Any]] = json.loads((ROOT / "published.json").read_text())["rows"]


def published(*picks: tuple[str, str, str | None, str]) -> dict[str, Any] | None:
    """The ``published`` block of a preset from (table, row, setting, dataset) picks, in order.

    Later picks add metrics the earlier ones lack; a pick that matches no row is an error here,
    so a typo cannot silently drop a preset's numbers.
    """
    metrics: dict[str, float] = {}
    sources = []
    for table, row, setting, dataset in picks:
        found = [
            r
            for r in TABLES
            if (r["table"], r["row"], r["setting"], r["dataset"]) == (table, row, setting, dataset)
        ]
        if len(found) != 1:
            raise SystemExit(f"{len(found)} rows of published.json match {table}/{row}/{setting}")
        for key, value in found[0]["metrics"].items():
            metrics.setdefault(key, value)
        where = f"{table}, row '{row}'" + (f", {setting}" if setting else "")
        sources.append(f"{found[0]['paper']}, {where}")
    if not metrics:
        return None
    return {"source": "; ".join(sources), "metrics": metrics}


IDML_TEXT_ROWS = {
    "idml": "IDML-ProxyAnchor",
    "baseline": "ProxyAnchor (IDML minus the stated gain)",
}


def recipe(dataset: str, loss: str, variant: str) -> dict[str, Any]:
    """The IDML paper's recipe in full; ``variant``: ``baseline``, ``idml`` or (SSR presets) ``ssr``."""
    d = DATASETS[dataset]
    cfg: dict[str, Any] = {
        "name": f"{dataset}-{loss}-{variant}",
        "data": {"dataset": dataset, "root": d["root"], "image_size": 224, "resize_size": 256},
        "sampler": (
            {"kind": "balanced", "classes_per_batch": 30, "images_per_class": 4}
            if LOSSES[loss]["sampler"] == "balanced"
            else {"kind": "random", "batch_size": 120}
        ),
        "model": {
            "backbone": "resnet50",
            "pretrained": True,
            "embedding_dim": 512,
            "pooling": "sum",
        },
        "loss": {"name": loss},
        "optim": {
            "epochs": 60,
            "lr": d["lr"],
            "weight_decay": 1e-4,
            "proxy_lr_mult": 100.0,
            "scheduler": "step",
            "step_size": d["step_size"],
            "step_gamma": d["step_gamma"],
            "warmup_epochs": 5,
            "grad_clip": 10.0,
        },
        "eval": {"ks": [1, 10, 100, 1000] if dataset == "sop" else [1, 2, 4, 8]},
    }
    cfg = merge_configs(cfg, read_fragment(f"method/{variant}"))
    if variant == "idml":
        cfg = merge_configs(
            cfg,
            {"metric": {"gamma": d["gamma"], "tau": 5.0}, "mixup": {"alpha": 1.0, "mode": "set"}},
        )
    cfg["published"] = (
        published(("Sec. IV text", IDML_TEXT_ROWS[variant], "R512", dataset))
        if loss == "proxy_anchor"
        else None
    )
    return cfg


def official(dataset: str) -> dict[str, Any]:
    """The authors' released IDML-ProxyAnchor code, reproduced with its quirks.

    Only ProxyAnchor has ISM there, with squared norms in the exponent, ``γ = 4`` and ``τ = 5`` fixed,
    ``δ`` between unnormalised proxies and samples, and an L2-normalised ``u`` (README, "Presets").
    """
    cfg = recipe(dataset, "proxy_anchor", "idml")
    cfg["name"] = f"{dataset}-proxy_anchor-official"
    cfg = merge_configs(
        cfg,
        {
            "model": {"uncertainty": {"form": "linear", "normalize": True}},
            "metric": {"gamma": 4.0, "tau": 5.0, "power": 2, "delta_normalized": False},
            "mixup": {"alpha": 1.0, "mode": "interpolate"},
        },
    )
    # The README of the released code reports what that code reaches.
    cfg["published"] = published(("Results", "idml_proxy_anchor", "R512", dataset))
    return cfg


# SSR presets (Fu et al. 2021): (dataset, loss, embedding size). Table 1 holds the 128-d rows of
# SSR and of the authors' re-implemented baselines, Table 2 the 512-d Margin row, Table 3 MAP and
# R-Precision at 128-d of SSR and of the baseline methods.
SSR_ROWS: list[tuple[str, str, int]] = [
    (ds, loss, dim)
    for ds in DATASETS
    for loss, dim in (("triplet", 128), ("margin", 128), ("multi_similarity", 128), ("margin", 512))
]
SSR_METHOD = {"triplet": "Triplet", "margin": "Margin", "multi_similarity": "MS"}
# Table 3's rows of the baseline methods (the SSR authors' measurements, R128).
SSR_TABLE3_BASELINE = {
    "triplet": "Triplet-semi (Schrof et al. 2015)",
    "margin": "Margin (Wu et al. 2017)",
    "multi_similarity": "MS (Wang et al. 2019a)",
}


def ssr_published(dataset: str, loss: str, dim: int, with_ssr: bool) -> dict[str, Any] | None:
    method = SSR_METHOD[loss]
    if dim == 512:
        # Table 2 has SSR-Margin at 512-d and no baseline at that size.
        return published(("Table 2", "Ours (Margin)", "R512", dataset)) if with_ssr else None
    if with_ssr:
        picks = [("Table 1", f"Ours ({method})", "128", dataset)]
        if loss != "triplet":  # Table 3 has no SSR-Triplet row
            picks.append(("Table 3", f"Ours ({method})", "R128", dataset))
    else:
        picks = [
            ("Table 1", f"{method} (Re Imp)", "128", dataset),
            ("Table 3", SSR_TABLE3_BASELINE[loss], "R128", dataset),
        ]
    return published(*picks)


def ssr_recipe(dataset: str, loss: str, dim: int, with_ssr: bool = True) -> dict[str, Any]:
    """SSR paper recipe: ResNet-50, AdamW lr 1e-4 (heads ×10), wd 4e-4, balanced batch 120.

    ``with_ssr=False`` is its baseline twin: the same recipe without the ranking task.
    """
    cfg = recipe(dataset, loss, "ssr" if with_ssr else "baseline")
    cfg["name"] = f"{dataset}-{loss}-{dim}-{'ssr' if with_ssr else 'baseline'}"
    cfg["model"]["embedding_dim"] = dim
    cfg["sampler"] = {"kind": "balanced", "classes_per_batch": 30, "images_per_class": 4}
    cfg["optim"].update(
        {
            "lr": 1e-4,
            "weight_decay": 4e-4,
            "head_lr_mult": 10.0,
            "warmup_epochs": 0,
            "scheduler": "none",
        }
    )
    if with_ssr:
        cfg["ssr"]["task"] = {
            "num_images": 20,
            "scale": 12.0,
            "margin": 0.05,
            "boundary": 0.5,
            "pos_weight": 1.0,
            "weight": 0.8,
            "p_task": 0.8,
            "transforms": {"num_levels": 4},
        }
    cfg["published"] = ssr_published(dataset, loss, dim, with_ssr)
    return cfg


def with_recipe(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` whose ``published`` block (if any) records the recipe its numbers belong to
    (:func:`idml.app.paper.recipe_of`), so that a run trained with other data, backbone, embedding
    size or schedule is not compared with them."""
    if cfg.get("published"):
        full = config_to_dict(validate_config({k: v for k, v in cfg.items() if k != "published"}))
        cfg["published"]["recipe"] = recipe_of(full)
    return cfg


@dataclass(frozen=True)
class Preset:
    """One preset: its title, the fragments it includes and the full recipe it must resolve to."""

    title: str
    include: tuple[str, ...]
    recipe: dict[str, Any]

    def body(self) -> dict[str, Any]:
        """``include:`` and the recipe's keys the fragments do not give (in the recipe's order).

        Raises SystemExit when the composed preset would not resolve to the recipe (a fragment
        sets a key the recipe wants otherwise and the recipe does not spell it).
        """
        given: dict[str, Any] = {}
        for name in self.include:
            given = merge_configs(given, read_fragment(name))
        own = _missing(self.recipe, given)
        composed = merge_configs(given, own)
        wanted = config_to_dict(validate_config(self.recipe))
        differences = config_difference(config_to_dict(validate_config(composed)), wanted, ())
        if differences:
            raise SystemExit(f"{self.recipe['name']}: its fragments change {differences}")
        return {"include": list(self.include), **own}


def _missing(wanted: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """The keys of ``wanted`` whose value ``given`` lacks or differs from, nested as in ``wanted``."""
    out: dict[str, Any] = {}
    for key, value in wanted.items():
        have = given.get(key, _ABSENT)
        if isinstance(value, dict) and value and isinstance(have, dict):
            rest = _missing(value, have)
            if rest:
                out[key] = rest
        elif have is _ABSENT or have != value or type(have) is not type(value):
            out[key] = value
    return out


_ABSENT = object()


def components(dataset: str, loss: str, method: str) -> tuple[str, ...]:
    """The fragments a preset includes, in merge order."""
    return (f"dataset/{dataset}", "backbone/resnet50", f"loss/{loss}", f"method/{method}")


def presets() -> dict[Path, Preset]:
    """Every preset, by its path under configs/."""
    out: dict[Path, Preset] = {}
    for dataset in DATASETS:
        for loss in LOSSES:
            for variant in ("baseline", "idml"):
                out[Path("idml") / f"{dataset}_{loss}_{variant}.yaml"] = Preset(
                    f"IDML paper Table I: {dataset.upper()}, {loss}, {variant}",
                    components(dataset, loss, variant),
                    with_recipe(recipe(dataset, loss, variant)),
                )
        for ds, loss, dim in SSR_ROWS:
            if ds == dataset:
                for with_ssr, tag in ((True, "ssr"), (False, "baseline")):
                    what = "with SSR" if with_ssr else "baseline twin (no SSR)"
                    out[Path("ssr") / f"{dataset}_{loss}_{dim}_{tag}.yaml"] = Preset(
                        f"SSR paper Tables 1-3: {dataset.upper()}, {loss}, {dim}-d, {what}",
                        components(dataset, loss, tag),
                        with_recipe(ssr_recipe(dataset, loss, dim, with_ssr)),
                    )
        out[Path("official") / f"{dataset}_proxy_anchor_official.yaml"] = Preset(
            f"Official IDML-ProxyAnchor code on {dataset.upper()} (L2-normalised u, γ=4, τ=5, "
            "squared)",
            components(dataset, "proxy_anchor", "idml"),
            with_recipe(official(dataset)),
        )
    return out


HEADER = (
    "# {title}\n# Generated by scripts/make_presets.py; `idml train {path}` runs it.\n"
    "# `include` names fragments packaged with idml (src/idml/app/config/fragments/); they merge in order,\n"
    '# then the keys below (README, "Composing configs"). A run\'s config.yaml holds the result.\n'
    "# `published` records a source's numbers (%) for this recipe and names the source (null: no\n"
    "# source states them); `idml train` and `idml report` compare the run with them while the\n"
    "# run keeps `published.recipe` (else they name what differs). It does not change training.\n"
)


def render(path: Path, preset: Preset) -> str:
    """The text of the preset file at ``path`` (relative to configs/)."""
    rel = Path("configs") / path
    header = HEADER.format(title=preset.title, path=rel.as_posix())
    return header + yaml.safe_dump(preset.body(), sort_keys=False)


def main() -> None:
    for path, preset in presets().items():
        target = ROOT / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(render(path, preset))


if __name__ == "__main__":
    main()
