"""``idml evaluate``: score embeddings files or a trained run's test set."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from idml.app.cli.command import Command, Group, Option
from idml.app.cli.options import (
    JSON,
    NO_PROGRESS,
    OLD_PROGRESS,
    RERANKING,
    device_name,
    reranker,
)

if TYPE_CHECKING:
    from idml.app.tasks import RunEvaluation


def _int_list(text: str) -> tuple[int, ...]:
    """``--ks 1,2,4,8``: comma-separated integers."""
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,2,4,8, got {text!r}") from None


_RUN_OPTIONS = (  # EvaluationRequest field, flag
    ("ks", "--ks"),
    ("introspective", "--introspective"),
    ("nmi", "--no-nmi"),
    ("nmi_backend", "--nmi-backend"),
    ("full_ranking", "--no-full-ranking"),
    ("block_size", "--block-size"),
    ("seed", "--seed"),
    ("reranking", "--rerank"),
    ("calibration", "--calibration"),
)
"""The evaluation options a run's task may honour with ``--checkpoint``."""

_FILE_OPTIONS = (  # argparse destination, flag
    ("labels", "--labels"),
    ("query_embeddings", "--query-embeddings"),
    ("query_labels", "--query-labels"),
    ("embeddings_key", "--embeddings-key"),
    ("uncertainty_key", "--uncertainty-key"),
    ("labels_key", "--labels-key"),
    ("metric", "--metric"),
    ("normalize", "--no-normalize"),
    ("gamma", "--gamma"),
    ("tau", "--tau"),
    ("knn_backend", "--knn-backend"),
    ("faiss_index", "--faiss-index"),
)
"""Options of embeddings files only (``None``: not given): with ``--checkpoint`` the run's own
config decides them."""


def _run_evaluate(args: argparse.Namespace) -> int:
    if args.checkpoint is not None:
        return _evaluate_run(args)
    from idml.evaluation import EntryNames, EvaluationSettings, evaluate_files
    from idml.evaluation.confidence import ConfidenceCalibration
    from idml.metrics import CosineSimilarity, EuclideanDistance, IntrospectiveMetric

    if args.embeddings is None:
        raise ValueError(
            "give --embeddings FILE (and --labels FILE unless the file has 'labels'), "
            "or --checkpoint RUN"
        )
    ism = None
    if args.introspective:
        base = CosineSimilarity() if args.metric in (None, "cosine") else EuclideanDistance()
        given = {k: v for k, v in (("gamma", args.gamma), ("tau", args.tau)) if v is not None}
        ism = IntrospectiveMetric(base, **given)
    settings = {
        "ks": args.ks or None,
        "metric": args.metric,
        "normalize": args.normalize,
        "nmi": False if args.no_nmi else None,
        "nmi_backend": args.nmi_backend,
        "full_ranking": False if args.no_full_ranking else None,
        "seed": args.seed,
        "knn_backend": args.knn_backend,
        "faiss_index": args.faiss_index,
        "block_size": args.block_size,
        "reranking": reranker(args),
    }
    report = evaluate_files(
        args.embeddings,
        args.labels,
        query_embeddings_path=args.query_embeddings,
        query_labels_path=args.query_labels,
        entry_names=EntryNames(args.embeddings_key, args.uncertainty_key, args.labels_key),
        # Options not given keep the library's defaults.
        settings=EvaluationSettings(**{k: v for k, v in settings.items() if v is not None}),
        introspective_metric=ism,
        calibration=None
        if args.calibration is None
        else ConfidenceCalibration.load(args.calibration),
        device=args.device,
        progress=not args.no_progress,
    )
    _print_report(report, args)
    return 0


def _evaluate_run(args: argparse.Namespace) -> int:
    """``--checkpoint RUN``: the run's task evaluates it with its own config's settings, changed
    only where a flag the task honours asks."""
    from idml.app.tasks import EvaluationRequest, task_of_run

    if args.embeddings is not None:
        raise ValueError("give either --checkpoint RUN or --embeddings FILE, not both")
    # A run is scored with its own config's metric and ISM; file-only options would be silently
    # ignored, so they are refused.
    file_only = [flag for dest, flag in _FILE_OPTIONS if getattr(args, dest) is not None]
    if file_only:
        raise ValueError(
            f"{', '.join(file_only)} only apply to --embeddings files; with --checkpoint the "
            "run's own config decides (metric.*, eval.*). Drop them, or export embeddings "
            "with `idml embed` and evaluate the file"
        )
    task = task_of_run(args.checkpoint, args.which)
    request = EvaluationRequest(
        ks=args.ks or None,
        introspective=True if args.introspective else None,
        # Naming a k-means backend asks for NMI, even where the run's eval.nmi is off.
        nmi=False if args.no_nmi else (True if args.nmi_backend else None),
        nmi_backend=args.nmi_backend,
        full_ranking=False if args.no_full_ranking else None,
        block_size=args.block_size,
        seed=args.seed,
        reranking=reranker(args),
        calibration=args.calibration,
    )
    given, honoured = request.given(), task.evaluation_options
    refused = [flag for name, flag in _RUN_OPTIONS if name in given and name not in honoured]
    if refused:
        raise ValueError(
            f"{', '.join(refused)} do not apply to {task.name} runs, and {args.checkpoint} is one "
            "(its config decides); drop them"
        )
    evaluation = task.evaluate_run(
        args.checkpoint, args.which, request, device=args.device, progress=not args.no_progress
    )
    _print_report(evaluation, args)
    return 0


EVALUATE = Command(
    "evaluate",
    _run_evaluate,
    help="retrieval metrics of embeddings or of a trained run",
    description="Recall@K, R-Precision, MAP@R, MAP, MRR, NMI and ||u|| of saved embeddings "
    "(.npy/.npz/.pt/.safetensors), exact and blocked, with the conventions of the DML literature "
    "(Musgrave et al. 2020), and how well each confidence score tells right top-1 answers from "
    "wrong ones (R-AUROC, AURC, selective R@1 at 50/80/90%% coverage); with a calibration (the "
    "run's calibration.json, or --calibration) also its ECE and the precision and coverage of "
    "its abstention thresholds. A file whose images have query/gallery roles (`idml embed` of a "
    "CSV with a role column) searches its queries against its gallery only.",
    arguments=(
        Group(
            "input",
            Option(
                "--embeddings", type=Path, help="embeddings file (the gallery; also the queries)"
            ),
            Option("--labels", type=Path, help="labels file (default: the 'labels' entry)"),
            Option(
                "--checkpoint",
                type=Path,
                help="a run folder of `idml train`: embed and score its test split",
            ),
            Option("--which", choices=("best", "latest"), default="best", help="with --checkpoint"),
            Option("--query-embeddings", type=Path, help="separate query embeddings file"),
            Option("--query-labels", type=Path, help="labels of the separate queries"),
            Option(
                "--embeddings-key",
                help="entry name of the embeddings (default embeddings|semantic)",
            ),
            Option("--uncertainty-key", help="entry name of the uncertainty (default uncertainty)"),
            Option("--labels-key", help="entry name of the labels (default labels)"),
        ),
        Group(
            "evaluation",
            Option(
                "--ks",
                type=_int_list,
                default=None,
                help="K of Recall@K, e.g. 1,10,100,1000 (default 1,2,4,8, or the run's eval.ks)",
            ),
            Option(
                "--metric", choices=("cosine", "euclidean"), default=None, help="default cosine"
            ),
            Option(
                "--no-normalize",
                dest="normalize",
                action="store_const",
                const=False,
                default=None,
                help="do not L2-normalise embeddings",
            ),
            Option(
                "--introspective",
                action="store_true",
                help="rank with ISM on semantic + uncertainty (ablation)",
            ),
            Option(
                "--gamma", type=float, default=None, help="ISM introspective bias γ (default 0)"
            ),
            Option("--tau", type=float, default=None, help="ISM weakening degree τ (default 5)"),
            Option("--no-nmi", action="store_true", help="skip NMI (k-means)"),
            Option(
                "--nmi-backend",
                choices=("auto", "faiss", "sklearn", "knn"),
                default=None,
                help="k-means for NMI: auto (the default, or the run's eval.nmi_backend: "
                "k-NN-graph k-means when points x classes > 5e7, e.g. SOP, else full k-means with "
                "faiss if installed, else sklearn), faiss, sklearn or knn (fast, many classes)",
            ),
            Option("--seed", type=int, default=None, help="k-means seed (default 1234)"),
            Option(
                "--no-full-ranking",
                action="store_true",
                help="rank only each query's neighbour list (as deep as --ks and the largest "
                "class): Recall@K, R-Precision and MAP@R exactly, several times faster on a "
                "large gallery; MAP and MRR over the whole gallery are not reported",
            ),
            Option("--knn-backend", choices=("exact", "faiss"), default=None, help="default exact"),
            Option("--faiss-index", default=None, help="faiss index factory (default HNSW32)"),
            Option(
                "--device", default=None, type=device_name, help="cpu, cuda, cuda:N (default: cpu)"
            ),
            Option("--block-size", type=int, default=None, help="tile side of the blocked search"),
            Option(
                "--calibration",
                type=Path,
                help="calibration.json whose calibrated confidence to judge (default with "
                "--checkpoint: the run's own, when it applies)",
            ),
        ),
        RERANKING,
        Group(
            "output",
            JSON,
            Option(
                "--per-class",
                type=int,
                default=0,
                metavar="N",
                help="table: the N worst classes; JSON: include every class when N > 0",
            ),
            OLD_PROGRESS,
            NO_PROGRESS.but(help="no progress (on stderr)"),
        ),
    ),
)


def _print_report(report: RunEvaluation, args: argparse.Namespace) -> None:
    """JSON (every class when ``--per-class N > 0``) or a table (the N worst classes)."""
    from idml.evaluation import EvaluationReport

    if args.json:
        print(report.to_json(per_class=args.per_class > 0))
        return
    print(report.format_table(per_class=args.per_class))
    # A retrieval run's evaluation says which confidence it judged (idml.app.calibration).
    if isinstance(report, EvaluationReport) and "calibration" in report.settings:
        print(f"confidence: {report.settings['calibration']}")
