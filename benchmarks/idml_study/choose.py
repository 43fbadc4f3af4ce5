"""Choosing the recipes on the validation split of the training classes: ``validate`` (the
baseline's grid of candidates), ``converge`` (the budget doubled), ``widen`` (a knob one step past
the edge of the values tried) and ``retune`` (an arm's own knob at the baseline's budget), each
with its table.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from idml_study.design import (
    ARMS,
    BASELINE,
    CONVERGED_GAIN,
    KNOBS,
    LOSS_NAMES,
    LOSSES,
    RETUNABLE,
    SETTINGS,
    TABLES,
    grid_edges,
    recipe_candidates,
    retune_candidates,
    widened_knob,
)
from idml_study.jobs import Job, run_jobs
from idml_study.ledger import study_ledger
from idml_study.recipes import RECIPES, load_recipes, setting_overrides
from idml_study.results import final_metrics, fmt, mean, seed_results
from idml_study.tables import (
    TABLE_METRICS,
    difference_table,
    floor_notes,
    untrained_reference,
    write_table,
)


def validate(args: argparse.Namespace) -> None:
    setting = args.setting
    base = [
        *setting_overrides(args),
        "data.protocol=validation",
        *SETTINGS[setting].validation,
    ]
    jobs = []
    for loss in args.losses:
        for name, overrides in recipe_candidates(setting, loss).items():
            folder = args.out / setting / "validation" / loss / slug(name)
            for seed in range(args.seeds):
                config = [
                    *base,
                    f"loss.name={loss}",
                    *BASELINE.overrides,
                    *overrides,
                    f"seed={seed}",
                ]
                jobs.append(Job(folder / f"s{seed}", tuple(config), mechanism=False))
    run_jobs(jobs, args.workers, study_ledger(args))
    recipes = load_recipes()
    lines = [
        f"# IDML study, {setting}: baseline recipes on the validation split\n",
        "Held-out *training* classes (`data.protocol=validation`, `data.validation_classes`); the "
        "test classes are never loaded. Baseline arm (plain metric, no Mixup), "
        f"{args.seeds} seeds, last epoch. Chosen: the highest mean validation MAP@R.\n",
        "Settings: `" + " ".join(o for o in base if not o.startswith("data.root=")) + "`\n",
        "| loss | recipe | R@1 | MAP@R | NMI | |",
        "|---|---|---|---|---|---|",
    ]
    reference = untrained_reference(args, validation=True)
    lines.append(
        f"| – | *untrained network* | {fmt(reference['recall@1'])} | {fmt(reference['map@r'])} | "
        f"{fmt(reference['nmi'])} | |"
    )
    notes: list[str] = []
    # Every loss validated so far goes in the table, not only this call's: the file is the
    # setting's one record of how its recipes were chosen.
    for loss in LOSSES:
        scores = {
            name: final_metrics(args.out / setting / "validation" / loss / slug(name), args.seeds)
            for name in recipe_candidates(setting, loss)
        }
        if loss not in args.losses and not all(m["map@r"] for m in scores.values()):
            continue  # not validated yet
        best = max(scores, key=lambda n: mean(scores[n]["map@r"]))
        for name, metrics in scores.items():
            lines.append(
                f"| {LOSS_NAMES[loss]} | {name} | {fmt(metrics['recall@1'])} | "
                f"{fmt(metrics['map@r'])} | {fmt(metrics['nmi'])} | {'**chosen**' if name == best else ''} |"
            )
        notes += floor_notes(reference, {f"{LOSS_NAMES[loss]} ({best})": scores[best]})
        edges = grid_edges(setting, loss, best)
        if edges:
            notes.append(
                f"- {LOSS_NAMES[loss]}: the chosen recipe ({best}) lies at the edge of the grid "
                f"({'; '.join(edges)}): a larger value was not tried, so the baseline may not have "
                "reached its best there."
            )
        if loss not in args.losses:
            continue
        recipes.setdefault(setting, {})[loss] = {
            "recipe": best,
            "overrides": list(recipe_candidates(setting, loss)[best]),
            "validation_map@r": mean(scores[best]["map@r"]),
        }
    if notes:
        lines += ["", *notes]
    if not args.quick:
        TABLES.mkdir(parents=True, exist_ok=True)
        RECIPES.write_text(json.dumps(recipes, indent=2, sort_keys=True) + "\n")
        (TABLES / f"idml_validation_{setting}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def doubled_budget(chosen: dict[str, Any]) -> tuple[str, tuple[str, ...]]:
    """The name and overrides of a stored recipe (``idml_recipes.json``) at twice its budget.

    >>> doubled_budget({"recipe": "m_pos=0.2, 10 epochs",
    ...                 "overrides": ["loss.pos_margin=0.2", "optim.epochs=10"]})
    ('m_pos=0.2, 20 epochs', ('loss.pos_margin=0.2', 'optim.epochs=20'))
    """
    epochs = next(
        int(o.split("=")[1]) for o in chosen["overrides"] if o.startswith("optim.epochs=")
    )
    name = chosen["recipe"].replace(f"{epochs} epochs", f"{2 * epochs} epochs")
    overrides = tuple(
        f"optim.epochs={2 * epochs}" if o.startswith("optim.epochs=") else o
        for o in chosen["overrides"]
    )
    return name, overrides


@dataclass(frozen=True)
class Challenge:
    """One way ``converge`` and ``widen`` question a validated recipe: train a challenger beside it
    on the validation split, paired over seeds, and adopt the challenger when it gains at least
    :data:`design.CONVERGED_GAIN` MAP@R points."""

    command: str
    challenger: Any
    """``(loss, recipe record) -> (name, overrides) | None``: the recipe to try, if any."""
    title: str
    rule: str
    table: str
    """The table's file name, ``{}`` standing for the setting."""
    axis: str
    """What the challenger changes, for the table's headings."""
    compared: str
    """The table's line of which runs it holds starts with this (:func:`tables.write_table`)."""
    verdicts: tuple[str, str]
    """The recipe's verdict when the challenger gains less than the rule, and when not."""


CHALLENGES = {
    "converge": Challenge(
        "converge",
        lambda loss, chosen: doubled_budget(chosen),
        "has the baseline converged at its chosen budget?",
        "the same recipe at twice its epochs. A budget counts as converged when its doubling "
        "gains less than {gain:g} validation MAP@R point (paired mean); `converge --adopt` "
        "replaces one that has not by the doubled recipe.",
        "idml_convergence_{}.md",
        "Twice the budget",
        "Budgets compared",
        ("converged", "**not converged**"),
    ),
    "widen": Challenge(
        "widen",
        widened_knob,
        "does the chosen knob lie inside the values tried?",
        "the same recipe with its knob (ProxyAnchor's proxy-rate multiplier, Contrastive's "
        "positive margin) one step past the edge of every value tried, where the chosen value is "
        "that edge (`validate`'s grid and the earlier trials the recipe records). The wider value "
        "is adopted by `widen --adopt` when it gains at least {gain:g} validation MAP@R point "
        "(paired mean); adopted or not, `--adopt` records the trial, so the next call steps past "
        "a new edge or finds the knob bracketed.",
        "idml_widening_{}.md",
        "The knob one step further",
        "Knob values compared",
        ("inside the values tried", "**the edge was not the best**"),
    ),
}


def converge(args: argparse.Namespace) -> None:
    """Has the baseline converged at its chosen budget? Each loss's validated recipe trained again
    at twice its epochs on the validation split, the same seeds, compared paired over seeds. A
    budget whose doubling gains at least :data:`design.CONVERGED_GAIN` MAP@R points has not
    converged; with ``--adopt`` the doubled recipe replaces it in ``idml_recipes.json`` (call again
    to check the new budget). The table covers every loss of the setting with both budgets' runs."""
    challenge(args, CHALLENGES["converge"])


def widen(args: argparse.Namespace) -> None:
    """Does the chosen knob lie inside the values tried? ``validate`` chose Contrastive's largest
    margin on Omniglot with Lite0: a recipe at the edge of its grid may not be the baseline's best.
    Each such loss's recipe is trained with the knob one step further (:func:`design.widened_knob`)
    and compared as ``converge`` compares budgets; a loss whose knob is bracketed is left alone."""
    challenge(args, CHALLENGES["widen"])


def challenge(args: argparse.Namespace, kind: Challenge) -> None:
    """Train each loss's validated recipe and its challenger (``kind``) on the validation split,
    the same seeds, and compare them paired over seeds; with ``--adopt``, a challenger that gains
    :data:`design.CONVERGED_GAIN` MAP@R points replaces the recipe in ``idml_recipes.json``."""
    setting = args.setting
    base = [
        *setting_overrides(args),
        "data.protocol=validation",
        *SETTINGS[setting].validation,
    ]
    all_recipes = load_recipes()
    recipes = all_recipes.get(setting, {})
    missing = [loss for loss in args.losses if loss not in recipes]
    if missing:
        raise SystemExit(f"no validated recipe for {setting}/{missing}: run `validate` first")

    def contenders(loss: str) -> list[tuple[str, tuple[str, ...], Path]] | None:
        chosen = recipes[loss]
        challenger = kind.challenger(loss, chosen)
        if challenger is None:
            return None
        return [
            (name, overrides, args.out / setting / "validation" / loss / slug(name))
            for name, overrides in ((chosen["recipe"], tuple(chosen["overrides"])), challenger)
        ]

    jobs = [
        Job(
            folder / f"s{seed}",
            (*base, f"loss.name={loss}", *BASELINE.overrides, *overrides, f"seed={seed}"),
            mechanism=False,
        )
        for loss in args.losses
        for _, overrides, folder in contenders(loss) or []
        for seed in range(args.seeds)
    ]
    run_jobs(jobs, args.workers, study_ledger(args))
    lines = [
        f"# IDML study, {setting}: {kind.title}\n",
        "The validated baseline recipe of each loss (`idml_recipes.json`) against "
        + kind.rule.format(gain=CONVERGED_GAIN)
        + f" Validation split of the training classes, seeds 0–{args.seeds - 1} of both (last "
        "epoch).\n",
        "| loss | recipe | R@1 | MAP@R | |",
        "|---|---|---|---|---|",
    ]
    pairs, adopted, compared, left = [], [], [], []
    for loss in LOSSES:
        if loss not in recipes:
            continue
        candidates = contenders(loss)
        if candidates is None:
            if loss in args.losses:
                left.append(f"- {LOSS_NAMES[loss]}: nothing to try ({recipes[loss]['recipe']}).")
            continue
        runs = []
        for _, _, folder in candidates:
            runs.append({s: r for s, r in seed_results(folder).items() if s < args.seeds})
        common = sorted(set(runs[0]) & set(runs[1]))
        if not common:
            continue  # this loss's challenger was not trained yet
        (name, _, _), (challenger, overrides, _) = candidates
        compared.append(f"{LOSS_NAMES[loss]}: {name} → {challenger}")
        gain = 100 * mean(
            [runs[1][s]["metrics"]["map@r"] - runs[0][s]["metrics"]["map@r"] for s in common]
        )
        verdict = kind.verdicts[gain >= CONVERGED_GAIN]
        if args.adopt and loss in args.losses and not args.quick:
            record = dict(recipes[loss])
            step = (
                f"{name} → {challenger}: {kind.command} gained {gain:+.2f} validation MAP@R "
                f"({len(common)} seeds)"
            )
            if kind.command == "widen":
                knob = KNOBS[loss]
                trial = {"value": knob.value_of(challenger), "recipe": challenger}
                record["widened"] = [
                    *record.get("widened", []),
                    {**trial, "gain": round(gain, 4), "seeds": len(common)},
                ]
            if gain >= CONVERGED_GAIN:
                record.update(
                    recipe=challenger,
                    overrides=list(overrides),
                    history=[*record.get("history", []), step],
                )
                record["validation_map@r"] = mean([runs[1][s]["metrics"]["map@r"] for s in common])
                adopted.append(f"- {LOSS_NAMES[loss]}: adopted {challenger} (was {name}).")
                verdict += ", adopted"
            recipes[loss] = record
        for label, seeds in zip((name, challenger), runs, strict=True):
            r1, map_r = ([r["metrics"][k] for r in seeds.values()] for k in TABLE_METRICS)
            note = f"{gain:+.2f} MAP@R: {verdict}" if label == challenger else ""
            lines.append(f"| {LOSS_NAMES[loss]} | {label} | {fmt(r1)} | {fmt(map_r)} | {note} |")
        pairs.append((LOSS_NAMES[loss], f"{challenger} − {name}", runs[0], runs[1]))
    lines += [f"\n## {kind.axis} − the chosen recipe (paired over seeds)\n"]
    lines += difference_table(pairs)
    lines += ["", *adopted, *left] if adopted or left else []
    if args.adopt and not args.quick and compared:
        all_recipes[setting] = recipes
        RECIPES.write_text(json.dumps(all_recipes, indent=2, sort_keys=True) + "\n")
    budgets_line = f"{kind.compared}: " + "; ".join(compared) + ".\n"
    lines.insert(1, budgets_line)
    write_table(args, kind.table.format(setting), lines, of=budgets_line)


def retune(args: argparse.Namespace) -> None:
    """Each arm's own knob: the baseline's recipe was chosen for the baseline, and every arm of a
    grid trains with it, but a Mixup batch may want another margin (on Omniglot, Mixup with the
    margin matched to IDML's weakening beat Mixup at the baseline's by 3 points). For each arm
    asked for (``--arms``, :data:`design.RETUNABLE`) and each loss with a knob, the arm trains on the
    validation split at the baseline's validated recipe with the knob at each of
    :func:`design.retune_candidates`' values, the budget unchanged, the same seeds. The value with
    the highest mean validation MAP@R becomes the arm's recipe (``idml_recipes.json``, the loss's
    ``arms``) where it gains :data:`design.CONVERGED_GAIN` point over the baseline's value (paired
    mean, the rule ``converge`` and ``widen`` adopt by), else the baseline's value does; recorded
    once every value has all its seeds. ``run --recipe <arm>`` then trains a grid
    whose every arm uses it: one recipe a grid, chosen for the arm the grid's question is about."""
    setting = args.setting
    base = [*setting_overrides(args), "data.protocol=validation", *SETTINGS[setting].validation]
    all_recipes = load_recipes()
    recipes = all_recipes.get(setting, {})
    missing = [loss for loss in args.losses if loss not in recipes]
    if missing:
        raise SystemExit(f"no validated recipe for {setting}/{missing}: run `validate` first")

    def arm_folder(loss: str, arm: str) -> Path:
        return args.out / setting / "validation" / loss / f"for_{arm}"

    def folder(loss: str, arm: str, name: str) -> Path:
        return arm_folder(loss, arm) / slug(name)

    knob_values = {
        loss: retune_candidates(loss, recipes[loss]) for loss in LOSSES if loss in recipes
    }
    tuned = [
        (loss, arm, knob_values[loss])
        for loss in args.losses
        for arm in args.arms
        if knob_values[loss]
    ]
    jobs = [
        Job(
            folder(loss, arm, name) / f"s{seed}",
            (*base, f"loss.name={loss}", *ARMS[arm].overrides, *overrides, f"seed={seed}"),
            mechanism=False,
        )
        for loss, arm, candidates in tuned
        for name, overrides in candidates.items()
        for seed in range(args.seeds)
    ]
    run_jobs(jobs, args.workers, study_ledger(args))
    asked = {(loss, arm) for loss, arm, _ in tuned}
    # Every arm retuned so far goes in the table, not only this call's: the file is the setting's
    # one record of how its arms' recipes were chosen (as ``validate``'s is of the baseline's).
    shown = [
        (loss, arm, candidates)
        for loss, candidates in knob_values.items()
        if candidates
        for arm in RETUNABLE
        if (loss, arm) in asked or arm_folder(loss, arm).is_dir()
    ]

    def seeds_of(loss: str, arm: str) -> int:
        # An arm retuned by an earlier call is shown at the seeds it was chosen with, not this call's.
        if (loss, arm) in asked:
            return int(args.seeds)
        return int(recipes[loss].get("arms", {}).get(arm, {}).get("seeds", args.seeds))

    counts = sorted({seeds_of(loss, arm) for loss, arm, _ in shown} or {args.seeds})
    seed_text = (
        f"seeds 0–{counts[0] - 1} of every value"
        if len(counts) == 1
        else "every value at the seeds its arm was retuned with (`idml_recipes.json`)"
    )
    lines = [
        f"# IDML study, {setting}: each arm's own knob on the validation split\n",
        "Arms retuned: "
        + "; ".join(
            f"{LOSS_NAMES[loss]}: {ARMS[arm].label} (from {recipes[loss]['recipe']})"
            for loss, arm, _ in shown
        )
        + ".\n",
        "The baseline's validated recipe (`idml_recipes.json`) with its knob at each value tried, "
        "trained by the arm named, the budget unchanged. Validation split of the training "
        f"classes, {seed_text} (last epoch). Chosen: the highest mean "
        f"validation MAP@R where it gains at least {CONVERGED_GAIN:g} point over the baseline's "
        "value (paired mean), else the baseline's; `run --recipe <arm>` trains a grid whose every "
        "arm uses it.\n",
        "| loss | arm | recipe | R@1 | MAP@R | |",
        "|---|---|---|---|---|---|",
    ]
    pairs, notes = [], []
    for loss, arm, candidates in shown:
        own = recipes[loss]["recipe"]
        wanted = seeds_of(loss, arm)
        runs = {
            name: {s: r for s, r in seed_results(folder(loss, arm, name)).items() if s < wanted}
            for name in candidates
        }
        scores = {
            name: [r["metrics"]["map@r"] for r in seeds.values()] for name, seeds in runs.items()
        }
        if not any(scores.values()):
            continue  # not trained yet
        best = max((n for n in candidates if scores[n]), key=lambda n: mean(scores[n]))
        complete = all(len(runs[name]) == wanted for name in candidates)
        # The rule ``converge`` and ``widen`` adopt by: the arm leaves the baseline's value only
        # for a paired gain of a point, not for a difference within the seeds' spread.
        common = sorted(set(runs[best]) & set(runs[own]))
        gain = 100 * mean(
            [runs[best][s]["metrics"]["map@r"] - runs[own][s]["metrics"]["map@r"] for s in common]
        )
        chosen = best if best == own or gain >= CONVERGED_GAIN else own
        for name, seeds in runs.items():
            r1 = [r["metrics"]["recall@1"] for r in seeds.values()]
            marks = [
                m
                for m, on in (
                    ("**chosen**", name == chosen),
                    ("the highest", name == best != chosen),
                    ("the baseline's", name == own),
                )
                if on
            ]
            lines.append(
                f"| {LOSS_NAMES[loss]} | {ARMS[arm].label} | {name} | {fmt(r1)} | "
                f"{fmt(scores[name])} | {', '.join(marks)} |"
            )
        label = f"{LOSS_NAMES[loss]}, {ARMS[arm].label}"
        if best != own and common:
            pairs.append((label, f"{best} − {own}", runs[own], runs[best]))
            verdict = "adopted" if chosen == best else "the arm keeps the baseline's value"
            notes.append(
                f"- {label}: {best} gains {gain:+.2f} validation MAP@R over the baseline's {own} "
                f"({len(common)} seeds; {CONVERGED_GAIN:g} point needed): {verdict}."
            )
        names = list(candidates)
        if best in (names[0], names[-1]):
            notes.append(
                f"- {label}: the highest value ({best}) is the "
                f"{'smallest' if best == names[0] else 'largest'} tried."
            )
        if not complete:
            notes.append(
                f"- {LOSS_NAMES[loss]}, {ARMS[arm].label}: not every value has its {wanted} "
                "seeds yet; nothing recorded."
            )
        elif not args.quick and (loss, arm) in asked:
            record = recipes[loss].setdefault("arms", {})
            record[arm] = {
                "recipe": chosen,
                "overrides": list(candidates[chosen]),
                "of": own,
                "validation_map@r": mean(scores[chosen]),
                "seeds": args.seeds,
                "tried": {name: round(mean(scores[name]), 6) for name in candidates},
            }
    notes += [
        f"- {LOSS_NAMES[loss]}: no knob beyond its budget; its validated recipe is every arm's."
        for loss in args.losses
        if not knob_values[loss]
    ]
    if pairs:
        lines += ["\n## The highest value − the baseline's (paired over seeds)\n"]
        lines += difference_table(pairs)
    lines += ["", *notes] if notes else []
    text = "\n".join(lines) + "\n"
    if not args.quick and tuned:
        all_recipes[setting] = recipes
        RECIPES.write_text(json.dumps(all_recipes, indent=2, sort_keys=True) + "\n")
    if not args.quick:
        TABLES.mkdir(parents=True, exist_ok=True)
        (TABLES / f"idml_retune_{setting}.md").write_text(text)
    print(text)


def slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._=" else "_" for c in name).strip("_") or "default"
