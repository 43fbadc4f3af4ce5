"""Options and output that several sub-commands share: each option declared once, with its help
text, and named in the :class:`~idml.app.cli.command.Command` of every sub-command that takes it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from idml.app.cli.command import Option

if TYPE_CHECKING:
    from idml.app.retrieval.workflow import Runtime


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
