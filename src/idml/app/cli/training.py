"""``idml train``, ``idml demo``, ``idml ablate`` and ``idml report``: train runs and report on them."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from idml.app.cli.command import INTERRUPTED, Command, Group, Option
from idml.app.cli.options import NO_PROGRESS, OLD_PROGRESS, OVERRIDES, device_name


def _run_train(args: argparse.Namespace) -> int:
    from idml.app.config import load_config
    from idml.app.distributed import destroy_distributed, init_distributed
    from idml.app.training import Trainer
    from idml.progress import echo

    if (args.config is None) == (args.data is None):
        raise ValueError(
            "give a YAML config (idml train CONFIG) or a folder or CSV of your images (idml "
            "train --data PATH), not both"
            if args.config is not None
            else "give a YAML config (idml train CONFIG) or your images (idml train --data PATH)"
        )
    if args.method is not None and args.data is None:
        raise ValueError(
            "--method applies to --data; a config chooses its method with include: method/<name>"
        )
    plan = None
    if args.data is not None:
        from idml.app.own_data import DEFAULT_METHOD, plan_own_data

        plan = plan_own_data(args.data, args.method or DEFAULT_METHOD, args.overrides)
        cfg = plan.config()
    else:
        cfg = load_config(args.config, args.overrides)
    out = args.out or Path("runs") / cfg.name
    # Under torchrun this joins the process group (NCCL on GPUs, gloo on CPU); else one process.
    context = init_distributed(device=cfg.device)
    if plan is not None and context.is_main:
        print("\n".join(plan.report()), flush=True)
    try:
        trainer = Trainer(
            cfg,
            out,
            progress=not args.no_progress,
            distributed=context,
            # The start-up summary and one line per epoch, kept above the bars and in a pipe.
            echo=echo,
        )
        result = trainer.fit(resume=args.resume, overwrite=args.overwrite)
    except KeyboardInterrupt:
        # The last finished epoch is saved (its log line and checkpoint are written together).
        if context.is_main:
            from idml.app.training.console import interrupted_line

            print(f"\nidml train: {interrupted_line(out, cfg.optim.epochs)}", file=sys.stderr)
            print(f"resume with: {resume_command(args, out)}", file=sys.stderr, flush=True)
        return INTERRUPTED
    finally:
        destroy_distributed(context)
    if not context.is_main:
        return 0
    from idml.app.metric_display import format_metrics

    print(format_metrics(f"{cfg.name}: final", result.final_metrics))
    if result.best_epoch > 0:
        print(format_metrics(f"best epoch {result.best_epoch}", result.best_metrics))
    if cfg.published is not None and result.final_metrics:
        from idml.app.config import config_to_dict
        from idml.app.paper import paper_vs_run, recipe_differences

        published = cfg.published
        differences = recipe_differences(
            published.recipe,
            config_to_dict(cfg),
            published.classes,
            trainer.data.num_train_classes,
        )
        print(
            paper_vs_run(
                published.source,
                published.metrics,
                result.final_metrics,
                differences,
                recipe_known=bool(published.recipe),
                title="paper vs this run (final epoch)",
            )
        )
    print(f"run folder: {result.run_dir}")
    return 0


def resume_command(args: argparse.Namespace, out: Path) -> str:
    """The ``idml train`` command that continues this run: the same config and ``--set``
    overrides (a resumed config must equal the run's), its folder, ``--resume``; shell-quoted."""
    words = ["idml", "train"]
    if args.data is not None:
        words += ["--data", str(args.data)]
        words += ["--method", args.method] if args.method is not None else []
    else:
        words.append(str(args.config))
    words += ["--out", str(out), "--resume"]
    for override in args.overrides:
        words += ["--set", override]
    if args.no_progress:
        words.append("--no-progress")
    return shlex.join(words)


def _train_epilog() -> str:
    """The methods ``--method`` takes (the packaged fragments, read when the help is printed)."""
    from idml.app.fragments import method_names

    return "methods (--method): " + ", ".join(method_names())


TRAIN = Command(
    "train",
    _run_train,
    help="train (and evaluate) a model from a YAML config or on your own images (--data)",
    # Printed as written (the epilog makes the help raw text), so the lines are broken here.
    description="Train and evaluate a run, from a YAML config or on your own images:\n"
    "`idml train --data PATH` inspects a folder of class folders (or a CSV), derives the\n"
    "settings that follow from it and prints each with its reason. Several GPUs or nodes:\n"
    "start it with torchrun, e.g. `torchrun --nproc_per_node=8 -m idml train CONFIG`\n"
    "(see the README).",
    epilog=_train_epilog,
    arguments=(
        Option(
            "config",
            type=Path,
            nargs="?",
            default=None,
            help="YAML config, e.g. configs/idml/cub_proxy_anchor_idml.yaml (not with --data)",
        ),
        Option(
            "--data",
            type=Path,
            default=None,
            metavar="PATH",
            help="your images instead of a config: a folder of class folders (root/<class>/"
            "<image>, or deeper) or a CSV of path,label[,split] rows",
        ),
        Option(
            "--method",
            default=None,
            help="with --data: the method, a packaged method/<name> fragment (default idml; "
            "listed below)",
        ),
        OVERRIDES.but(
            help="override a config value, e.g. --set optim.epochs=10 (repeatable); with --data "
            "it wins over the derived value"
        ),
        Option("--out", type=Path, default=None, help="run folder (default: runs/<name>)"),
        Option("--resume", action="store_true", help="continue from the run's last checkpoint"),
        Option(
            "--overwrite",
            action="store_true",
            help="start afresh in a folder that holds a run; the old run is moved to "
            "OUT.replaced-<time>, not deleted",
        ),
        NO_PROGRESS.but(help="no progress bars"),
    ),
)


def _run_cache(args: argparse.Namespace) -> int:
    from idml.app.config import load_config
    from idml.app.image_cache import cache_dataset

    cfg = load_config(args.config, args.overrides)
    short_side = None if args.short_side == 0 else args.short_side
    count = cache_dataset(cfg, args.out, short_side, progress=not args.no_progress)
    print(
        f"cached {count} images of {cfg.data.dataset} in {args.out}; train with "
        f"--set data.cache={args.out}"
    )
    return 0


CACHE = Command(
    "cache",
    _run_cache,
    help="decode a dataset's images once into a uint8 cache that training reads (data.cache)",
    description="Decode every image of the config's dataset (all sides) into a memory-mapped "
    "uint8 cache with checksums. Images whose shorter side exceeds --short-side are resized down "
    "to it (0: keep every image as decoded). Train with --set data.cache=OUT; the cache is "
    "checked against the dataset's files when a run starts.",
    arguments=(
        Option("config", type=Path, help="YAML config of the runs that will read the cache"),
        OVERRIDES.but(help="override a config value (repeatable)"),
        Option("--out", type=Path, required=True, help="cache folder to write (replaced)"),
        Option(
            "--short-side",
            type=int,
            default=512,
            help="largest shorter side stored (default 512: CUB and SOP as decoded); 0: no resize",
        ),
        NO_PROGRESS.but(help="no progress"),
    ),
)


def _run_demo(args: argparse.Namespace) -> int:
    from idml.app.demo import DEMO_SETTING, run_demo

    result = run_demo(
        args.out,
        epochs=args.epochs,
        seed=args.seed,
        progress=not args.no_progress,
        seeds=args.seeds,
    )
    print(DEMO_SETTING)
    print(result.table())
    print(f"runs: {args.out}/baseline, {args.out}/idml")
    if not args.no_report:
        from idml.app.reports import write_report

        # Every seed counts in the page's seed table; the figures are those of the first seed.
        page = write_report(result.run_dirs, args.out / "report", sections_per_group=1)
        print(f"report: {page} (open it in a browser)")
    return 0


DEMO = Command(
    "demo",
    _run_demo,
    help="baseline vs IDML on the bundled digits (no download)",
    arguments=(
        Option("--epochs", type=int, default=8, help="training epochs of each run"),
        Option("--seed", type=int, default=0, help="first seed"),
        Option("--seeds", type=int, default=3, help="seeds per arm (mean ± std)"),
        Option("--out", type=Path, default=Path("runs/demo")),
        NO_PROGRESS,
        Option("--no-report", action="store_true", help="skip the HTML report of both runs"),
    ),
)


def _run_report(args: argparse.Namespace) -> int:
    from idml.app.distributed import resolve_device
    from idml.app.reports import AnalysisOptions, write_report
    from idml.app.run_folder import make_folder

    out = args.out or (args.runs[0] / "report" if len(args.runs) == 1 else Path("report"))
    analysis = [  # (flag, AnalysisOptions field or None, value given)
        ("--which", "which", args.which),
        ("--queries", "num_queries", args.queries),
        ("--tsne-points", "tsne_points", args.tsne_points),
        ("--batch-size", "batch_size", args.batch_size),
        ("--seed", "seed", args.seed),
        ("--device", None, args.device),
    ]
    given = [(flag, field, value) for flag, field, value in analysis if value is not None]
    if args.no_test and given:
        raise ValueError(
            f"{', '.join(flag for flag, _, _ in given)} only apply to the test-set analysis, "
            "which --no-test skips; drop them or --no-test"
        )
    options = AnalysisOptions(**{field: value for _, field, value in given if field})
    make_folder(out, "report folder")  # a file in the way is named before any figure is drawn
    skipped: list[str] = []
    page = write_report(
        args.runs,
        out,
        options,
        analyse=not args.no_test,
        inline=args.inline,
        device=resolve_device(args.device or "auto"),
        progress=not args.no_progress,
        log=print,
        reference=args.reference,
        on_skip=skipped.append,
    )
    for line in skipped:
        print(f"idml report: warning: skipped {line}", file=sys.stderr)
    print(f"report: {page}")
    if skipped and args.strict:
        print(
            f"idml report: error: {len(skipped)} part(s) of the report were skipped (--strict)",
            file=sys.stderr,
        )
        return 1
    return 0


REPORT = Command(
    "report",
    _run_report,
    help="HTML report (figures, metrics, comparison) of one or more runs",
    description="Write an offline HTML page with PNG figures: training curves, Recall@K, "
    "precision-recall, uncertainty trend and test histogram, retrieval grid, t-SNE, and a "
    "comparison table of all runs given. Classification runs get their test metrics, "
    "reliability diagram, confusion matrix, risk-coverage curves and most confident "
    "mistakes instead of the retrieval figures.",
    arguments=(
        Option(
            "runs",
            type=Path,
            nargs="+",
            metavar="RUN_DIR",
            help="run folders, or `idml ablate` folders (their cells' seeds are grouped)",
        ),
        Option(
            "--reference",
            default=None,
            metavar="GROUP",
            help="group the seed table's Δ is taken against: an ablation cell (e.g. "
            "'metric=plain, mixup=off') or a run name (default: the baseline)",
        ),
        Option(
            "--out",
            type=Path,
            default=None,
            help="report folder (default: RUN_DIR/report for one run, ./report for several)",
        ),
        Option("--no-test", action="store_true", help="logs only: no test-set analysis"),
        Option(
            "--strict",
            action="store_true",
            help="exit 1 when a part of the report had to be skipped (e.g. an unreadable "
            "checkpoint); it is always printed as a warning",
        ),
        Option("--inline", action="store_true", help="also embed figures in the HTML"),
        # None = not given: the defaults come from AnalysisOptions, and --no-test can refuse them.
        Group(
            "test-set analysis (not with --no-test)",
            Option("--which", choices=["best", "latest"], help="checkpoint (default best)"),
            Option("--queries", type=int, help="queries in the retrieval grid (default 6)"),
            Option("--tsne-points", type=int, help="points in the t-SNE (default 1000)"),
            Option("--batch-size", type=int, help="embedding batch size (default 128)"),
            Option("--seed", type=int, help="seed of all sampling in the report (default 0)"),
            Option("--device", type=device_name, help="auto (default), cpu, cuda, cuda:N"),
        ),
        NO_PROGRESS,
    ),
)


def _run_ablate(args: argparse.Namespace) -> int:
    from idml.app.ablation import parse_grid, run_ablation
    from idml.app.config import load_config

    axes = parse_grid(args.grid)
    out = args.out or Path("runs") / f"ablation-{load_config(args.config, args.overrides).name}"
    metrics = [m.strip() for m in args.metrics.split(",")] if args.metrics else None
    try:
        result = run_ablation(
            args.config,
            axes,
            args.seeds,
            out,
            overrides=args.overrides,
            select=args.select,
            metrics=metrics,
            progress=not args.no_progress,
            log=print,
        )
    except KeyboardInterrupt:
        print(
            "\nidml ablate: interrupted; run the same command again: finished runs are reused and "
            "the interrupted one resumes from its last saved epoch",
            file=sys.stderr,
        )
        return INTERRUPTED
    print(result.markdown(), end="")
    print(f"tables: {out / 'ablation.md'}, {out / 'ablation.csv'}")
    return 0


def _ablate_epilog() -> str:
    """The grid keys ``idml ablate`` takes, presets included."""
    from idml.app.ablation import describe_presets

    return "grid keys are raw config keys (metric.gamma=0,2,4) or presets:\n" + describe_presets()


ABLATE = Command(
    "ablate",
    _run_ablate,
    help="train a grid of configs over seeds and tabulate mean ± std",
    description="Run every cell of a grid for N seeds (finished cells are reused) and write "
    "OUT/ablation.md and OUT/ablation.csv.",
    epilog=_ablate_epilog,
    arguments=(
        Option("config", type=Path, help="YAML config of the base run"),
        Option(
            "--grid",
            action="append",
            default=[],
            required=True,
            metavar="KEY=V1,V2",
            help="one axis of the grid (repeatable), e.g. --grid metric=plain,ism "
            "--grid mixup=on,off",
        ),
        Option("--seeds", type=int, default=1, help="seeds per cell (config seed, +1, ...)"),
        OVERRIDES.but(help="override a base config value for every cell (repeatable)"),
        Option("--out", type=Path, default=None, help="folder (default: runs/ablation-<name>)"),
        Option("--select", choices=["final", "best"], default="final", help="which epoch"),
        Option(
            "--metrics", default=None, help="comma-separated metric columns (default: all reported)"
        ),
        OLD_PROGRESS,
        NO_PROGRESS.but(help="no per-epoch progress"),
    ),
)
