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
    format_metrics,
    reranker,
)

if TYPE_CHECKING:
    from idml.evaluation import EvaluationReport


def _int_list(text: str) -> tuple[int, ...]:
    """``--ks 1,2,4,8``: comma-separated integers."""
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,2,4,8, got {text!r}") from None


def _run_evaluate(args: argparse.Namespace) -> int:
    from idml.evaluation import EntryNames, EvaluationSettings, evaluate_files
    from idml.evaluation.confidence import ConfidenceCalibration
    from idml.metrics import CosineSimilarity, EuclideanDistance, IntrospectiveMetric

    if args.checkpoint is not None:
        from idml.app.trained_run import evaluate_checkpoint

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

        from idml.app.classification_task import evaluate_classification_run, run_task

        if run_task(args.checkpoint, args.which) == "classification":
            retrieval_only = [
                flag
                for flag, given in (
                    ("--ks", args.ks is not None),
                    ("--introspective", args.introspective),
                    ("--no-nmi", args.no_nmi),
                    ("--nmi-backend", args.nmi_backend is not None),
                    ("--rerank", args.rerank is not None),
                    ("--calibration", args.calibration is not None),
                )
                if given
            ]
            if retrieval_only:
                raise ValueError(
                    f"{', '.join(retrieval_only)} apply to retrieval runs; {args.checkpoint} is a "
                    "classification run (its classification.* settings decide)"
                )
            metrics = evaluate_classification_run(
                args.checkpoint, args.which, device=args.device, progress=not args.no_progress
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
            reranking=reranker(args),
            calibration=args.calibration,
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
        entry_names=EntryNames(args.embeddings_key, args.uncertainty_key, args.labels_key),
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
            reranking=reranker(args),
        ),
        introspective_metric=ism,
        calibration=None
        if args.calibration is None
        else ConfidenceCalibration.load(args.calibration),
        device=args.device,
        progress=not args.no_progress,
    )
    _print_report(report, args)
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
            Option("--metric", choices=("cosine", "euclidean"), default="cosine"),
            Option("--no-normalize", action="store_true", help="do not L2-normalise embeddings"),
            Option(
                "--introspective",
                action="store_true",
                help="rank with ISM on semantic + uncertainty (ablation)",
            ),
            Option("--gamma", type=float, default=0.0, help="ISM introspective bias γ"),
            Option("--tau", type=float, default=5.0, help="ISM weakening degree τ"),
            Option("--no-nmi", action="store_true", help="skip NMI (k-means)"),
            Option(
                "--nmi-backend",
                choices=("auto", "faiss", "sklearn", "knn"),
                default=None,
                help="k-means for NMI: auto (the default, or the run's eval.nmi_backend: "
                "k-NN-graph k-means when points x classes > 5e7, e.g. SOP, else full k-means with "
                "faiss if installed, else sklearn), faiss, sklearn or knn (fast, many classes)",
            ),
            Option("--seed", type=int, default=1234, help="k-means seed"),
            Option("--knn-backend", choices=("exact", "faiss"), default="exact"),
            Option("--faiss-index", default="HNSW32", help="faiss index factory string"),
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


def _print_report(report: EvaluationReport, args: argparse.Namespace) -> None:
    """JSON (every class when ``--per-class N > 0``) or a table (the N worst classes)."""
    if args.json:
        print(report.to_json(per_class=args.per_class > 0))
        return
    print(report.format_table(per_class=args.per_class))
    if "calibration" in report.settings:
        print(f"confidence: {report.settings['calibration']}")
