"""``idml embed``, ``idml index``, ``idml search``, ``idml export`` and ``idml serve``: use a trained
run for retrieval."""

from __future__ import annotations

import argparse
from pathlib import Path

from idml.app.cli.command import Command, Option
from idml.app.cli.options import (
    BATCH_SIZE,
    DEVICE,
    INDEX_MODEL,
    JSON,
    NO_PROGRESS,
    RUNTIME,
    SEARCH_PARAMETERS,
    WHICH,
    runtime,
)


def _run_embed(args: argparse.Namespace) -> int:
    from idml.app.distributed import destroy_distributed, init_distributed
    from idml.app.tasks import task_of_run
    from idml.app.trained_run import embed_images

    loaded = task_of_run(args.checkpoint, args.which).load_run(args.checkpoint, args.which)
    # Under torchrun every process embeds its share of the images; rank 0 writes the file.
    context = init_distributed(device=args.device or "cpu")
    try:
        n = embed_images(
            loaded.config,
            loaded.model.to(context.device),
            args.images,
            args.out,
            batch_size=args.batch_size,
            split=args.split,
            progress=not args.no_progress and context.is_main,
            extras=loaded.extra_outputs,
            distributed=context,
        )
    finally:
        destroy_distributed(context)
    if context.is_main:
        extra = f" with {' and '.join(loaded.extra_arrays)}" if loaded.extra_arrays else ""
        print(f"wrote {n} embeddings{extra} to {args.out}")
    return 0


EMBED = Command(
    "embed",
    _run_embed,
    help="export semantic embeddings and uncertainty levels of images (a classification "
    "run: also its logits and class probabilities)",
    description="Embed the images of a folder or CSV with a trained run. Started by torchrun, "
    "every process embeds its share of the images and rank 0 writes the file.",
    arguments=(
        Option("--checkpoint", type=Path, required=True, help="run folder or checkpoint folder"),
        Option(
            "--images",
            type=Path,
            required=True,
            help="image folder (label = folder path below it) or CSV (path,label[,split[,role]])",
        ),
        Option("--out", type=Path, required=True, help=".npz, .pt or .safetensors file"),
        BATCH_SIZE,
        WHICH,
        Option(
            "--split",
            choices=("train", "val", "test"),
            default=None,
            help="embed only this split (a CSV's split column, or train/val/test folders)",
        ),
        DEVICE,
        NO_PROGRESS.but(help="no progress (on stderr)"),
    ),
)


def _run_index(args: argparse.Namespace) -> int:
    from idml.app.distributed import destroy_distributed, init_distributed
    from idml.app.retrieval.workflow import build_index

    if args.no_vectors and args.backend != "faiss":
        raise ValueError("--no-vectors needs --backend faiss (an exact index searches its vectors)")
    # Under torchrun every process embeds its share of the gallery; rank 0 writes the index.
    context = init_distributed(device=args.device or "cpu")
    try:
        index = build_index(
            args.gallery,
            args.out,
            args.checkpoint,
            which=args.which,
            add=args.add,
            backend=args.backend,
            faiss_factory=args.faiss_index,
            search_parameters=args.search_parameters,
            root=args.root,
            allow_outside_root=args.allow_outside_root,
            store_vectors=not args.no_vectors,
            train_size=args.train_size,
            runtime=runtime(args),
            log=print if context.is_main else lambda _: None,
            distributed=context,
        )
    finally:
        destroy_distributed(context)
    if index is not None:
        print(
            f"index {args.out}: {len(index)} items, dimension {index.dim}, backend {index.backend}"
        )
    return 0


INDEX = Command(
    "index",
    _run_index,
    help="embed a gallery with a trained run and save a searchable index",
    description="Embed GALLERY (an image folder, labelled by the folder path below it; a CSV of "
    "path[,label]; or an `idml embed` file) and write an index folder: embeddings, ||u||, "
    "ids/paths/labels, the model, and a manifest with checksums. --add extends an existing "
    "index with the same model. Paths are recorded relative to the gallery's root folder; items "
    "outside it are refused unless --allow-outside-root. A second writer of the same index is "
    "refused. Started by torchrun, every process embeds its share of the gallery and rank 0 "
    "merges them into the index.",
    arguments=(
        Option("gallery", type=Path, help="image folder, CSV or embeddings file"),
        Option("--out", type=Path, required=True, help="index folder to write (or extend)"),
        Option("--checkpoint", type=Path, help="run, checkpoint or `idml export` folder"),
        WHICH,
        Option("--add", action="store_true", help="add the items to the existing index OUT"),
        Option("--backend", choices=["exact", "faiss"], default="exact"),
        Option(
            "--faiss-index",
            default="HNSW32",
            help="faiss factory string: Flat, HNSW32, or compressed for galleries of millions, "
            "e.g. IVF65536,PQ32 or IVF65536_HNSW32,PQ32 (32-byte codes; README, 'Galleries')",
        ),
        SEARCH_PARAMETERS,
        Option(
            "--no-vectors",
            action="store_true",
            help="faiss only: keep no float32 copy of the embeddings (4·d bytes per item); the "
            "faiss index alone holds the items",
        ),
        Option(
            "--train-size",
            type=int,
            default=None,
            help="vectors a trained faiss index (IVF, PQ) learns from, evenly spaced over the "
            "gallery (default: 64 per IVF list, at least 100,000)",
        ),
        Option(
            "--root",
            type=Path,
            help="gallery root the paths are recorded under (default: the image folder, the "
            "CSV's folder, or the folder of an embeddings file's paths)",
        ),
        Option(
            "--allow-outside-root",
            action="store_true",
            help="record items outside the root (e.g. ../ rows of a CSV); such an index can "
            "reveal other folders to whoever it is served to",
        ),
        *RUNTIME,
    ),
)


def _run_search(args: argparse.Namespace) -> int:
    from idml.app.retrieval import Index
    from idml.app.retrieval.index import check_k
    from idml.app.retrieval.output import format_table, to_json, write_csv, write_html
    from idml.app.retrieval.workflow import encoder_for_index, read_source, search_source
    from idml.app.storage import write_file

    if args.out is not None and args.out.suffix.lower() not in (".json", ".csv"):
        raise ValueError(f"--out {args.out}: use a .json or .csv file name")
    index = Index.load(args.index, search_parameters=args.search_parameters)
    try:
        check_k(args.k, len(index))  # before any image is embedded
    except ValueError as err:
        raise ValueError(f"-k: {err}") from None
    queries = read_source(args.queries)
    encoder = None
    if queries.embeddings is None:
        encoder = encoder_for_index(index, args.checkpoint, args.which, args.device)
    records = search_source(
        index,
        queries,
        args.k,
        encoder,
        runtime=runtime(args),
    )
    if args.out is not None and args.out.suffix.lower() == ".csv":
        write_csv(records, args.out)
    elif args.out is not None:
        write_file(args.out, (to_json(records, index, args.k) + "\n").encode())
    if args.html is not None:
        write_html(records, args.html, title=f"idml search: {args.index}")
    print(to_json(records, index, args.k) if args.json else format_table(records))
    return 0


SEARCH = Command(
    "search",
    _run_search,
    help="query an index with images or embeddings: neighbours, similarity, ||u||, confidence",
    arguments=(
        *INDEX_MODEL,
        Option("queries", type=Path, help="image file, image folder, CSV or embeddings file"),
        Option("-k", type=int, default=10, help="neighbours per query"),
        JSON,
        Option("--out", type=Path, help="write the results to a .json or .csv file"),
        Option("--html", type=Path, help="also write an HTML page of queries and neighbours"),
        SEARCH_PARAMETERS,
        *RUNTIME,
    ),
)


def _run_export(args: argparse.Namespace) -> int:
    from idml.app.deploy import export_model
    from idml.app.inference import Encoder

    formats = [f.strip() for f in args.format.split(",") if f.strip()]
    encoder = Encoder.from_run(args.checkpoint, args.which)
    meta = export_model(encoder, args.out, formats, overwrite=args.overwrite)
    written = [meta[f] for f in ("torchscript", "onnx") if f in meta]
    print(f"exported {', '.join(written)} and export.json to {args.out}")
    return 0


EXPORT = Command(
    "export",
    _run_export,
    help="export the retrieval model to TorchScript and ONNX (embedding + ||u||)",
    arguments=(
        Option("--checkpoint", type=Path, required=True, help="run or checkpoint folder"),
        Option("--out", type=Path, required=True, help="export folder"),
        WHICH,
        Option(
            "--format",
            default="torchscript,onnx",
            help="comma-separated: torchscript, onnx (default both)",
        ),
        Option(
            "--overwrite",
            action="store_true",
            help="replace the export already in --out (all its files; nothing else is there)",
        ),
    ),
)


def _run_serve(args: argparse.Namespace) -> int:
    from idml.app.retrieval import Index
    from idml.app.retrieval.server import create_app, serve
    from idml.app.retrieval.workflow import encoder_for_index

    index = Index.load(args.index)
    encoder = None
    if not args.embeddings_only:
        encoder = encoder_for_index(index, args.checkpoint, args.which, args.device)
    app = create_app(
        index,
        encoder,
        max_bytes=args.max_bytes,
        max_k=args.max_k,
        max_pixels=args.max_pixels,
        paths=args.paths,
    )
    print(f"serving {args.index} ({len(index)} items) on http://{args.host}:{args.port}")
    serve(app, args.host, args.port)
    return 0


SERVE = Command(
    "serve",
    _run_serve,
    help="HTTP JSON search service over an index (POST /search, GET /health, GET /info; "
    "OpenAPI at GET /openapi.json, readable at GET /docs)",
    arguments=(
        *INDEX_MODEL,
        Option("--embeddings-only", action="store_true", help="no model: embedding queries only"),
        Option("--host", default="127.0.0.1", help="bind address (default loopback only)"),
        Option("--port", type=int, default=8000),
        Option("--max-bytes", type=int, default=10 * 1024 * 1024, help="request size limit"),
        Option("--max-k", type=int, default=100, help="largest k a request may ask"),
        Option(
            "--max-pixels",
            type=int,
            default=40_000_000,
            help="largest uploaded image, width × height (a bigger one is refused from its header)",
        ),
        Option(
            "--paths",
            choices=["relative", "none"],
            default="relative",
            help="neighbours' paths in answers: relative to the gallery root, or none (ids only)",
        ),
        DEVICE,
    ),
)
