"""The study's tables: each arm's test metrics beside the untrained network's, the paired
differences (Holm-adjusted over a table), the mechanism, and the rule that a table never replaces
one of other runs.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping, Sequence
from functools import partial

from idml_study.design import (
    ARMS,
    BASELINE,
    COMPARISONS,
    DEGRADATION_ARMS,
    DEGRADATION_COMPARISONS,
    DEGRADATION_LOSS,
    LOSS_NAMES,
    PROBES,
    SETTINGS,
    TABLES,
    TRAINS_MARGIN,
    Arm,
)
from idml_study.mechanism import matched_section
from idml_study.recipes import load_recipes, pinned_recipe, setting_overrides, study_overrides
from idml_study.results import Runs, fmt, mean, mean_of, seed_results

TABLE_METRICS = ("recall@1", "map@r")


def untrained_reference(
    args: argparse.Namespace, validation: bool = False
) -> dict[str, list[float]]:
    """Test metrics of the setting's network before any training, per seed (one value for a
    pretrained backbone, whose features do not depend on the seed): the floor a baseline must clear.
    With ``validation``, the same on the validation split of the training classes (``validate``'s
    floor; the test classes are never loaded). Cached in ``untrained.json`` of the split's folder;
    a cache written for fewer seeds (a peek at a grid still training) is extended to ``seeds``, so
    the floor is always the mean over the seeds the table compares."""
    folder = args.out / args.setting / ("validation" if validation else "")
    cache = folder / "untrained.json"
    seeds = 1 if SETTINGS[args.setting].pretrained else args.seeds
    out: dict[str, list[float]] = {"recall@1": [], "map@r": [], "nmi": []}
    if cache.is_file():
        out = json.loads(cache.read_text())
    if len(out["recall@1"]) >= seeds:
        return {key: values[:seeds] for key, values in out.items()}
    import torch

    from idml.app import build
    from idml.app.config import load_config
    from idml.embeddings import Embeddings
    from idml.evaluation import EvaluationSettings, evaluate_embeddings

    base = setting_overrides(args)
    if validation:
        base += ["data.protocol=validation", *SETTINGS[args.setting].validation]
    for seed in range(len(out["recall@1"]), seeds):
        cfg = load_config(None, [*base, *BASELINE.overrides, f"seed={seed}"])
        torch.manual_seed(cfg.seed)
        data = build.build_data(cfg)
        model = build.build_model(cfg).eval()
        features, labels = [], []
        with torch.no_grad():
            for images, batch_labels, *_ in torch.utils.data.DataLoader(data.test, batch_size=256):
                features.append(model.features(images))
                labels.append(batch_labels)
        settings = EvaluationSettings(ks=(1,), nmi=True, nmi_backend="sklearn", seed=cfg.seed)
        metrics = evaluate_embeddings(
            Embeddings(torch.cat(features)), torch.cat(labels), settings
        ).metrics
        for k in out:
            out[k].append(float(metrics[k]))
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(out))
    return out


def floor_notes(
    reference: Mapping[str, Sequence[float]], baselines: Mapping[str, Mapping[str, Sequence[float]]]
) -> list[str]:
    """A note for each loss whose baseline does not beat the untrained network's ``reference`` by
    :data:`design.TRAINS_MARGIN` MAP@R points. ``baselines`` maps a loss's name to its baseline's
    metrics over seeds, in the shape of ``reference`` (:func:`results.final_metrics`).

    >>> print(*floor_notes({"recall@1": [0.833], "map@r": [0.364]},
    ...                    {"Multi-Similarity": {"recall@1": [0.872], "map@r": [0.347]}}))
    ... # doctest: +ELLIPSIS
    - **Multi-Similarity: the baseline does not beat the untrained network** (MAP@R 34.7 against 36.4, R@1 87.2 against 83.3; ...
    >>> floor_notes({"recall@1": [0.892], "map@r": [0.482]},
    ...             {"Contrastive": {"recall@1": [0.897], "map@r": [0.707]}})
    []
    """
    notes = []
    untrained = {key: 100 * mean(reference[key]) for key in TABLE_METRICS}
    for loss, metrics in baselines.items():
        trained = {key: 100 * mean(metrics[key]) for key in TABLE_METRICS}
        if trained["map@r"] - untrained["map@r"] < TRAINS_MARGIN:
            notes.append(
                f"- **{loss}: the baseline does not beat the untrained network** (MAP@R "
                f"{trained['map@r']:.1f} against {untrained['map@r']:.1f}, R@1 "
                f"{trained['recall@1']:.1f} against {untrained['recall@1']:.1f}; a trained recipe "
                f"clears it by {TRAINS_MARGIN:g} MAP@R point): by the study's rule its recipe is "
                "broken here, and this loss's comparisons are not evidence about ISM."
            )
    return notes


def failed_seed_notes(
    reference: Mapping[str, Sequence[float]], runs: Mapping[str, Runs]
) -> list[str]:
    """A note for each arm (``runs``: label → its runs by seed) with seeds whose test MAP@R ends
    below the untrained network's ``reference``: runs that failed (on Lite0, ProxyAnchor with
    Mixup collapsed every image to one embedding). They stay in every mean and test, as measured;
    the note says which seeds they are, so a reader can tell a spread from a failure.

    >>> print(*failed_seed_notes({"recall@1": [0.23], "map@r": [0.062]},
    ...       {"ProxyAnchor, Mixup only": {0: {"metrics": {"recall@1": 0.0, "map@r": 0.0}},
    ...                                    1: {"metrics": {"recall@1": 0.39, "map@r": 0.14}}},
    ...        "ProxyAnchor, baseline": {0: {"metrics": {"recall@1": 0.58, "map@r": 0.24}}}}))
    - ProxyAnchor, Mixup only: 1 of 2 seeds end below the untrained network's MAP@R of 6.2 (seed 0: R@1 0.0, MAP@R 0.0); they count in every mean and test here, as measured.
    """
    floor = mean(reference["map@r"])
    notes = []
    for label, seeds in runs.items():
        failed = {
            s: r["metrics"] for s, r in sorted(seeds.items()) if r["metrics"]["map@r"] < floor
        }
        if failed:
            which = "; ".join(
                f"seed {s}: R@1 {100 * m['recall@1']:.1f}, MAP@R {100 * m['map@r']:.1f}"
                for s, m in failed.items()
            )
            notes.append(
                f"- {label}: {len(failed)} of {len(seeds)} seeds end below the untrained "
                f"network's MAP@R of {100 * floor:.1f} ({which}); they count in every mean and "
                "test here, as measured."
            )
    return notes


def arm_row(name: str, label: str, seeds: Runs) -> str:
    values = {
        k: [r["metrics"][k] for r in seeds.values() if k in r["metrics"]]
        for k in ("recall@1", "map@r", "nmi")
    }
    return (
        f"| {name} | {label} | {len(seeds)} | {fmt(values['recall@1'])} | "
        f"{fmt(values['map@r'])} | {fmt(values['nmi'])} |"
    )


def difference_table(pairs: Sequence[tuple[str, str, Runs, Runs]]) -> list[str]:
    """Markdown rows of paired differences ``b − a`` for ``(group, comparison, a, b)``, Holm-adjusted
    over every cell (comparison × metric) of the table."""
    from idml.statistics import compare_paired, holm

    cells = []
    for group, label, a, b in pairs:
        common = sorted(set(a) & set(b))
        for metric in TABLE_METRICS:
            x = [a[s]["metrics"][metric] * 100 for s in common]
            y = [b[s]["metrics"][metric] * 100 for s in common]
            cells.append((group, label, metric, compare_paired(x, y)))
    adjusted = holm([c.p_value for *_, c in cells])
    lines = [
        "Δ = mean of the per-seed differences in points, its 95 % t-interval, Cohen's d_z, and the "
        f"p-value of a paired t-test Holm-adjusted over all {len(cells)} cells of this table; "
        "▲/▼ only where the adjusted p < 0.05.\n",
        "| | comparison | n | Δ R@1 [95 % CI] | d_z | p (Holm) | Δ MAP@R [95 % CI] | d_z | p (Holm) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    rows: dict[tuple[str, str], dict[str, str]] = {}
    counts: dict[tuple[str, str], int] = {}
    for (group, label, metric, c), p in zip(cells, adjusted, strict=True):
        mark = (" ▲" if c.difference > 0 else " ▼") if c.significant(p) else ""
        rows.setdefault((group, label), {})[metric] = (
            f"{c.difference:+.2f}{mark} [{c.low:+.2f}, {c.high:+.2f}] | {c.effect_size:+.2f} | {p:.3g}"
            if math.isfinite(c.p_value)
            else f"{c.difference:+.2f} | – | –"
        )
        counts[(group, label)] = c.n
    for (group, label), texts in rows.items():
        lines.append(
            f"| {group} | {label} | {counts[(group, label)]} | "
            + " | ".join(texts.get(m, "– | – | –") for m in TABLE_METRICS)
            + " |"
        )
    return lines


def scored_with_ism(seeds: Runs) -> Runs:
    """``seeds`` as scored at test time with the introspective metric (``mechanism.json``'s
    ``ism_at_test``), for the runs that recorded it."""
    return {
        s: {"metrics": r["mechanism"]["ism_at_test"], "mechanism": None}
        for s, r in seeds.items()
        if r["mechanism"] and r["mechanism"].get("ism_at_test")
    }


def ism_at_test_section(arms: Sequence[tuple[str, Arm, Runs]]) -> list[str]:
    """The paper's Table 5, paired: each run of an arm that learns ``u`` with ISM, scored at test
    with the introspective metric against the same run's plain score (``(group, arm, runs)``;
    Holm over this section's cells alone, so the table's other differences keep their family).
    Empty where no run recorded it. An arm with ``u`` frozen is left out: a constant ``u``
    weakens every pair alike, which leaves each query's ranking as it is."""
    pairs = []
    for group, arm, seeds in arms:
        scored = scored_with_ism(seeds) if arm.learns_u else {}
        if scored:
            plain = {s: seeds[s] for s in scored}
            pairs.append((group, f"{arm.label} with ISM at test − {arm.label}", plain, scored))
    if not pairs:
        return []
    return [
        "\n## ISM at test time (the paper's Table 5), paired over the same trained runs\n",
        *difference_table(pairs),
    ]


def mechanism_header(altered: str = "Mixup") -> list[str]:
    """The mechanism table's preamble and header; ``altered`` names the training images whose
    ``||u||`` trend is shown beside the originals' (Mixup images, or the degraded ones)."""
    return [
        "Test images: `||u||` mean and coefficient of variation; AUROC of `||u||` for Mixup / "
        "blurred / low-resolution / occluded images against the same images clean (0.5: no "
        "difference). Training batches, last epoch: the 10th and 50th percentile of the weakening "
        f"`e^{{−y}}` over positive pairs and the CV of `||u||` across a batch. `||u||` of the "
        f"original training images (those no augmentation changed) and of the {altered} ones in "
        "the first → last epoch; where the runs logged it, the last epoch's ratio of the training "
        "images' `||u||` in eval mode to the trained one (eval ×r: 1 is the same `u`). ISM at "
        "test: R@1 / MAP@R with the introspective metric at test time (the paper's Table 5).\n",
        "| | arm | test ‖u‖ | test CV | AUROC mixup / blur / low-res / occl. | pos q10 / q50 | "
        f"batch CV | ‖u‖ original | ‖u‖ {altered} | ISM at test R@1 / MAP@R |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]


def mechanism_row(group: str, label: str, seeds: Runs, altered: str = "mixed") -> str | None:
    """The mechanism of an arm's runs (mean over seeds), or ``None`` without an uncertainty head;
    ``altered`` is the ``uncertainty/<altered>`` training key trended beside the originals'."""
    from idml.app.training.level_probe import drift_ratio

    mechs = [r["mechanism"] for r in seeds.values() if r["mechanism"]]
    if not mechs:
        return None
    avg = partial(mean_of, mechs)
    probe = " / ".join(
        f"{avg(lambda m, k=k: m['probe_auroc'][k]):.2f}"
        for k in ("mixup", "blur", "low_resolution", "occlusion")
    )

    def trend(kind: str) -> str:
        key = f"uncertainty/{kind}"
        before = avg(lambda m: m["first_epoch"].get(key))
        after = avg(lambda m: m["last_epoch"].get(key))
        return "–" if math.isnan(before) else f"{before:.3f} → {after:.3f}"

    # Runs trained before the trainer logged uncertainty/eval_train have no ratio.
    ratio = avg(lambda m: drift_ratio(m["last_epoch"]))
    at_eval = "" if math.isnan(ratio) else f" (eval ×{ratio:.2f})"

    return (
        f"| {group} | {label} | {avg(lambda m: m['test_u_mean']):.4f} | "
        f"{avg(lambda m: m['test_u_cv']):.2f} | {probe} | "
        f"{avg(lambda m: m['last_epoch'].get('ism/pos_q10')):.3f} / "
        f"{avg(lambda m: m['last_epoch'].get('ism/pos_q50')):.3f} | "
        f"{avg(lambda m: m['last_epoch'].get('ism/u_cv')):.2f} | {trend('original')}{at_eval} | "
        f"{trend(altered)} | {100 * avg(lambda m: m['ism_at_test'].get('recall@1')):.1f} / "
        f"{100 * avg(lambda m: m['ism_at_test'].get('map@r')):.1f} |"
    )


def settings_lines(args: argparse.Namespace, losses: Sequence[str]) -> list[str]:
    """The setting's overrides and the recipe of each loss whose runs the table holds: the one its
    runs were trained with (the run folder's :data:`recipes.FOLDER_RECIPE`; the baseline's, or the
    one ``retune`` chose for the arm it names), else — a grid started before folders pinned their
    recipe — the validated one."""
    base = setting_overrides(argparse.Namespace(**{**vars(args), "quick": False}), pin=False)
    recipes = load_recipes().get(args.setting, {})
    names = {
        loss: pinned_recipe(args.out / args.setting / loss) or recipes.get(loss, {}).get("recipe")
        for loss in losses
    }
    # The setting's default budget is not printed: every recipe sets its own (optim.epochs).
    shown = [o for o in base if not o.startswith(("data.root=", "optim.epochs="))]
    # A recipe ``retune`` chose for another arm says so in its name ("(chosen for Mixup only)").
    retuned = any(v is not None and "(chosen for " in v for v in names.values())
    lines = [
        "Settings: `" + " ".join(shown) + "`\n",
        ("Recipes, every arm's" if retuned else "Baseline recipes")
        + " (validation split of the training classes): "
        + "; ".join(f"{LOSS_NAMES[k]}: {v or 'as set'}" for k, v in names.items() if v is not None)
        + ".\n",
    ]
    study = study_overrides(args, pin=False)
    if study:
        lines.append(
            "**A diagnostic**: every run also trains with `"
            + " ".join(study)
            + "` (`--override`), on top of its validated recipe; not the recipe's grid.\n"
        )
    return lines


def tables(args: argparse.Namespace) -> None:
    if args.degradations:
        return degradation_tables(args)
    setting = args.setting
    root = args.out / setting
    reference = untrained_reference(args)
    runs = {
        (loss, arm): seed_results(root / loss / arm)
        for loss in args.losses
        for arm in ARMS
        if (root / loss / arm).is_dir()
    }
    runs = {key: seeds for key, seeds in runs.items() if seeds}
    header = settings_lines(args, [loss for loss in args.losses if any(k[0] == loss for k in runs)])
    lines = [f"# IDML study: {setting}\n", *header]
    lines += [
        "## Test metrics (last epoch, mean ± std over seeds, %)\n",
        "| loss | arm | seeds | R@1 | MAP@R | NMI |",
        "|---|---|---|---|---|---|",
        arm_row(
            "–",
            "*untrained network*",
            {
                i: {"metrics": {k: v[i] for k, v in reference.items()}}
                for i in range(len(reference["recall@1"]))
            },
        ),
    ]
    lines += [
        arm_row(LOSS_NAMES[loss], ARMS[arm].label, seeds) for (loss, arm), seeds in runs.items()
    ]
    below = floor_notes(
        reference,
        {
            LOSS_NAMES[loss]: {k: [r["metrics"][k] for r in seeds.values()] for k in TABLE_METRICS}
            for (loss, arm), seeds in runs.items()
            if arm == "baseline"
        },
    )
    below += failed_seed_notes(
        reference,
        {f"{LOSS_NAMES[loss]}, {ARMS[arm].label}": seeds for (loss, arm), seeds in runs.items()},
    )
    if below:
        lines += ["", *below]
    lines += matched_section({LOSS_NAMES[loss]: root / loss for loss in args.losses}, ARMS)
    pairs = [
        (LOSS_NAMES[loss], label, runs[(loss, ref)], runs[(loss, arm)])
        for loss in args.losses
        for label, ref, arm in COMPARISONS
        if (loss, ref) in runs and (loss, arm) in runs
    ]
    lines += ["\n## Differences (paired over seeds that share initialisation and batches)\n"]
    lines += difference_table(pairs)
    for title, comparisons in PROBES:
        probe = [
            (LOSS_NAMES[loss], label, runs[(loss, ref)], runs[(loss, arm)])
            for loss in args.losses
            for label, ref, arm in comparisons
            if (loss, ref) in runs and (loss, arm) in runs
        ]
        if probe:
            lines += [f"\n## {title}\n", *difference_table(probe)]
    lines += ism_at_test_section(
        [(LOSS_NAMES[loss], ARMS[arm], seeds) for (loss, arm), seeds in runs.items()]
    )
    lines += ["\n## Is the introspection real? (runs with an uncertainty head, mean over seeds)\n"]
    lines += mechanism_header()
    for (loss, arm), seeds in runs.items():
        row = mechanism_row(LOSS_NAMES[loss], ARMS[arm].label, seeds)
        if row is not None:
            lines.append(row)
    write_table(args, f"idml_{setting}.md", lines, of=header[1])


def degradation_tables(args: argparse.Namespace) -> None:
    setting, loss = args.setting, DEGRADATION_LOSS
    clean = seed_results(args.out / setting / loss / "baseline")
    header = settings_lines(args, [loss])
    lines = [f"# IDML study: {setting}, degraded training images (the paper's Table 3)\n", *header]
    lines += [
        f"{LOSS_NAMES[loss]}; a quarter of every batch degraded (low resolution ×4, Gaussian blur "
        "σ 2, a quarter of the image occluded), labels unchanged; the clean baseline is the main "
        "grid's.\n",
        "## Test metrics (last epoch, mean ± std over seeds, %)\n",
        "| degradation | arm | seeds | R@1 | MAP@R | NMI |",
        "|---|---|---|---|---|---|",
        arm_row("none", "baseline (clean images)", clean),
    ]
    pairs, mechanism, trained = [], [], []
    for degradation in args.kinds:
        folder = args.out / setting / "degradations" / degradation
        runs = {"baseline": clean}
        for name, arm in DEGRADATION_ARMS.items():
            seeds = seed_results(folder / name)
            if seeds:
                runs[name] = seeds
                trained.append((degradation, arm, seeds))
                lines.append(arm_row(degradation, arm.label, seeds))
                row = mechanism_row(degradation, arm.label, seeds, altered="degraded")
                if row is not None:
                    mechanism.append(row)
        pairs += [
            (degradation, label, runs[ref], runs[arm])
            for label, ref, arm in DEGRADATION_COMPARISONS
            if ref in runs and arm in runs and runs[ref] and runs[arm]
        ]
    degraded = {kind: args.out / setting / "degradations" / kind for kind in args.kinds}
    lines += matched_section(degraded, DEGRADATION_ARMS)
    lines += ["\n## Differences (paired over seeds)\n", *difference_table(pairs)]
    lines += ism_at_test_section(trained)
    lines += ["\n## Mechanism\n", *mechanism_header("degraded"), *mechanism]
    write_table(args, f"idml_{setting}_degradations.md", lines, of=header[1])


def write_table(args: argparse.Namespace, name: str, lines: list[str], of: str) -> None:
    """Write ``name`` (``<name>_<label>.md`` with ``--label``) under ``benchmarks/study``.

    ``of`` is the table's line saying which runs it is of (the recipes, or the budgets compared).
    An existing table without that line is the record of other runs — another recipe, other losses,
    an older version of this script — and is never replaced: the call stops and asks for a label.
    """
    text = "\n".join(lines) + "\n"
    if args.label:
        name = name.removesuffix(".md") + f"_{args.label}.md"
    path = TABLES / name
    if not args.quick:
        if path.is_file() and of.strip() not in path.read_text().splitlines():
            held = next(
                (
                    line
                    for line in path.read_text().splitlines()
                    if line.startswith(of.split(":")[0] + ":")
                ),
                "no such line (an older version of this script)",
            )
            raise SystemExit(
                f"{path} holds a table of other runs; it says {held!r}, this one would say "
                f"{of.strip()!r}. Pass --label NAME to write idml_..._NAME.md beside it (or delete "
                "the file if it is stale)."
            )
        TABLES.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    print(text)
