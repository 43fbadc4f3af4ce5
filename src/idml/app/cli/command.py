"""What a sub-command is made of.

A sub-command is a :class:`Command`: its name, the function that runs it, what ``idml --help`` and
``idml NAME --help`` say, and its arguments, each an :class:`Option` (or a :class:`Group` of them
under a heading). An option is a value, so one that several sub-commands take is declared once
(:mod:`idml.app.cli.options`) and named in each; :meth:`Option.but` gives it one sub-command's own
help text.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

INTERRUPTED = 130
"""The exit status after Ctrl-C (128 + SIGINT, as a shell reports a process stopped by it)."""


class Option:
    """One argument of a sub-command: the flags and keywords of
    :meth:`argparse.ArgumentParser.add_argument`, to be added to any number of parsers."""

    def __init__(self, *flags: str, **settings: Any) -> None:
        self.flags = flags
        self.settings = settings

    def but(self, **changes: Any) -> Option:
        """This option with some of its keywords changed, e.g. its ``help`` in one sub-command."""
        return Option(*self.flags, **{**self.settings, **changes})

    def add_to(self, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        parser.add_argument(*self.flags, **self.settings)


class Group:
    """Options that ``--help`` lists under their own heading."""

    def __init__(self, title: str, *options: Option) -> None:
        self.title = title
        self.options = options

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group(self.title)
        for option in self.options:
            option.add_to(group)


@dataclass(frozen=True)
class Command:
    """A sub-command, ``idml NAME``: its parser and the function that runs the parsed arguments
    (an exit status; the errors of :data:`~idml.app.cli.USER_ERRORS` become one line)."""

    name: str
    run: Callable[[argparse.Namespace], int]
    help: str
    """The line of ``idml --help``."""
    description: str | None = None
    """The paragraph under the usage of ``idml NAME --help``."""
    arguments: Sequence[Option | Group] = ()
    epilog: Callable[[], str] | None = None
    """The text after the arguments, made only when ``idml NAME --help`` prints it (it may import
    what the parser must not: ``idml --help`` stays fast); with one, the description and the
    epilog are printed as written (their line breaks kept)."""

    def add_to(self, sub: argparse._SubParsersAction) -> None:
        raw = self.epilog is not None
        parser = sub.add_parser(
            self.name,
            help=self.help,
            description=self.description,
            epilog_factory=self.epilog,
            formatter_class=argparse.RawDescriptionHelpFormatter if raw else argparse.HelpFormatter,
        )
        for argument in self.arguments:
            argument.add_to(parser)
        parser.set_defaults(run=self.run)


class Parser(argparse.ArgumentParser):
    """An :class:`argparse.ArgumentParser` whose epilog is made when the help is formatted
    (``epilog_factory``), not when the parser is built."""

    def __init__(self, *args: Any, epilog_factory: Callable[[], str] | None = None, **kw: Any):
        super().__init__(*args, **kw)
        self._epilog_factory = epilog_factory

    def format_help(self) -> str:
        if self._epilog_factory is not None and self.epilog is None:
            self.epilog = self._epilog_factory()
        return super().format_help()
