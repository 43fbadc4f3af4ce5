"""Options and output that several sub-commands share."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_overrides(p: argparse.ArgumentParser, help_text: str) -> None:
    """``--set KEY=VALUE`` (repeatable) into ``args.overrides``, as :func:`load_config` takes them."""
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help_text
    )


def add_embedding_options(p: argparse.ArgumentParser) -> None:
    """Options of index and search: faiss search parameters and how images are embedded."""
    p.add_argument(
        "--search-parameters",
        help="faiss parameters, e.g. efSearch=128; when an index is built also "
        "efConstruction=200 (a better HNSW graph)",
    )
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--device", default=None, help="cpu (default), cuda, cuda:N")
    p.add_argument("--no-progress", action="store_true")


def add_index_model(p: argparse.ArgumentParser) -> None:
    """The index folder and the model that embeds query images (search and serve)."""
    p.add_argument("index", type=Path, help="index folder of `idml index`")
    p.add_argument("--checkpoint", type=Path, help="model for query images (default: the index's)")
    p.add_argument("--which", choices=["best", "latest"], default="best")


def format_metrics(title: str, metrics: dict[str, float]) -> str:
    """A two-column table of metric values."""
    width = max((len(k) for k in metrics), default=6)
    lines = [title] + [f"  {k.ljust(width)}  {v:.4f}" for k, v in metrics.items()]
    return "\n".join(lines)
