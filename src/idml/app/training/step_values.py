"""The values a training step logs, summed on the device and read once per interval.

A read of a device tensor (``float(loss)``) waits for every kernel queued before it, so a read per
step leaves an accelerator idle while the host prepares the next step. :class:`StepValues` adds
each step's values to running sums that stay on the device, and :meth:`StepValues.read` copies
them to the host in one transfer (one all-reduce over processes first), at the steps the run's
:class:`~idml.app.training.compute.ComputePlan` reads at. The sums are float64 and add the steps in
order, so the means are those of reading every step and summing on the host.

Example:
    >>> import torch
    >>> values = StepValues()
    >>> values.add("total", torch.tensor(0.5))
    >>> values.add_masked_mean("u_mixed", torch.tensor([1.0, 3.0]), torch.tensor([True, True]))
    >>> values.add("total", torch.tensor(1.5))
    >>> values.add_masked_mean("u_mixed", torch.tensor([1.0, 3.0]), torch.tensor([False, False]))
    >>> values.read()
    {'total': 1.0, 'u_mixed': 2.0}
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from idml.app.distributed import DistributedContext


class StepValues:
    """Running sums of per-step values over an epoch, on the values' device."""

    def __init__(self) -> None:
        self._sums: dict[str, Tensor] = {}
        self._counts: dict[str, Tensor] = {}

    def add(self, name: str, value: Tensor) -> None:
        """One step's ``value`` (a 0-d tensor) of ``name``; a NaN or inf is kept, to be found by
        :meth:`non_finite`."""
        value = value.detach().double()
        if name in self._sums:
            self._sums[name] = self._sums[name] + value
            self._counts[name] = self._counts[name] + 1
        else:
            self._sums[name] = value
            self._counts[name] = torch.ones((), dtype=torch.float64, device=value.device)

    def add_masked_mean(self, name: str, values: Tensor, mask: Tensor) -> None:
        """One step's mean of ``values[mask]``, computed without indexing by the mask (which
        would read the mask's count to the host); a step whose mask selects nothing does not
        count towards ``name``'s mean."""
        mask = mask.to(device=values.device, dtype=torch.float64)
        count = mask.sum()
        chosen = count > 0
        mean = (values.detach().double() * mask).sum() / count.clamp_min(1.0)
        if name in self._sums:
            self._sums[name] = self._sums[name] + mean
            self._counts[name] = self._counts[name] + chosen
        else:
            self._sums[name] = mean
            self._counts[name] = chosen.to(torch.float64)

    def read(self, dist: DistributedContext | None = None) -> dict[str, float]:
        """The mean of each value over the steps added so far (the mean over processes too, with
        ``dist``), in one host transfer; names no step defined are left out."""
        if not self._sums:
            return {}
        names = list(self._sums)
        sums = torch.stack([self._sums[k] for k in names])
        if dist is not None and dist.is_distributed:
            sums = dist.average(sums)
        counts = torch.stack([self._counts[k] for k in names])
        host = torch.stack([sums, counts]).cpu().tolist()
        return {k: s / c for k, s, c in zip(names, host[0], host[1], strict=True) if c > 0}


def non_finite(values: dict[str, float], ignore_prefix: str = "u_") -> list[str]:
    """The names among ``values`` (read by :meth:`StepValues.read`) whose mean is NaN or infinite;
    names starting with ``ignore_prefix`` (the uncertainty levels, NaN only when undefined) aside."""
    return [
        k for k, v in values.items() if not k.startswith(ignore_prefix) and not math.isfinite(v)
    ]
