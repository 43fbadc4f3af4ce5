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

import json
import math
import time
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
from idml.config import RUNTIME_KEYS, Config, config_difference, config_to_dict, dump_config
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
from idml.embeddings import Embeddings
from idml.loggers import MLflowLogger, RunLogger, TensorBoardLogger, tensorboard_available
from idml.progress import Progress
from idml.ranking import RankingOutput, draw_images

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
    notes: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "steps": self.steps,
            "seconds": round(self.seconds, 3),
            **{f"loss/{k}": v for k, v in self.losses.items()},
            **{f"lr/{k}": v for k, v in self.lr.items()},
            **{f"uncertainty/{k}": v for k, v in self.uncertainty.items()},
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

    Example:
        >>> from idml.config import load_config
        >>> cfg = load_config("configs/demo/digits_baseline.yaml", ["optim.epochs=1"])  # doctest: +SKIP
        >>> Trainer(cfg, Path("runs/demo")).fit()  # doctest: +SKIP
    """

    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        progress: bool = True,
        distributed: DistributedContext | None = None,
        shards: int | None = None,
    ) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.dist = distributed if distributed is not None else DistributedContext()
        self.plan = ShardPlan.create(self.dist, shards)
        self.progress = progress and self.dist.is_main
        self.device = self.dist.device if self.dist.is_distributed else resolve_device(cfg.device)
        torch.manual_seed(cfg.seed)
        self.data = build.build_data(cfg)
        self.model = build.build_model(cfg).to(self.device)
        self.loss = build.build_loss(cfg, self.data.num_train_classes).to(self.device)
        self.ssr = build.build_ssr(cfg, self.model.feature_dim)
        if self.ssr is not None:
            self.ssr = self.ssr.to(self.device)
        self.augment = build.build_augmentations(cfg)
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
        self._loggers: list[RunLogger] = []
        # One DDP over model, loss (proxies) and SSR head: their gradients are averaged over ranks.
        self._ddp = wrap_ddp(
            {"model": self.model, **self._training_modules()},
            self.dist,
            find_unused_parameters=build.needs_unused_parameter_search(cfg),
        )

    # ------------------------------------------------------------------ set-up
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
        return torch.optim.AdamW(groups, lr=o.lr, weight_decay=o.weight_decay), ranking_opt

    def _scheduler(self, opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler | None:
        o = self.cfg.optim
        if o.scheduler == "step":
            return torch.optim.lr_scheduler.StepLR(opt, step_size=o.step_size, gamma=o.step_gamma)
        if o.scheduler == "cosine":
            return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=o.epochs)
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
            saved.get("config", {}), config_to_dict(self.cfg), RESUMABLE_CHANGES
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
            self.scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.start_epoch = int(state["epoch"]) + 1
        self.best_value = float(state.get("best_value", -math.inf))
        self.best_epoch = int(state.get("best_epoch", -1))
        self.best_metrics = dict(state.get("best_metrics", {}))
        self.history = [
            json.loads(line) for line in self._log_path.read_text().splitlines() if line
        ][: self.start_epoch]
        self.dist.barrier()  # every rank has read the log before rank 0 truncates it
        if self.dist.is_main:
            self._log_path.write_text("".join(json.dumps(h) + "\n" for h in self.history))

    # ------------------------------------------------------------------ main loop
    @property
    def _log_path(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    def fit(self, resume: bool = False) -> TrainResult:
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
        bar = Progress(total, f"epoch {epoch + 1}/{cfg.optim.epochs}", enabled=self.progress)
        for images, labels, _ in loader:
            if limit is not None and steps >= limit:
                break
            images = images.to(self.device, non_blocking=True)
            labels = labels.to(self.device, non_blocking=True)
            ssr_on = gate() if gate is not None else False
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
        return EpochRecord(epoch, losses, lr, unc, seconds=time.perf_counter() - start, steps=steps)

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
                out = self.model(batch.images)
                unc = None if out.uncertainty is None else _upcast(out.uncertainty)
                emb, global_batch = self.plan.gather(Embeddings(_upcast(out.semantic), unc), batch)
                metric_loss = self._metric_loss(emb, global_batch)
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
            raise FloatingPointError(
                f"non-finite loss {parts} at this step; lower optim.lr, enable optim.grad_clip or "
                "check the data"
            )
        self.optimizer.zero_grad(set_to_none=True)
        if self.ranking_optimizer is not None:
            self.ranking_optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(total).backward()
        self._clip_and_step(self.optimizer)
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
        return {k: v for k, v in parts.items() if not (isinstance(v, float) and math.isnan(v))}

    def _forward(self, compute: Callable[[], _T]) -> _T:
        """Run a loss computation, through DDP when there are several processes.

        DDP hooks the gradients of the parameters the computation uses, so the next backward
        averages them over ranks (:class:`idml.distributed.ParallelModules`).
        """
        return self._ddp(compute) if self._ddp is not None else compute()

    def _metric_loss(self, emb: Embeddings, batch: AugmentedBatch) -> Tensor:
        if not self.cfg.metric.introspective and self.cfg.loss.name != "pel":
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

    def _clip_and_step(self, *optimizers: torch.optim.Optimizer) -> None:
        """Unscale, clip and step each optimizer of one backward, then update the AMP scale once:
        updating between them would unscale the later ones by a different factor than the one
        their gradients were scaled with."""
        for opt in optimizers:
            self.scaler.unscale_(opt)
            if self.cfg.optim.grad_clip is not None:
                params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
                torch.nn.utils.clip_grad_norm_(params, self.cfg.optim.grad_clip)
            self.scaler.step(opt)
        self.scaler.update()

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def embed_test(self) -> tuple[Embeddings, Tensor]:
        """Test-set embeddings in dataset order; each process embeds a contiguous shard."""
        shard = contiguous_shard(self.data.test, self.dist)
        emb, labels = build.embed_dataset(
            self.model, shard, self.cfg.eval.batch_size, self.device, self.progress
        )
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
        }
        save_checkpoint(
            self.run_dir, name, self.model, self._training_modules(), self._optimizer_map(), state
        )
        if self.best_epoch == epoch:
            mark_best(self.run_dir, name)
        _prune(self.run_dir / "checkpoints", keep={name, f"epoch_{self.best_epoch:04d}"})


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
