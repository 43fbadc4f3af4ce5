"""Command-line interface: parses arguments and calls the library. No logic lives here.

Each sub-command has one ``_add_<name>`` function that registers its parser and one ``_run_<name>``
function that calls into the library: :mod:`idml.app.cli.training` (train, demo, ablate, report),
:mod:`idml.app.cli.evaluation` (evaluate) and :mod:`idml.app.cli.retrieval` (embed, index, search, export,
serve).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence

from idml.app.cli.evaluation import _add_evaluate
from idml.app.cli.options import format_metrics
from idml.app.cli.retrieval import _add_embed, _add_export, _add_index, _add_search, _add_serve
from idml.app.cli.training import _add_ablate, _add_demo, _add_report, _add_train

__all__ = ["USER_ERRORS", "build_parser", "format_metrics", "main"]


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
