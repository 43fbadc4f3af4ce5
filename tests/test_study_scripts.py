"""The IDML study's bookkeeping (``benchmarks/study_idml.py`` and its package
``benchmarks/idml_study``): what keeps a grid honest.

A grid's arms must share one recipe (budget and knobs), and a recipe changed by ``converge --adopt``
must not silently retrain or mix with a grid run at the old one. The study itself trains for hours
and lives in ``benchmarks/``; these tests check its pure parts.
"""

from __future__ import annotations

import argparse
import doctest
import importlib
import importlib.util
import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from idml.losses.contrastive import DISTANCE_MARGINS

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPT = BENCHMARKS / "study_idml.py"
PACKAGE = "idml_study"


@dataclass(frozen=True)
class Study:
    """The study's script (its command line, ``main``) and the modules of its package. A test
    reaches a name through the module that defines it, and patches a name in the module that looks
    it up: ``run`` (``jobs``) calls ``study.jobs.run_jobs``, ``challenge`` (``choose``)
    ``study.choose.run_jobs``; a patch elsewhere would leave the real one running."""

    script: ModuleType
    design: ModuleType
    recipes: ModuleType
    ledger: ModuleType
    results: ModuleType
    mechanism: ModuleType
    jobs: ModuleType
    tables: ModuleType
    choose: ModuleType
    summary: ModuleType

    def modules(self) -> list[ModuleType]:
        return [getattr(self, field.name) for field in fields(self)]


@pytest.fixture(scope="module")
def study() -> Iterator[Study]:
    # Run as a script, the study finds its package beside it: benchmarks/ is sys.path[0].
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location("study_idml", SCRIPT)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["study_idml"] = module  # importable by its name, as its package's modules are
        spec.loader.exec_module(module)
        parts = [importlib.import_module(f"{PACKAGE}.{f.name}") for f in fields(Study)[1:]]
        yield Study(module, *parts)
    finally:
        sys.path.remove(str(BENCHMARKS))
        for name in [n for n in sys.modules if n == "study_idml" or n.split(".")[0] == PACKAGE]:
            sys.modules.pop(name)


WITH_EXAMPLES = ("design", "mechanism", "jobs", "tables", "choose", "summary")
"""The package's modules whose docstrings hold examples (the script's holds none)."""


def test_the_study_examples_hold(study: Study) -> None:
    attempted = 0
    for module in study.modules():
        result = doctest.testmod(module)
        if module.__name__.removeprefix(PACKAGE + ".") in WITH_EXAMPLES:
            assert result.attempted > 0, module.__name__
        assert result.failed == 0, module.__name__
        attempted += result.attempted
    assert attempted >= 3


def test_a_grid_keeps_the_recipe_its_runs_were_trained_with(study: Study, tmp_path: Path) -> None:
    folder = tmp_path / "omniglot_cnn" / "proxy_anchor"
    ten = {
        "recipe": "proxy_lr×10, 10 epochs",
        "overrides": ["optim.proxy_lr_mult=10", "optim.epochs=10"],
    }
    study.recipes.pin_recipe(folder, ten)
    assert (
        json.loads((folder / study.recipes.FOLDER_RECIPE).read_text())["overrides"]
        == ten["overrides"]
    )
    # The same recipe: nothing to say.
    study.recipes.pin_recipe(folder, dict(ten, validation_map_r=0.5))
    assert study.recipes.pinned_recipe(folder) == "proxy_lr×10, 10 epochs"

    twenty = {
        "recipe": "proxy_lr×10, 20 epochs",
        "overrides": ["optim.proxy_lr_mult=10", "optim.epochs=20"],
    }
    with pytest.raises(SystemExit) as stop:
        study.recipes.pin_recipe(folder, twenty)
    message = str(stop.value)
    assert str(folder) in message
    assert "10 epochs" in message and "20 epochs" in message and "--out" in message
    # The old pin is untouched.
    assert study.recipes.pinned_recipe(folder) == "proxy_lr×10, 10 epochs"
    assert study.recipes.pinned_recipe(tmp_path / "elsewhere") is None


def test_a_grid_grows_at_its_pinned_recipe_only_when_asked(
    study: Study, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    twenty = {"recipe": "proxy_lr×10, 20 epochs", "overrides": ["optim.epochs=20"]}
    forty = {"recipe": "proxy_lr×10, 40 epochs", "overrides": ["optim.epochs=40"]}
    monkeypatch.setattr(
        study.recipes, "load_recipes", lambda: {"omniglot_cnn": {"proxy_anchor": forty}}
    )
    folder = tmp_path / "omniglot_cnn" / "proxy_anchor"
    study.recipes.pin_recipe(folder, twenty)

    def args(recipe: str) -> argparse.Namespace:
        return argparse.Namespace(quick=False, recipe=recipe, setting="omniglot_cnn")

    # The validated recipe moved on: a grid at the old pin refuses it, and adds arms at its pin.
    with pytest.raises(SystemExit):
        study.recipes.grid_recipe(args("validated"), "proxy_anchor", folder)
    assert study.recipes.grid_recipe(args("pinned"), "proxy_anchor", folder) == ["optim.epochs=20"]
    fresh = tmp_path / "new" / "proxy_anchor"
    assert study.recipes.grid_recipe(args("validated"), "proxy_anchor", fresh) == [
        "optim.epochs=40"
    ]
    assert study.recipes.pinned_recipe(fresh) == forty["recipe"]
    with pytest.raises(SystemExit) as stop:
        study.recipes.grid_recipe(
            args("pinned"), "proxy_anchor", tmp_path / "none" / "proxy_anchor"
        )
    assert "pins no recipe" in str(stop.value)


def test_a_setting_folder_keeps_the_memory_format_of_its_first_runs(
    study: Study, tmp_path: Path
) -> None:
    def overrides(out: Path, pin: bool = True) -> list[str]:
        args = argparse.Namespace(setting="demo", omniglot_root=tmp_path, quick=False, out=out)
        return study.recipes.setting_overrides(args, pin=pin)

    # A new folder trains in today's CPU default, and pins it; a table's read pins nothing.
    assert overrides(tmp_path / "new", pin=False)[-1] == "optim.channels_last=true"
    assert not (tmp_path / "new").exists()
    assert overrides(tmp_path / "new")[-1] == "optim.channels_last=true"
    assert (tmp_path / "new" / "demo" / study.recipes.FOLDER_MEMORY_FORMAT).is_file()
    # Runs trained before the pin existed used the default layout of their day, and keep it.
    old = tmp_path / "old" / "demo" / "contrastive" / "baseline" / "s0"
    old.mkdir(parents=True)
    (old / "metrics.jsonl").write_text("{}\n")
    assert overrides(tmp_path / "old")[-1] == "optim.channels_last=false"
    # Once pinned, the folder's layout no longer depends on what it holds.
    (old / "metrics.jsonl").unlink()
    assert overrides(tmp_path / "old")[-1] == "optim.channels_last=false"
    assert overrides(tmp_path / "new")[-1] == "optim.channels_last=true"


def test_a_run_finished_before_the_layout_pin_is_reused_not_retrained(
    study: Study, tmp_path: Path
) -> None:
    overrides = ("loss.name=contrastive", study.recipes.LEGACY_LAYOUT, "seed=0")
    job = study.jobs.Job(tmp_path / "s0", overrides, mechanism=False)
    runs = tmp_path / "s0" / "cells" / "base"

    def finish(folder: str, channels_last: object) -> None:
        (runs / folder).mkdir(parents=True)
        record = {"config": {"optim": {"channels_last": channels_last}}}
        (runs / folder / "result.json").write_text(json.dumps(record))

    # Nothing trained yet, or only a run moved aside: the new run trains in the pinned layout.
    assert study.jobs.reuse_overrides(job) == list(overrides)
    finish("seed0.replaced-20261203-224509", "auto")
    assert study.jobs.reuse_overrides(job) == list(overrides)
    # The run of that day said "auto" (the contiguous layout on the CPU then): asked for as it is.
    finish("seed0", "auto")
    assert study.jobs.reuse_overrides(job) == ["loss.name=contrastive", "seed=0"]
    # A folder pinned to channels-last has no runs of the old default to reuse.
    fresh = study.jobs.Job(tmp_path / "s0", ("optim.channels_last=true",), mechanism=False)
    assert study.jobs.reuse_overrides(fresh) == ["optim.channels_last=true"]


def test_doubling_a_budget_keeps_every_other_knob(study: Study) -> None:
    name, overrides = study.choose.doubled_budget(
        {
            "recipe": "proxy_lr×10, 20 epochs",
            "overrides": ["optim.proxy_lr_mult=10", "optim.epochs=20"],
        }
    )
    assert name == "proxy_lr×10, 40 epochs"
    assert overrides == ("optim.proxy_lr_mult=10", "optim.epochs=40")


def test_a_table_label_must_be_a_plain_name(
    study: Study, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        study.script.main(["tables", "--setting", "demo", "--label", "../escape"])
    assert "--label" in capsys.readouterr().err


def test_a_degraded_grid_trains_only_the_kinds_and_arms_asked_for(
    study: Study, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--degradations --kinds ... --arms ...`` stages the Table 3 grid: the cost of each kind
    first (its baseline), the ISM arms only where there is a cost to recover."""
    batches: list[list[Path]] = []
    monkeypatch.setattr(
        study.jobs,
        "run_jobs",
        lambda jobs, workers, ledger: batches.append([j.folder for j in jobs]),
    )
    args = ["run", "--setting", "demo", "--quick", "--degradations", "--seeds", "2"]
    study.script.main([*args, "--kinds", "blur", "--arms", "deg_baseline", "--out", str(tmp_path)])
    root = tmp_path.with_name(tmp_path.name + "_quick") / "demo" / "degradations"
    assert batches == [
        [root / "blur" / "deg_baseline" / "s0", root / "blur" / "deg_baseline" / "s1"],
        [],
    ]

    batches.clear()
    unmatched = [name for name, arm in study.design.DEGRADATION_ARMS.items() if not arm.matched]
    study.script.main([*args, "--arms", ",".join(unmatched), "--out", str(tmp_path)])  # every kind
    trained = {(f.parent.parent.name, f.parent.name) for batch in batches for f in batch}
    assert trained == {(kind, arm) for kind in study.design.DEGRADATIONS for arm in unmatched}

    # The uniform control takes its γ from the ISM runs: none trained here, so it says so.
    with pytest.raises(SystemExit, match="no run yet"):
        study.script.main([*args, "--kinds", "blur", "--out", str(tmp_path)])


@pytest.mark.parametrize(
    "option",
    [("--kinds", "fog"), ("--arms", "idml")],  # an unknown kind; a main-grid arm
)
def test_a_degraded_grid_names_what_it_does_not_know(
    study: Study, option: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        study.script.main(["run", "--setting", "demo", "--quick", "--degradations", *option])
    error = capsys.readouterr().err
    assert repr(option[1]) in error and "low_resolution" in error and "deg_uniform" in error


@pytest.mark.slow
def test_the_uniform_control_weakens_as_much_as_the_learned_one(
    study: Study, tmp_path: Path
) -> None:
    """The ``idml_uniform`` control of a proxy loss takes the γ whose uniform weakening ``e^{−γk}``
    has the median of IDML's learned one over the sample–proxy relations (with the trained
    proxies), and trains with it; checked here on the same batches by applying that γ."""
    import torch

    from idml.app import build
    from idml.app.checkpoint import load_training_state
    from idml.app.trained_run import load_trained_run
    from idml.embeddings import Embeddings
    from idml.losses import ProxyLoss

    args = ["run", "--setting", "demo", "--quick", "--losses", "proxy_anchor", "--seeds", "1"]
    study.script.main(
        [*args, "--arms", "idml,idml_uniform", "--workers", "1", "--out", str(tmp_path)]
    )
    root = tmp_path.with_name(tmp_path.name + "_quick") / "demo" / "proxy_anchor"
    run_dir = next((root / "idml").rglob("mechanism.json")).parent
    matched = json.loads((run_dir / "mechanism.json").read_text())["matched"]
    assert matched["relations"] == "proxy" and matched["pos_margin"] is None
    assert matched["recipe_pos_margin"] is None  # a proxy loss has no positive margin to move
    assert 0 < matched["median_weakening"] < 1 and 0 < matched["gamma"] < 10

    control = yaml.safe_load(next((root / "idml_uniform").rglob("config.yaml")).read_text())
    # The control's override is written with 6 significant digits: a relative 5e-6 at most.
    assert control["metric"]["gamma"] == pytest.approx(matched["gamma"], rel=1e-5)
    assert control["model"]["uncertainty"]["enabled"] is False

    run = load_trained_run(run_dir, "latest")
    cfg = run.config
    data = build.build_data(cfg)
    loss = build.build_loss(cfg, data.num_train_classes)
    assert isinstance(loss, ProxyLoss)
    load_training_state(run.checkpoint, {"loss": loss}, {})
    loss.metric.gamma = matched["gamma"]
    loss.proxy_uncertainty = None
    augment = build.build_augmentations(cfg)
    generator = torch.Generator().manual_seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    loader = build.train_loader(cfg, data, 0, generator, num_replicas=1, rank=0)
    uniform = []
    with torch.no_grad():
        for step, (images, labels, *_) in enumerate(loader):
            if step >= 8:
                break
            batch = augment(images, labels, generator)
            emb = run.model(batch.images)
            no_head = Embeddings(emb.semantic, torch.zeros_like(emb.uncertainty))
            found = loss.weakening(no_head, batch.labels)
            assert found is not None
            factors, positive, _ = found
            uniform.append(factors[positive])
    ordered = torch.cat(uniform).double().sort().values
    middle = (len(ordered) - 1) // 2
    # e^{−γk} falls with k, so its median is e^{−γ·median k} up to the neighbouring order
    # statistic when the count is even; float32 factors, float64 γ: a relative 1e-6 on top.
    low, high = float(ordered[middle - 1]), float(ordered[min(middle + 1, len(ordered) - 1)])
    assert low * (1 - 1e-6) <= matched["median_weakening"] <= high * (1 + 1e-6)


def test_the_mechanism_row_trends_the_altered_images_it_names(study: Study) -> None:
    """The degraded grid's mechanism table trends ``||u||`` of the degraded training images (the
    trainer's ``uncertainty/degraded``) beside the originals', averaged over seeds; the main grid's
    trends the mixed ones, and an arm without that key shows a dash, not a number."""

    def record(original: tuple[float, float], degraded: tuple[float, float]) -> dict:
        return {
            "test_u_mean": 0.05,
            "test_u_cv": 0.4,
            "probe_auroc": {"mixup": 0.5, "blur": 0.6, "low_resolution": 0.7, "occlusion": 0.9},
            "first_epoch": {
                "uncertainty/original": original[0],
                "uncertainty/degraded": degraded[0],
            },
            "last_epoch": {
                "uncertainty/original": original[1],
                "uncertainty/degraded": degraded[1],
                "ism/pos_q10": 0.9,
                "ism/pos_q50": 0.95,
                "ism/u_cv": 0.3,
            },
            "ism_at_test": {"recall@1": 0.8, "map@r": 0.4},
        }

    first, second = record((0.020, 0.010), (0.030, 0.100)), record((0.020, 0.014), (0.034, 0.140))
    seeds = {
        0: {"metrics": {}, "mechanism": first},
        1: {"metrics": {}, "mechanism": second},
        2: {"metrics": {}, "mechanism": None},  # a run without an uncertainty head
    }
    row = study.tables.mechanism_row("occlusion", "ISM", seeds, altered="degraded")
    cells = [c.strip() for c in row.strip("|").split("|")]
    header = study.tables.mechanism_header("degraded")[1]
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert len(cells) == len(columns)
    assert columns[7:9] == ["‖u‖ original", "‖u‖ degraded"]
    assert cells[7:9] == ["0.020 → 0.012", "0.032 → 0.120"]
    assert cells[4] == "0.50 / 0.60 / 0.70 / 0.90" and cells[5] == "0.900 / 0.950"
    assert cells[9] == "80.0 / 40.0"
    mixed = study.tables.mechanism_row("occlusion", "ISM", seeds)  # the main grid's column
    assert [c.strip() for c in mixed.strip("|").split("|")][8] == "–"
    assert study.tables.mechanism_row("occlusion", "baseline", {2: seeds[2]}) is None
    # Runs that logged the eval-mode level of training images add its ratio to the trained one,
    # averaged over the seeds that have it: (0.05/0.010 + 0.021/0.014) / 2 = 3.25.
    first["last_epoch"]["uncertainty/eval_train"] = 0.05
    second["last_epoch"]["uncertainty/eval_train"] = 0.021
    logged = study.tables.mechanism_row("occlusion", "ISM", seeds, altered="degraded")
    assert [c.strip() for c in logged.strip("|").split("|")][7] == "0.020 → 0.012 (eval ×3.25)"


def test_every_probe_section_compares_arms_of_the_main_grid(study: Study) -> None:
    """Each section beside the main differences (its own Holm family) names arms that exist, and
    the level standardised as at test differs from IDML by that override alone."""
    design = study.design
    assert [comparisons for _, comparisons in design.PROBES] == [
        design.U_HIGH_COMPARISONS,
        design.RUNNING_LEVEL_COMPARISONS,
        design.DETACHED_COMPARISONS,
        design.RUNNING_DETACHED_COMPARISONS,
    ]
    for title, comparisons in design.PROBES:
        assert title and all(
            ref in design.ARMS and arm in design.ARMS for _, ref, arm in comparisons
        )
        labels = [label for label, _, _ in comparisons]
        assert len(set(labels)) == len(labels), title
    idml = design.ARMS["idml"]
    for name, extra in (
        ("idml_running", (design.RUNNING_LEVEL,)),
        ("idml_detached", (design.DETACHED,)),
        ("idml_running_detached", (design.RUNNING_LEVEL, design.DETACHED)),
    ):
        arm = design.ARMS[name]
        assert arm.method == idml.method and arm.extra == extra, name
        assert arm.learns_u and name in design.MATCHED_TO, name
    # Each family compares its arm (and only it) with its own two controls, not another arm's.
    for arm, comparisons in (
        ("idml_u_high", design.U_HIGH_COMPARISONS),
        ("idml_running", design.RUNNING_LEVEL_COMPARISONS),
        ("idml_detached", design.DETACHED_COMPARISONS),
        ("idml_running_detached", design.RUNNING_DETACHED_COMPARISONS),
    ):
        assert {compared for _, _, compared in comparisons} == {arm}
        references = {ref for _, ref, _ in comparisons}
        assert {f"{arm}_frozen_u", f"{arm}_uniform", "idml", "mixup"} <= references, arm
        if "detached" in arm:
            assert "baseline" in references, arm


@pytest.mark.parametrize("loss", ["multi_similarity", "proxy_anchor", "contrastive"])
def test_every_arm_of_the_main_grid_builds_a_config_that_validates(
    study: Study, tmp_path: Path, loss: str
) -> None:
    """Each arm's overrides (on the setting and its validated recipe) make a config that loads and
    passes the trainer's preflight, so a new arm with a misspelt key fails here rather than when a
    grid reaches it hours in. The matched controls take their values from trained runs, so they
    are checked by the tests that train them."""
    args = argparse.Namespace(
        setting="demo", omniglot_root=tmp_path, quick=False, out=tmp_path, seeds=1,
        losses=[loss], arms=list(study.design.ARMS), recipe="validated", override=[],
    )  # fmt: skip
    jobs = study.jobs.main_jobs(args, matched=False)
    trained = {job.folder.parent.name for job in jobs}
    expected = {
        name for name, arm in study.design.ARMS.items() if not arm.matched and arm.trains_with(loss)
    }
    assert trained == expected and {"idml_detached", "idml_running_detached_frozen_u"} <= trained
    assert study.jobs.checked_jobs(args, jobs) == jobs
    for job in jobs:
        assert f"loss.name={loss}" in job.overrides and job.overrides[-1] == "seed=0"
        assert set(study.design.ARMS[job.folder.parent.name].overrides) <= set(job.overrides)


def test_every_ism_arm_has_controls_that_differ_from_it_only_in_u(study: Study) -> None:
    """The frozen-``u`` control trains the arm's own method with the head's learning rate at 0; the
    uniform one drops the head and keeps ISM and the arm's Mixup (with or without set labels)."""
    arms = {**study.design.ARMS, **study.design.DEGRADATION_ARMS}
    controlled = [name for name in arms if f"{name}_frozen_u" in arms]
    assert {
        "idml",
        "idml_u_high",
        "idml_running",
        "idml_detached",
        "idml_running_detached",
        "deg_ism",
        "deg_ism_u_high",
    } <= set(controlled)
    for name in controlled:
        arm, frozen = arms[name], arms[f"{name}_frozen_u"]
        uniform = next(a for a in arms.values() if a.match == study.design.Match("uniform", name))
        assert frozen.method == arm.method and frozen.extra == (*arm.extra, study.design.FROZEN_U)
        assert (uniform.method.head, uniform.method.ism) == (False, True)
        assert uniform.method.mixup == arm.method.mixup, name
        assert "mixup.enabled=" + str(arm.method.mixup).lower() in uniform.overrides
        assert arm.has_head and frozen.has_head and not uniform.has_head
    with pytest.raises(AssertionError, match="isolate ISM"):
        study.design.with_controls("mixup", ("a", "b", "c"), study.design.MIXUP)


def grid_args(tmp_path: Path, setting: str, loss: str, arms: list[str]) -> argparse.Namespace:
    """``run``'s arguments for a two-seed grid of ``arms`` in ``tmp_path``."""
    return argparse.Namespace(
        setting=setting,
        losses=[loss],
        arms=arms,
        seeds=2,
        workers=1,
        out=tmp_path,
        omniglot_root=tmp_path / "omniglot",
        quick=False,
        recipe="validated",
        degradations=False,
        override=[],
    )


def record_runs(jobs: list, matched: dict[str, Any]) -> None:
    """Stands in for training ``jobs``: each run folder gets a result and a ``mechanism.json``
    whose ``matched`` is what the controls take from it."""
    for job in jobs:
        record = job.folder / "cells" / "base" / f"seed{job.folder.name[1:]}"
        record.mkdir(parents=True)
        (record / "result.json").write_text("{}")
        (record / "mechanism.json").write_text(json.dumps({"matched": matched}))


def test_a_grid_finishes_at_the_recipe_it_started_with(
    study: Study, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``converge --adopt`` may move the validated recipe on while a grid trains; the controls
    matched to the grid's first arms must still train at the grid's recipe, not refuse it."""
    twenty = {"recipe": "20 epochs", "overrides": ["optim.epochs=20"]}
    forty = {"recipe": "40 epochs", "overrides": ["optim.epochs=40"]}
    recipes = {"omniglot_cnn": {"multi_similarity": twenty}}
    monkeypatch.setattr(study.recipes, "load_recipes", lambda: recipes)
    phases: list[list] = []

    def run_jobs(jobs: list, workers: int, ledger: object) -> None:
        phases.append(jobs)
        record_runs(jobs, {"gamma": 0.02})  # the ISM arm's, which its uniform control matches
        recipes["omniglot_cnn"]["multi_similarity"] = forty  # adopted meanwhile

    monkeypatch.setattr(study.jobs, "run_jobs", run_jobs)
    study.jobs.run(
        grid_args(tmp_path, "omniglot_cnn", "multi_similarity", ["idml", "idml_uniform"])
    )
    first, matched = phases
    assert [job.folder.parent.name for job in first] == ["idml", "idml"]
    assert [job.folder.parent.name for job in matched] == ["idml_uniform", "idml_uniform"]
    for job in matched:
        assert "optim.epochs=20" in job.overrides and "optim.epochs=40" not in job.overrides
        assert "metric.gamma=0.02" in job.overrides
    assert (
        study.recipes.pinned_recipe(tmp_path / "omniglot_cnn" / "multi_similarity") == "20 epochs"
    )


def contrastive_grid(
    study: Study,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    pos_margin: float,
    matched: dict[str, Any],
) -> tuple[list[list], list[str]]:
    """Runs a two-seed Lite0 Contrastive grid of IDML and its two matched controls at the recipe
    ``m_pos=pos_margin``, each IDML run recording ``matched``; the phases' jobs (nothing trains)
    and the table's lines on its matched controls."""
    recipe = {"recipe": f"m_pos={pos_margin}", "overrides": [f"loss.pos_margin={pos_margin}"]}
    monkeypatch.setattr(
        study.recipes, "load_recipes", lambda: {"omniglot_lite0": {"contrastive": recipe}}
    )
    matched = {"gamma": 0.03, "neg_margin": DISTANCE_MARGINS[1], "similarity": False, **matched}
    phases: list[list] = []

    def run_jobs(jobs: list, workers: int, ledger: object) -> None:
        phases.append(jobs)
        record_runs(jobs, matched)

    monkeypatch.setattr(study.jobs, "run_jobs", run_jobs)
    arms = ["idml", "idml_uniform", "mixup_margin"]
    study.jobs.run(grid_args(tmp_path, "omniglot_lite0", "contrastive", arms))
    folders = {"Contrastive": tmp_path / "omniglot_lite0" / "contrastive"}
    return phases, study.mechanism.matched_section(folders, study.design.ARMS)[2:]


def test_a_margin_matched_past_the_negative_margin_is_capped_there_and_the_table_says_so(
    study: Study, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From Lite0's m_pos 0.4, ISM's median effect on Contrastive's positive pairs can reach past
    m_neg, where the loss refuses its margins. The margin-matched control then trains at m_neg
    (the largest margin that still separates the pairs) instead of stopping the matched phase —
    which would also lose the uniform control — and the tables name both margins."""
    phases, lines = contrastive_grid(study, tmp_path, monkeypatch, 0.4, {"pos_margin": 0.62})
    # Seed by seed, so a grid stopped mid-way has every arm at the same seeds.
    order = [(job.folder.name, job.folder.parent.name) for job in phases[1]]
    assert order == [(s, a) for s in ("s0", "s1") for a in ("idml_uniform", "mixup_margin")]
    controls = {job.folder.parent.name: job.overrides for job in phases[1]}
    assert set(controls) == {"idml_uniform", "mixup_margin"}
    assert controls["mixup_margin"][-2:] == ("loss.pos_margin=0.5", "seed=1")
    assert "metric.gamma=0.03" in controls["idml_uniform"]

    uniform = "- Contrastive, IDML, u = 0 and matched γ (uniform weakening): metric.gamma = 0.03"
    assert lines[0].startswith(uniform + ", from 2 runs of `idml`")
    assert "loss.pos_margin = 0.5 (ISM acts as 0.62, past the negative margin 0.5" in lines[1]
    assert "capped there" in lines[1]


def test_a_margin_matched_control_that_would_be_mixup_only_is_not_trained_and_the_table_says_so(
    study: Study, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the recipe's m_pos is already m_neg, the cap takes the margin-matched control back to
    the recipe's own margin: it would be Mixup only, ten runs for a copy of another arm. It is
    skipped, the uniform control still trains, and the table says why the control is missing."""
    m_neg = DISTANCE_MARGINS[1]
    matched = {"pos_margin": 0.7, "recipe_pos_margin": m_neg}
    phases, lines = contrastive_grid(study, tmp_path, monkeypatch, m_neg, matched)
    assert {job.folder.parent.name for job in phases[1]} == {"idml_uniform"}
    assert len(lines) == 2 and lines[0].startswith("- Contrastive, IDML, u = 0 and matched γ")
    assert lines[1].startswith("- Contrastive, Mixup only, margin matched to IDML: not trained")
    assert "capped at m_neg = 0.5, which is the recipe's own m_pos" in lines[1]
    assert "Mixup only (IDML − Mixup only is its comparison)" in lines[1]


def test_a_proxy_grid_lists_its_uniform_control_and_no_margin_control(
    study: Study, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The margin-matched control is Contrastive's alone: a ProxyAnchor grid's IDML runs record no
    positive margin, and its table lists the uniform control without asking what margin ISM acts
    as (which raised a bare ``TypeError`` on Lite0's ProxyAnchor ledger)."""
    recipe = {"recipe": "16 epochs", "overrides": ["optim.epochs=16"]}
    monkeypatch.setattr(
        study.recipes, "load_recipes", lambda: {"omniglot_lite0": {"proxy_anchor": recipe}}
    )
    monkeypatch.setattr(study.jobs, "run_jobs", lambda jobs, *_: record_runs(jobs, {"gamma": 0.05}))
    study.jobs.run(grid_args(tmp_path, "omniglot_lite0", "proxy_anchor", ["idml", "idml_uniform"]))
    folders = {"ProxyAnchor": tmp_path / "omniglot_lite0" / "proxy_anchor"}
    lines = study.mechanism.matched_section(folders, study.design.ARMS)[2:]
    assert lines == [
        "- ProxyAnchor, IDML, u = 0 and matched γ (uniform weakening): metric.gamma = 0.05, "
        "from 2 runs of `idml`"
    ]
    assert not study.design.ARMS["mixup_margin"].trains_with("proxy_anchor")
    assert study.design.DEGRADATION_ARMS["deg_uniform"].trains_with("occlusion")


def test_ism_at_test_is_compared_with_the_same_runs_plain_for_the_arms_that_learn_u(
    study: Study,
) -> None:
    """The paper's Table 5, paired: each seed of an arm that learns ``u`` scored with ISM at test
    against its own plain score, Holm over this section alone. The frozen-``u`` arm is left out
    (a constant ``u`` leaves every ranking as it is), as is a run without the record."""

    def seed(r1: float, map_r: float, at_test: tuple[float, float] | None) -> dict:
        mechanism = None
        if at_test is not None:
            mechanism = {"ism_at_test": {"recall@1": at_test[0], "map@r": at_test[1]}}
        return {"metrics": {"recall@1": r1, "map@r": map_r}, "mechanism": mechanism}

    idml = {
        0: seed(0.70, 0.36, (0.55, 0.26)),
        1: seed(0.72, 0.37, (0.58, 0.28)),
        2: seed(0.69, 0.35, (0.52, 0.25)),
        3: seed(0.71, 0.36, None),  # recorded before ISM at test was: not paired
    }
    frozen = {s: seed(0.7, 0.36, (0.7, 0.36)) for s in range(3)}
    arms = study.design.ARMS
    lines = study.tables.ism_at_test_section(
        [
            ("Contrastive", arms["idml"], idml),
            ("Contrastive", arms["idml_frozen_u"], frozen),
            ("Contrastive", arms["baseline"], {0: seed(0.6, 0.3, None)}),
        ]
    )
    assert lines[0].startswith("\n## ISM at test time (the paper's Table 5)")
    assert "Holm-adjusted over all 2 cells of this table" in lines[1]
    rows = [line for line in lines if line.startswith("| Contrastive")]
    assert len(rows) == 1
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[1:3] == ["IDML with ISM at test − IDML", "3"]
    assert cells[3].startswith("-15.33 ▼") and cells[6].startswith("-9.67 ▼")
    assert study.tables.ism_at_test_section([("Contrastive", arms["idml"], {})]) == []


def test_a_degraded_table_pairs_ism_at_test_for_its_ism_arms_only(
    study: Study, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Table 3 grid's table carries the Table 5 section too: the ISM arm trained on degraded
    images scored with ISM at test against its plain score, per degradation; the degraded
    baseline, which has no head, is not in it."""
    monkeypatch.setattr(study.tables, "TABLES", tmp_path / "tables")
    monkeypatch.setattr(study.tables, "load_recipes", lambda: {})
    root = tmp_path / "omniglot_cnn"
    mechanism = {
        "test_u_mean": 0.05,
        "test_u_cv": 0.4,
        "probe_auroc": {"mixup": 0.5, "blur": 0.6, "low_resolution": 0.7, "occlusion": 0.9},
        "first_epoch": {},
        "last_epoch": {"ism/pos_q10": 0.9, "ism/pos_q50": 0.95, "ism/u_cv": 0.3},
    }
    plain = {0: (0.80, 0.40), 1: (0.82, 0.42)}
    at_test = {0: (0.79, 0.39), 1: (0.80, 0.41)}
    arms = {
        root / "multi_similarity" / "baseline": None,
        root / "degradations" / "occlusion" / "deg_baseline": None,
        root / "degradations" / "occlusion" / "deg_ism": at_test,
    }
    for arm, scores in arms.items():
        for seed, (r1, map_r) in plain.items():
            run = arm / f"s{seed}" / "cells" / "base" / f"seed{seed}"
            run.mkdir(parents=True)
            metrics = {"recall@1": r1, "map@r": map_r, "nmi": 0.5}
            (run / "result.json").write_text(json.dumps({"seed": seed, "final_metrics": metrics}))
            if scores is not None:
                scored = {"recall@1": scores[seed][0], "map@r": scores[seed][1]}
                (run / "mechanism.json").write_text(
                    json.dumps({**mechanism, "ism_at_test": scored})
                )
    args = argparse.Namespace(
        setting="omniglot_cnn",
        omniglot_root=tmp_path,
        out=tmp_path,
        losses=["multi_similarity"],
        kinds=["occlusion"],
        degradations=True,
        label="",
        quick=False,
    )
    study.tables.tables(args)
    text = (tmp_path / "tables" / "idml_omniglot_cnn_degradations.md").read_text()
    section = text.split("## ISM at test time (the paper's Table 5)")[1].split("## Mechanism")[0]
    rows = [line for line in section.splitlines() if line.startswith("| occlusion")]
    label = "ISM + degraded images"
    assert [row.split(" | ")[1] for row in rows] == [f"{label} with ISM at test − {label}"]
    assert rows[0].split(" | ")[3].startswith("-1.50") and " | -1.00 |" in rows[0]


def test_a_table_never_replaces_the_table_of_other_runs(
    study: Study, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``tables`` without ``--label`` once overwrote a superseded table of another recipe (the
    README cites it as such): a table is replaced only by one of the same runs."""
    monkeypatch.setattr(study.tables, "TABLES", tmp_path)
    args = argparse.Namespace(label="", quick=False)
    ten = "Baseline recipes (validation split of the training classes): Multi-Similarity: 10 epochs.\n"
    twenty = ten.replace("10 epochs", "20 epochs")
    study.tables.write_table(args, "idml_omniglot_cnn.md", ["# t", ten, "first"], of=ten)
    # The same runs: replaced.
    study.tables.write_table(args, "idml_omniglot_cnn.md", ["# t", ten, "again"], of=ten)
    assert "again" in (tmp_path / "idml_omniglot_cnn.md").read_text()
    with pytest.raises(SystemExit, match="--label") as refused:
        study.tables.write_table(args, "idml_omniglot_cnn.md", ["# t", twenty, "other"], of=twenty)
    assert "10 epochs" in str(refused.value) and "20 epochs" in str(refused.value)
    assert "again" in (tmp_path / "idml_omniglot_cnn.md").read_text()
    (tmp_path / "idml_old.md").write_text("# IDML study\n\n> **Superseded.**\n")
    with pytest.raises(SystemExit, match="older version"):
        study.tables.write_table(args, "idml_old.md", ["# t", ten], of=ten)
    labelled = argparse.Namespace(label="twenty_epochs", quick=False)
    study.tables.write_table(labelled, "idml_omniglot_cnn.md", ["# t", twenty, "other"], of=twenty)
    assert "other" in (tmp_path / "idml_omniglot_cnn_twenty_epochs.md").read_text()


def test_a_table_names_the_recipes_of_the_losses_it_holds_only(
    study: Study, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The degraded grid (one loss) once printed every loss's validated recipe, ProxyAnchor's
    adopted 40 epochs among them, beside runs of Multi-Similarity at 10."""
    validated = {
        "multi_similarity": {"recipe": "40 epochs", "overrides": ["optim.epochs=40"]},
        "proxy_anchor": {"recipe": "proxy_lr×10, 40 epochs", "overrides": ["optim.epochs=40"]},
    }
    monkeypatch.setattr(study.tables, "load_recipes", lambda: {"omniglot_cnn": validated})
    study.recipes.pin_recipe(
        tmp_path / "omniglot_cnn" / "multi_similarity",
        {"recipe": "10 epochs", "overrides": ["optim.epochs=10"]},
    )
    args = argparse.Namespace(
        setting="omniglot_cnn", omniglot_root=tmp_path, out=tmp_path, losses=list(validated)
    )
    _, recipes = study.tables.settings_lines(args, ["multi_similarity"])
    assert recipes.strip().endswith("Multi-Similarity: 10 epochs.")
    assert "ProxyAnchor" not in recipes and "40" not in recipes


def test_a_baseline_below_the_untrained_network_is_called_out_in_its_table(
    study: Study, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On Fashion-MNIST the validated Multi-Similarity baseline ended below Lite0's training-free
    features in MAP@R (34.7 against 36.4; R@1 87.2 against 83.3): the table must say that its
    comparisons are no evidence, and say nothing of a loss whose baseline clears the floor."""
    monkeypatch.setattr(study.tables, "TABLES", tmp_path / "tables")
    monkeypatch.setattr(study.tables, "load_recipes", lambda: {})
    root = tmp_path / "fashion_lite0"
    root.mkdir()
    (root / "untrained.json").write_text(
        json.dumps({"recall@1": [0.833], "map@r": [0.364], "nmi": [0.36]})
    )
    finals = {
        "multi_similarity": [(0.87, 0.34), (0.88, 0.356)],  # R@1 clears it, MAP@R does not
        "contrastive": [(0.88, 0.40), (0.89, 0.41)],
    }
    for loss, values in finals.items():
        for seed, (r1, map_r) in enumerate(values):
            run = root / loss / "baseline" / f"s{seed}" / "cells" / "base" / f"seed{seed}"
            run.mkdir(parents=True)
            metrics = {"recall@1": r1, "map@r": map_r, "nmi": 0.4}
            (run / "result.json").write_text(json.dumps({"seed": seed, "final_metrics": metrics}))
    args = argparse.Namespace(
        setting="fashion_lite0",
        omniglot_root=tmp_path,
        out=tmp_path,
        losses=list(finals),
        degradations=False,
        label="",
        quick=False,
    )
    study.tables.tables(args)
    text = (tmp_path / "tables" / "idml_fashion_lite0.md").read_text()
    assert "**Multi-Similarity: the baseline does not beat the untrained network**" in text
    assert "MAP@R 34.8 against 36.4, R@1 87.5 against 83.3" in text
    assert "Contrastive: the baseline does not" not in text
    # Each seed below the floor is named, in every arm: a failed run is told from a spread.
    assert "- Multi-Similarity, baseline: 2 of 2 seeds end below the untrained network's" in text
    assert "seed 0: R@1 87.0, MAP@R 34.0; seed 1: R@1 88.0, MAP@R 35.6" in text
    assert "Contrastive, baseline: " not in text


def test_the_untrained_floor_grows_with_the_seeds_a_table_compares(
    study: Study, tmp_path: Path
) -> None:
    """A peek at a grid still training caches the untrained network for its first seeds; the
    finished table must average the floor over every seed it compares, not the peek's. The seeds
    already cached are kept as they are, the missing ones evaluated, and a table over fewer seeds
    reads only its own."""
    root = tmp_path / "demo"
    root.mkdir()
    peek = {"recall@1": [0.25], "map@r": [0.125], "nmi": [0.5]}  # a sentinel no network scores
    (root / "untrained.json").write_text(json.dumps(peek))
    args = argparse.Namespace(
        setting="demo", omniglot_root=tmp_path, out=tmp_path, seeds=2, quick=False
    )
    floor = study.tables.untrained_reference(args)
    assert [len(values) for values in floor.values()] == [2, 2, 2]
    assert [values[0] for values in floor.values()] == [0.25, 0.125, 0.5]
    assert all(0.0 <= values[1] <= 1.0 and values[1] != values[0] for values in floor.values())
    assert json.loads((root / "untrained.json").read_text()) == floor
    args.seeds = 1
    assert study.tables.untrained_reference(args) == peek


def test_validate_sets_each_recipe_against_the_untrained_network_on_the_validation_split(
    study: Study, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``validate`` prints the untrained network's validation metrics beside the candidates (read
    from the validation split's own cache, never the test split's) and calls out a chosen recipe
    that does not clear it; a loss whose recipe clears it gets no such note."""
    monkeypatch.setattr(study.choose, "TABLES", tmp_path / "tables")
    monkeypatch.setattr(study.choose, "RECIPES", tmp_path / "recipes.json")
    monkeypatch.setattr(study.choose, "load_recipes", lambda: {})
    monkeypatch.setattr(study.choose, "run_jobs", lambda jobs, workers, ledger: None)
    root = tmp_path / "demo"
    (root / "validation").mkdir(parents=True)
    (root / "validation" / "untrained.json").write_text(
        json.dumps({"recall@1": [0.90], "map@r": [0.60], "nmi": [0.5]})
    )
    # A test-split reference that would clear everything, to show it is not the one used.
    (root / "untrained.json").write_text(
        json.dumps({"recall@1": [0.1], "map@r": [0.1], "nmi": [0.1]})
    )
    best_map = {"multi_similarity": 0.605, "contrastive": 0.70}  # below / above 60 + 1 point
    for loss, top in best_map.items():
        for i, name in enumerate(study.design.recipe_candidates("demo", loss)):
            candidate = root / "validation" / loss / study.choose.slug(name)
            run = candidate / "s0" / "cells" / "base" / "seed0"
            run.mkdir(parents=True)
            map_r = top - 0.01 * i if i else top  # the first candidate is the best
            metrics = {"recall@1": 0.95, "map@r": map_r, "nmi": 0.5}
            (run / "result.json").write_text(json.dumps({"seed": 0, "final_metrics": metrics}))
    args = argparse.Namespace(
        setting="demo",
        omniglot_root=tmp_path,
        out=tmp_path,
        losses=list(best_map),
        seeds=1,
        workers=1,
        quick=False,
        label="",
    )
    study.choose.validate(args)
    text = (tmp_path / "tables" / "idml_validation_demo.md").read_text()
    assert "| – | *untrained network* | 90.0 | 60.0 | 50.0 | |" in text
    assert (
        "**Multi-Similarity (8 epochs): the baseline does not beat the untrained network**" in text
    )
    assert "MAP@R 60.5 against 60.0" in text
    assert "Contrastive (m_pos=0.0, 8 epochs): the baseline does not" not in text


def test_the_ledger_keeps_a_folders_records_and_pins_but_not_its_checkpoints(
    study: Study, tmp_path: Path
) -> None:
    out = tmp_path / "grid"
    run = out / "demo" / "contrastive" / "idml" / "s0" / "cells" / "base" / "seed0"
    aside = run.with_name("seed0.replaced-20261203-224509")
    for folder in (run, aside):
        folder.mkdir(parents=True)
        (folder / "result.json").write_text('{"seed": 0}')
        (folder / "mechanism.json").write_text('{"test_u_cv": 0.3}')
        (folder / "checkpoint_latest.safetensors").write_bytes(b"\0" * 64)
    (run / "metrics.jsonl").write_text("{}\n")
    (out / "demo" / study.recipes.FOLDER_MEMORY_FORMAT).write_text('{"override": "x"}')
    (out / "demo" / "contrastive" / study.recipes.FOLDER_RECIPE).write_text(
        '{"recipe": "8 epochs"}'
    )
    (out / "demo" / "untrained.json").write_text('{"map@r": [0.4]}')
    (out / "demo" / study.recipes.FOLDER_OVERRIDES).write_text('{"overrides": []}')
    ledger = study.ledger.Ledger(out, tmp_path / "ledger" / "grid")

    assert ledger.record() == 6
    kept = sorted(str(p.relative_to(ledger.root)) for p in ledger.root.rglob("*") if p.is_file())
    assert kept == [
        "demo/contrastive/idml/s0/cells/base/seed0/mechanism.json",
        "demo/contrastive/idml/s0/cells/base/seed0/result.json",
        "demo/contrastive/recipe.json",
        "demo/memory_format.json",
        "demo/study_overrides.json",
        "demo/untrained.json",
    ]
    assert ledger.record() == 0  # nothing changed, nothing rewritten
    (run / "mechanism.json").write_text('{"test_u_cv": 0.3, "matched": {}}')  # a rematch
    assert ledger.record(run.parents[3]) == 1

    # A run that finishes takes the pins above it along: a chain stopped mid-grid, before the
    # command's closing record, still leaves the grid's recipe pin in the ledger.
    alone = study.ledger.Ledger(out, tmp_path / "ledger" / "alone")
    assert alone.record_run(run.parents[2]) == 6
    assert (alone.root / "demo" / "contrastive" / study.recipes.FOLDER_RECIPE).is_file()
    assert not (
        alone.root
        / "demo"
        / "contrastive"
        / "idml"
        / "s0"
        / "cells"
        / "base"
        / "seed0.replaced-20261203-224509"
    ).exists()

    # A new machine: an empty --out of the same name gets everything back but the checkpoints,
    # and a file it already has is never overwritten by the ledger's copy.
    fresh = tmp_path / "elsewhere" / "grid"
    (fresh / "demo").mkdir(parents=True)
    (fresh / "demo" / "untrained.json").write_text('{"map@r": [0.5]}')
    assert study.ledger.Ledger(fresh, ledger.root).restore() == 5
    moved = fresh / run.relative_to(out)
    assert json.loads((moved / "mechanism.json").read_text())["matched"] == {}
    assert not list(fresh.rglob("*.safetensors")) and not list(fresh.rglob("*replaced*"))
    assert json.loads((fresh / "demo" / "untrained.json").read_text()) == {"map@r": [0.5]}


def test_a_grid_restored_from_its_ledger_resumes_without_training_again(
    study: Study, tmp_path: Path
) -> None:
    """The point of the ledger: a run trained on one machine, whose folder is gone, is reused on
    the next from its record alone (``run_ablation`` matches the recorded config), and its table
    row is the same."""
    args = ["run", "--setting", "demo", "--quick", "--losses", "multi_similarity", "--seeds", "1"]
    args += ["--arms", "baseline", "--workers", "1"]
    study.script.main([*args, "--out", str(tmp_path / "first" / "grid")])
    first = tmp_path / "first" / "grid_quick"
    assert list(first.rglob("*.safetensors")), "the run trained"
    ledger = tmp_path / "ledger" / "grid_quick"
    study.ledger.Ledger(first, ledger).record()

    second = tmp_path / "second" / "grid_quick"
    study.ledger.Ledger(second, ledger).restore()
    study.script.main([*args, "--out", str(tmp_path / "second" / "grid")])
    assert not list(second.rglob("*.safetensors")), "a restored run must not train again"
    arm = Path("demo") / "multi_similarity" / "baseline"
    assert study.results.seed_results(second / arm) == study.results.seed_results(first / arm)


def test_a_grid_says_how_long_its_runs_still_to_train_will_take(
    study: Study,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A grid of a day's CPU time is resumed across sessions: its progress lines give the time
    left from the runs it trains, and count neither the finished runs it reuses (0 s) nor them
    among the runs left."""
    jobs = [
        study.jobs.Job(tmp_path / arm / f"s{seed}", (), False) for arm in "ab" for seed in (0, 1)
    ]
    record_runs(jobs[:2], {})  # arm a finished in an earlier session
    seconds = {
        str(job.folder): 0.0 if i < 2 else 600.0 + 600.0 * (i - 2) for i, job in enumerate(jobs)
    }
    monkeypatch.setattr(
        study.jobs, "run_job", lambda job: (str(job.folder), seconds[str(job.folder)])
    )
    study.jobs.run_jobs(jobs, workers=1)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and all("left" not in line for line in lines[:2])
    assert lines[2].endswith("(600 s; 0.0 min so far; about 10.0 min left)")
    assert lines[3].endswith("(1200 s; 0.0 min so far)")


def test_a_grid_times_the_runs_left_by_their_arm_and_not_by_a_run_resumed_part_way(
    study: Study,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Arms differ in time (one with Mixup trains half a batch more), and a run a stop cut off
    resumes from its checkpoint in part of a run's time: each run left is timed at its own arm's
    mean once that arm has a whole run, and the resumed run counts among the runs left only."""
    names = [("a", 0), ("a", 1), ("b", 0), ("a", 2), ("a", 3), ("b", 1)]
    jobs = [study.jobs.Job(tmp_path / arm / f"s{seed}", (), False) for arm, seed in names]
    part = jobs[0].folder / "cells" / "base" / "seed0"
    part.mkdir(parents=True)
    (part / "metrics.jsonl").write_text('{"epoch": 1}\n')
    assert study.jobs.part_trained(jobs[0]) and not study.jobs.part_trained(jobs[1])
    seconds = {str(job.folder): 1200.0 if job.folder.parent.name == "b" else 600.0 for job in jobs}
    seconds[str(jobs[0].folder)] = 100.0
    monkeypatch.setattr(
        study.jobs, "run_job", lambda job: (str(job.folder), seconds[str(job.folder)])
    )
    study.jobs.run_jobs(jobs, workers=1)
    lines = capsys.readouterr().out.splitlines()
    assert "left" not in lines[0]
    # Four runs left at arm a's 600 s (b has no run yet): not at the mean with the resumed 100 s.
    assert lines[1].endswith("(600 s; 0.0 min so far; about 40.0 min left)")
    # a, a, b left: 600 + 600 + 1200 s, not three runs at the mean of 600 and 1200.
    assert lines[2].endswith("(1200 s; 0.0 min so far; about 40.0 min left)")
    assert "left" not in lines[-1]


def record_margin_runs(jobs: list, map_at: dict[str, float], per_seed: float) -> None:
    """Stands in for training Contrastive validation ``jobs``: each run's result has the MAP@R
    ``map_at`` gives its positive margin, plus ``per_seed`` times its seed."""
    for job in jobs:
        margin = next(o for o in job.overrides if o.startswith("loss.pos_margin="))[16:]
        seed = int(job.folder.name[1:])
        run = job.folder / "cells" / "base" / f"seed{seed}"
        run.mkdir(parents=True, exist_ok=True)
        metrics = {"recall@1": 0.9, "map@r": map_at[margin] + per_seed * seed}
        (run / "result.json").write_text(json.dumps({"seed": seed, "final_metrics": metrics}))


def test_widen_steps_past_an_edge_until_the_chosen_value_lies_inside_the_values_tried(
    study: Study, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Contrastive's margin was chosen at the top of its grid on Omniglot with Lite0: ``widen``
    trains one step further (up to m_neg, never past it), adopts it when it gains a point, records
    the trial either way, and leaves the knob alone once the values tried bracket the choice or it
    has met its ceiling. Only the knob moves."""
    assert DISTANCE_MARGINS[1] == study.design.M_NEG
    monkeypatch.setattr(study.tables, "TABLES", tmp_path / "tables")
    monkeypatch.setattr(study.choose, "RECIPES", tmp_path / "recipes.json")
    recipes = {
        "demo": {
            "contrastive": {
                "recipe": "m_pos=0.4, 16 epochs",
                "overrides": ["loss.pos_margin=0.4", "optim.epochs=16"],
                "validation_map@r": 0.60,
                "history": ["m_pos=0.4, 8 epochs → m_pos=0.4, 16 epochs: converge gained +2"],
            },
            "multi_similarity": {"recipe": "16 epochs", "overrides": ["optim.epochs=16"]},
        }
    }
    (tmp_path / "recipes.json").write_text(json.dumps(recipes))
    monkeypatch.setattr(
        study.choose, "load_recipes", lambda: json.loads(study.choose.RECIPES.read_text())
    )
    trained: list[tuple[str, ...]] = []
    map_at = {"0.4": 0.60, "0.5": 0.59}

    def run_jobs(jobs: list, workers: int, ledger: object) -> None:
        trained.extend(job.overrides for job in jobs)
        record_margin_runs(jobs, map_at, per_seed=0.001)

    monkeypatch.setattr(study.choose, "run_jobs", run_jobs)

    def widen(label: str) -> str:
        args = ["widen", "--setting", "demo", "--seeds", "2", "--adopt", "--label", label]
        args += ["--losses", "multi_similarity,contrastive"]
        study.script.main([*args, "--out", str(tmp_path / "runs"), "--no-ledger"])
        return (tmp_path / "tables" / f"idml_widening_demo_{label}.md").read_text()

    first = widen("first")  # 0.5 loses a point: kept at 0.4, and the trial is on record
    chosen = json.loads(study.choose.RECIPES.read_text())["demo"]["contrastive"]
    assert chosen["recipe"] == "m_pos=0.4, 16 epochs" and len(chosen["history"]) == 1
    assert chosen["widened"] == [
        {"value": 0.5, "recipe": "m_pos=0.5, 16 epochs", "gain": pytest.approx(-1.0), "seeds": 2}
    ]
    assert "Knob values compared: Contrastive: m_pos=0.4, 16 epochs → m_pos=0.5, 16 epochs" in first
    assert "−1.00" in first or "-1.00" in first
    assert "Multi-Similarity: nothing to try" in first
    assert all("optim.epochs=16" in o and "loss.name=contrastive" in o for o in trained)

    trained.clear()
    second = widen("second")  # 0.4 now lies between 0.2 and 0.5: nothing to train
    assert trained == []
    assert "Contrastive: nothing to try (m_pos=0.4, 16 epochs)" in second

    # Where 0.5 gains, it is adopted; it is m_neg, so the margin goes no further.
    (tmp_path / "recipes.json").write_text(json.dumps(recipes))
    map_at["0.5"] = 0.625
    third = widen("third")
    chosen = json.loads(study.choose.RECIPES.read_text())["demo"]["contrastive"]
    assert chosen["recipe"] == "m_pos=0.5, 16 epochs"
    assert chosen["overrides"] == ["loss.pos_margin=0.5", "optim.epochs=16"]
    assert len(chosen["history"]) == 2 and "widen gained +2.50" in chosen["history"][1]
    assert "adopted m_pos=0.5, 16 epochs" in third
    trained.clear()
    assert "Contrastive: nothing to try (m_pos=0.5, 16 epochs)" in widen("fourth")
    assert trained == []


def retune(study: Study, out: Path, seeds: int, losses: str, arms: str) -> None:
    """``study_idml.py retune`` on the demo setting, its runs in ``out``, no ledger."""
    study.script.main(
        [
            *("retune", "--setting", "demo", "--seeds", str(seeds), "--losses", losses),
            *("--arms", arms, "--out", str(out), "--no-ledger"),
        ]
    )


def test_retune_chooses_an_arms_own_margin_and_a_grid_trains_every_arm_with_it(
    study: Study, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The baseline's validated margin may be too tight for a Mixup batch: ``retune`` trains the
    arm asked for on the validation split at the baseline's recipe with each margin tried (the
    budget unchanged), records the best as that arm's recipe, and ``run --recipe <arm>`` trains a
    grid whose every arm uses it, its tables saying whose recipe it is."""
    monkeypatch.setattr(study.choose, "TABLES", tmp_path / "tables")
    monkeypatch.setattr(study.choose, "RECIPES", tmp_path / "recipes.json")
    baseline = {
        "recipe": "m_pos=0.2, 40 epochs",
        "overrides": ["loss.pos_margin=0.2", "optim.epochs=40"],
    }
    recipes = {
        "demo": {
            "contrastive": dict(baseline),
            "multi_similarity": {"recipe": "8 epochs", "overrides": ["optim.epochs=8"]},
        }
    }
    (tmp_path / "recipes.json").write_text(json.dumps(recipes))

    def load() -> dict[str, Any]:
        return dict(json.loads((tmp_path / "recipes.json").read_text()))

    monkeypatch.setattr(study.choose, "load_recipes", load)
    monkeypatch.setattr(study.recipes, "load_recipes", load)
    map_at = {"0.0": 0.45, "0.1": 0.50, "0.2": 0.55, "0.3": 0.60, "0.4": 0.58, "0.5": 0.52}
    trained: list[tuple[str, ...]] = []

    def run_jobs(jobs: list, workers: int, ledger: object) -> None:
        trained.extend(job.overrides for job in jobs)
        record_margin_runs(jobs, map_at, per_seed=0.002)

    monkeypatch.setattr(study.choose, "run_jobs", run_jobs)
    retune(
        study, out=tmp_path / "runs", seeds=2, losses="contrastive,multi_similarity", arms="mixup"
    )
    assert len(trained) == 6 * 2  # six margins, two seeds; Multi-Similarity has no knob
    assert all("mixup.enabled=true" in o and "optim.epochs=40" in o for o in trained)
    assert all("data.protocol=validation" in o for o in trained)
    assert sorted({o for job in trained for o in job if o.startswith("loss.pos_margin=")}) == [
        f"loss.pos_margin=0.{k}" for k in range(6)
    ]
    chosen = json.loads((tmp_path / "recipes.json").read_text())["demo"]["contrastive"]
    assert chosen["recipe"] == baseline["recipe"]  # the baseline's own recipe stays
    assert chosen["arms"]["mixup"]["recipe"] == "m_pos=0.3, 40 epochs"
    assert chosen["arms"]["mixup"]["overrides"] == ["loss.pos_margin=0.3", "optim.epochs=40"]
    assert chosen["arms"]["mixup"]["of"] == "m_pos=0.2, 40 epochs"
    table = (tmp_path / "tables" / "idml_retune_demo.md").read_text()
    assert "Arms retuned: Contrastive: Mixup only (from m_pos=0.2, 40 epochs)." in table
    assert (
        "| Contrastive | Mixup only | m_pos=0.3, 40 epochs | 90.0 ± 0.0 | 60.1 ± 0.1 | **chosen** |"
        in table
    )
    assert "| m_pos=0.2, 40 epochs | 90.0 ± 0.0 | 55.1 ± 0.1 | the baseline's |" in table
    assert "| m_pos=0.3, 40 epochs − m_pos=0.2, 40 epochs | 2 | +0.00 | – | – | +5.00 |" in table
    assert "m_pos=0.3, 40 epochs gains +5.00 validation MAP@R over the baseline's" in table
    assert "1 point needed): adopted." in table
    assert "Multi-Similarity: no knob beyond its budget" in table

    # Another arm retuned later joins the table and the record; the first stays in both.
    retune(study, out=tmp_path / "runs", seeds=2, losses="contrastive", arms="idml")
    arms = json.loads((tmp_path / "recipes.json").read_text())["demo"]["contrastive"]["arms"]
    assert sorted(arms) == ["idml", "mixup"]
    table = (tmp_path / "tables" / "idml_retune_demo.md").read_text()
    assert (
        "Arms retuned: Contrastive: Mixup only (from m_pos=0.2, 40 epochs); Contrastive: IDML"
        in table
    )
    assert "| Contrastive | Mixup only | m_pos=0.3, 40 epochs |" in table
    assert "| Contrastive | IDML | m_pos=0.3, 40 epochs |" in table
    # Retuned again at more seeds, IDML reads its new ones; Mixup, not asked, keeps its own two.
    retune(study, out=tmp_path / "runs", seeds=3, losses="contrastive", arms="idml")
    table = (tmp_path / "tables" / "idml_retune_demo.md").read_text()
    assert "Mixup only: not every value has its" not in table
    assert "| Contrastive | Mixup only | m_pos=0.3, 40 epochs | 90.0 ± 0.0 | 60.1 ± 0.1 |" in table
    assert "| Contrastive | IDML | m_pos=0.3, 40 epochs | 90.0 ± 0.0 | 60.2 ± 0.2 |" in table
    assert "every value at the seeds its arm was retuned with" in table

    # A grid at the arm's recipe: every arm trains with it, and its tables say whose it is.
    phases: list[list] = []
    monkeypatch.setattr(study.jobs, "run_jobs", lambda jobs, w, ledger: phases.append(jobs))
    args = grid_args(tmp_path / "grid", "demo", "contrastive", ["baseline", "mixup", "idml"])
    args.recipe = "mixup"
    study.jobs.run(args)
    assert {o for job in phases[0] for o in job.overrides if o.startswith("loss.pos")} == {
        "loss.pos_margin=0.3"
    }
    folder = tmp_path / "grid" / "demo" / "contrastive"
    assert study.recipes.pinned_recipe(folder) == "m_pos=0.3, 40 epochs (chosen for Mixup only)"
    header = study.tables.settings_lines(args, ["contrastive"])[1]
    assert header.startswith("Recipes, every arm's (validation split of the training classes)")
    assert "Contrastive: m_pos=0.3, 40 epochs (chosen for Mixup only)" in header
    # ... a folder pinned to it refuses the baseline's recipe, as any other.
    args.recipe = "validated"
    with pytest.raises(SystemExit, match="new --out"):
        study.jobs.run(args)

    # Once the baseline's recipe moves on, the arm's must be chosen again before a grid uses it.
    moved = json.loads((tmp_path / "recipes.json").read_text())
    moved["demo"]["contrastive"].update(recipe="m_pos=0.2, 80 epochs")
    (tmp_path / "recipes.json").write_text(json.dumps(moved))
    args = grid_args(tmp_path / "later", "demo", "contrastive", ["mixup"])
    args.recipe = "mixup"
    with pytest.raises(SystemExit, match="retune --arms mixup` again"):
        study.jobs.run(args)
    args.recipe = "ism"
    with pytest.raises(SystemExit, match="no recipe chosen for the arm 'ism'"):
        study.jobs.run(args)


def test_retune_keeps_the_baselines_value_unless_another_gains_a_point(
    study: Study, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A value that beats the baseline's by less than the seeds' spread is not a recipe: the arm
    keeps the baseline's, by the rule ``converge`` and ``widen`` adopt by, and the table says
    which value was highest and by how much."""
    monkeypatch.setattr(study.choose, "TABLES", tmp_path / "tables")
    monkeypatch.setattr(study.choose, "RECIPES", tmp_path / "recipes.json")
    baseline = {
        "recipe": "m_pos=0.2, 8 epochs",
        "overrides": ["loss.pos_margin=0.2", "optim.epochs=8"],
    }
    (tmp_path / "recipes.json").write_text(json.dumps({"demo": {"contrastive": baseline}}))
    monkeypatch.setattr(
        study.choose, "load_recipes", lambda: json.loads((tmp_path / "recipes.json").read_text())
    )
    map_at = {"0.0": 0.556, "0.1": 0.553, "0.2": 0.55, "0.3": 0.54, "0.4": 0.50, "0.5": 0.45}

    def run_jobs(jobs: list, workers: int, ledger: object) -> None:
        record_margin_runs(jobs, map_at, per_seed=0.01)

    monkeypatch.setattr(study.choose, "run_jobs", run_jobs)
    retune(study, out=tmp_path / "runs", seeds=3, losses="contrastive", arms="mixup")
    chosen = json.loads((tmp_path / "recipes.json").read_text())["demo"]["contrastive"]
    assert chosen["arms"]["mixup"]["recipe"] == "m_pos=0.2, 8 epochs"
    assert chosen["arms"]["mixup"]["overrides"] == baseline["overrides"]
    assert chosen["arms"]["mixup"]["tried"]["m_pos=0.0, 8 epochs"] == pytest.approx(0.566)
    table = (tmp_path / "tables" / "idml_retune_demo.md").read_text()
    assert "| m_pos=0.0, 8 epochs | 90.0 ± 0.0 | 56.6 ± 1.0 | the highest |" in table
    assert "| m_pos=0.1, 8 epochs | 90.0 ± 0.0 | 56.3 ± 1.0 |  |" in table
    assert "| m_pos=0.2, 8 epochs | 90.0 ± 0.0 | 56.0 ± 1.0 | **chosen**, the baseline's |" in table
    assert (
        "m_pos=0.0, 8 epochs gains +0.60 validation MAP@R over the baseline's m_pos=0.2, 8 epochs "
        "(3 seeds; 1 point needed): the arm keeps the baseline's value." in table
    )
    assert "the highest value (m_pos=0.0, 8 epochs) is the smallest tried." in table


def test_retune_records_nothing_until_every_value_has_its_seeds(
    study: Study, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(study.choose, "TABLES", tmp_path / "tables")
    monkeypatch.setattr(study.choose, "RECIPES", tmp_path / "recipes.json")
    baseline = {
        "recipe": "m_pos=0.2, 8 epochs",
        "overrides": ["loss.pos_margin=0.2", "optim.epochs=8"],
    }
    (tmp_path / "recipes.json").write_text(json.dumps({"demo": {"contrastive": baseline}}))
    monkeypatch.setattr(
        study.choose, "load_recipes", lambda: json.loads((tmp_path / "recipes.json").read_text())
    )

    def run_jobs(jobs: list, workers: int, ledger: object) -> None:
        # Cut off: only the first value's seeds and one more run finish.
        record_margin_runs(jobs[:3], {f"0.{k}": 0.5 for k in range(6)}, per_seed=0.0)

    monkeypatch.setattr(study.choose, "run_jobs", run_jobs)
    retune(study, out=tmp_path / "runs", seeds=2, losses="contrastive", arms="idml")
    assert "arms" not in json.loads((tmp_path / "recipes.json").read_text())["demo"]["contrastive"]
    table = (tmp_path / "tables" / "idml_retune_demo.md").read_text()
    assert "not every value has its 2 seeds yet; nothing recorded" in table


@pytest.mark.parametrize(
    "arms", [[], ["--arms", "baseline"], ["--arms", "idml_uniform"], ["--arms", "mixup_margin"]]
)
def test_retune_asks_for_the_arms_it_can_tune(
    study: Study, tmp_path: Path, arms: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        study.script.main(
            ["retune", "--setting", "demo", *arms, "--out", str(tmp_path), "--no-ledger"]
        )
    error = capsys.readouterr().err
    assert "retune chooses the knob of the arms named by --arms" in error
    assert "mixup" in error and "a matched control takes the knobs" in error


def test_a_diagnostic_override_keeps_to_its_own_folder_and_says_so_in_its_tables(
    study: Study, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Lite0 collapse was diagnosed with a hand-edited recipe pin (the backbone at a tenth of
    its rate), which no command could repeat. ``run --override`` makes it one, and keeps such runs
    out of a grid of the validated recipe."""
    sixteen = {"recipe": "16 epochs", "overrides": ["optim.epochs=16"]}
    for module in (study.recipes, study.tables):
        monkeypatch.setattr(module, "load_recipes", lambda: {"demo": {"contrastive": sixteen}})

    def args(out: Path, *override: str, arms: tuple[str, ...] = ("baseline", "mixup")) -> Any:
        return argparse.Namespace(
            setting="demo", omniglot_root=tmp_path, quick=False, out=out, seeds=2,
            losses=["contrastive"], arms=list(arms), recipe="validated", override=list(override),
        )  # fmt: skip

    slow = args(tmp_path / "slow", "optim.backbone_lr_mult=0.1")
    jobs = study.jobs.main_jobs(slow, matched=False)
    assert len(jobs) == 4
    for job in jobs:  # after the recipe (it may change a recipe's key), before the arm's own keys
        keys = [o.partition("=")[0] for o in job.overrides]
        assert keys.index("optim.epochs") < keys.index("optim.backbone_lr_mult")
        assert keys.index("optim.backbone_lr_mult") < keys.index("mixup.enabled")
    assert not (tmp_path / "slow" / "demo" / study.recipes.FOLDER_OVERRIDES).exists(), (
        "pinned unchecked"
    )
    study.jobs.checked_jobs(slow, jobs)
    assert study.recipes.study_overrides(slow, pin=False) == ["optim.backbone_lr_mult=0.1"]
    assert len(study.jobs.main_jobs(slow, matched=False)) == 4  # the same again: nothing to say

    # Without the override, or with another, the folder's runs would mix two recipes.
    for other in ((), ("optim.backbone_lr_mult=0.2",)):
        with pytest.raises(SystemExit, match="--out") as stop:
            study.jobs.checked_jobs(args(tmp_path / "slow", *other), jobs)
        assert "optim.backbone_lr_mult=0.1" in str(stop.value)
    # A folder of the plain recipe (its runs trained before the pin existed) gains no diagnostic.
    plain = tmp_path / "plain" / "demo" / "contrastive" / "baseline" / "s0"
    plain.mkdir(parents=True)
    (plain / "result.json").write_text("{}")
    with pytest.raises(SystemExit, match="no --override"):
        study.jobs.main_jobs(args(tmp_path / "plain", "optim.lr=0.01"), matched=False)
    assert study.recipes.study_overrides(args(tmp_path / "plain"), pin=True) == []

    # A key an arm sets would make two arms one run; a misspelt key stops before anything is pinned.
    with pytest.raises(SystemExit, match=r"the arm 'baseline' sets mixup\.enabled=false"):
        study.jobs.main_jobs(args(tmp_path / "clash", "mixup.enabled=false"), matched=False)
    typo = args(tmp_path / "typo", "optim.backbone_lr_mul=0.1")
    with pytest.raises(SystemExit, match="backbone_lr_mult"):
        study.jobs.checked_jobs(typo, study.jobs.main_jobs(typo, matched=False))
    assert not (tmp_path / "typo" / "demo" / study.recipes.FOLDER_OVERRIDES).exists()

    # Its tables say what the runs are.
    lines = study.tables.settings_lines(slow, ["contrastive"])
    assert "A diagnostic" in lines[-1] and "optim.backbone_lr_mult=0.1" in lines[-1]
    assert not any(
        "diagnostic" in line for line in study.tables.settings_lines(args(tmp_path / "x"), [])
    )


def test_only_a_grid_takes_a_diagnostic_override_and_its_runs_train_with_it(
    study: Study, tmp_path: Path
) -> None:
    for command in ("validate", "converge", "widen"):
        with pytest.raises(SystemExit):
            study.script.main([command, "--setting", "demo", "--override", "optim.lr=0.1"])
    out = ["--out", str(tmp_path / "grid")]
    with pytest.raises(SystemExit):
        study.script.main(["run", "--setting", "demo", "--override", "lr 0.1", *out])
    with pytest.raises(SystemExit):  # the study sets the seed (and the loss) of each run itself
        study.script.main(["run", "--setting", "demo", "--override", "seed=3", *out])
    assert not list(tmp_path.iterdir())

    args = ["run", "--setting", "demo", "--quick", "--losses", "multi_similarity", "--seeds", "1"]
    study.script.main(
        [*args, "--arms", "baseline", "--workers", "1", "--override", "optim.lr=0.0021", *out]
    )
    (result,) = (tmp_path / "grid_quick").rglob("result.json")
    assert json.loads(result.read_text())["config"]["optim"]["lr"] == 0.0021
    # Recipes are never chosen among a diagnostic's runs.
    with pytest.raises(SystemExit):
        study.script.main(["validate", "--setting", "demo", "--quick", "--seeds", "1", *out])
    assert not (tmp_path / "grid_quick" / "demo" / "validation").exists()


def test_a_control_matched_past_the_negative_margin_stops_before_training(
    study: Study, tmp_path: Path
) -> None:
    """The margin-matched control moves m_pos by ISM's median effect; from Lite0's m_pos 0.4 that
    can pass m_neg, where Contrastive no longer separates a positive from a negative pair."""
    args = argparse.Namespace(setting="demo", out=tmp_path, override=[])
    crossed = study.jobs.Job(
        tmp_path / "s0", ("loss.name=contrastive", "loss.pos_margin=0.62", "seed=0"), False
    )
    with pytest.raises(SystemExit, match=r"pos_margin 0\.62 and neg_margin 0\.5 cross") as stop:
        study.jobs.checked_jobs(args, [crossed])
    assert str(tmp_path / "s0") in str(stop.value)
    met = study.jobs.Job(tmp_path / "s0", ("loss.name=contrastive", "loss.pos_margin=0.5"), False)
    assert study.jobs.checked_jobs(args, [met]) == [met]


SUMMARY_TABLE = """\
# IDML study: a setting

## Differences (paired over seeds that share initialisation and batches)

| | comparison | n | Δ R@1 [95 % CI] | d_z | p (Holm) | Δ MAP@R [95 % CI] | d_z | p (Holm) |
|---|---|---|---|---|---|---|---|---|
| Contrastive | ISM only − baseline | 6 | +3.79 ▲ [+2.21, +5.36] | +1.72 | 0.00248 | +1.25 [+0.28, +2.28] | +0.92 | 0.0706 |
| Contrastive | IDML − Mixup only | 6 | -0.04 [-0.90, +0.80] | -0.01 | 1 | +0.04 [-0.16, +0.94] | +0.01 | 1 |
| Contrastive | IDML − IDML with u frozen | 10 | +0.56 [-0.13, +1.25] | +0.58 | 0.165 | -0.85 [-1.01, -0.64] | -0.70 | 0.165 |
| Contrastive | IDML − uniform weakening | 10 | -5.52 ▼ [-6.24, -4.81] | -5.55 | 2e-07 | -3.71 ▼ [-4.39, -3.04] | -3.92 | 4e-06 |

## Is the introspection real? (runs with an uncertainty head, mean over seeds)

| | arm | test ‖u‖ | test CV | AUROC mixup / blur / low-res / occl. | pos q10 / q50 | batch CV |
|---|---|---|---|---|---|---|
| Contrastive | IDML | 0.1199 | 2.13 | 1.00 / 1.00 / 1.00 / 0.07 | 0.288 / 0.572 | 1.43 |
"""


def test_a_summary_row_reads_its_table_as_printed(study: Study, tmp_path: Path) -> None:
    summary = study.summary
    (tmp_path / "t.md").write_text(SUMMARY_TABLE)
    cells = [summary.Cell("a cell §", "t.md", "Contrastive")]
    rows = summary.summary_table(cells, tmp_path)
    assert rows[: len(summary.HEADER)] == list(summary.HEADER)
    # MAP@R to one decimal, a half away from zero; R@1 beside it only where R@1 is beyond noise;
    # bold with the marker where MAP@R is; the seeds where fewer than a claim needs; no sign on 0.
    assert rows[-1] == (
        "| a cell § | 0.288 / 0.572 | +1.3 (R@1 +3.8 ▲) (6 seeds) | 0.0 (6 seeds) | −0.9 | "
        "**−3.7 ▼** (R@1 −5.5 ▼) |"
    )
    # A family without the comparison leaves the column empty; a mark follows every number.
    no_ism_only = replace(summary.MAIN, ism_only=None)
    (row,) = summary.summary_table(
        [summary.Cell("b", "t.md", "Contrastive", no_ism_only, "†")], tmp_path
    )[2:]
    assert row.startswith("| b | 0.288 / 0.572 |  | 0.0 (6 seeds) † | −0.9 † |")
    # A cell whose group or comparison the table lacks is an error naming the table.
    with pytest.raises(ValueError, match=r"t\.md.*ProxyAnchor"):
        summary.summary_table([summary.Cell("c", "t.md", "ProxyAnchor")], tmp_path)
    # A table whose header the summary does not know is an error that says which columns.
    (tmp_path / "old.md").write_text(SUMMARY_TABLE.replace("Δ MAP@R [95 % CI]", "Δ MAP@R"))
    with pytest.raises(ValueError, match=r"old\.md.*Δ MAP@R \[95 % CI\]"):
        summary.summary_table([summary.Cell("d", "old.md", "Contrastive")], tmp_path)


def test_the_readme_summary_is_the_one_drawn_from_the_study_tables(study: Study) -> None:
    summary = study.summary
    readme = summary.README.read_text()
    drawn = summary.with_summary(readme, summary.summary_table())
    assert drawn == readme, (
        "README.md's study summary differs from the committed study tables: run "
        "`python benchmarks/study_idml.py summary` (and add a new cell to CELLS in "
        "benchmarks/idml_study/summary.py)"
    )
    with pytest.raises(ValueError, match="markers"):
        summary.with_summary(readme.replace(summary.END, ""), [])
    # Every table `tables` wrote is a row or set aside with the README's reason, so a finished
    # grid cannot be left out of the summary by forgetting it.
    assert summary.unsummarised() == []


def test_the_readmes_headline_counts_the_summary_and_no_control_is_beaten(study: Study) -> None:
    # The README leads with "In none of the N cells measured has the introspective metric beaten
    # the controls": N is the summary's row count, and no row's frozen-`u` or uniform-weakening
    # column holds a ▲ (Holm-corrected). A new cell that changes either fails here, not in review.
    summary = study.summary
    rows = summary.summary_table()[len(summary.HEADER) :]
    (count,) = re.findall(r"In none of the (\d+) cells measured", summary.README.read_text())
    assert int(count) == len(rows) == len(summary.CELLS)
    columns = [name.strip() for name in summary.HEADER[0].split("|")]
    controls = [columns.index("IDML − `u` frozen"), columns.index("IDML − uniform weakening")]
    beaten = [row for row in rows if any("▲" in row.split("|")[i] for i in controls)]
    assert beaten == []


def test_a_study_table_no_cell_reads_is_named(study: Study, tmp_path: Path) -> None:
    summary = study.summary
    for name in ("idml_demo.md", "idml_omniglot_lite0_new_grid.md", "idml_convergence_demo.md"):
        (tmp_path / name).write_text("")
    for name in summary.SET_ASIDE:
        (tmp_path / name).write_text("")
    # idml_demo.md is a cell's; a convergence table is not a grid's (its name is not a setting's).
    assert summary.unsummarised(tmp_path) == ["idml_omniglot_lite0_new_grid.md"]


def test_summary_is_a_command_of_the_study_that_needs_no_setting(
    study: Study, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setattr(study.script, "summary", lambda: False)
    study.script.main(["summary"])
    assert "already current" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        study.script.main(["tables"])
    assert "needs --setting" in capsys.readouterr().err
