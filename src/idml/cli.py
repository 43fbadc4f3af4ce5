"""Command-line interface: parses arguments and calls the library. No logic lives here.

Each sub-command has one ``_add_<name>`` function that registers its parser and one ``_run_<name>``
function that calls into the library.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="idml", description="Deep metric learning with IDML and SSR."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_evaluate,):
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except (ValueError, FileNotFoundError, KeyError) as err:
        print(f"idml {args.command}: error: {err}", file=sys.stderr)
        return 2


# --------------------------------------------------------------------------- evaluate
def _add_evaluate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("evaluate", help="retrieval metrics of embeddings or of a trained run")
    p.set_defaults(run=_run_evaluate)


def _run_evaluate(args: argparse.Namespace) -> int:
    raise NotImplementedError("evaluate is being built")
