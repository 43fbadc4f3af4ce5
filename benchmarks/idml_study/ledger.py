"""The ledger: the committed copy of a study folder's pins and its finished runs' records
(``benchmarks/study/ledger``), so that a grid outlives the machine it trained on.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from idml_study.design import TABLES
from idml_study.recipes import FOLDER_MEMORY_FORMAT, FOLDER_OVERRIDES, FOLDER_RECIPE

LEDGER = TABLES / "ledger"
"""The committed copy of each study folder's small files (:class:`Ledger`), one subfolder per
``--out`` by its name."""

DURABLE_FILES = frozenset({FOLDER_MEMORY_FORMAT, FOLDER_OVERRIDES, FOLDER_RECIPE, "untrained.json"})
"""A study folder's pins and caches, kept in its ledger wherever they lie."""
DURABLE_RUN_FILES = frozenset({"result.json", "mechanism.json"})
"""A finished run's record: what ``run_ablation`` reuses a run by, and what the tables read."""


@dataclass(frozen=True)
class Ledger:
    """The durable copy of a study folder: its pins, caches and finished runs' records, without the
    checkpoints, mirrored file for file under ``root`` (``benchmarks/study/ledger/<out's name>``).

    A grid of Lite0 runs outlives a session and its machine only in the repository: a run folder's
    checkpoints are hundreds of megabytes, a run's record a few kilobytes. :meth:`record` copies a
    folder's records into the ledger as its runs finish; :meth:`restore` puts them back into a new
    machine's empty ``--out``, where ``run_ablation`` reuses a run whose ``result.json`` names the
    same config (so a grid resumes at its next untrained seed), the controls match the restored
    ``mechanism.json``, and the tables read them as any finished run."""

    out: Path
    root: Path

    def durable(self, folder: Path) -> list[Path]:
        """The files of ``folder`` (within :attr:`out`) that the ledger keeps: pins and caches,
        and the records of finished runs, not of runs moved aside (``seedN.replaced-…``)."""
        kept = []
        for path in sorted(folder.rglob("*.json")) if folder.is_dir() else []:
            if path.name in DURABLE_FILES or (
                path.name in DURABLE_RUN_FILES and re.fullmatch(r"seed\d+", path.parent.name)
            ):
                kept.append(path)
        return kept

    def record(self, folder: Path | None = None) -> int:
        """Copy the durable files of ``folder`` (default: all of :attr:`out`) into the ledger,
        replacing an older copy (a re-run's or a rematch's); the number of files written."""
        return self.copy(self.durable(folder or self.out))

    def record_run(self, run_folder: Path) -> int:
        """A finished run's records and the pins of the folders above it (the grid's recipe, the
        setting's layout), so that a chain stopped mid-grid leaves what resuming needs."""
        above = [a for a in run_folder.parents if a == self.out or self.out in a.parents]
        pins = [a / name for a in above for name in sorted(DURABLE_FILES) if (a / name).is_file()]
        return self.copy([*self.durable(run_folder), *pins])

    def copy(self, paths: Sequence[Path]) -> int:
        """Copy ``paths`` (within :attr:`out`) into the ledger where its copy differs; the number
        of files written."""
        from idml.app.checkpoint import atomic_write_text

        written = 0
        for path in paths:
            copy = self.root / path.relative_to(self.out)
            text = path.read_text()
            if not copy.is_file() or copy.read_text() != text:
                copy.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_text(copy, text)
                written += 1
        return written

    def restore(self) -> int:
        """Copy into :attr:`out` the ledger's files it lacks (never over a file it has: a run
        folder's own record is at least as new); the number of files restored."""
        restored = 0
        for copy in sorted(self.root.rglob("*.json")) if self.root.is_dir() else []:
            path = self.out / copy.relative_to(self.root)
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(copy.read_text())
                restored += 1
        return restored


def study_ledger(args: argparse.Namespace) -> Ledger | None:
    """The ledger of ``args.out``, or ``None`` for a ``--quick`` pipeline check or ``--no-ledger``."""
    root = getattr(args, "ledger", None)
    if root is None or args.quick:
        return None
    return Ledger(args.out, root / args.out.name)
