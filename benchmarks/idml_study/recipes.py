"""What every run of a study folder trains with, and the pins that keep a folder's runs on one
set: the setting's overrides and memory format (``memory_format.json``), a diagnostic's
``--override`` values (``study_overrides.json``), and the validated recipe
(``benchmarks/study/idml_recipes.json``) that each loss's folder pins (``recipe.json``).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from idml_study.design import ARMS, KNOBS, SETTINGS, TABLES

RECIPES = TABLES / "idml_recipes.json"
FOLDER_RECIPE = "recipe.json"
"""Beside a loss's arms in a run folder: the recipe its runs were trained with (:func:`pin_recipe`)."""


def setting_overrides(args: argparse.Namespace, pin: bool = True) -> list[str]:
    """The overrides every run of ``args.setting`` in ``args.out`` trains with: the setting's, its
    data, and the memory format the folder's runs use (:func:`memory_format`; ``pin``: record it
    for a new folder)."""
    spec = SETTINGS[args.setting]
    out = [*spec.overrides, f"optim.epochs={spec.epochs}"]
    if spec.needs_omniglot:
        out.append(f"data.root={args.omniglot_root}")
    if args.quick:
        out += ["optim.max_steps_per_epoch=3"]
    return [*out, memory_format(args.out / args.setting, pin)]


FOLDER_MEMORY_FORMAT = "memory_format.json"
"""Beside a setting's runs: the memory format they train in (:func:`memory_format`)."""

LEGACY_LAYOUT = "optim.channels_last=false"
"""The layout :func:`memory_format` pins to a folder trained before the pin existed."""


FOLDER_OVERRIDES = "study_overrides.json"
"""Beside a setting's runs: the ``--override`` values they all train with (:func:`study_overrides`)."""


def trained_runs(folder: Path) -> bool:
    """Whether ``folder`` holds a run that trained, or the record of one (restored from a ledger)."""
    return folder.is_dir() and any(
        path.name in ("metrics.jsonl", "result.json") for path in folder.rglob("*.json*")
    )


def said(overrides: Sequence[str]) -> str:
    """``overrides`` as the command line that asks for them."""
    return " ".join(f"--override {o}" for o in overrides) or "no --override"


def study_overrides(args: argparse.Namespace, pin: bool) -> list[str]:
    """The ``--override`` values every run in ``args.out / args.setting`` trains with: those the
    folder pins, which ``args.override`` (when given, or when ``pin``) must repeat. A folder without
    the pin whose runs trained, trained without overrides; a new folder pins what it is asked for
    (``pin``). A mismatch stops the command: one folder never mixes a diagnostic with the recipe."""
    folder = args.out / args.setting
    path = folder / FOLDER_OVERRIDES
    asked = list(getattr(args, "override", None) or [])
    if path.is_file():
        pinned: list[str] | None = list(json.loads(path.read_text())["overrides"])
    else:
        pinned = [] if trained_runs(folder) else None
    if pinned is None:
        if pin:
            folder.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"overrides": asked}, indent=2) + "\n")
        return asked
    if (pin or asked) and asked != pinned:
        raise SystemExit(
            f"{folder}: its runs trained with {said(pinned)}, this command asks for {said(asked)}; "
            "a folder's runs share one set of overrides, so run a diagnostic in its own --out "
            f"(or repeat the folder's: {said(pinned)})"
        )
    return pinned


def memory_format(setting_folder: Path, pin: bool) -> str:
    """The ``optim.channels_last`` override of every run in ``setting_folder``, the same for all of
    them. Channels-last became the CPU's default on 2026-12-03: the same float32 sums in another
    order, which training's chaos turns into a seed-sized difference, so a grid grown after that
    must not mix its new runs' layout with its old ones'. The layout is pinned at a folder's first
    run (``pin``); a folder with runs but no pin was trained before, in the default layout."""
    path = setting_folder / FOLDER_MEMORY_FORMAT
    if path.is_file():
        return str(json.loads(path.read_text())["override"])
    override = LEGACY_LAYOUT if trained_runs(setting_folder) else "optim.channels_last=true"
    if pin:
        setting_folder.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"override": override}, indent=2) + "\n")
    return override


def load_recipes() -> dict[str, Any]:
    return json.loads(RECIPES.read_text()) if RECIPES.is_file() else {}


def recipe_record(setting: str, loss: str) -> dict[str, Any]:
    """The validated recipe of ``loss`` in ``setting`` (``idml_recipes.json``; an error before
    ``validate``)."""
    chosen = load_recipes().get(setting, {}).get(loss)
    if chosen is None:
        raise SystemExit(
            f"no validated recipe for {setting}/{loss}: run `python benchmarks/study_idml.py "
            f"validate --setting {setting}` first ({RECIPES} holds the chosen ones)"
        )
    return dict(chosen)


def retuned_record(setting: str, loss: str, arm: str) -> dict[str, Any]:
    """The recipe ``retune`` chose for ``arm`` of ``loss`` in ``setting`` (``idml_recipes.json``,
    under its loss's ``arms``), with ``chosen_for`` set; an error before ``retune``, or once the
    baseline recipe it was tuned from has moved on (``converge`` or ``widen --adopt``). A loss
    without a knob (Multi-Similarity) has nothing to retune: its validated recipe is every arm's."""
    baseline = recipe_record(setting, loss)
    if loss not in KNOBS:
        return baseline
    retuned = baseline.get("arms", {}).get(arm)
    if retuned is None:
        raise SystemExit(
            f"no recipe chosen for the arm {arm!r} of {setting}/{loss}: run `python "
            f"benchmarks/study_idml.py retune --setting {setting} --losses {loss} --arms {arm}` "
            f"first ({RECIPES} holds the chosen ones)"
        )
    if retuned["of"] != baseline["recipe"]:
        raise SystemExit(
            f"the recipe chosen for the arm {arm!r} of {setting}/{loss} ({retuned['recipe']!r}) "
            f"was tuned from the baseline recipe {retuned['of']!r}, which has since become "
            f"{baseline['recipe']!r}: run `retune --arms {arm}` again"
        )
    return {**retuned, "chosen_for": arm}


def pin_recipe(loss_folder: Path, chosen: dict[str, Any]) -> None:
    """Record the recipe a loss's runs in ``loss_folder`` train with, or stop if its runs used
    another: a grid never mixes budgets or knobs across arms. ``converge --adopt`` changes a
    recipe; its grid then goes to a new ``--out``, the old grid keeping the recipe it was run at."""
    path = loss_folder / FOLDER_RECIPE
    if path.is_file():
        pinned = json.loads(path.read_text())
        if list(pinned["overrides"]) != list(chosen["overrides"]):
            raise SystemExit(
                f"{loss_folder}: its runs used the recipe {pinned['recipe']!r} "
                f"({' '.join(pinned['overrides'])}), the validated recipe is now "
                f"{chosen['recipe']!r} ({' '.join(chosen['overrides'])}); run the new recipe in a "
                "new --out (with --label for its tables), or move this folder away"
            )
        return
    loss_folder.mkdir(parents=True, exist_ok=True)
    record = {"recipe": chosen["recipe"], "overrides": list(chosen["overrides"])}
    if "chosen_for" in chosen:
        record["chosen_for"] = chosen["chosen_for"]
    path.write_text(json.dumps(record, indent=2) + "\n")


def pinned_recipe(loss_folder: Path) -> str | None:
    """The recipe name :func:`pin_recipe` recorded in ``loss_folder``, if any, saying which arm
    chose it where ``retune`` did (``"m_pos=0.3, 40 epochs (chosen for Mixup only)"``)."""
    path = loss_folder / FOLDER_RECIPE
    if not path.is_file():
        return None
    pinned = json.loads(path.read_text())
    arm = pinned.get("chosen_for")
    return str(pinned["recipe"]) + (f" (chosen for {ARMS[arm].label})" if arm else "")


def grid_recipe(args: argparse.Namespace, loss: str, loss_folder: Path) -> list[str]:
    """The overrides a grid's runs of ``loss`` in ``loss_folder`` train with: the validated recipe,
    pinned to the folder (:func:`pin_recipe`); with ``--recipe pinned`` the one the folder already
    pins, so that arms or seeds can be added to a grid after ``converge --adopt`` moved the
    validated recipe on; with ``--recipe <arm>`` the one ``retune`` chose for that arm
    (:func:`retuned_record`), which every arm of the grid then trains with, pinned likewise."""
    if args.quick:
        return []
    if args.recipe == "pinned":
        path = loss_folder / FOLDER_RECIPE
        if not path.is_file():
            raise SystemExit(
                f"--recipe pinned: {loss_folder} pins no recipe ({FOLDER_RECIPE} is missing); "
                "start a grid with the validated recipe (the default --recipe validated)"
            )
        return list(json.loads(path.read_text())["overrides"])
    if args.recipe == "validated":
        chosen = recipe_record(args.setting, loss)
    else:
        chosen = retuned_record(args.setting, loss, args.recipe)
    pin_recipe(loss_folder, chosen)
    return list(chosen["overrides"])
