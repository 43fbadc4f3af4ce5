"""The trainer: composes data, model, augmentations, metric, loss, SSR and evaluation into a run.

A run folder holds ``config.yaml`` (every resolved default), ``metrics.jsonl`` (one line per epoch:
losses, metrics, learning rates, mean ``||u||`` of original and of mixed images), ``checkpoints/``
(atomic, one per epoch, plus ``latest``/``best`` pointers) and TensorBoard events when installed.

Determinism: every epoch reseeds its own generators from ``(seed, epoch)``, so a run resumed from the
checkpoint of epoch ``e`` replays epochs ``e+1..`` exactly as an uninterrupted run would (on CPU).

Several processes (``torchrun``, see :mod:`idml.distributed`): each loads its share of every global
batch, the model, loss and SSR head train under one DistributedDataParallel, the loss sees the
gathered global batch, evaluation is sharded, and only rank 0 writes files. The global batches do not
depend on the number of processes, so a run may resume with another one.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from idml import build
from idml.augment import AugmentedBatch
from idml.checkpoint import (
    load_model_weights,
    load_training_state,
    mark_best,
    read_state,
    resolve_checkpoint,
    save_checkpoint,
)
from idml.config import (
    RUNTIME_KEYS,
    Config,
    config_difference,
    config_to_dict,
    dump_config,
    stored_config_dict,
)
from idml.distributed import (
    DistributedContext,
    ShardPlan,
    contiguous_shard,
    gather_embeddings,
    rank_generator,
    rank_seed,
    resolve_device,
    wrap_ddp,
)
from idml.embeddings import Embeddings, NonFiniteEmbeddingsError
from idml.loggers import MLflowLogger, RunLogger, TensorBoardLogger, tensorboard_available
from idml.metrics import IntrospectiveMetric
from idml.monitoring import SATURATED, WeakeningMonitor, is_saturated
from idml.preflight import check_model_input, check_run_config
from idml.progress import Progress
from idml.ranking import RankingOutput, draw_images
from idml.run_folder import claim_run_folder

_T = TypeVar("_T")


@dataclass
class EpochRecord:
    """What one epoch logs (one line of ``metrics.jsonl``)."""

    epoch: int
    losses: dict[str, float]
    lr: dict[str, float]
    uncertainty: dict[str, float]
    metrics: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    steps: int = 0
    ism: dict[str, float] = field(default_factory=dict)
    """ISM's weakening factors over the epoch (:class:`~idml.monitoring.WeakeningMonitor`), the
    warm-up strength at the epoch's end, and the mean gradient norm of the model."""
    notes: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "steps": self.steps,
            "seconds": round(self.seconds, 3),
            **{f"loss/{k}": v for k, v in self.losses.items()},
            **{f"lr/{k}": v for k, v in self.lr.items()},
            **{f"uncertainty/{k}": v for k, v in self.uncertainty.items()},
            **{f"ism/{k}": v for k, v in self.ism.items()},
            **{f"test/{k}": v for k, v in self.metrics.items()},
            **{f"eval/{k}": v for k, v in self.notes.items()},
        }


@dataclass
class TrainResult:
    """Outcome of :meth:`Trainer.fit`."""

    run_dir: Path
    final_metrics: dict[str, float]
    best_metrics: dict[str, float]
    best_epoch: int
    history: list[dict[str, Any]]


class Trainer:
    """Train and evaluate one configured run.

    Args:
        cfg: the run's configuration.
        run_dir: folder for the config, log and checkpoints.
        progress: show progress bars (rank 0 only).
        distributed: this process's place in a ``torchrun`` job (:func:`idml.distributed.init_distributed`);
            ``None``: a single process.
        shards: split each global batch into this many shards for the per-shard random draws (Mixup,
            degradations, SSR); defaults to the number of processes. A single process with
            ``shards=R`` reproduces an ``R``-process run exactly (:class:`idml.distributed.ShardPlan`).
        epoch_log: called (rank 0 only) with one summary line per finished epoch, e.g. ``print``
            when no progress bars are shown.

    Example:
        One epoch of the ``idml demo`` baseline (scikit-learn's digits, a small CNN), in a
        throw-away folder; a preset from ``configs/`` loads the same way, by its path:

        >>> import tempfile
        >>> from idml.config import load_config
        >>> from idml.demo import DEMO_BASE
        >>> cfg = load_config(None, [*DEMO_BASE, "optim.epochs=1", "eval.every=1"])
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     result = Trainer(cfg, Path(folder) / "run", progress=False).fit()
        >>> result.best_epoch, "recall@1" in result.final_metrics
        (0, True)
    """

    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        progress: bool = True,
        distributed: DistributedContext | None = None,
        shards: int | None = None,
        epoch_log: Callable[[str], None] | None = None,
    ) -> None:
        # Before any work: a config that cannot work is refused here, naming its keys.
        self.config_warnings = check_run_config(cfg)
        self.epoch_log = epoch_log
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.dist = distributed if distributed is not None else DistributedContext()
        self.plan = ShardPlan.create(self.dist, shards)
        self.progress = progress and self.dist.is_main
        self.device = self.dist.device if self.dist.is_distributed else resolve_device(cfg.device)
        torch.manual_seed(cfg.seed)
        self.data = self._build_data()
        self.model = build.build_model(cfg).to(self.device)
        check_model_input(self.model, cfg)
        self.loss = self._build_loss().to(self.device)
        self.ssr = build.build_ssr(cfg, self.model.feature_dim)
        if self.ssr is not None:
            self.ssr = self.ssr.to(self.device)
        self.augment = self._build_augmentations()
        self.optimizer, self.ranking_optimizer = self._optimizers()
        self.scheduler = self._scheduler(self.optimizer)
        self.amp = cfg.optim.amp and self.device.type == "cuda"
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.amp)
        self.start_epoch = 0
        self.best_value = -math.inf
        self.best_epoch = -1
        self.best_metrics: dict[str, float] = {}
        self.eval_notes: dict[str, str] = {}
        self.history: list[dict[str, Any]] = []
        metric = getattr(self.loss, "metric", None)
        self.ism_metric = metric if isinstance(metric, IntrospectiveMetric) else None
        self.weakening = WeakeningMonitor()
        self._warned: set[str] = set()
        self._grad_norms: list[Tensor] = []
        """The model's gradient norm at each step of the current epoch (tensors: no host sync)."""
        self._loggers: list[RunLogger] = []
        # One DDP over model, loss (proxies) and SSR head: their gradients are averaged over ranks.
        self._ddp = wrap_ddp(
            {"model": self.model, **self._training_modules()},
            self.dist,
            find_unused_parameters=build.needs_unused_parameter_search(cfg),
        )

    # ------------------------------------------------------------------ set-up
    # The task hooks: a task other than metric learning (idml.classification_task) overrides them.
    def _build_data(self) -> Any:
        return build.build_data(self.cfg)

    def _build_loss(self) -> nn.Module:
        return build.build_loss(self.cfg, self.data.num_train_classes)

    def _build_augmentations(self) -> Any:
        return build.build_augmentations(self.cfg)

    def _optimizers(self) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer | None]:
        o = self.cfg.optim
        # The uncertainty head gets its own group only when asked to: the default layout (and so
        # the optimizer state of existing checkpoints) stays two model groups.
        uncertainty_mult = o.uncertainty_lr_mult
        own_uncertainty_group = uncertainty_mult is not None
        uncertainty = {id(p) for p in self.model.uncertainty_head_parameters()}
        groups = [
            {
                "params": list(self.model.backbone_parameters()),
                "lr": o.lr * o.backbone_lr_mult,
                "name": "backbone",
            },
            {
                "params": [
                    p
                    for p in self.model.head_parameters()
                    if not (own_uncertainty_group and id(p) in uncertainty)
                ],
                "lr": o.lr * o.head_lr_mult,
                "name": "heads",
            },
        ]
        if uncertainty_mult is not None:
            groups.append(
                {
                    "params": list(self.model.uncertainty_head_parameters()),
                    "lr": o.lr * uncertainty_mult,
                    "name": "uncertainty",
                }
            )
        proxies: list[nn.Parameter] = []
        others: list[nn.Parameter] = []
        for n, p in self.loss.named_parameters():
            (proxies if n.startswith(("proxies", "proxy_")) else others).append(p)
        if proxies:
            groups.append({"params": proxies, "lr": o.lr * o.proxy_lr_mult, "name": "proxies"})
        if others:
            groups.append({"params": others, "lr": o.lr * o.head_lr_mult, "name": "loss"})
        ranking_opt = None
        if self.ssr is not None:
            ranking = {
                "params": list(self.ssr.parameters()),
                "lr": o.lr * o.head_lr_mult,
                "name": "ranking",
            }
            if self.cfg.ssr.task.update == "alternating":
                ranking_opt = torch.optim.AdamW([ranking], lr=o.lr, weight_decay=o.weight_decay)
            else:
                groups.append(ranking)
        groups = [g for g in groups if g["params"]]
        if o.optimizer == "sgd":
            sgd = torch.optim.SGD(
                groups,
                lr=o.lr,
                momentum=o.momentum,
                nesterov=o.nesterov,
                weight_decay=o.weight_decay,
            )
            return sgd, ranking_opt
        return torch.optim.AdamW(groups, lr=o.lr, weight_decay=o.weight_decay), ranking_opt

    def _scheduler(self, opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler | None:
        o = self.cfg.optim
        if o.scheduler == "step":
            return torch.optim.lr_scheduler.StepLR(opt, step_size=o.step_size, gamma=o.step_gamma)
        if o.scheduler == "cosine":
            return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=o.epochs)
        if o.scheduler == "multistep":
            return torch.optim.lr_scheduler.MultiStepLR(
                opt, milestones=list(o.milestones), gamma=o.step_gamma
            )
        return None

    def _training_modules(self) -> dict[str, nn.Module]:
        modules: dict[str, nn.Module] = {"loss": self.loss}
        if self.ssr is not None:
            modules["ssr"] = self.ssr
        return modules

    def _optimizer_map(self) -> dict[str, torch.optim.Optimizer]:
        opts = {"optim_main": self.optimizer}
        if self.ranking_optimizer is not None:
            opts["optim_ranking"] = self.ranking_optimizer
        return opts

    # ------------------------------------------------------------------ resume
    def resume(self) -> None:
        """Continue from the run folder's latest checkpoint (exactly, for a fixed seed on CPU)."""
        ckpt = resolve_checkpoint(self.run_dir)
        saved = read_state(ckpt)
        changes = config_difference(
            stored_config_dict(saved.get("config", {})), config_to_dict(self.cfg), RESUMABLE_CHANGES
        )
        diff = "; ".join(changes[:5])
        if diff:
            raise ValueError(
                f"cannot resume {self.run_dir}: its config differs from the one given ({diff}); "
                "resume with the run's own config.yaml or start a new --out folder"
            )
        load_model_weights(ckpt, self.model)
        state = load_training_state(ckpt, self._training_modules(), self._optimizer_map())
        if self.scheduler is not None and state.get("scheduler") is not None:
            if saved.get("config", {}).get("optim", {}).get("epochs") == self.cfg.optim.epochs:
                self.scheduler.load_state_dict(state["scheduler"])
            else:  # more (or fewer) epochs: the schedule of a fresh run of the new length
                self._replay_schedule(int(state["epoch"]) + 1)
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.start_epoch = int(state["epoch"]) + 1
        self.best_value = float(state.get("best_value", -math.inf))
        self.best_epoch = int(state.get("best_epoch", -1))
        self.best_metrics = dict(state.get("best_metrics", {}))
        self.history = _read_log(self._log_path, self.start_epoch)
        self.dist.barrier()  # every rank has read the log before rank 0 truncates it
        if self.dist.is_main:
            self._log_path.write_text("".join(json.dumps(h) + "\n" for h in self.history))

    def _replay_schedule(self, epochs_done: int) -> None:
        """Rebuild the learning-rate schedule for ``optim.epochs`` and advance it by
        ``epochs_done`` steps from the base rates, as an uninterrupted run of that length steps it
        (cosine's ``T_max`` is the run length, so the saved schedule cannot be reused)."""
        assert self.scheduler is not None
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs, strict=True):
            group["lr"] = group["initial_lr"] = base
        self.scheduler = self._scheduler(self.optimizer)
        # Stepping the schedule without optimizer steps is the point: silence torch's warning.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(epochs_done):
                self.scheduler.step()  # type: ignore[union-attr]

    # ------------------------------------------------------------------ main loop
    @property
    def _log_path(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    def fit(self, resume: bool = False, overwrite: bool = False) -> TrainResult:
        """Train (or, with ``resume``, continue) the run; returns its metrics and history.

        The config was checked when the trainer was built (:func:`idml.preflight.check_run_config`);
        its warnings are issued here.
        Rank 0 locks the run folder for the whole run and refuses a folder that already holds a
        run unless ``resume`` or ``overwrite`` (which moves the old run aside;
        :func:`idml.run_folder.claim_run_folder`).
        """
        for message in self.config_warnings if self.dist.is_main else []:
            warnings.warn(message, UserWarning, stacklevel=2)
        claim = (
            claim_run_folder(self.run_dir, resume=resume, overwrite=overwrite)
            if self.dist.is_main
            else contextlib.nullcontext()
        )
        with claim:
            return self._fit(resume)

    def _fit(self, resume: bool) -> TrainResult:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if resume:
            self.resume()
        elif self.dist.is_main:
            self._log_path.write_text("")
        if self.dist.is_main:
            dump_config(self.cfg, self.run_dir / "config.yaml")
        self._open_loggers(resume)
        epochs = self.cfg.optim.epochs
        metrics: dict[str, float] = {}
        for epoch in range(self.start_epoch, epochs):
            record = self.train_epoch(epoch)
            last = epoch == epochs - 1
            if (epoch + 1) % self.cfg.eval.every == 0 or last:
                record.metrics = self.evaluate()
                record.notes = dict(self.eval_notes)
                metrics = record.metrics
                self._track_best(epoch, metrics)
            if self.scheduler is not None:
                self.scheduler.step()
            self._log(record)
            self._checkpoint(epoch)
        for logger in self._loggers:
            logger.close()
        self.dist.barrier()  # every rank returns after rank 0 wrote the last checkpoint
        if not metrics and self.history:
            metrics = {k[5:]: v for k, v in self.history[-1].items() if k.startswith("test/")}
        return TrainResult(self.run_dir, metrics, self.best_metrics, self.best_epoch, self.history)

    def _generator(self, epoch: int, stream: int) -> torch.Generator:
        g = torch.Generator()
        g.manual_seed(self.cfg.seed * 1_000_003 + epoch * 101 + stream)
        return g

    def train_epoch(self, epoch: int) -> EpochRecord:
        cfg = self.cfg
        self.model.train()
        self.loss.train()
        warm = epoch < cfg.optim.warmup_epochs
        for p in self.model.backbone_parameters():
            p.requires_grad_(not warm)
        rank = self.dist.rank
        # Pixel transforms draw from these: per rank, so ranks do not crop their images alike.
        torch.manual_seed(rank_seed(cfg.seed * 7919 + epoch, rank))
        loader_gen = rank_generator(self._generator(epoch, 0), rank)
        loader = build.train_loader(
            cfg, self.data, epoch, loader_gen, num_replicas=self.dist.world_size, rank=rank
        )
        one_lambda = cfg.mixup.enabled and cfg.mixup.mode == "interpolate"
        aug_gen = self.plan.generators(self._generator(epoch, 1), shared=one_lambda)
        ssr_gen = self._generator(epoch, 2)
        gate = self.ssr.make_gate(ssr_gen) if self.ssr is not None else None
        # The gate's draws must agree on every rank, so shards draw their SSR images elsewhere.
        ssr_shard_gen = self.plan.generators(ssr_gen)
        if gate is not None:
            gate.new_epoch()
        sums: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)
        start = time.perf_counter()
        steps = 0
        limit = cfg.optim.max_steps_per_epoch
        total = len(loader) if limit is None else min(limit, len(loader))
        self.weakening.reset()
        self._grad_norms.clear()
        bar = Progress(total, f"epoch {epoch + 1}/{cfg.optim.epochs}", enabled=self.progress)
        for images, labels, _ in loader:
            if limit is not None and steps >= limit:
                break
            images = images.to(self.device, non_blocking=True)
            labels = labels.to(self.device, non_blocking=True)
            ssr_on = gate() if gate is not None else False
            self._set_ism_strength(epoch + (steps + 1) / max(total, 1))
            self._position = (epoch, steps)  # named by a non-finite loss or weights error
            parts = self.train_step(images, labels, aug_gen, ssr_shard_gen, ssr_on)
            for k, v in parts.items():
                sums[k] += v
                counts[k] += 1
            steps += 1
            bar.update(1, loss=parts["total"])
        bar.close()
        means = {k: sums[k] / counts[k] for k in sums}
        losses = {k: v for k, v in means.items() if not k.startswith("u_")}
        unc = {k[2:]: v for k, v in means.items() if k.startswith("u_")}
        lr = {g.get("name", str(i)): g["lr"] for i, g in enumerate(self.optimizer.param_groups)}
        ism = self._ism_summary()
        self._check_learning(epoch, ism)
        return EpochRecord(
            epoch, losses, lr, unc, seconds=time.perf_counter() - start, steps=steps, ism=ism
        )

    # ------------------------------------------------------------------ is ISM working?
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
        """Warn once when ISM saturates most relations, or when no gradient reaches the model."""
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

    def train_step(
        self,
        images: Tensor,
        labels: Tensor,
        aug_gen: torch.Generator | Sequence[torch.Generator],
        ssr_gen: torch.Generator | Sequence[torch.Generator],
        ssr_on: bool,
    ) -> dict[str, float]:
        """One optimisation step; returns the loss parts and uncertainty levels for logging.

        ``images``/``labels`` are this process's rows; ``aug_gen``/``ssr_gen`` hold one generator per
        shard it computes (or a single generator for a single shard). With several processes the loss
        sees the gathered global batch and the returned values are those of the global batch.
        """
        aug_gens = [aug_gen] if isinstance(aug_gen, torch.Generator) else list(aug_gen)
        ssr_gens = [ssr_gen] if isinstance(ssr_gen, torch.Generator) else list(ssr_gen)
        joint = self.ranking_optimizer is None
        batch = self.plan.augment(self.augment, images, labels, aug_gens)

        def forward() -> tuple[Tensor, Embeddings, AugmentedBatch, dict[str, float]]:
            parts: dict[str, float] = {}
            with torch.autocast(self.device.type, enabled=self.amp):
                try:
                    out = self.model(batch.images)  # Embeddings refuse NaN/inf rows themselves
                except NonFiniteEmbeddingsError as err:
                    # With several processes this rank ends here and torchrun stops the others.
                    raise self._non_finite(f"NaN or inf in the training batch's {err}") from err
                unc = None if out.uncertainty is None else _upcast(out.uncertainty)
                emb, global_batch = self.plan.gather(Embeddings(_upcast(out.semantic), unc), batch)
                metric_loss = self._metric_loss(emb, global_batch)
                self._monitor_weakening(emb, global_batch)
            parts["metric"] = float(metric_loss.detach())
            total = metric_loss
            if ssr_on and joint and self.ssr is not None:
                total = total + self.ssr.weight * self._ranking_loss(images, ssr_gens, parts)
            parts["total"] = float(total.detach())
            return total, emb, global_batch, parts

        total, emb, batch, parts = self._forward(forward)
        if emb.uncertainty is not None:
            level = self.model.uncertainty_level(emb.detach())
            parts["u_original"] = (
                float(level[~batch.mixed].mean()) if (~batch.mixed).any() else math.nan
            )
            if batch.mixed.any():
                parts["u_mixed"] = float(level[batch.mixed].mean())
            if batch.degraded is not None and batch.degraded.any():
                parts["u_degraded"] = float(level[batch.degraded].mean())
        parts = self.dist.mean(parts)
        if not math.isfinite(parts["total"]):
            raise self._non_finite(f"non-finite loss {parts}")
        self.optimizer.zero_grad(set_to_none=True)
        if self.ranking_optimizer is not None:
            self.ranking_optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(total).backward()
        self._grad_norms.append(self._clip_and_step(self.optimizer)[0])
        self._check_finite_weights()
        if ssr_on and not joint and self.ssr is not None:
            # Alternating (SSR Alg. 1): after the metric step, a second forward, backward and step
            # on γ_r·L_ranking alone (it must see the updated weights, so it cannot reuse a graph).
            self.optimizer.zero_grad(set_to_none=True)
            self.ranking_optimizer.zero_grad(set_to_none=True)  # type: ignore[union-attr]
            ranking_parts: dict[str, float] = {}
            ranking = self._forward(lambda: self._ranking_loss(images, ssr_gens, ranking_parts))
            parts.update(self.dist.mean(ranking_parts))
            self.scaler.scale(self.ssr.weight * ranking).backward()
            self._clip_and_step(self.optimizer, self.ranking_optimizer)  # type: ignore[arg-type]
            self._check_finite_weights()
        return {k: v for k, v in parts.items() if not (isinstance(v, float) and math.isnan(v))}

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

    def _forward(self, compute: Callable[[], _T]) -> _T:
        """Run a loss computation, through DDP when there are several processes.

        DDP hooks the gradients of the parameters the computation uses, so the next backward
        averages them over ranks (:class:`idml.distributed.ParallelModules`).
        """
        return self._ddp(compute) if self._ddp is not None else compute()

    def _monitor_weakening(self, emb: Embeddings, batch: AugmentedBatch) -> None:
        """Record the ISM weakening factors of this step's relations (no gradient)."""
        if self.ism_metric is None or not hasattr(self.loss, "weakening"):
            return
        found = self.loss.weakening(emb.detach(), batch.labels)
        if found is not None:
            self.weakening.update(*found)

    def _metric_loss(self, emb: Embeddings, batch: AugmentedBatch) -> Tensor:
        if not self.cfg.metric.introspective and not self.cfg.loss.probabilistic:
            # The uncertainty head may exist (e.g. for logging) but the plain metric ignores it.
            emb = Embeddings(emb.semantic)
        return batch.loss(self.loss, emb)

    def _ranking_loss(
        self, images: Tensor, gens: Sequence[torch.Generator], parts: dict[str, float]
    ) -> Tensor:
        """SSR's L_ranking on M images from the metric batch or sampled separately.

        Each shard ranks its share ``M_s`` of the ``M`` images with its own generator, weighted so
        that the average over processes is the mean over all ``M`` images
        (:meth:`idml.distributed.ShardPlan.ranking_shares`); one shard is the plain loss.
        """
        assert self.ssr is not None
        task = self.cfg.ssr.task
        shares = self.plan.ranking_shares(task.num_images, images.shape[0])
        weighted: list[tuple[float, RankingOutput]] = []
        for shard, gen, (count, weight) in zip(self.plan.split(images), gens, shares, strict=True):
            if task.source == "metric_batch":
                chosen = draw_images(shard, count, gen)
            else:
                chosen = build.sample_images(self.data.train, count, gen).to(self.device)
            with torch.autocast(self.device.type, enabled=self.amp):
                weighted.append((weight, self.ssr.loss(self.model.features, chosen, generator=gen)))
        loss = sum(w * out.loss for w, out in weighted)
        parts["ranking"] = float(loss.detach())
        parts["ranking_sort"] = float(sum(w * out.sort.detach() for w, out in weighted))
        parts["ranking_pos"] = float(sum(w * out.pos.detach() for w, out in weighted))
        return _upcast(loss)

    def _clip_and_step(self, *optimizers: torch.optim.Optimizer) -> list[Tensor]:
        """Unscale, clip and step each optimizer of one backward, then update the AMP scale once:
        updating between them would unscale the later ones by a different factor than the one
        their gradients were scaled with. Returns each optimizer's gradient norm (before clipping)."""
        norms: list[Tensor] = []
        for opt in optimizers:
            self.scaler.unscale_(opt)
            params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
            if self.cfg.optim.grad_clip is not None:
                norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.optim.grad_clip)
            else:
                norm = torch.nn.utils.get_total_norm([p.grad for p in params])
            norms.append(norm.detach())
            self.scaler.step(opt)
        self.scaler.update()
        return norms

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def embed_test(self) -> tuple[Embeddings, Tensor]:
        """Test-set embeddings in dataset order; each process embeds a contiguous shard."""
        shard = contiguous_shard(self.data.test, self.dist)
        error: NonFiniteEmbeddingsError | None = None
        try:
            emb, labels = build.embed_dataset(
                self.model, shard, self.cfg.eval.batch_size, self.device, self.progress
            )
        except NonFiniteEmbeddingsError as err:
            error = err
        failed = error is not None
        if self.dist.is_distributed:
            # Agree before the gather: a rank stopping alone would leave the others waiting in it.
            failed = self.dist.mean({"failed": float(failed)})["failed"] > 0
        if failed:
            raise self._non_finite(
                f"NaN or inf in the test-set embeddings ({error or 'of another process'})",
                after_epoch=True,
            ) from error
        return gather_embeddings(emb, labels, self.dist)

    def evaluate(self) -> dict[str, float]:
        """Test metrics, computed once (by rank 0) on the gathered test set, known to every rank."""
        emb, labels = self.embed_test()
        report = None
        if self.dist.is_main:
            evaluation = build.evaluate(self.cfg, emb, labels, self.device, self.progress)
            # How NMI was computed goes into the log beside the numbers (``eval/nmi_method``).
            report = (dict(evaluation.metrics), {"nmi_method": evaluation.settings["nmi_method"]})
        metrics, self.eval_notes = self.dist.broadcast_object(report)
        return metrics

    def _track_best(self, epoch: int, metrics: dict[str, float]) -> None:
        key = self.cfg.eval.select
        if key not in metrics:
            raise ValueError(f"eval.select={key!r} is not among the metrics {sorted(metrics)}")
        if metrics[key] > self.best_value:
            self.best_value = metrics[key]
            self.best_epoch = epoch
            self.best_metrics = dict(metrics)

    # ------------------------------------------------------------------ logging and checkpoints
    def _log(self, record: EpochRecord) -> None:
        line = record.to_json()
        self.history.append(line)
        if self.epoch_log is not None and self.dist.is_main:
            self.epoch_log(_epoch_summary(record, self.cfg.optim.epochs))
        if not self.dist.is_main:
            return
        with open(self._log_path, "a") as fh:
            fh.write(json.dumps(line) + "\n")
        for logger in self._loggers:
            logger.log(line, record.epoch)

    def _open_loggers(self, resume: bool) -> None:
        """TensorBoard when installed and ``tensorboard``; MLflow when ``mlflow.enabled``."""
        if not self.dist.is_main:
            return
        if self.cfg.tensorboard and tensorboard_available():  # tensorboard is optional
            self._loggers.append(TensorBoardLogger(self.run_dir / "tensorboard"))
        m = self.cfg.mlflow
        if m.enabled:
            self._loggers.append(
                MLflowLogger(
                    self.run_dir,
                    self.cfg.name,
                    config_to_dict(self.cfg),
                    tracking_uri=m.tracking_uri,
                    experiment=m.experiment,
                    resume=resume,
                )
            )

    def _checkpoint_extras(self) -> dict[str, Any]:
        """Task-specific entries of a checkpoint's ``state.json`` (none for metric learning)."""
        return {}

    def _checkpoint(self, epoch: int) -> None:
        if not self.dist.is_main:
            return
        name = f"epoch_{epoch:04d}"
        state = {
            "epoch": epoch,
            "config": config_to_dict(self.cfg),
            "num_train_classes": self.data.num_train_classes,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.amp else None,
            "best_value": self.best_value,
            "best_epoch": self.best_epoch,
            "best_metrics": self.best_metrics,
            "metrics": self.history[-1] if self.history else {},
            **self._checkpoint_extras(),
        }
        save_checkpoint(
            self.run_dir, name, self.model, self._training_modules(), self._optimizer_map(), state
        )
        if self.best_epoch == epoch:
            mark_best(self.run_dir, name)
        _prune(self.run_dir / "checkpoints", keep={name, f"epoch_{self.best_epoch:04d}"})


def _read_log(path: Path, epochs: int) -> list[dict[str, Any]]:
    """The first ``epochs`` lines of ``metrics.jsonl``. Lines after them belong to epochs whose
    checkpoint was never written (a line cut by a crash among them) and are dropped."""
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        raise ValueError(
            f"cannot resume: {path} is missing; the run folder is incomplete"
        ) from None
    if len(lines) < epochs:
        raise ValueError(
            f"cannot resume: {path} has {len(lines)} epoch lines but the checkpoint is of epoch "
            f"{epochs}; the log was truncated or replaced"
        )
    history = []
    for number, line in enumerate(lines[:epochs], start=1):
        try:
            history.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise ValueError(
                f"cannot resume: line {number} of {path} is not JSON ({err.msg}); restore the "
                "line or start again with --overwrite"
            ) from None
    return history


def _epoch_summary(record: EpochRecord, epochs: int) -> str:
    """``epoch 3/60: loss 0.4312, recall@1 0.5120 (41.2 s)``: the loss and the first metric."""
    parts = [f"epoch {record.epoch + 1}/{epochs}:"]
    if "total" in record.losses:
        parts.append(f"loss {record.losses['total']:.4f},")
    for key, value in list(record.metrics.items())[:1]:
        parts.append(f"{key} {value:.4f},")
    parts.append(f"{record.steps} steps, {record.seconds:.1f} s")
    return " ".join(parts)


class NonFiniteError(FloatingPointError):
    """Training produced a NaN or infinite loss or weight; the message names the epoch and step."""


def _upcast(tensor: Tensor) -> Tensor:
    """Half-precision autocast outputs in float32 for the loss; float32/float64 stay as they are."""
    return tensor.float() if tensor.dtype in (torch.float16, torch.bfloat16) else tensor


def _prune(root: Path, keep: set[str]) -> None:
    """Keep the latest and the best epoch; older epochs would only fill the disk."""
    import shutil

    for path in root.glob("epoch_*"):
        if path.is_dir() and path.name not in keep:
            shutil.rmtree(path)


RESUMABLE_CHANGES = RUNTIME_KEYS | {"optim.epochs"}
"""Config keys a resumed run may change (more epochs, another machine); any other change is refused."""
