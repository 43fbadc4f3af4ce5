"""The checks a training run makes as it goes: ISM's warm-up, saturation and identity, gradients
that never reach the model, and NaN or infinite losses and weights."""

from __future__ import annotations

import warnings

import torch

from idml.app.training.monitoring import SATURATED, identity_reasons, is_saturated
from idml.app.training.records import NonFiniteError
from idml.augment import AugmentedBatch
from idml.embeddings import Embeddings


class LearningChecks:
    """Is the :class:`~idml.app.training.Trainer` learning? ISM strength and weakening, gradient
    norms, and the non-finite checks that stop a run at the step that broke it."""

    def _set_ism_strength(self, progress_epochs: float) -> None:
        """ISM warm-up: scale the relative uncertainty by ``min(1, t / metric.warmup_epochs)``,
        ``t`` the epochs done after this step (a function of the step alone, so resume replays
        it)."""
        if self.ism_metric is None:
            return
        warmup = self.cfg.metric.warmup_epochs
        self.ism_metric.strength = 1.0 if warmup <= 0 else min(1.0, progress_epochs / warmup)

    def _ism_summary(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.ism_metric is not None:
            out.update(self.weakening.summary())
            out["strength"] = self.ism_metric.strength
        if self._grad_norms:
            norms = torch.stack(self._grad_norms).double()
            out["grad_norm"] = float(norms.mean())
            out["grad_norm_max"] = float(norms.max())
        return out

    def _check_learning(self, epoch: int, ism: dict[str, float]) -> None:
        """Warn once when ISM saturates most relations, when it acts as the identity after the
        first quarter of training, or when no gradient reaches the model."""
        if not self.dist.is_main:
            return
        if self.ism_metric is not None and "saturated" not in self._warned and is_saturated(ism):
            self._warned.add("saturated")
            shares = ", ".join(
                f"{k} {ism[f'{k}_saturated']:.0%}"
                for k in ("pos", "neg")
                if f"{k}_saturated" in ism
            )
            warnings.warn(
                f"epoch {epoch + 1}: ISM saturates most relations (weakening e^(-y) < {SATURATED:g} "
                f"for {shares} of the pairs): similarities are pinned and almost no gradient "
                "reaches the model. Use the bounded uncertainty head "
                "(model.uncertainty.form=bounded), lower model.uncertainty.max_norm or "
                "model.uncertainty.init_level, raise metric.tau, lower metric.gamma, or set "
                "metric.warmup_epochs",
                RuntimeWarning,
                stacklevel=2,
            )
        # The head starts every image at one level (w = 0), so the first quarter of training is
        # allowed to be uniform; a run still there afterwards trains as the plain metric would.
        settled = epoch >= 1 and epoch + 1 > self.cfg.optim.epochs / 4
        reasons = identity_reasons(ism) if self.ism_metric is not None and settled else []
        if reasons and "identity" not in self._warned:
            self._warned.add("identity")
            warnings.warn(
                f"epoch {epoch + 1}: ISM acts as the identity: {'; '.join(reasons)}. The "
                "introspective metric then trains like the plain metric (or a uniform rescaling "
                "of it), so this run measures Mixup, not introspection. Check that the uncertainty "
                "head trains (optim.uncertainty_lr_mult is not 0; model.uncertainty.level_input="
                "standardized), or raise model.uncertainty.max_norm; the ism/pos_q10 and "
                "ism/u_cv keys of metrics.jsonl show the trend",
                RuntimeWarning,
                stacklevel=2,
            )
        if ism.get("grad_norm_max", 1.0) == 0.0 and "no_gradient" not in self._warned:
            self._warned.add("no_gradient")
            hint = (
                " With ISM, a strict variant (metric.variant=strict) or ISM-Dis under a large "
                "||u|| makes every pair constant: see the ism/* keys of metrics.jsonl."
                if self.ism_metric is not None
                else ""
            )
            warnings.warn(
                f"epoch {epoch + 1}: the model received exactly zero gradient at every step, so "
                f"training changes nothing but weight decay.{hint}",
                RuntimeWarning,
                stacklevel=2,
            )

    def _check_finite_weights(self) -> None:
        """Stop at the step that made a weight NaN or infinite (e.g. a learning rate far too
        high): a checkpoint of such weights would be useless, and training on is wasted time."""
        named = [
            (f"{prefix}.{name}", p)
            for prefix, module in {"model": self.model, **self._training_modules()}.items()
            for name, p in module.named_parameters()
        ]
        finite = torch.stack([torch.isfinite(p).all() for _, p in named])
        if not bool(finite.all()):  # one device sync per step, not one per tensor
            bad = [name for (name, _), ok in zip(named, finite.tolist()) if not ok]
            raise self._non_finite(f"non-finite weights in {', '.join(bad[:3])}")

    def _non_finite(self, what: str, after_epoch: bool = False) -> NonFiniteError:
        epoch, step = getattr(self, "_position", (self.start_epoch, 0))
        where = (
            f"after epoch {epoch + 1}" if after_epoch else f"at epoch {epoch + 1}, step {step + 1}"
        )
        latest = self.run_dir / "checkpoints" / "latest"
        kept = (
            f"the last good checkpoint ({latest.read_text().strip()}) stays latest"
            if latest.is_file()
            else "no checkpoint was written"
        )
        return NonFiniteError(
            f"{what} {where}; training stopped and {kept}. Lower "
            f"optim.lr (now {self.cfg.optim.lr:g}), set optim.grad_clip, or check the data, then "
            f"start again in a new --out (or with --overwrite)"
        )

    def _monitor_weakening(self, emb: Embeddings, batch: AugmentedBatch) -> None:
        """Record the ISM weakening factors of this step's relations (no gradient)."""
        if self.ism_metric is not None:
            self.weakening.record(self.loss, emb, batch.labels)
