"""Is IDML's introspection real, and does it help? ISM against the controls that isolate it.

The question (issue "IDML whose introspection is real"): with an uncertainty embedding ``u`` that
moves, does the introspective similarity metric (ISM) improve retrieval of unseen classes beyond what
Mixup, a frozen ``u`` and a uniform weakening give? Every arm of a setting trains the same steps from
the same initialisation and batches (seed ``s`` of every arm), and the tables report last-epoch test
metrics with paired tests over seeds, Holm-corrected across each table.

Settings (zero-shot: train and test classes are disjoint):

- ``demo``: ``idml demo``'s data and model (scikit-learn's digits, small CNN from scratch, 16 px),
  with the standard first-half/second-half class split (0–4 train, 5–9 test).
- ``omniglot_cnn``: Omniglot's minimal background splits (136 training characters of five
  alphabets, 106 test characters of three others), 28 px, a small CNN from scratch.
- ``omniglot_lite0`` / ``fashion_lite0``: Omniglot at 32 px / Debian's Fashion-MNIST (0–4 train,
  5–9 test, 200 images a class), EfficientNet-Lite0 from its shipped ImageNet weights.

Arms (:data:`idml_study.design.ARMS`), each for Multi-Similarity, ProxyAnchor and Contrastive:

- ``baseline`` (plain metric, no Mixup), ``mixup`` (Mixup set labels), ``ism`` (ISM alone),
  ``idml`` (ISM + Mixup: the paper's method with the default uncertainty head);
- the controls of ``idml``: ``idml_frozen_u`` (the head never trains: ``u`` stays at its start),
  ``idml_uniform`` (no head, ``u ≡ 0``, and ``γ`` chosen so that the uniform weakening
  ``e^{−γ/(τδ)}`` has the same median over the positive relations the loss compares — pairs of
  samples, or samples and their proxies for ProxyAnchor — as ``idml``'s learned one) and, for
  Contrastive, ``mixup_margin`` (Mixup with the positive margin moved by the median amount ISM
  moves positive pairs in ``idml``: the margin ISM acts as,
  :func:`idml_study.mechanism.matched_controls`; capped at the negative margin, which
  Contrastive's margins may not cross, :func:`idml_study.mechanism.matched_margin`; not trained
  where that is the recipe's own margin, which would make it Mixup only again,
  :func:`idml_study.mechanism.idle_control`);
- ``idml_u_high``: ``idml`` with ``u`` starting at a quarter of its bound instead of 2 %
  (``model.uncertainty.init_level=0.25``): does the objective bring ``u`` back to the level where
  ISM is near the identity, or does the weakening stay where it starts? And where ISM does weaken
  pairs unevenly, does it help? Its own controls: ``idml_u_high_frozen_u`` (the same start, the
  head never trains) and ``idml_u_high_uniform`` (``u ≡ 0``, γ matched to its weakening), compared
  in a table of their own (:data:`idml_study.design.U_HIGH_COMPARISONS`, Holm within it).
- ``idml_running``: ``idml`` with the level standardised by running statistics in training as at
  test (``model.uncertainty.level_input=standardized_running``), so the ``u`` measured and used at
  test is the one that trained; its own controls ``idml_running_frozen_u`` and
  ``idml_running_uniform``, in a table section of their own
  (:data:`idml_study.design.RUNNING_LEVEL_COMPARISONS`, Holm within it).
- ``idml_detached`` and ``idml_running_detached``: ``idml`` and ``idml_running`` with the head
  reading the features detached (``model.uncertainty.backbone_gradient=false``), so ``u`` cannot
  shape the features and ISM's weakening is all it does; each with its own ``_frozen_u`` and
  ``_uniform`` controls, in sections of their own
  (:data:`idml_study.design.DETACHED_COMPARISONS`,
  :data:`idml_study.design.RUNNING_DETACHED_COMPARISONS`).
- ``idml_ext``: ``idml`` plus the Mixup-supervised uncertainty *extension*
  (``mixup.uncertainty_weight``, :mod:`idml.losses.ambiguity`), never the default.

Recipes (``validate``): the baseline's hyper-parameters are chosen per setting and loss on a
validation split of the *training* classes (``data.protocol=validation``; the test classes are never
loaded), by the highest mean validation MAP@R over the seeds; every arm then uses them. The knobs
are the ones a broken baseline recipe was traced to: ProxyAnchor's proxy learning rate (a multiple
of the heads'), Contrastive's positive margin, and the step budget (``optim.epochs``: the setting's
and twice that). Pretrained settings train heads only for the first epoch (``optim.warmup_epochs=1``,
as the presets do). The chosen recipes are stored in ``benchmarks/study/idml_recipes.json``.
``converge`` then trains each chosen recipe at twice its budget: a budget is converged when that
gains less than :data:`idml_study.design.CONVERGED_GAIN` validation MAP@R points, and ``--adopt``
doubles the ones that are not (each doubling in the recipe's ``history``). ``widen`` does the same
for a knob whose chosen value is the largest (or smallest) tried: it trains the recipe with the
knob one step further (m_pos + 0.2 up to m_neg = 0.5, which it may meet but not cross; the proxy
rate ×10) and ``--adopt`` takes it on the same rule, recording every trial (``widened``) so that a
knob's range grows until the choice lies inside it (or meets its ceiling). ``retune --arms mixup``
chooses an arm's own knob the same way, at the baseline's budget: the baseline's margin may be too
tight for a Mixup batch, and a claim about ISM is fairest against Mixup at Mixup's best margin.
``run --recipe mixup`` then trains a grid whose every arm (controls included) uses the recipe
chosen for Mixup: one recipe a grid, still. A run folder pins the recipe its runs used
(``<loss>/recipe.json``), so a grid at an adopted recipe goes to a new ``--out``, its tables named
by ``--label``; ``run --recipe pinned`` adds arms or seeds to an older grid at the recipe it pins.
A setting's folder pins the memory format its runs train in (``memory_format.json``): runs added to
a folder trained before channels-last became the CPU's default keep the contiguous layout.

Diagnostics (``run --override KEY=VALUE``, repeatable): every run of the grid trains with these
config overrides on top of its recipe, for a question the validated recipe does not ask ("does the
collapse go away at a tenth of the backbone's rate?"). They may change the setting's or the recipe's
keys, never a key an arm sets (that would make two arms one) nor the seed. The setting folder pins
them (``study_overrides.json``) as it pins its layout, so a folder's runs all share one set, a grid
of the plain recipe never gains a diagnostic run, and its tables print them: run a diagnostic in its
own ``--out``. Recipes are chosen without them (``validate``, ``converge`` and ``widen`` refuse it).

Ledger (``benchmarks/study/ledger/<--out's name>``, committed): each finished run's
``result.json`` and ``mechanism.json`` and each folder's pins, copied as runs finish and restored into
an empty ``--out`` of the same name at the start of every command. A session's machine does not
outlive it, and a Lite0 grid takes longer than one: with its ledger committed, a grid resumes on the
next machine at its first unfinished seed, and its tables can be drawn anywhere (a restored run is
reused because its record names the same config; ``data.root`` is part of it, so keep
``--omniglot-root`` where it was).

Mechanism (``mechanism.json`` beside each run with an uncertainty head): ``||u||`` over the test
images (mean and coefficient of variation), the AUROC of ``||u||`` for "altered vs clean" test
images (Mixup, low resolution, blur, occlusion; :func:`idml.diagnostics.uncertainty_probe`), the
last epoch's weakening quantiles and ``||u||`` spread over training batches (``metrics.jsonl``), the
trend of ``||u||`` for original and Mixup (or degraded) training images, and the test metrics with
ISM at test time (the paper's Table 5 ablation).

Degradations (``--degradations``): the paper's Table 3 (low resolution, blur, occlusion of a quarter
of each batch instead of Mixup), for baseline, ISM and ISM's two controls, and ISM with ``u``
starting high with its own two (``--kinds`` and ``--arms`` stage it: each kind's cost first).

Run (each step reuses finished runs; ``--workers 2`` trains two runs at a time, one thread each):

    python benchmarks/study_idml.py validate --setting demo --seeds 2
    python benchmarks/study_idml.py converge --setting demo --seeds 3   # the chosen budget, doubled
    python benchmarks/study_idml.py converge --setting demo --seeds 3 --adopt   # ... and adopted
    python benchmarks/study_idml.py widen --setting demo --seeds 3 --adopt   # a knob at its edge
    python benchmarks/study_idml.py retune --setting demo --losses contrastive --arms mixup
    python benchmarks/study_idml.py run --setting demo --recipe mixup --out runs/study_idml_mixm
    python benchmarks/study_idml.py run --setting demo --seeds 10
    python benchmarks/study_idml.py tables --setting demo
    python benchmarks/study_idml.py summary   # the README's table of every cell, from the tables
    python benchmarks/study_idml.py run --setting demo --arms mixup --seeds 3 \\
        --override optim.backbone_lr_mult=0.1 --out runs/diag_slow_backbone   # a diagnostic

(``--omniglot-root`` defaults to ``../shared/data/omniglot`` beside the repository; the library never
reads that folder.)

This script is the study's command line; the study itself is the package ``idml_study`` beside it
(``benchmarks/idml_study``), one module an idea: its design, recipes and pins, ledger, results,
mechanism, jobs, tables, the commands that choose the recipes, and the README's summary of them.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from idml_study.choose import converge, retune, validate, widen
from idml_study.design import (
    ARMS,
    CONVERGED_GAIN,
    DEFAULT_OMNIGLOT,
    DEGRADATION_ARMS,
    DEGRADATIONS,
    LOSSES,
    REPO,
    RETUNABLE,
    SETTINGS,
    Arm,
)
from idml_study.jobs import PER_RUN_KEYS, key_of, run
from idml_study.ledger import LEDGER, study_ledger
from idml_study.recipes import said, study_overrides
from idml_study.summary import summary, unsummarised
from idml_study.tables import tables


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "command",
        choices=("validate", "converge", "widen", "retune", "run", "tables", "summary"),
        help="summary: redraw the README's table of every cell from the committed study tables "
        "(it takes no other option)",
    )
    parser.add_argument("--setting", choices=sorted(SETTINGS))
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--losses", default=",".join(LOSSES))
    parser.add_argument(
        "--arms",
        default=None,
        help=f"the main grid's arms (default all: {', '.join(ARMS)}); with --degradations, the "
        f"degraded grid's (default all: {', '.join(DEGRADATION_ARMS)}); retune: the arms whose "
        f"own knob to choose (one or more of {', '.join(RETUNABLE)})",
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--degradations", action="store_true", help="the Table 3 grid instead")
    parser.add_argument(
        "--kinds",
        default=",".join(DEGRADATIONS),
        help="with --degradations: which degradations to train (default all)",
    )
    parser.add_argument("--omniglot-root", type=Path, default=DEFAULT_OMNIGLOT)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "study_idml")
    parser.add_argument(
        "--ledger",
        type=Path,
        default=LEDGER,
        help="where the finished runs' records and the folder's pins are copied, under the --out "
        "folder's name, and restored from on a new machine (default: the committed "
        "benchmarks/study/ledger)",
    )
    parser.add_argument(
        "--no-ledger", dest="ledger", action="store_const", const=None, help="keep no ledger"
    )
    parser.add_argument("--quick", action="store_true", help="3 steps an epoch: a pipeline check")
    parser.add_argument(
        "--label",
        default="",
        help="suffix of the tables written (idml_<setting>_<label>.md): a grid in its own --out",
    )
    parser.add_argument(
        "--recipe",
        choices=("validated", "pinned", *RETUNABLE),
        default="validated",
        help="run: train with the validated recipe (pinned to the run folder), with the one the "
        "run folder already pins (add arms or seeds to a grid after its recipe was adopted away), "
        "or with the one `retune` chose for the arm named (every arm of the grid then uses it; "
        "pinned likewise, so give the grid its own --out)",
    )
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="run: a config override every run of the grid trains with, on top of its recipe (a "
        "diagnostic; repeatable). The setting folder pins them: use a new --out",
    )
    parser.add_argument(
        "--adopt",
        action="store_true",
        help=f"converge / widen: replace a recipe by its doubled budget / its knob one step past "
        f"the edge when that gains ≥ {CONVERGED_GAIN} validation MAP@R points (widen records the "
        "trial either way)",
    )
    args = parser.parse_args(argv)
    if args.command == "summary":
        print("README.md: study summary " + ("redrawn" if summary() else "already current"))
        for name in unsummarised():
            print(
                f"not in the summary: benchmarks/study/{name} (add a Cell for it, or its reason "
                "to SET_ASIDE, in benchmarks/idml_study/summary.py)"
            )
        return
    if args.setting is None:
        parser.error(f"{args.command} needs --setting, one of {', '.join(sorted(SETTINGS))}")
    if args.label and not re.fullmatch(r"[A-Za-z0-9_]+", args.label):
        parser.error(f"--label {args.label!r}: letters, digits and underscores only")
    args.losses = [x for x in args.losses.split(",") if x]
    arms: Mapping[str, Arm] = DEGRADATION_ARMS if args.degradations else ARMS
    given_arms = args.arms
    args.arms = [x for x in (args.arms or ",".join(arms)).split(",") if x]
    args.kinds = [x for x in args.kinds.split(",") if x]
    unknown = (
        [x for x in args.arms if x not in arms]
        + [x for x in args.losses if x not in LOSSES]
        + [x for x in args.kinds if x not in DEGRADATIONS]
    )
    if unknown:
        parser.error(
            f"unknown arm, loss or degradation {unknown}; arms: {', '.join(arms)}; losses: "
            f"{', '.join(LOSSES)}; degradations: {', '.join(DEGRADATIONS)}"
        )
    if args.command == "retune":
        wrong = [x for x in args.arms if x not in RETUNABLE]
        if given_arms is None or wrong or args.degradations:
            parser.error(
                f"retune chooses the knob of the arms named by --arms, one or more of "
                f"{', '.join(RETUNABLE)} (not {', '.join(wrong) or 'all of them'}): `validate` "
                "chose the baseline's, and a matched control takes the knobs of the arm it matches"
            )
    if args.override and args.command in ("validate", "converge", "widen", "retune"):
        parser.error(
            f"--override is for run (and tables) only: {args.command} chooses the recipe every "
            "arm trains with, on the validation split, without diagnostics"
        )
    malformed = [o for o in args.override if not re.fullmatch(r"[A-Za-z_][\w.]*=.*", o)]
    if malformed:
        parser.error(f"--override {malformed[0]!r}: write it as key.sub=value")
    per_run = [o for o in args.override if key_of(o) in PER_RUN_KEYS]
    if per_run:
        parser.error(f"--override {per_run[0]}: the study sets it per run (--losses, --seeds)")
    if args.quick:
        args.out = args.out.with_name(args.out.name + "_quick")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ledger = study_ledger(args)
    if ledger is not None and (restored := ledger.restore()):
        print(f"restored {restored} records of finished runs and pins from {ledger.root}")
    if args.command in ("validate", "converge", "widen", "retune") and (
        diagnostic := study_overrides(args, pin=False)
    ):
        parser.error(
            f"{args.out / args.setting} holds a diagnostic ({said(diagnostic)}); choose recipes "
            "in an --out of their own"
        )
    commands = {
        "validate": validate,
        "converge": converge,
        "widen": widen,
        "retune": retune,
        "run": run,
    }
    {**commands, "tables": tables}[args.command](args)
    if ledger is not None and (written := ledger.record()):
        print(
            f"recorded {written} files in {ledger.root} (commit them: the runs outlive this machine)"
        )


if __name__ == "__main__":
    main()
