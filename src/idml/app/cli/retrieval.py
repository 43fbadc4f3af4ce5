"""``idml embed``, ``idml index``, ``idml search``, ``idml export`` and ``idml serve``: use a trained
run for retrieval."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from idml.app.cli.options import add_embedding_options, add_index_model

if TYPE_CHECKING:
    from idml.app.retrieval.workflow import Runtime


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
    from idml.app.classification_task import load_classification_run, run_task
    from idml.app.trained_run import embed_images, load_trained_model

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
    add_embedding_options(p)
    p.set_defaults(run=_run_index)


def _runtime(args: argparse.Namespace) -> Runtime:
    """The :class:`~idml.app.retrieval.workflow.Runtime` of the ``--batch-size``, ``--device`` and
    ``--no-progress`` flags (:func:`~idml.app.cli.options.add_embedding_options`)."""
    from idml.app.retrieval.workflow import Runtime

    return Runtime(args.batch_size, args.device, progress=not args.no_progress)


def _run_index(args: argparse.Namespace) -> int:
    from idml.app.retrieval.workflow import build_index

    index = build_index(
        args.gallery,
        args.out,
        args.checkpoint,
        which=args.which,
        add=args.add,
        backend=args.backend,
        faiss_factory=args.faiss_index,
        search_parameters=args.search_parameters,
        runtime=_runtime(args),
    )
    print(f"index {args.out}: {len(index)} items, dimension {index.dim}, backend {index.backend}")
    return 0


def _add_search(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "search",
        help="query an index with images or embeddings: neighbours, similarity, ||u||, confidence",
    )
    add_index_model(p)
    p.add_argument("queries", type=Path, help="image file, image folder, CSV or embeddings file")
    p.add_argument("-k", type=int, default=10, help="neighbours per query")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--out", type=Path, help="write the results to a .json or .csv file")
    p.add_argument("--html", type=Path, help="also write an HTML page of queries and neighbours")
    add_embedding_options(p)
    p.set_defaults(run=_run_search)


def _run_search(args: argparse.Namespace) -> int:
    from idml.app.retrieval import Index
    from idml.app.retrieval.output import format_table, to_json, write_csv, write_html
    from idml.app.retrieval.workflow import encoder_for_index, read_source, search_source

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
        runtime=_runtime(args),
    )
    if args.out is not None and args.out.suffix.lower() == ".csv":
        write_csv(records, args.out)
    elif args.out is not None:
        args.out.write_text(to_json(records, index, args.k) + "\n")
    if args.html is not None:
        write_html(records, args.html, title=f"idml search: {args.index}")
    print(to_json(records, index, args.k) if args.json else format_table(records))
    return 0


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
    from idml.app.deploy import export_model
    from idml.app.inference import Encoder

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
    add_index_model(p)
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
    from idml.app.retrieval import Index
    from idml.app.retrieval.server import create_app, serve
    from idml.app.retrieval.workflow import encoder_for_index

    index = Index.load(args.index)
    encoder = None
    if not args.embeddings_only:
        encoder = encoder_for_index(index, args.checkpoint, args.which, args.device)
    app = create_app(index, encoder, max_bytes=args.max_bytes, max_k=args.max_k)
    print(f"serving {args.index} ({len(index)} items) on http://{args.host}:{args.port}")
    serve(app, args.host, args.port)
    return 0
