"""Is ISM working? The saturation and identity monitor of the introspective metric.

ISM weakens each pair by ``e^{−y}``, ``y = (β + γ)/(τ·δ)`` (IDML, Wang et al. 2022, eq. 5–7). A
factor near 1 trains like the plain metric; a factor near 0 means the pair is *saturated*: its
similarity is pinned at 1 (or its distance at 0) and every gradient through it, to the semantic and
to the uncertainty embedding alike, carries the vanishing ``e^{−y}``. When most pairs saturate, the
loss is a constant and the model learns nothing, whatever the final metric then says.

:class:`WeakeningMonitor` collects the factors a loss sees over an epoch, separately for positive
and negative relations (pairs of the batch, or sample–proxy pairs for proxy losses), and
summarises them as quantiles and the share of pairs below :data:`SATURATED` (``10⁻²``).

The other failure is the opposite one: ISM that weakens nothing, or weakens every pair alike. Then
the introspective metric is the plain metric (or a uniform rescaling of it) and an "IDML" run
measures Mixup alone. :func:`identity_reasons` says so when the 10th percentile of the positive
relations' factor is above :data:`IDENTITY_Q10` (0.98: nine pairs in ten lose under 2 % of their
pull) or when ``||u||`` varies by less than :data:`IDENTITY_U_CV` (5 %, the coefficient of variation
over a batch, averaged over the epoch's steps; ``u_cv`` in the summary).

Example:
    >>> import torch
    >>> monitor = WeakeningMonitor()
    >>> factors = torch.tensor([[1.0, 0.5], [0.001, 0.9]])
    >>> positive = torch.tensor([[False, True], [True, False]])
    >>> monitor.update(factors, positive, ~positive)
    >>> summary = monitor.summary()
    >>> summary["pos_saturated"], summary["neg_saturated"]
    (0.5, 0.0)
    >>> monitor.is_saturated()
    False
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from idml.embeddings import Embeddings
from idml.relations import LabelSets

SATURATED = 1e-2
"""A pair whose weakening factor ``e^{−y}`` is below this is counted as saturated."""

IDENTITY_Q10 = 0.98
"""ISM counts as the identity when the 10th percentile of the positive relations' ``e^{−y}`` is
above this."""

IDENTITY_U_CV = 0.05
"""... or when ``||u||`` varies across a batch by less than this coefficient of variation."""

QUANTILES: tuple[float, ...] = (0.1, 0.5, 0.9)
"""The quantiles of the factor that are logged, for positive and for negative relations."""

SAMPLES_PER_UPDATE = 4096
"""Factors kept per relation kind and step: a strided (deterministic) subsample of larger batches,
so an epoch's summary costs a bounded amount of memory and draws no random numbers."""


class WeakeningMonitor:
    """Accumulates ISM weakening factors over steps and summarises them.

    ``summary()`` keys: ``pos_q10``, ``pos_q50``, ``pos_q90``, ``pos_saturated`` (share below
    :data:`SATURATED`) and the same for ``neg``; relations that never occurred are left out; and
    ``u_cv``, the mean over steps of ``std/mean`` of ``||u||`` across the batch, when the
    embeddings carried an uncertainty.
    """

    def __init__(self, samples_per_update: int = SAMPLES_PER_UPDATE) -> None:
        self.samples_per_update = samples_per_update
        self._values: dict[str, list[Tensor]] = {"pos": [], "neg": []}
        self._u_cv: list[Tensor] = []

    def reset(self) -> None:
        self._values = {"pos": [], "neg": []}
        self._u_cv = []

    def update(self, factors: Tensor, positive: Tensor, negative: Tensor) -> None:
        """Add one step's factors ``(B, B')`` with its positive and negative boolean masks."""
        for kind, mask in (("pos", positive), ("neg", negative)):
            values = factors.detach()[mask].float().cpu()
            if values.numel() > self.samples_per_update:
                stride = values.numel() / self.samples_per_update
                index = (torch.arange(self.samples_per_update) * stride).long()
                values = values[index]
            if values.numel():
                self._values[kind].append(values)

    def record(self, loss: Any, embeddings: Embeddings, labels: LabelSets) -> None:
        """Add the factors of the relations ``loss`` compares in this step (no gradient: the
        trainer's per-step pass); nothing for a loss that does not compare through ISM
        (``loss.weakening`` absent or ``None``)."""
        weakening = getattr(loss, "weakening", None)
        found = None if weakening is None else weakening(embeddings.detach(), labels)
        if found is not None:
            self.update(*found)
        if embeddings.uncertainty is not None and embeddings.uncertainty.shape[0] > 1:
            level = embeddings.uncertainty.detach().float().norm(dim=1)
            # A tensor, not a float: no host synchronisation inside the step.
            self._u_cv.append(level.std() / level.mean().clamp_min(1e-12))

    def summary(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for kind, parts in self._values.items():
            if not parts:
                continue
            values = torch.cat(parts).double()
            qs = torch.quantile(values, torch.tensor(QUANTILES, dtype=torch.float64))
            for q, v in zip(QUANTILES, qs.tolist(), strict=True):
                out[f"{kind}_q{round(q * 100):02d}"] = v
            out[f"{kind}_saturated"] = float((values < SATURATED).double().mean())
        if self._u_cv:
            out["u_cv"] = float(torch.stack(self._u_cv).double().mean())
        return out

    def is_saturated(self, share: float = 0.5) -> bool:
        """Whether more than ``share`` of the positive *and* of the negative relations saturated."""
        return is_saturated(self.summary(), share)


def is_saturated(summary: dict[str, float], share: float = 0.5) -> bool:
    """:meth:`WeakeningMonitor.is_saturated` on a summary already computed (no second pass)."""
    kinds = [k for k in ("pos", "neg") if f"{k}_saturated" in summary]
    return bool(kinds) and all(summary[f"{k}_saturated"] > share for k in kinds)


def identity_reasons(summary: dict[str, float]) -> list[str]:
    """Why ISM acts as the identity (or a uniform rescaling) in an epoch summarised by
    :meth:`WeakeningMonitor.summary`; empty when it weakens pairs unevenly.

    >>> for reason in identity_reasons({"pos_q10": 0.993, "pos_q50": 0.996, "u_cv": 0.012}):
    ...     print(reason)
    the 10th percentile of the positive pairs' weakening e^(-y) is 0.993 (> 0.98)
    ||u|| varies by 1.2 % across a batch (< 5 %)
    >>> identity_reasons({"pos_q10": 0.6, "pos_q50": 0.95, "u_cv": 0.4})
    []
    """
    reasons = []
    if summary.get("pos_q10", 0.0) > IDENTITY_Q10:
        reasons.append(
            "the 10th percentile of the positive pairs' weakening e^(-y) is "
            f"{summary['pos_q10']:.3f} (> {IDENTITY_Q10:g})"
        )
    if "u_cv" in summary and summary["u_cv"] < IDENTITY_U_CV:
        reasons.append(
            f"||u|| varies by {100 * summary['u_cv']:.1f} % across a batch "
            f"(< {100 * IDENTITY_U_CV:g} %)"
        )
    return reasons
