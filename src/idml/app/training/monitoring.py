"""Is the run learning? :class:`LearningMonitor` follows a training run step by step: ISM's
warm-up, saturation and identity, the model's gradient norm, the collapse of the embeddings to one
point, and the NaN or infinite losses and weights that stop a run at the step that broke it
(:class:`NonFiniteError`).

Is ISM working? The saturation and identity monitor of the introspective metric.

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

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from idml.app.config import Config
from idml.app.training.level_probe import LevelDriftWarning, level_drift
from idml.embeddings import Embeddings
from idml.metrics import IntrospectiveMetric
from idml.relations import LabelSets

SATURATED = 1e-2
"""A pair whose weakening factor ``e^{−y}`` is below this is counted as saturated."""

IDENTITY_Q10 = 0.98
"""ISM counts as the identity when the 10th percentile of the positive relations' ``e^{−y}`` is
above this."""

IDENTITY_U_CV = 0.05
"""... or when ``||u||`` varies across a batch by less than this coefficient of variation."""

COLLAPSED_RESULTANT = 0.999
"""The semantic embeddings count as collapsed when the mean resultant length of a training batch's
unit embeddings, ``||mean_i ŝ_i||`` (1: every embedding the same point), averages above this over
an epoch: every embedding then lies within about 2.5° of the batch's mean direction. Measured on
Omniglot with pretrained Lite0 (ProxyAnchor, 90-image batches): 0.97 at initialisation (its
all-positive pooled features make every image's embedding alike), 0.76 after a healthy run, 0.987
for a run that ended at 21.7 R@1, and 1.0 for the Mixup runs whose backbone died (R@1 0)."""

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
        self._pending: list[tuple[Tensor, Tensor, Tensor]] = []
        self._u_cv: list[Tensor] = []

    def reset(self) -> None:
        self._values = {"pos": [], "neg": []}
        self._pending = []
        self._u_cv = []

    def update(self, factors: Tensor, positive: Tensor, negative: Tensor) -> None:
        """Add one step's factors ``(B, B')`` with its positive and negative boolean masks.

        They are kept on their device until :meth:`settle` (selecting by a mask reads its count
        to the host, which a step on an accelerator must not wait for)."""
        self._pending.append((factors.detach(), positive, negative))

    def settle(self) -> None:
        """Select and subsample the pending steps' factors on the host (the trainer calls this
        at the steps it reads; :meth:`summary` calls it too)."""
        for factors, positive, negative in self._pending:
            host = factors.float().cpu()
            for kind, mask in (("pos", positive.cpu()), ("neg", negative.cpu())):
                values = host[mask]
                if values.numel() > self.samples_per_update:
                    stride = values.numel() / self.samples_per_update
                    index = (torch.arange(self.samples_per_update) * stride).long()
                    values = values[index]
                if values.numel():
                    self._values[kind].append(values)
        self._pending = []

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
        self.settle()
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


RAISED_INIT_LEVEL = 0.25
"""The start the identity warning suggests for ``u`` (``model.uncertainty.init_level``): on Omniglot
it met every mechanism target where the default 0.02 stayed the identity; on the digits it trades
some for others (benchmarks/RESULTS.md, the IDML sections)."""


def identity_advice(cfg: Config) -> str:
    """What to change, for this run's config, when ISM acts as the identity: a control run (a
    frozen head, or no head and a uniform weakening by γ) is the identity on purpose and is told
    so; a training head is told which of its keys keep ``u`` from moving.

    >>> from idml.app.config import Config
    >>> cfg = Config.model_validate({"model": {"uncertainty": {"enabled": True}}})
    >>> print(identity_advice(cfg))
    Start u higher (model.uncertainty.init_level is 0.02; e.g. 0.25: training lowers u slowly from where it starts, so a low start stays low)
    >>> cfg.optim.uncertainty_lr_mult = 0.0
    >>> print(identity_advice(cfg))
    The uncertainty head is frozen (optim.uncertainty_lr_mult=0), so every image keeps its starting ||u||: expected of a frozen-u control; set it above 0 to train u
    """
    head = cfg.model.uncertainty
    if not head.enabled:
        return (
            "There is no uncertainty head (model.uncertainty.enabled=false), so ISM weakens every "
            "pair by metric.gamma alone: expected of a uniform-weakening control; set "
            "model.uncertainty.enabled=true for introspection"
        )
    head_lr, key = cfg.optim.uncertainty_head_lr
    if head_lr == 0:
        return (
            f"The uncertainty head is frozen ({key}=0), so every image keeps its starting ||u||: "
            "expected of a frozen-u control; set it above 0 to train u"
        )
    if head.form != "bounded":
        return (
            "The linear head (model.uncertainty.form=linear) starts wherever its weights put "
            "||u||; the bounded head (form=bounded, the default) lets u vary from its start"
        )
    advice = []
    if head.level_input == "direction":
        advice.append(
            "read the level from standardised features (model.uncertainty.level_input="
            "standardized; the unit direction moves every image's ||u|| as one number)"
        )
    if head.init_level < RAISED_INIT_LEVEL:
        advice.append(
            f"start u higher (model.uncertainty.init_level is {head.init_level:g}; e.g. "
            f"{RAISED_INIT_LEVEL:g}: "
            "training lowers u slowly from where it starts, so a low start stays low)"
        )
    else:
        advice.append(
            "give the head a larger learning rate (optim.uncertainty_lr_mult) or more epochs: "
            f"u started at {head.init_level:g} of its bound and still moves too little"
        )
    text = "; or ".join(advice)
    return text[0].upper() + text[1:]


class NonFiniteError(FloatingPointError):
    """Training produced a NaN or infinite loss or weight; the message names the epoch and step."""


class LearningMonitor:
    """Follows a run step by step (:class:`~idml.app.training.Trainer` calls it each step and epoch).

    Args:
        ism: the introspective metric the loss compares through (``None``: no ISM to follow).
        warmup_epochs: ISM warm-up (``metric.warmup_epochs``).
        run_dir: the run folder (errors name its latest checkpoint).
        lr: the configured learning rate (errors suggest lowering it).
        epochs: the run's epochs (ISM may act as the identity in the first quarter of them).
        warns: whether this process issues the warnings (rank 0).
        identity_advice: what the identity warning tells the user to change
            (:func:`identity_advice` of the run's config; ``None``: the warning gives no advice).
        mixup: whether the run trains with Mixup (the identity warning then says that the run
            measures Mixup; without it, the plain metric).
        drift_advice: what the level-drift warning says of its cause and cure
            (:func:`~idml.app.training.level_probe.drift_advice` of the run's config and model).
    """

    def __init__(
        self,
        ism: IntrospectiveMetric | None,
        warmup_epochs: float,
        run_dir: Path,
        lr: float,
        epochs: int = 1,
        warns: bool = True,
        identity_advice: str | None = None,
        mixup: bool = False,
        drift_advice: str | None = None,
    ) -> None:
        self.ism = ism
        self.mixup = mixup
        self.identity_advice = identity_advice
        self.drift_advice = drift_advice
        self.epochs = epochs
        self.warmup_epochs = warmup_epochs
        self.run_dir = Path(run_dir)
        self.lr = lr
        self.warns = warns
        self.weakening = WeakeningMonitor()
        self.position = (0, 0)
        """``(epoch, step)`` of the step being taken, named by a non-finite error."""
        self._grad_norms: list[Tensor] = []
        """The model's gradient norm at each step of the current epoch (tensors: no host sync)."""
        self._resultants: list[Tensor] = []
        """Each step's mean resultant length of the batch's semantic embeddings (tensors)."""
        self._warned: set[str] = set()

    def start_epoch(self, epoch: int) -> None:
        self.weakening.reset()
        self._grad_norms.clear()
        self._resultants.clear()
        self.position = (epoch, 0)

    def step(self, epoch: int, step: int, steps_per_epoch: int) -> None:
        """Enter step ``step`` of ``epoch``: its position, and ISM's warm-up strength
        ``min(1, t / metric.warmup_epochs)``, ``t`` the epochs done after this step (a function
        of the step alone, so resume replays it)."""
        self.position = (epoch, step)
        if self.ism is not None:
            done = epoch + (step + 1) / max(steps_per_epoch, 1)
            warmup = self.warmup_epochs
            self.ism.strength = 1.0 if warmup <= 0 else min(1.0, done / warmup)

    def record_weakening(self, loss: Any, embeddings: Embeddings, labels: LabelSets) -> None:
        """ISM's weakening factors of the relations ``loss`` compares this step (no gradient)."""
        if self.ism is not None:
            self.weakening.record(loss, embeddings, labels)

    def record_grad_norm(self, norm: Tensor) -> None:
        self._grad_norms.append(norm)

    def record_embeddings(self, semantic: Tensor) -> None:
        """The batch's unit semantic embeddings: their mean resultant length ``||mean_i ŝ_i||``,
        the collapse signal (:data:`COLLAPSED_RESULTANT`), kept as a tensor (no host sync)."""
        if semantic.shape[0] > 1:
            unit = torch.nn.functional.normalize(semantic.detach().float(), dim=1)
            self._resultants.append(unit.mean(dim=0).norm())

    def summary(self) -> dict[str, float]:
        """The epoch's ``ism/*`` log entries: weakening quantiles and strength (with ISM), the
        mean and largest gradient norm of the model, and the mean resultant length of the
        training batches' semantic embeddings (``embedding_resultant``)."""
        out: dict[str, float] = {}
        if self.ism is not None:
            out.update(self.weakening.summary())
            out["strength"] = self.ism.strength
        if self._grad_norms:
            norms = torch.stack(self._grad_norms).double()
            out["grad_norm"] = float(norms.mean())
            out["grad_norm_max"] = float(norms.max())
        if self._resultants:
            out["embedding_resultant"] = float(torch.stack(self._resultants).double().mean())
        return out

    def check(self, epoch: int, summary: dict[str, float]) -> None:
        """Warn once when ISM saturates most relations, when it acts as the identity after the
        first quarter of training, when no gradient reaches the model, or when the semantic
        embeddings have collapsed to one point."""
        if not self.warns:
            return
        # The head starts every image at one level (w = 0), so the first quarter of training is
        # allowed to be uniform; a run still there afterwards trains as the plain metric would.
        settled = epoch >= 1 and epoch + 1 > self.epochs / 4
        reasons = identity_reasons(summary) if self.ism is not None and settled else []
        if reasons and "identity" not in self._warned:
            self._warned.add("identity")
            advice = f" {self.identity_advice}." if self.identity_advice else ""
            measures = "Mixup" if self.mixup else "the plain metric"
            warnings.warn(
                f"epoch {epoch + 1}: ISM acts as the identity: {'; '.join(reasons)}. The "
                "introspective metric then trains like the plain metric (or a uniform rescaling "
                f"of it), so this run measures {measures}, not introspection.{advice} "
                "The ism/pos_q10 and ism/u_cv keys of metrics.jsonl show the trend",
                RuntimeWarning,
                stacklevel=3,
            )
        if self.ism is not None and "saturated" not in self._warned and is_saturated(summary):
            self._warned.add("saturated")
            shares = ", ".join(
                f"{k} {summary[f'{k}_saturated']:.0%}"
                for k in ("pos", "neg")
                if f"{k}_saturated" in summary
            )
            warnings.warn(
                f"epoch {epoch + 1}: ISM saturates most relations (weakening e^(-y) < {SATURATED:g} "
                f"for {shares} of the pairs): similarities are pinned and almost no gradient "
                "reaches the model. Use the bounded uncertainty head "
                "(model.uncertainty.form=bounded), lower model.uncertainty.max_norm or "
                "model.uncertainty.init_level, raise metric.tau, lower metric.gamma, or set "
                "metric.warmup_epochs",
                RuntimeWarning,
                stacklevel=3,
            )
        if summary.get("grad_norm_max", 1.0) == 0.0 and "no_gradient" not in self._warned:
            self._warned.add("no_gradient")
            hint = (
                " With ISM, a strict variant (metric.variant=strict) or ISM-Dis under a large "
                "||u|| makes every pair constant: see the ism/* keys of metrics.jsonl."
                if self.ism is not None
                else ""
            )
            warnings.warn(
                f"epoch {epoch + 1}: the model received exactly zero gradient at every step, so "
                f"training changes nothing but weight decay.{hint}",
                RuntimeWarning,
                stacklevel=3,
            )
        resultant = summary.get("embedding_resultant", 0.0)
        if resultant > COLLAPSED_RESULTANT and "collapsed" not in self._warned:
            self._warned.add("collapsed")
            warnings.warn(
                f"epoch {epoch + 1}: the embeddings have collapsed to one point (the training "
                f"batches' unit embeddings have a mean resultant length of {resultant:.4f}; 1 "
                "means identical, a trained model is far below): such a model ranks the gallery "
                "at chance. Seen with a proxy loss under Mixup's set labels on a pretrained "
                "backbone, and with a backbone learning rate too high (optim.lr, "
                "optim.head_lr_mult, optim.warmup_epochs); the ism/embedding_resultant key of "
                "metrics.jsonl shows when it set in",
                RuntimeWarning,
                stacklevel=3,
            )

    def check_eval_level(self, epoch: int, trained: float | None, at_eval: float) -> None:
        """Warn when, after the last epoch, the uncertainty level of training images in eval mode
        (``at_eval``, an :class:`~idml.app.training.level_probe.EvalLevelProbe`) differs from the
        level the epoch trained with (``trained``, its untouched images in training mode) by more
        than :data:`~idml.app.training.level_probe.DRIFT_FACTOR`, with the run's ``drift_advice``. Only the model the run
        delivers is judged: mid-training the two can part and meet again as the learning rate
        falls (``uncertainty/eval_train`` in ``metrics.jsonl`` keeps the trend)."""
        if not self.warns or trained is None or epoch + 1 != self.epochs:
            return
        factor = level_drift(trained, at_eval)
        if factor is None:
            return
        direction = "above" if at_eval > trained else "below"
        advice = f"{self.drift_advice}. " if self.drift_advice else ""
        warnings.warn(
            f"epoch {epoch + 1}: the uncertainty level at test is not the one the model trained "
            f"with: the training images' mean level is {at_eval:.4g} in eval mode, {factor:.3g} "
            f"times {direction} the {trained:.4g} training logged for them. ISM at test, the "
            "uncertainty `idml embed` writes and the report's uncertainty probes read the "
            f"eval-mode level, which training never used. {advice}The uncertainty/original and "
            "uncertainty/eval_train keys of metrics.jsonl show the trend",
            LevelDriftWarning,
            stacklevel=3,
        )

    def check_finite_weights(
        self, modules: Mapping[str, nn.Module], first_step: int | None = None
    ) -> None:
        """Stop at the step that made a weight NaN or infinite (e.g. a learning rate far too
        high): a checkpoint of such weights would be useless, and training on is wasted time.
        ``first_step``: the first step since the host last read (the fault lies in
        ``first_step..`` the current step)."""
        named = [
            (f"{prefix}.{name}", p)
            for prefix, module in modules.items()
            for name, p in module.named_parameters()
        ]
        finite = torch.stack([torch.isfinite(p).all() for _, p in named])
        if not bool(finite.all()):  # one host read, not one per tensor
            bad = [name for (name, _), ok in zip(named, finite.tolist(), strict=True) if not ok]
            raise self.non_finite(
                f"non-finite weights in {', '.join(bad[:3])}", first_step=first_step
            )

    def settle(self) -> None:
        """Bring what the steps since the last read recorded on the device to the host."""
        self.weakening.settle()

    def non_finite(
        self, what: str, after_epoch: bool = False, first_step: int | None = None
    ) -> NonFiniteError:
        """The error that stops the run at the current step (or after its epoch's training);
        ``first_step``: the first step since the host last read, when it read only now, so the
        fault lies in ``first_step..`` the current step."""
        epoch, step = self.position
        if after_epoch:
            where = f"after epoch {epoch + 1}"
        elif first_step is not None and first_step < step:
            where = f"at epoch {epoch + 1}, in steps {first_step + 1}-{step + 1}"
        else:
            where = f"at epoch {epoch + 1}, step {step + 1}"
        latest = self.run_dir / "checkpoints" / "latest"
        kept = (
            f"the last good checkpoint ({latest.read_text().strip()}) stays latest"
            if latest.is_file()
            else "no checkpoint was written"
        )
        return NonFiniteError(
            f"{what} {where}; training stopped and {kept}. Lower optim.lr (now {self.lr:g}), set "
            "optim.grad_clip, or check the data, then start again in a new --out (or with "
            "--overwrite)"
        )
