"""Progress of long loops that reads well on a terminal and in a log file.

On a terminal, a tqdm bar (redrawn in place). Anywhere else — output piped to a file, ``nohup``,
CI, a cluster scheduler — a redrawn bar becomes thousands of carriage-return frames, so
:class:`Progress` writes plain lines instead: at most one every ``interval`` seconds and one when
the loop ends, each with the same facts (``step 120/500 (24%), loss 0.4321, 12.5 step/s, ETA
0:00:30``) and no carriage return. Training, evaluation, embedding, reports and ablations all use
it, so every long command behaves the same; ``--no-progress`` switches it off.

A bar is transient (it disappears when its loop ends); what a user keeps — a start-up summary, one
line per epoch with its test metrics — is written with :func:`echo`: a plain line on stdout, printed
above any live bar on a terminal, so the history stays on screen and reads the same in a log file.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import IO, Any

DEFAULT_INTERVAL = 10.0
"""Seconds between plain progress lines off a terminal."""

_LIVE_BARS = 0
"""tqdm bars open now: :func:`echo` writes above them instead of through them."""


def echo(line: str, stream: IO[str] | None = None) -> None:
    """Write ``line`` to ``stream`` (default ``sys.stdout``) as a line to keep: above any live bar
    on a terminal (the bar is redrawn below it), a plain line anywhere else, flushed at once so a
    log file is current while the run goes on.

    Example:
        >>> import io
        >>> out = io.StringIO()
        >>> echo("epoch 1/2: loss 0.5000", out)
        >>> out.getvalue()
        'epoch 1/2: loss 0.5000\\n'
    """
    stream = stream if stream is not None else sys.stdout
    if _LIVE_BARS:
        from tqdm.auto import tqdm

        tqdm.write(line, file=stream)
    else:
        stream.write(line + "\n")
    stream.flush()


def _clock_text(seconds: float) -> str:
    seconds = max(0, round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}"


class Progress:
    """A bar on a terminal, plain lines elsewhere, nothing when ``enabled`` is false.

    Args:
        total: expected number of units (``None`` when unknown: no percentage or ETA).
        desc: what is progressing, e.g. ``"epoch 3/60"``.
        enabled: ``False`` writes nothing.
        unit: the name of one unit (``"step"``, ``"batch"``, ``"tile"``).
        stream: where to write (default ``sys.stderr``, so ``--json`` output stays clean).
        interval: seconds between plain lines off a terminal.
        clock: a monotonic clock in seconds (tests pass their own).

    Example:
        >>> import io
        >>> out = io.StringIO()
        >>> p = Progress(4, "epoch 1/1", stream=out, interval=1e9, clock=iter([0, 0, 0, 0, 0, 2]).__next__)
        >>> for _ in range(4):
        ...     p.update(loss=0.5)
        >>> p.close()
        >>> out.getvalue()
        'epoch 1/1: step 4/4 (100%), loss 0.5000, 2.0 step/s, 0:00:02 elapsed\\n'
    """

    def __init__(
        self,
        total: int | None,
        desc: str,
        *,
        enabled: bool = True,
        unit: str = "step",
        stream: IO[str] | None = None,
        interval: float = DEFAULT_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = total
        self.desc = desc
        self.unit = unit
        self.enabled = enabled
        self.count = 0
        self.facts: dict[str, Any] = {}
        self._stream = stream if stream is not None else sys.stderr
        self._interval = interval
        self._clock = clock
        self._bar: Any = None
        self._closed = False
        if not enabled:
            return
        self._start = clock()
        self._last_line = self._start
        if _is_terminal(self._stream):
            from tqdm.auto import tqdm

            global _LIVE_BARS
            self._bar = tqdm(total=total, desc=desc, unit=unit, leave=False, file=self._stream)
            _LIVE_BARS += 1

    def update(self, n: int = 1, **facts: Any) -> None:
        """Advance by ``n`` units; ``facts`` (``loss=0.43``) are shown with the next line or frame."""
        if not self.enabled:
            return
        self.count += n
        self.facts.update(facts)
        if self._bar is not None:
            self._bar.update(n)
            if facts:
                self._bar.set_postfix({k: _fact(v) for k, v in facts.items()}, refresh=False)
            return
        now = self._clock()
        if now - self._last_line >= self._interval:
            self._last_line = now
            self._write(now, final=False)

    def close(self) -> None:
        """End the bar, or write the closing line (always, so every loop leaves one line)."""
        if not self.enabled or self._closed:
            return
        self._closed = True
        if self._bar is not None:
            global _LIVE_BARS
            self._bar.close()
            _LIVE_BARS -= 1
            return
        self._write(self._clock(), final=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write(self, now: float, final: bool) -> None:
        elapsed = now - self._start
        parts = [f"{self.unit} {self.count}" + (f"/{self.total}" if self.total else "")]
        if self.total:
            parts[0] += f" ({100 * self.count / self.total:.0f}%)"
        parts += [f"{k} {_fact(v)}" for k, v in self.facts.items()]
        rate = self.count / elapsed if elapsed > 0 else None
        if rate is not None:
            parts.append(f"{rate:.1f} {self.unit}/s")
        if final:
            parts.append(f"{_clock_text(elapsed)} elapsed")
        elif rate and self.total:
            parts.append(f"ETA {_clock_text((self.total - self.count) / rate)}")
        self._stream.write(f"{self.desc}: {', '.join(parts)}\n")
        self._stream.flush()


def _fact(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or file-like without isatty
        return False
