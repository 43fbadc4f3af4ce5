"""Command-line interface: parses arguments and calls the library. No logic lives here.

Each sub-command has one ``_add_<name>`` function that registers its parser and one ``_run_<name>``
function that calls into the library.
"""

from __future__ import annotations

import argparse
import functools
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from idml.evaluation import EvaluationReport


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="idml", description="Deep metric learning with IDML and SSR."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_train, _add_evaluate, _add_embed, _add_demo, _add_report, _add_ablate):
        add(sub)
    for add in (_add_index, _add_search, _add_export, _add_serve):  # retrieval for applications
        add(sub)
    return parser


USER_ERRORS = (ValueError, OSError, KeyError, ArithmeticError)
"""What the library raises for bad input, bad files, a full disk or a diverging run: printed as one
line (exit 2). ``ValueError`` covers ``ConfigError``, ``CheckpointError``, ``RunFolderError`` and
codec errors; ``ArithmeticError`` the trainer's ``NonFiniteError``."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # The library warns about settings that make a run meaningless; say so in the CLI's own voice.
    warnings.formatwarning = lambda message, category, *_a, **_k: (
        f"idml {args.command}: warning: {message}\n"
        if issubclass(category, UserWarning)
        else f"{category.__name__}: {message}\n"
    )
    try:
        return int(args.run(args) or 0)
    except USER_ERRORS as err:
        print(f"idml {args.command}: error: {_one_line(err)}", file=sys.stderr)
        return 2


def _one_line(err: BaseException) -> str:
    """The error's message; a bare ``KeyError('x')`` or ``OSError`` also says what it was."""
    if isinstance(err, KeyError) and len(err.args) == 1:
        return f"missing entry {err.args[0]!r}"
    if isinstance(err, OSError) and err.strerror:
        where = f": {err.filename}" if err.filename else ""
        return f"{err.strerror}{where}"
    text = str(err) or type(err).__name__
    if text.startswith("Caught ") and "Original Traceback" in text:
        # Re-raised from a DataLoader worker: the original error's message is the last line.
        last = text.rstrip().splitlines()[-1]
        return last.split(": ", 1)[1] if ": " in last else last
    return text


# --------------------------------------------------------------------------- evaluate
def _add_evaluate(sub: argparse._SubParsersAction) -> None:
    def int_list(text: str) -> tuple[int, ...]:
        try:
            return tuple(int(part) for part in text.split(",") if part.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected integers like 1,2,4,8, got {text!r}"
            ) from None

    p = sub.add_parser(
        "evaluate",
        help="retrieval metrics of embeddings or of a trained run",
        description="Recall@K, R-Precision, MAP@R, MAP, MRR, NMI and ||u|| of saved embeddings "
        "(.npy/.npz/.pt/.safetensors), exact and blocked, with the conventions of the DML literature "
        "(Musgrave et al. 2020).",
    )
    src = p.add_argument_group("input")
    src.add_argument(
        "--embeddings", type=Path, help="embeddings file (the gallery; also the queries)"
    )
    src.add_argument("--labels", type=Path, help="labels file (default: the 'labels' entry)")
    src.add_argument(
        "--checkpoint",
        type=Path,
        help="a run folder of `idml train`: embed and score its test split",
    )
    src.add_argument(
        "--which", choices=("best", "latest"), default="best", help="with --checkpoint"
    )
    src.add_argument("--query-embeddings", type=Path, help="separate query embeddings file")
    src.add_argument("--query-labels", type=Path, help="labels of the separate queries")
    src.add_argument(
        "--embeddings-key", help="entry name of the embeddings (default embeddings|semantic)"
    )
    src.add_argument(
        "--uncertainty-key", help="entry name of the uncertainty (default uncertainty)"
    )
    src.add_argument("--labels-key", help="entry name of the labels (default labels)")
    opt = p.add_argument_group("evaluation")
    opt.add_argument(
        "--ks",
        type=int_list,
        default=None,
        help="K of Recall@K, e.g. 1,10,100,1000 (default 1,2,4,8, or the run's eval.ks)",
    )
    opt.add_argument("--metric", choices=("cosine", "euclidean"), default="cosine")
    opt.add_argument("--no-normalize", action="store_true", help="do not L2-normalise embeddings")
    opt.add_argument(
        "--introspective",
        action="store_true",
        help="rank with ISM on semantic + uncertainty (ablation)",
    )
    opt.add_argument("--gamma", type=float, default=0.0, help="ISM introspective bias γ")
    opt.add_argument("--tau", type=float, default=5.0, help="ISM weakening degree τ")
    opt.add_argument("--no-nmi", action="store_true", help="skip NMI (k-means)")
    opt.add_argument(
        "--nmi-backend",
        choices=("auto", "faiss", "sklearn", "knn"),
        default=None,
        help="k-means for NMI: auto (the default, or the run's eval.nmi_backend: k-NN-graph "
        "k-means when points x classes > 5e7, e.g. SOP, else full k-means with faiss if "
        "installed, else sklearn), faiss, sklearn or knn (fast, many classes)",
    )
    opt.add_argument("--seed", type=int, default=1234, help="k-means seed")
    opt.add_argument("--knn-backend", choices=("exact", "faiss"), default="exact")
    opt.add_argument("--faiss-index", default="HNSW32", help="faiss index factory string")
    opt.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cpu)")
    opt.add_argument("--block-size", type=int, default=None, help="tile side of the blocked search")
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print JSON instead of a table")
    out.add_argument(
        "--per-class",
        type=int,
        default=0,
        metavar="N",
        help="table: the N worst classes; JSON: include every class when N > 0",
    )
    out.add_argument(
        "--progress", action="store_true", help="progress is shown by default (kept for scripts)"
    )
    out.add_argument("--no-progress", action="store_true", help="no progress (on stderr)")
    p.set_defaults(run=_run_evaluate)


def _run_evaluate(args: argparse.Namespace) -> int:
    from idml.evaluation import EvaluationSettings, evaluate_files
    from idml.metrics import CosineSimilarity, EuclideanDistance, IntrospectiveMetric

    if args.checkpoint is not None:
        from idml.export import evaluate_checkpoint

        if args.embeddings is not None:
            raise ValueError("give either --checkpoint RUN or --embeddings FILE, not both")
        # A run is scored with its own config's metric and ISM; file-only options would be
        # silently ignored, so they are refused.
        file_only = [
            flag
            for flag, given in (
                ("--labels", args.labels is not None),
                ("--query-embeddings", args.query_embeddings is not None),
                ("--query-labels", args.query_labels is not None),
                ("--embeddings-key", args.embeddings_key is not None),
                ("--uncertainty-key", args.uncertainty_key is not None),
                ("--labels-key", args.labels_key is not None),
                ("--metric", args.metric != "cosine"),
                ("--no-normalize", args.no_normalize),
                ("--gamma", args.gamma != 0.0),
                ("--tau", args.tau != 5.0),
                ("--knn-backend", args.knn_backend != "exact"),
                ("--faiss-index", args.faiss_index != "HNSW32"),
            )
            if given
        ]
        if file_only:
            raise ValueError(
                f"{', '.join(file_only)} only apply to --embeddings files; with --checkpoint the "
                "run's own config decides (metric.*, eval.*). Drop them, or export embeddings "
                "with `idml embed` and evaluate the file"
            )
        import json

        from idml.classification_task import evaluate_classification_run, run_task

        if run_task(args.checkpoint, args.which) == "classification":
            retrieval_only = [
                flag
                for flag, given in (
                    ("--ks", args.ks is not None),
                    ("--introspective", args.introspective),
                    ("--no-nmi", args.no_nmi),
                    ("--nmi-backend", args.nmi_backend is not None),
                )
                if given
            ]
            if retrieval_only:
                raise ValueError(
                    f"{', '.join(retrieval_only)} apply to retrieval runs; {args.checkpoint} is a "
                    "classification run (its classification.* settings decide)"
                )
            metrics = evaluate_classification_run(
                args.checkpoint, args.which, device=args.device, progress=args.progress
            )
            print(
                json.dumps(metrics) if args.json else format_metrics(str(args.checkpoint), metrics)
            )
            return 0
        report = evaluate_checkpoint(
            args.checkpoint,
            args.which,
            ks=args.ks,
            introspective=True if args.introspective else None,
            device=args.device,
            progress=not args.no_progress,
            # Naming a k-means backend asks for NMI, even where the run's eval.nmi is off.
            nmi=False if args.no_nmi else (True if args.nmi_backend else None),
            nmi_backend=args.nmi_backend,
            block_size=args.block_size,
            seed=args.seed,
        )
        _print_report(report, args)
        return 0
    if args.embeddings is None:
        raise ValueError(
            "give --embeddings FILE (and --labels FILE unless the file has 'labels'), "
            "or --checkpoint RUN"
        )
    ism = None
    if args.introspective:
        base = CosineSimilarity() if args.metric == "cosine" else EuclideanDistance()
        ism = IntrospectiveMetric(base, gamma=args.gamma, tau=args.tau)
    report = evaluate_files(
        args.embeddings,
        args.labels,
        query_embeddings_path=args.query_embeddings,
        query_labels_path=args.query_labels,
        embeddings_key=args.embeddings_key,
        uncertainty_key=args.uncertainty_key,
        labels_key=args.labels_key,
        settings=EvaluationSettings(
            ks=args.ks or (1, 2, 4, 8),
            metric=args.metric,
            normalize=not args.no_normalize,
            nmi=not args.no_nmi,
            nmi_backend=args.nmi_backend or "auto",
            seed=args.seed,
            knn_backend=args.knn_backend,
            faiss_index=args.faiss_index,
            block_size=args.block_size,
        ),
        introspective_metric=ism,
        device=args.device,
        progress=not args.no_progress,
    )
    _print_report(report, args)
    return 0


def _print_report(report: EvaluationReport, args: argparse.Namespace) -> None:
    """JSON (every class when ``--per-class N > 0``) or a table (the N worst classes)."""
    if args.json:
        print(report.to_json(per_class=args.per_class > 0))
    else:
        print(report.format_table(per_class=args.per_class))


# --------------------------------------------------------------------------- train
def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train (and evaluate) a model from a YAML config",
        description="Train and evaluate a run. Several GPUs or nodes: start it with torchrun, e.g. "
        "`torchrun --nproc_per_node=8 -m idml train CONFIG` (see the README).",
    )
    p.add_argument(
        "config", type=Path, help="YAML config, e.g. configs/idml/cub_proxy_anchor_idml.yaml"
    )
    _add_overrides(p, "override a config value, e.g. --set optim.epochs=10 (repeatable)")
    p.add_argument("--out", type=Path, default=None, help="run folder (default: runs/<name>)")
    p.add_argument("--resume", action="store_true", help="continue from the run's last checkpoint")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh in a folder that holds a run; the old run is moved to "
        "OUT.replaced-<time>, not deleted",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(run=_run_train)


def _add_overrides(p: argparse.ArgumentParser, help_text: str) -> None:
    """``--set KEY=VALUE`` (repeatable) into ``args.overrides``, as :func:`load_config` takes them."""
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help_text
    )


def _run_train(args: argparse.Namespace) -> int:
    from idml.classification_task import make_trainer
    from idml.config import load_config
    from idml.distributed import destroy_distributed, init_distributed

    cfg = load_config(args.config, args.overrides)
    out = args.out or Path("runs") / cfg.name
    # Under torchrun this joins the process group (NCCL on GPUs, gloo on CPU); else one process.
    context = init_distributed(device=cfg.device)
    try:
        trainer = make_trainer(
            cfg,
            out,
            progress=not args.no_progress,
            distributed=context,
            # Without bars a long run would print nothing until it ends: one line per epoch.
            epoch_log=functools.partial(print, flush=True) if args.no_progress else None,
        )
        result = trainer.fit(resume=args.resume, overwrite=args.overwrite)
    finally:
        destroy_distributed(context)
    if not context.is_main:
        return 0
    print(format_metrics(f"{cfg.name}: final", result.final_metrics))
    if result.best_epoch >= 0:
        print(format_metrics(f"best epoch {result.best_epoch + 1}", result.best_metrics))
    if cfg.published is not None and result.final_metrics:
        from idml.paper import compare_with_paper, format_paper_table

        rows = compare_with_paper(cfg.published.metrics, result.final_metrics)
        print(format_paper_table(cfg.published.source, rows, "paper vs this run (final epoch)"))
    print(f"run folder: {result.run_dir}")
    return 0


# --------------------------------------------------------------------------- embed
def _add_embed(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "embed",
        help="export semantic embeddings and uncertainty levels of images (a classification "
        "run: also its logits and class probabilities)",
    )
    p.add_argument("--checkpoint", type=Path, required=True, help="run folder or checkpoint folder")
    p.add_argument("--images", type=Path, required=True, help="image folder or CSV (path[,label])")
    p.add_argument("--out", type=Path, required=True, help=".npz, .pt or .safetensors file")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--which", choices=["best", "latest"], default="best")
    p.add_argument("--split", default=None, help="CSV only: embed the rows of this split column")
    p.add_argument("--no-progress", action="store_true", help="no progress (on stderr)")
    p.set_defaults(run=_run_embed)


def _run_embed(args: argparse.Namespace) -> int:
    from idml.classification_task import load_classification_run, run_task
    from idml.export import embed_images, load_trained_model

    classifier, logit_classes = None, None
    if run_task(args.checkpoint, args.which) == "classification":
        loaded = load_classification_run(args.checkpoint, args.which)
        cfg, model = loaded.config, loaded.run.model
        classifier, logit_classes = loaded.classifier, loaded.class_names
    else:
        cfg, model = load_trained_model(args.checkpoint, which=args.which)
    n = embed_images(
        cfg,
        model,
        args.images,
        args.out,
        batch_size=args.batch_size,
        split=args.split,
        progress=not args.no_progress,
        classifier=classifier,
        logit_classes=logit_classes,
    )
    extra = " with logits and probabilities" if classifier is not None else ""
    print(f"wrote {n} embeddings{extra} to {args.out}")
    return 0


# --------------------------------------------------------------------------- demo
def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="baseline vs IDML on the bundled digits (no download)")
    p.add_argument("--epochs", type=int, default=8, help="training epochs of each run")
    p.add_argument("--seed", type=int, default=0, help="first seed")
    p.add_argument("--seeds", type=int, default=3, help="seeds per arm (mean ± std)")
    p.add_argument("--out", type=Path, default=Path("runs/demo"))
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-report", action="store_true", help="skip the HTML report of both runs")
    p.set_defaults(run=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from idml.demo import DEMO_SETTING, run_demo

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
        from idml.reports import write_report

        page = write_report([args.out / "baseline", args.out / "idml"], args.out / "report")
        print(f"report: {page} (open it in a browser)")
    return 0


def format_metrics(title: str, metrics: dict[str, float]) -> str:
    """A two-column table of metric values."""
    width = max((len(k) for k in metrics), default=6)
    lines = [title] + [f"  {k.ljust(width)}  {v:.4f}" for k, v in metrics.items()]
    return "\n".join(lines)


# --------------------------------------------------------------------------- report
def _add_report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report",
        help="HTML report (figures, metrics, comparison) of one or more runs",
        description="Write an offline HTML page with PNG figures: training curves, Recall@K, "
        "precision-recall, uncertainty trend and test histogram, retrieval grid, t-SNE, and a "
        "comparison table of all runs given. Classification runs get their test metrics, "
        "reliability diagram, confusion matrix, risk-coverage curves and most confident "
        "mistakes instead of the retrieval figures.",
    )
    p.add_argument(
        "runs",
        type=Path,
        nargs="+",
        metavar="RUN_DIR",
        help="run folders, or `idml ablate` folders (their cells' seeds are grouped)",
    )
    p.add_argument(
        "--reference",
        default=None,
        metavar="GROUP",
        help="group the seed table's Δ is taken against: an ablation cell (e.g. "
        "'metric=plain, mixup=off') or a run name (default: the baseline)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="report folder (default: RUN_DIR/report for one run, ./report for several)",
    )
    p.add_argument("--no-test", action="store_true", help="logs only: no test-set analysis")
    p.add_argument("--inline", action="store_true", help="also embed figures in the HTML")
    test = p.add_argument_group("test-set analysis (not with --no-test)")
    # None = not given: the defaults come from AnalysisOptions, and --no-test can refuse them.
    test.add_argument("--which", choices=["best", "latest"], help="checkpoint (default best)")
    test.add_argument("--queries", type=int, help="queries in the retrieval grid (default 6)")
    test.add_argument("--tsne-points", type=int, help="points in the t-SNE (default 1000)")
    test.add_argument("--batch-size", type=int, help="embedding batch size (default 128)")
    test.add_argument("--seed", type=int, help="seed of all sampling in the report (default 0)")
    test.add_argument("--device", help="auto (default), cpu, cuda, cuda:N")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(run=_run_report)


def _run_report(args: argparse.Namespace) -> int:
    from idml.distributed import resolve_device
    from idml.reports import AnalysisOptions, write_report
    from idml.run_folder import make_folder

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
    )
    print(f"report: {page}")
    return 0


# --------------------------------------------------------------------------- ablate
def _add_ablate(sub: argparse._SubParsersAction) -> None:
    from idml.ablation import describe_presets

    p = sub.add_parser(
        "ablate",
        help="train a grid of configs over seeds and tabulate mean ± std",
        description="Run every cell of a grid for N seeds (finished cells are reused) and write "
        "OUT/ablation.md and OUT/ablation.csv.",
        epilog="grid keys are raw config keys (metric.gamma=0,2,4) or presets:\n"
        + describe_presets(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", type=Path, help="YAML config of the base run")
    p.add_argument(
        "--grid",
        action="append",
        default=[],
        required=True,
        metavar="KEY=V1,V2",
        help="one axis of the grid (repeatable), e.g. --grid metric=plain,ism --grid mixup=on,off",
    )
    p.add_argument("--seeds", type=int, default=1, help="seeds per cell (config seed, +1, ...)")
    _add_overrides(p, "override a base config value for every cell (repeatable)")
    p.add_argument("--out", type=Path, default=None, help="folder (default: runs/ablation-<name>)")
    p.add_argument("--select", choices=["final", "best"], default="final", help="which epoch")
    p.add_argument(
        "--metrics", default=None, help="comma-separated metric columns (default: all reported)"
    )
    p.add_argument(
        "--progress", action="store_true", help="progress is shown by default (kept for scripts)"
    )
    p.add_argument("--no-progress", action="store_true", help="no per-epoch progress")
    p.set_defaults(run=_run_ablate)


def _run_ablate(args: argparse.Namespace) -> int:
    from idml.ablation import parse_grid, run_ablation
    from idml.config import load_config

    axes = parse_grid(args.grid)
    out = args.out or Path("runs") / f"ablation-{load_config(args.config, args.overrides).name}"
    metrics = [m.strip() for m in args.metrics.split(",")] if args.metrics else None
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
    print(result.markdown(), end="")
    print(f"tables: {out / 'ablation.md'}, {out / 'ablation.csv'}")
    return 0


# --------------------------------------------------------------------------- index / search
def _add_index(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "index",
        help="embed a gallery with a trained run and save a searchable index",
        description="Embed GALLERY (an image folder, a CSV of path[,label], or an `idml embed` "
        "file) and write an index folder: embeddings, ||u||, ids/paths/labels, the model, and a "
        "manifest with checksums. --add extends an existing index with the same model.",
    )
    p.add_argument("gallery", type=Path, help="image folder, CSV or embeddings file")
    p.add_argument("--out", type=Path, required=True, help="index folder to write (or extend)")
    p.add_argument("--checkpoint", type=Path, help="run, checkpoint or `idml export` folder")
    p.add_argument("--which", choices=["best", "latest"], default="best")
    p.add_argument("--add", action="store_true", help="add the items to the existing index OUT")
    p.add_argument("--backend", choices=["exact", "faiss"], default="exact")
    p.add_argument("--faiss-index", default="HNSW32", help="faiss factory string (Flat, HNSW32…)")
    _add_embedding_options(p)
    p.set_defaults(run=_run_index)


def _run_index(args: argparse.Namespace) -> int:
    from idml.retrieval.workflow import build_index

    index = build_index(
        args.gallery,
        args.out,
        args.checkpoint,
        which=args.which,
        add=args.add,
        backend=args.backend,
        faiss_factory=args.faiss_index,
        search_parameters=args.search_parameters,
        batch_size=args.batch_size,
        device=args.device,
        progress=not args.no_progress,
    )
    print(f"index {args.out}: {len(index)} items, dimension {index.dim}, backend {index.backend}")
    return 0


def _add_embedding_options(p: argparse.ArgumentParser) -> None:
    """Options of index and search: faiss search parameters and how images are embedded."""
    p.add_argument("--search-parameters", help="faiss search parameters, e.g. efSearch=128")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--device", default=None, help="cpu (default), cuda, cuda:N")
    p.add_argument("--no-progress", action="store_true")


def _add_index_model(p: argparse.ArgumentParser) -> None:
    """The index folder and the model that embeds query images (search and serve)."""
    p.add_argument("index", type=Path, help="index folder of `idml index`")
    p.add_argument("--checkpoint", type=Path, help="model for query images (default: the index's)")
    p.add_argument("--which", choices=["best", "latest"], default="best")


def _add_search(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "search",
        help="query an index with images or embeddings: neighbours, similarity, ||u||, confidence",
    )
    _add_index_model(p)
    p.add_argument("queries", type=Path, help="image file, image folder, CSV or embeddings file")
    p.add_argument("-k", type=int, default=10, help="neighbours per query")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--out", type=Path, help="write the results to a .json or .csv file")
    p.add_argument("--html", type=Path, help="also write an HTML page of queries and neighbours")
    _add_embedding_options(p)
    p.set_defaults(run=_run_search)


def _run_search(args: argparse.Namespace) -> int:
    from idml.retrieval import Index
    from idml.retrieval.output import format_table, to_json, write_csv, write_html
    from idml.retrieval.workflow import encoder_for_index, read_source, search_source

    if args.out is not None and args.out.suffix.lower() not in (".json", ".csv"):
        raise ValueError(f"--out {args.out}: use a .json or .csv file name")
    index = Index.load(args.index, search_parameters=args.search_parameters)
    queries = read_source(args.queries)
    encoder = None
    if queries.embeddings is None:
        encoder = encoder_for_index(index, args.checkpoint, args.which, args.device)
    records = search_source(
        index,
        queries,
        args.k,
        encoder,
        batch_size=args.batch_size,
        progress=not args.no_progress,
        device=args.device,
    )
    if args.out is not None and args.out.suffix.lower() == ".csv":
        write_csv(records, args.out)
    elif args.out is not None:
        args.out.write_text(to_json(records, index, args.k) + "\n")
    if args.html is not None:
        write_html(records, args.html, title=f"idml search: {args.index}")
    print(to_json(records, index, args.k) if args.json else format_table(records))
    return 0


# --------------------------------------------------------------------------- export / serve
def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="export the retrieval model to TorchScript and ONNX (embedding + ||u||)",
    )
    p.add_argument("--checkpoint", type=Path, required=True, help="run or checkpoint folder")
    p.add_argument("--out", type=Path, required=True, help="export folder")
    p.add_argument("--which", choices=["best", "latest"], default="best")
    p.add_argument(
        "--format",
        default="torchscript,onnx",
        help="comma-separated: torchscript, onnx (default both)",
    )
    p.set_defaults(run=_run_export)


def _run_export(args: argparse.Namespace) -> int:
    from idml.deploy import export_model
    from idml.inference import Encoder

    formats = [f.strip() for f in args.format.split(",") if f.strip()]
    meta = export_model(Encoder.from_run(args.checkpoint, args.which), args.out, formats)
    written = [meta[f] for f in ("torchscript", "onnx") if f in meta]
    print(f"exported {', '.join(written)} and export.json to {args.out}")
    return 0


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="HTTP JSON search service over an index (POST /search, GET /health, GET /info)",
    )
    _add_index_model(p)
    p.add_argument(
        "--embeddings-only", action="store_true", help="no model: embedding queries only"
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-bytes", type=int, default=10 * 1024 * 1024, help="request size limit")
    p.add_argument("--max-k", type=int, default=100, help="largest k a request may ask")
    p.add_argument("--device", default=None, help="cpu (default), cuda, cuda:N")
    p.set_defaults(run=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    from idml.retrieval import Index
    from idml.retrieval.server import create_app, serve
    from idml.retrieval.workflow import encoder_for_index

    index = Index.load(args.index)
    encoder = None
    if not args.embeddings_only:
        encoder = encoder_for_index(index, args.checkpoint, args.which, args.device)
    app = create_app(index, encoder, max_bytes=args.max_bytes, max_k=args.max_k)
    print(f"serving {args.index} ({len(index)} items) on http://{args.host}:{args.port}")
    serve(app, args.host, args.port)
    return 0
