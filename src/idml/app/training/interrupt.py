"""Ctrl-C while a run saves: the epoch's log line and checkpoint are written whole first.

A run is resumable from its latest checkpoint whenever it stops (the checkpoint is written
atomically, and log lines past it are dropped on resume). :func:`interrupts_deferred` keeps a
Ctrl-C from splitting the two writes of an epoch, so the last finished epoch is never lost to an
interrupt that arrives while it is saved: the interrupt is held, then raised once both are written.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


@contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold SIGINT (Ctrl-C) until the block ends, then act on it as the previous handler would
    (by default: raise :class:`KeyboardInterrupt`). Signals are only delivered to the main thread,
    so elsewhere the block runs unchanged.

    Where SIGINT is ignored (a process started with ``&`` by a shell without job control
    inherits that), the held signal is ignored too.

    Example (with Python's own Ctrl-C handler, as a terminal gives it):
        >>> import os, signal
        >>> before = signal.signal(signal.SIGINT, signal.default_int_handler)
        >>> finished = []
        >>> try:
        ...     with interrupts_deferred():
        ...         os.kill(os.getpid(), signal.SIGINT)
        ...         finished.append("saved")
        ... except KeyboardInterrupt:
        ...     finished.append("stopped")
        >>> finished
        ['saved', 'stopped']
        >>> _ = signal.signal(signal.SIGINT, before)
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[FrameType | None] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        held.append(frame)

    previous = signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held and callable(previous):
        previous(signal.SIGINT, held[-1])
