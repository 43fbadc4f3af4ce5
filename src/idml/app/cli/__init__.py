"""Command-line interface: parses arguments and calls the library. No logic lives here.

Each sub-command is one :class:`~idml.app.cli.command.Command`: its options, declared next to the
``_run_<name>`` function that calls into the library with them, in :mod:`idml.app.cli.training`
(train, demo, ablate, report, cache), :mod:`idml.app.cli.evaluation` (evaluate) and
:mod:`idml.app.cli.retrieval` (embed, index, search, export, serve). Options that several
sub-commands take are declared once in :mod:`idml.app.cli.options`.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence

from idml import __version__
from idml.app.cli.command import INTERRUPTED, Parser
from idml.app.cli.evaluation import EVALUATE
from idml.app.cli.retrieval import EMBED, EXPORT, INDEX, SEARCH, SERVE
from idml.app.cli.training import ABLATE, CACHE, DEMO, REPORT, TRAIN

__all__ = ["COMMANDS", "USER_ERRORS", "build_parser", "main"]


COMMANDS = (TRAIN, EVALUATE, EMBED, DEMO, REPORT, ABLATE, CACHE, INDEX, SEARCH, EXPORT, SERVE)
"""The sub-commands, in the order ``idml --help`` lists them: those of the paper's workflow, then
retrieval for applications (index, search, export, serve)."""


def build_parser() -> argparse.ArgumentParser:
    """The parser of every sub-command. Building it imports no torch: each sub-command imports
    what it needs when it runs, so ``idml --help`` and ``idml --version`` answer at once."""
    parser = Parser(prog="idml", description="Deep metric learning with IDML and SSR.")
    parser.add_argument("--version", action="version", version=f"idml {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for command in COMMANDS:
        command.add_to(sub)
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
    except KeyboardInterrupt:
        # Ctrl-C: one line and the shell's exit status for SIGINT, not a traceback.
        print(f"\nidml {args.command}: interrupted", file=sys.stderr)
        return INTERRUPTED


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
