"""Options and output that several sub-commands share: each option declared once, with its help
text, and named in the :class:`~idml.app.cli.command.Command` of every sub-command that takes it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from idml.app.cli.command import Group, Option

if TYPE_CHECKING:
    from idml.app.retrieval.workflow import Runtime
    from idml.evaluation.reranking import Reranker


OVERRIDES = Option("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
"""``--set KEY=VALUE`` (repeatable) into ``args.overrides``, as
:func:`~idml.app.config.load_config` takes them."""


WHICH = Option("--which", choices=["best", "latest"], default="best")
"""The checkpoint of a run: ``best`` (the default) or ``latest``."""

NO_PROGRESS = Option("--no-progress", action="store_true")
"""``args.no_progress``: no progress bars."""

OLD_PROGRESS = Option(
    "--progress", action="store_true", help="progress is shown by default (kept for scripts)"
)
"""``--progress`` of older scripts: progress is on unless ``--no-progress``."""

JSON = Option("--json", action="store_true", help="print JSON instead of a table")

SEARCH_PARAMETERS = Option(
    "--search-parameters",
    help="faiss parameters, e.g. efSearch=128; when an index is built also "
    "efConstruction=200 (a better HNSW graph)",
)
"""faiss search parameters of index and search."""


def device_name(text: str) -> str:
    """An argparse ``type`` for ``--device``: ``auto`` or a device torch knows (``cpu``,
    ``cuda``, ``cuda:1``, ``mps``…), refused at parse time with the valid forms (not a torch
    traceback once the model is loaded). Whether that device exists is checked where it is used."""
    import torch

    if text == "auto":
        return text
    try:
        torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(
            f"unknown device {text!r}; use cpu, cuda, cuda:N (or auto where accepted)"
        ) from None
    return text


DEVICE = Option("--device", default=None, type=device_name, help="cpu (default), cuda, cuda:N")
"""Where the model runs and an index is searched."""

BATCH_SIZE = Option("--batch-size", type=int, default=64)
"""Images per forward pass of the model."""

RUNTIME = (BATCH_SIZE, DEVICE, NO_PROGRESS)
"""How images are embedded (index and search): the :func:`runtime` of the parsed flags."""

INDEX_MODEL = (
    Option("index", type=Path, help="index folder of `idml index`"),
    Option("--checkpoint", type=Path, help="model for query images (default: the index's)"),
    WHICH,
)
"""The index folder and the model that embeds query images (search and serve)."""


def runtime(args: argparse.Namespace) -> Runtime:
    """The :class:`~idml.app.retrieval.workflow.Runtime` of the :data:`RUNTIME` flags
    ``--batch-size``, ``--device`` and ``--no-progress``."""
    from idml.app.retrieval.workflow import Runtime

    return Runtime(args.batch_size, args.device, progress=not args.no_progress)


RERANKING = Group(
    "re-ranking (k-reciprocal: Zhong et al. 2017; αQE / DBA: Radenović et al. 2019)",
    Option(
        "--rerank",
        choices=("k-reciprocal", "query-expansion"),
        default=None,
        help="re-order each query's shortlist before metrics and confidence (default: none)",
    ),
    Option("--rerank-shortlist", type=int, metavar="L", help="shortlist re-ranked (100)"),
    Option("--rerank-k1", type=int, metavar="K", help="k-reciprocal: k1 (20)"),
    Option("--rerank-k2", type=int, metavar="K", help="k-reciprocal: k2 (6)"),
    Option("--rerank-lambda", type=float, metavar="λ", help="k-reciprocal: λ (0.3)"),
    Option("--rerank-qe", type=int, metavar="N", help="query-expansion: αQE neighbours (2)"),
    Option("--rerank-dba", type=int, metavar="N", help="query-expansion: DBA neighbours (0)"),
    Option("--rerank-alpha", type=float, metavar="α", help="query-expansion: α (3)"),
)
"""``--rerank`` and its parameters (evaluate, search, serve, calibrate): :func:`reranker`."""

_RERANK_PARAMETERS = {
    "k-reciprocal": {
        "rerank_k1": "k1",
        "rerank_k2": "k2",
        "rerank_lambda": "lambda_value",
        "rerank_shortlist": "shortlist",
    },
    "query-expansion": {
        "rerank_qe": "query_neighbors",
        "rerank_dba": "database_neighbors",
        "rerank_alpha": "alpha",
        "rerank_shortlist": "shortlist",
    },
}


def reranker(args: argparse.Namespace) -> Reranker | None:
    """The re-ranker of the :data:`RERANKING` flags (``None`` without ``--rerank``); a parameter
    of another method, or without ``--rerank``, is refused naming it."""
    from idml.evaluation.reranking import KReciprocal, QueryExpansion

    given = {
        dest
        for names in _RERANK_PARAMETERS.values()
        for dest in names
        if getattr(args, dest) is not None
    }
    method = args.rerank
    fields = _RERANK_PARAMETERS.get(method, {}) if method is not None else {}
    stray = sorted(given - set(fields))
    if stray:
        flags = ", ".join("--" + dest.replace("_", "-") for dest in stray)
        raise ValueError(
            f"{flags} {'is' if len(stray) == 1 else 'are'} not a parameter of "
            f"{'--rerank ' + method if method else 'a search without --rerank'}; "
            "drop it, or choose the method it belongs to"
        )
    if method is None:
        return None
    cls = KReciprocal if method == "k-reciprocal" else QueryExpansion
    return cls(**{field: getattr(args, dest) for dest, field in fields.items() if dest in given})


ANSWERS = Group(
    "answers: confidence and abstention",
    Option(
        "--calibration",
        type=Path,
        help="calibration.json to use (default: the index folder's, else the model folder's)",
    ),
    Option(
        "--min-confidence",
        type=float,
        metavar="C",
        help="abstain on queries whose confidence is below C (of the kind the answers report)",
    ),
    Option(
        "--target-precision",
        type=float,
        metavar="P",
        help="abstain below the threshold certified for precision >= P among answered queries "
        "(needs a calibration; Learn then Test)",
    ),
    Option(
        "--delta",
        type=float,
        default=0.1,
        help="allowed probability that the precision misses --target-precision (0.1)",
    ),
)
"""How search and serve score and abstain (:func:`idml.app.retrieval.workflow.prepare_answering`)."""
