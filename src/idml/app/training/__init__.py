"""The trainer: composes data, model, augmentations, metric, loss, SSR and evaluation into a run.

A run folder holds ``config.yaml`` (every resolved default), ``metrics.jsonl`` (one line per epoch:
losses, metrics, learning rates, mean ``||u||`` of original and of mixed images), ``checkpoints/``
(atomic, one per epoch, plus ``latest``/``best`` pointers) and TensorBoard events when installed.

Determinism: every epoch reseeds its own generators from ``(seed, epoch)``, so a run resumed from the
checkpoint of epoch ``e`` replays epochs ``e+1..`` exactly as an uninterrupted run would (on CPU).

Several processes (``torchrun``, see :mod:`idml.app.distributed`): each loads its share of every global
batch, the model, loss and SSR head train under one DistributedDataParallel, the loss sees the
gathered global batch, evaluation is sharded, and only rank 0 writes files. The global batches do not
depend on the number of processes, so a run may resume with another one.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from idml.app import build
from idml.app.calibration import calibrate_run
from idml.app.config import (
    Config,
    dump_config,
)
from idml.app.distributed import (
    DistributedContext,
    ShardPlan,
    contiguous_shard,
    gather_embeddings,
    rank_generator,
    rank_seed,
    resolve_device,
    wrap_ddp,
)
from idml.app.loggers import RunLogger
from idml.app.preflight import check_model_input, check_run_config
from idml.app.run_folder import claim_run_folder
from idml.app.training.checkpoints import RESUMABLE_CHANGES, Checkpointing
from idml.app.training.checks import LearningChecks
from idml.app.training.monitoring import WeakeningMonitor
from idml.app.training.optim import build_optimizers, build_scheduler
from idml.app.training.records import EpochLogging, EpochRecord, NonFiniteError, TrainResult
from idml.augment import AugmentedBatch
from idml.embeddings import Embeddings, NonFiniteEmbeddingsError
from idml.metrics import IntrospectiveMetric
from idml.models import embed_dataset
from idml.progress import Progress
from idml.ranking import RankingOutput, draw_images

__all__ = [
    "RESUMABLE_CHANGES",
    "EpochRecord",
    "NonFiniteError",
    "TrainResult",
    "Trainer",
]

_T = TypeVar("_T")


class Trainer(LearningChecks, Checkpointing, EpochLogging):
    """Train and evaluate one configured run.

    Args:
        cfg: the run's configuration.
        run_dir: folder for the config, log and checkpoints.
        progress: show progress bars (rank 0 only).
        distributed: this process's place in a ``torchrun`` job (:func:`idml.app.distributed.init_distributed`);
            ``None``: a single process.
        shards: split each global batch into this many shards for the per-shard random draws (Mixup,
            degradations, SSR); defaults to the number of processes. A single process with
            ``shards=R`` reproduces an ``R``-process run exactly (:class:`idml.app.distributed.ShardPlan`).
        epoch_log: called (rank 0 only) with one summary line per finished epoch, e.g. ``print``
            when no progress bars are shown.

    Example:
        One epoch of the ``idml demo`` baseline (scikit-learn's digits, a small CNN), in a
        throw-away folder; a preset from ``configs/`` loads the same way, by its path:

        >>> import tempfile
        >>> from idml.app.config import load_config
        >>> from idml.app.demo import DEMO_BASE
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
    # The task hooks: a task other than metric learning (idml.app.classification_task) overrides them.
    def _build_data(self) -> Any:
        return build.build_data(self.cfg)

    def _build_loss(self) -> nn.Module:
        return build.build_loss(self.cfg, self.data.num_train_classes)

    def _build_augmentations(self) -> Any:
        return build.build_augmentations(self.cfg)

    def _optimizers(self) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer | None]:
        return build_optimizers(self.cfg, self.model, self.loss, self.ssr)

    def _scheduler(self, opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler | None:
        return build_scheduler(self.cfg, opt)

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

    # ------------------------------------------------------------------ main loop
    def fit(self, resume: bool = False, overwrite: bool = False) -> TrainResult:
        """Train (or, with ``resume``, continue) the run; returns its metrics and history.

        The config was checked when the trainer was built (:func:`idml.app.preflight.check_run_config`);
        its warnings are issued here.
        Rank 0 locks the run folder for the whole run and refuses a folder that already holds a
        run unless ``resume`` or ``overwrite`` (which moves the old run aside;
        :func:`idml.app.run_folder.claim_run_folder`).
        """
        for message in self.config_warnings if self.dist.is_main else []:
            warnings.warn(message, UserWarning, stacklevel=2)
        claim = (
            claim_run_folder(self.run_dir, resume=resume, overwrite=overwrite)
            if self.dist.is_main
            else contextlib.nullcontext()
        )
        with claim as moved:
            if moved is not None:
                print(f"--overwrite: moved the previous run in {self.run_dir} to {moved}")
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
        if self.dist.is_main:  # the run's calibrated confidence, on its held-out classes if any
            say = self.epoch_log or (print if self.progress else None)
            calibrate_run(self.run_dir, self.data, device=self.device, log=say)
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

    def _forward(self, compute: Callable[[], _T]) -> _T:
        """Run a loss computation, through DDP when there are several processes.

        DDP hooks the gradients of the parameters the computation uses, so the next backward
        averages them over ranks (:class:`idml.app.distributed.ParallelModules`).
        """
        return self._ddp(compute) if self._ddp is not None else compute()

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
        (:meth:`idml.app.distributed.ShardPlan.ranking_shares`); one shard is the plain loss.
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
            emb, labels = embed_dataset(
                self.model, shard, self.cfg.eval.batch_size, self.device, progress=self.progress
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
            evaluation = build.evaluate(
                self.cfg, emb, labels, self.device, self.progress, self.data.test.roles
            )
            # How NMI was computed goes into the log beside the numbers (``eval/nmi_method``).
            report = (dict(evaluation.metrics), {"nmi_method": evaluation.settings["nmi_method"]})
        metrics, self.eval_notes = self.dist.broadcast_object(report)
        return metrics


def _upcast(tensor: Tensor) -> Tensor:
    """Half-precision autocast outputs in float32 for the loss; float32/float64 stay as they are."""
    return tensor.float() if tensor.dtype in (torch.float16, torch.bfloat16) else tensor
