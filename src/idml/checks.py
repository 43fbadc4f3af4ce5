"""Whether the library checks tensor *values* (finite embeddings and losses, label and image
ranges): :func:`value_checks`.

Shape and dtype checks are free; a check of values reads a result to the host (``bool(x.all())``),
which on an accelerator waits for every queued kernel. A training loop that reads its values only
every few steps (:class:`idml.app.training.compute.ComputePlan`) turns the value checks off in the
steps between, and keeps them at the steps it reads, where a NaN is still caught through the loss.
They are on by default, for every caller.

Example:
    >>> import torch
    >>> from idml.embeddings import Embeddings
    >>> with value_checks(False):
    ...     Embeddings(torch.tensor([[float("nan"), 0.0]])).semantic.shape
    torch.Size([1, 2])
    >>> value_checks_enabled()
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

_ENABLED: ContextVar[bool] = ContextVar("idml_value_checks", default=True)


def value_checks_enabled() -> bool:
    """Whether checks that read tensor values to the host run here."""
    return _ENABLED.get()


@contextlib.contextmanager
def value_checks(enabled: bool) -> Iterator[None]:
    """Within: the value checks run (``True``, the default everywhere) or are skipped."""
    token = _ENABLED.set(enabled)
    try:
        yield
    finally:
        _ENABLED.reset(token)
