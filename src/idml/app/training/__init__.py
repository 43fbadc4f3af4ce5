"""The trainer: composes data, model, augmentations, metric, loss, SSR and evaluation into a run.

A run folder holds ``config.yaml`` (every resolved default), ``metrics.jsonl`` (one line per epoch:
losses, metrics, learning rates, mean ``||u||`` of original and of mixed images), ``checkpoints/``
(atomic, one per epoch, plus ``latest``/``best`` pointers), TensorBoard events when installed, and
what the task writes after the last epoch (:meth:`~idml.app.tasks.Task.after_training`: a retrieval
run's ``calibration.json``).

Determinism: every epoch reseeds its own generators from ``(seed, epoch)``, so a run resumed from the
checkpoint of epoch ``e`` replays epochs ``e+1..`` exactly as an uninterrupted run would (on CPU).

The trainer is the loop; the rest are parts it holds, each with its own small interface: the
run's :class:`~idml.app.tasks.Task` (data, objective, augmentations, evaluation),
:class:`~idml.app.training.checkpoints.Checkpointing` (with the :class:`~idml.app.training.checkpoints.BestEpoch`),
:class:`~idml.app.training.epoch_log.EpochLog` and :class:`~idml.app.training.monitoring.LearningMonitor`.

Several processes (``torchrun``, see :mod:`idml.app.distributed`): each loads its share of every global
batch, the model, loss and SSR head train under one DistributedDataParallel, the loss sees the
gathered global batch, evaluation is sharded, and only rank 0 writes files. The global batches do not
depend on the number of processes, so a run may resume with another one.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
from torch import Tensor, nn

from idml.app import build
from idml.app.checkpoint import EPOCH_BASE, NonFiniteStateError, resolve_checkpoint
from idml.app.config import Config, config_to_dict, dump_config
from idml.app.distributed import (
    DistributedContext,
    ShardPlan,
    rank_generator,
    rank_seed,
    resolve_device,
    wrap_ddp,
)
from idml.app.preflight import check_model_input, check_run_config
from idml.app.run_folder import claim_run_folder
from idml.app.tasks import EvaluationContext, task_of
from idml.app.training.checkpoints import BestEpoch, Checkpointing, TrainingWeights
from idml.app.training.compute import ComputePlan
from idml.app.training.console import resume_line, startup_summary
from idml.app.training.epoch_log import EpochLog, EpochRecord, TrainResult
from idml.app.training.interrupt import interrupts_deferred
from idml.app.training.level_probe import LOG_KEY, EvalLevelProbe, drift_advice
from idml.app.training.monitoring import LearningMonitor, identity_advice
from idml.app.training.optim import build_optimizers, build_scheduler, restore_schedule
from idml.app.training.step_values import StepValues, non_finite
from idml.augment import AugmentedBatch
from idml.checks import value_checks
from idml.embeddings import Embeddings, NonFiniteEmbeddingsError
from idml.progress import Progress
from idml.ranking import RankingOutput, draw_images

_T = TypeVar("_T")


class Trainer:
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
        echo: called (rank 0 only) with the start-up summary, the resume line and one line per
            finished epoch (:func:`idml.progress.echo` keeps them above the bars), e.g. ``print``
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
        (1, True)
    """

    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        progress: bool = True,
        distributed: DistributedContext | None = None,
        shards: int | None = None,
        echo: Callable[[str], None] | None = None,
    ) -> None:
        # Before any work: a config that cannot work is refused here, naming its keys.
        self.config_warnings = check_run_config(cfg)
        self.cfg = cfg
        self.task = task_of(cfg)
        self.run_dir = Path(run_dir)
        self.dist = distributed if distributed is not None else DistributedContext()
        self.plan = ShardPlan.create(self.dist, shards)
        self.progress = progress and self.dist.is_main
        self.device = self.dist.device if self.dist.is_distributed else resolve_device(cfg.device)
        torch.manual_seed(cfg.seed)
        self.data = self.task.build_data(cfg)
        self.model = build.build_model(cfg).to(self.device)
        check_model_input(self.model, cfg)
        self.compute = ComputePlan.resolve(cfg.optim, self.device)
        """How the step uses the device: autocast, memory format, compilation, fused optimizer,
        host reads (:mod:`idml.app.training.compute`)."""
        self.compute.prepare_model(self.model)
        self.objective = self.task.build_objective(cfg, self.data)
        self.objective.module.to(self.device)
        self.ssr = build.build_ssr(cfg, self.model.feature_dim)
        if self.ssr is not None:
            self.ssr = self.ssr.to(self.device)
        self.augment = self.task.build_augmentations(cfg)
        self.optimizer, self.ranking_optimizer = build_optimizers(
            cfg, self.model, self.objective.module, self.ssr, fused=self.compute.fused
        )
        self.scheduler = build_scheduler(cfg, self.optimizer)
        self.scaler = self.compute.grad_scaler()
        self.start_epoch = 0
        self.best = BestEpoch()
        self.eval_notes: dict[str, str] = {}
        self.checkpoints = Checkpointing(self.run_dir, self.dist)
        self.echo = echo
        self.log = EpochLog(self.run_dir, self.dist, echo)
        self.level_probe = (
            EvalLevelProbe.training_images(
                self.data, cfg.eval.train_level_images, cfg.eval.batch_size
            )
            if self.model.uncertainty_head is not None and cfg.eval.train_level_images > 0
            else None
        )
        """The eval-mode uncertainty level of training images, checked against the trained one
        after each evaluation (:mod:`idml.app.training.level_probe`)."""
        self.monitor = LearningMonitor(
            self.objective.introspective_metric,
            cfg.metric.warmup_epochs,
            self.run_dir,
            cfg.optim.lr,
            epochs=cfg.optim.epochs,
            warns=self.dist.is_main,
            identity_advice=identity_advice(cfg),
            mixup=cfg.mixup.enabled,
            drift_advice=drift_advice(cfg, frozen_batchnorm=self.model.freeze_bn),
        )
        # One DDP over model, objective (proxies, classifier) and SSR head: their gradients are
        # averaged over ranks.
        self._ddp = wrap_ddp(
            {"model": self.model, **self.training_modules()},
            self.dist,
            find_unused_parameters=build.needs_unused_parameter_search(cfg),
        )

    @property
    def history(self) -> list[dict[str, Any]]:
        """Every logged epoch line so far (``metrics.jsonl``)."""
        return self.log.history

    def training_modules(self) -> dict[str, nn.Module]:
        """The trainable modules beside the model, by their checkpoint names."""
        modules: dict[str, nn.Module] = {"loss": self.objective.module}
        if self.ssr is not None:
            modules["ssr"] = self.ssr
        return modules

    def weights(self) -> TrainingWeights:
        """What a checkpoint stores: the model, the other modules and the optimizers."""
        optimizers = {"optim_main": self.optimizer}
        if self.ranking_optimizer is not None:
            optimizers["optim_ranking"] = self.ranking_optimizer
        return TrainingWeights(self.model, self.training_modules(), optimizers)

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

    def resume(self) -> None:
        """Continue from the run folder's latest checkpoint (exactly, for a fixed seed on CPU)."""
        restored = self.checkpoints.restore(self.cfg, self.weights())
        state = restored.state
        # Epochs are numbered from 1 (read_state renumbers older runs), so a checkpoint's epoch is
        # the number of epochs done, and the index of the next one.
        self.scheduler = restore_schedule(
            self.cfg,
            self.optimizer,
            self.scheduler,
            state.get("scheduler"),
            restored.epoch,
            restored.epochs_changed,
        )
        if state.get("scaler") and self.compute.loss_scaling:
            self.scaler.load_state_dict(state["scaler"])
        self.start_epoch = restored.epoch
        self.best = BestEpoch.from_state(state)
        self.log.restore(self.start_epoch)

    def _fit(self, resume: bool) -> TrainResult:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        epochs = self.cfg.optim.epochs
        self._say(
            *startup_summary(
                self.cfg,
                self.data,
                self.run_dir,
                self.device,
                self.dist.world_size,
                self.compute.describe(),
            )
        )
        if resume:
            self.resume()
            self._say(
                resume_line(
                    resolve_checkpoint(self.run_dir),
                    self.start_epoch,
                    epochs,
                    self.best.epoch,
                    self.best.metrics,
                    self.cfg.eval.select,
                )
            )
        else:
            self.log.start()
        if self.dist.is_main:
            dump_config(self.cfg, self.run_dir / "config.yaml")
        self.log.open_loggers(self.cfg, resume)
        metrics: dict[str, float] = {}
        try:
            for index in range(self.start_epoch, epochs):
                record = self.train_epoch(index)  # record.epoch = index + 1
                if record.epoch % self.cfg.eval.every == 0 or record.epoch == epochs:
                    start = time.perf_counter()
                    record.metrics = self.evaluate()
                    self.probe_level(record)
                    record.eval_seconds = time.perf_counter() - start
                    record.notes = dict(self.eval_notes)
                    metrics = record.metrics
                    self.best.update(record.epoch, metrics, self.cfg.eval.select)
                if self.scheduler is not None:
                    self.scheduler.step()
                best = self.cfg.eval.select if self.best.epoch == record.epoch else None
                # A Ctrl-C waits for both: the epoch is logged and saved whole, or not at all.
                with interrupts_deferred():
                    self.log.write(record, epochs, best)
                    self._checkpoint(record.epoch)
        finally:
            self.log.close()
        if self.dist.is_main:  # e.g. the calibrated confidence of a retrieval run's answers
            self.task.after_training(self.run_dir, self.data, self.device, self.echo)
        # Every rank returns after rank 0 wrote the last checkpoint and did the task's work after it.
        self.dist.barrier()
        metrics = metrics or self.log.last_test_metrics()
        return TrainResult(self.run_dir, metrics, self.best.metrics, self.best.epoch, self.history)

    def _say(self, *lines: str) -> None:
        """Hand ``lines`` to ``echo`` (rank 0 only)."""
        if self.echo is not None and self.dist.is_main:
            for line in lines:
                self.echo(line)

    def _checkpoint(self, epoch: int) -> None:
        """The checkpoint after epoch ``epoch`` (numbered from 1)."""
        state = {
            "epoch": epoch,
            EPOCH_BASE: 1,
            "config": config_to_dict(self.cfg),
            "num_train_classes": self.data.num_train_classes,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.compute.loss_scaling else None,
            **self.best.to_state(),
            "metrics": self.history[-1] if self.history else {},
            **self.task.checkpoint_state(self.data),
        }
        try:
            self.checkpoints.save(epoch, self.weights(), state, self.best.epoch)
        except NonFiniteStateError as err:  # parameters or buffers (BatchNorm statistics)
            raise self.monitor.non_finite(str(err), after_epoch=True) from None

    def generator(self, epoch: int, stream: int) -> torch.Generator:
        """The random stream ``stream`` of ``epoch`` (0: batches, 1: augmentations, 2: SSR)."""
        g = torch.Generator()
        g.manual_seed(self.cfg.seed * 1_000_003 + epoch * 101 + stream)
        return g

    def train_epoch(self, epoch: int) -> EpochRecord:
        """Train the epoch of index ``epoch`` (from 0: the random streams are drawn from it); its
        record is numbered ``epoch + 1``, as the log and the checkpoints name it."""
        cfg = self.cfg
        self.model.train()
        self.objective.module.train()
        warm = epoch < cfg.optim.warmup_epochs
        for p in self.model.backbone_parameters():
            p.requires_grad_(not warm)
        rank = self.dist.rank
        # Pixel transforms draw from these: per rank, so ranks do not crop their images alike.
        torch.manual_seed(rank_seed(cfg.seed * 7919 + epoch, rank))
        loader_gen = rank_generator(self.generator(epoch, 0), rank)
        loader = build.train_loader(
            cfg, self.data, epoch, loader_gen, num_replicas=self.dist.world_size, rank=rank
        )
        one_lambda = cfg.mixup.enabled and cfg.mixup.mode == "interpolate"
        aug_gen = self.plan.generators(self.generator(epoch, 1), shared=one_lambda)
        ssr_gen = self.generator(epoch, 2)
        gate = self.ssr.make_gate(ssr_gen) if self.ssr is not None else None
        # The gate's draws must agree on every rank, so shards draw their SSR images elsewhere.
        ssr_shard_gen = self.plan.generators(ssr_gen)
        if gate is not None:
            gate.new_epoch()
        values = StepValues()
        start = time.perf_counter()
        steps = 0
        limit = cfg.optim.max_steps_per_epoch
        total = len(loader) if limit is None else min(limit, len(loader))
        self.monitor.start_epoch(epoch)
        bar = Progress(total, f"epoch {epoch + 1}/{cfg.optim.epochs}", enabled=self.progress)
        first_unread = 0  # the first step since the host last read
        for images, labels, _ in loader:
            if limit is not None and steps >= limit:
                break
            images = self.compute.prepare_images(images.to(self.device, non_blocking=True))
            labels = labels.to(self.device, non_blocking=True)
            ssr_on = gate() if gate is not None else False
            self.monitor.step(epoch, steps, total)
            # The host reads the step's values every compute.sync_every steps; the library's checks
            # of values (input range, finite embeddings, labels) run at those steps only.
            reads = self.compute.reads_at(steps, total)
            with value_checks(reads):
                read = self.step(
                    images,
                    labels,
                    aug_gen,
                    ssr_shard_gen,
                    ssr_on,
                    values,
                    first_unread if reads else None,
                )
            steps += 1
            if read is None:
                bar.update(1)
            else:
                first_unread = steps
                bar.update(1, loss=read["total"])
        bar.close()
        means = values.read(self.dist)
        losses = {k: v for k, v in means.items() if not k.startswith("u_")}
        unc = {k[2:]: v for k, v in means.items() if k.startswith("u_")}
        lr = {g.get("name", str(i)): g["lr"] for i, g in enumerate(self.optimizer.param_groups)}
        ism = self.monitor.summary()
        self.monitor.check(epoch, ism)
        return EpochRecord(
            epoch + 1, losses, lr, unc, seconds=time.perf_counter() - start, steps=steps, ism=ism
        )

    def train_step(
        self,
        images: Tensor,
        labels: Tensor,
        aug_gen: torch.Generator | Sequence[torch.Generator],
        ssr_gen: torch.Generator | Sequence[torch.Generator],
        ssr_on: bool,
    ) -> dict[str, float]:
        """One optimisation step, read at once: its loss parts and uncertainty levels.

        ``images``/``labels`` are this process's rows; ``aug_gen``/``ssr_gen`` hold one generator per
        shard it computes (or a single generator for a single shard). With several processes the loss
        sees the gathered global batch and the returned values are those of the global batch.
        (The epoch loop keeps the values on the device and reads them every
        ``compute.sync_every`` steps.)
        """
        values = StepValues()
        self.step(images, labels, aug_gen, ssr_gen, ssr_on, values, self.monitor.position[1])
        return values.read(self.dist)

    def step(
        self,
        images: Tensor,
        labels: Tensor,
        aug_gen: torch.Generator | Sequence[torch.Generator],
        ssr_gen: torch.Generator | Sequence[torch.Generator],
        ssr_on: bool,
        values: StepValues,
        read_from: int | None,
    ) -> dict[str, float] | None:
        """One optimisation step that adds its values to ``values`` on the device.

        With ``read_from`` (the first step since the host last read) the host reads ``values``
        before the update, stops the run on a NaN or infinite loss among the steps since
        ``read_from``, and checks the weights after it; returns what it read. Without, nothing in
        the step waits for the device (``None``) when it runs as the epoch loop runs it, with the
        library's value checks off (:func:`idml.checks.value_checks`).
        """
        aug_gens = [aug_gen] if isinstance(aug_gen, torch.Generator) else list(aug_gen)
        ssr_gens = [ssr_gen] if isinstance(ssr_gen, torch.Generator) else list(ssr_gen)
        joint = self.ranking_optimizer is None
        batch = self.plan.augment(self.augment, images, labels, aug_gens)

        def forward() -> tuple[Tensor, Embeddings, AugmentedBatch]:
            with self.compute.autocast():
                try:
                    out = self.model(batch.images)  # Embeddings refuse NaN/inf rows themselves
                except NonFiniteEmbeddingsError as err:
                    # With several processes this rank ends here and torchrun stops the others.
                    raise self.monitor.non_finite(
                        f"NaN or inf in the training batch's {err}", first_step=read_from
                    ) from err
                unc = None if out.uncertainty is None else _upcast(out.uncertainty)
                emb, global_batch = self.plan.gather(Embeddings(_upcast(out.semantic), unc), batch)
                metric_loss = self.objective(emb, global_batch)
                self.monitor.record_weakening(self.objective.module, emb, global_batch.labels)
                self.monitor.record_embeddings(emb.semantic)
            values.add("metric", metric_loss)
            total = metric_loss
            if ssr_on and joint and self.ssr is not None:
                total = total + self.ssr.weight * self._ranking_loss(images, ssr_gens, values)
            values.add("total", total)
            return total, emb, global_batch

        total, emb, batch = self._forward(forward)
        if emb.uncertainty is not None:
            level = self.model.uncertainty_level(emb.detach())
            # "original" is the rows no augmentation changed: a degraded row counted there would
            # pull the originals' level towards the degraded one that it is compared with.
            values.add_masked_mean("u_original", level, ~batch.altered)
            values.add_masked_mean("u_mixed", level, batch.mixed)
            values.add_masked_mean("u_degraded", level, batch.degraded)  # absent when none is
        read = None
        if read_from is not None:
            read = values.read(self.dist)
            bad = non_finite(read)
            if bad:
                found = ", ".join(f"{k} {read[k]}" for k in bad)
                raise self.monitor.non_finite(f"non-finite loss ({found})", first_step=read_from)
            self.monitor.settle()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ranking_optimizer is not None:
            self.ranking_optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(total).backward()
        self.monitor.record_grad_norm(self._clip_and_step(self.optimizer)[0])
        if read_from is not None:
            self.check_finite_weights(read_from)
        if ssr_on and not joint and self.ssr is not None:
            # Alternating (SSR Alg. 1): after the metric step, a second forward, backward and step
            # on γ_r·L_ranking alone (it must see the updated weights, so it cannot reuse a graph).
            ranking_optimizer = self.ranking_optimizer
            assert ranking_optimizer is not None  # not joint
            self.optimizer.zero_grad(set_to_none=True)
            ranking_optimizer.zero_grad(set_to_none=True)
            ranking = self._forward(lambda: self._ranking_loss(images, ssr_gens, values))
            self.scaler.scale(self.ssr.weight * ranking).backward()
            self._clip_and_step(self.optimizer, ranking_optimizer)
            if read_from is not None:
                self.check_finite_weights(read_from)
        return read

    def check_finite_weights(self, read_from: int | None = None) -> None:
        """Stop if a weight of the model or the other modules is NaN or inf (``read_from``: the
        first step since the host last read, where the fault may have begun)."""
        self.monitor.check_finite_weights(
            {"model": self.model, **self.training_modules()}, first_step=read_from
        )

    def _forward(self, compute: Callable[[], _T]) -> _T:
        """Run a loss computation, through DDP when there are several processes.

        DDP hooks the gradients of the parameters the computation uses, so the next backward
        averages them over ranks (:class:`idml.app.distributed.ParallelModules`).
        """
        return self._ddp(compute) if self._ddp is not None else compute()

    def _ranking_loss(
        self, images: Tensor, gens: Sequence[torch.Generator], values: StepValues
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
            with self.compute.autocast():
                weighted.append((weight, self.ssr.loss(self.model.features, chosen, generator=gen)))
        loss = cast(Tensor, sum(w * out.loss for w, out in weighted))
        values.add("ranking", loss)
        values.add("ranking_sort", cast(Tensor, sum(w * out.sort.detach() for w, out in weighted)))
        values.add("ranking_pos", cast(Tensor, sum(w * out.pos.detach() for w, out in weighted)))
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
    def evaluation_context(self) -> EvaluationContext:
        """What the task's evaluation sees of this run."""
        return EvaluationContext(
            self.cfg,
            self.model,
            self.objective,
            self.data,
            self.device,
            self.dist,
            self.progress,
        )

    def probe_level(self, record: EpochRecord) -> None:
        """Log the eval-mode uncertainty level of the probe's training images in ``record``
        (``uncertainty/eval_train``) and warn when it has drifted from the trained level. Every
        rank measures the same images with the same weights, so the logs agree."""
        if self.level_probe is None:
            return
        at_eval = self.level_probe.measure(self.model, self.device)
        if at_eval is None:
            return
        record.uncertainty[LOG_KEY] = at_eval
        trained = record.uncertainty.get("original")
        self.monitor.check_eval_level(record.epoch - 1, trained, at_eval)

    def evaluate(self) -> dict[str, float]:
        """The task's test metrics of the current model, known to every rank (its notes go to
        ``eval_notes``)."""
        try:
            evaluation = self.task.evaluate(self.evaluation_context())
        except NonFiniteEmbeddingsError as err:
            raise self.monitor.non_finite(
                f"NaN or inf in the test-set embeddings ({err})", after_epoch=True
            ) from err
        self.eval_notes = evaluation.notes
        return evaluation.metrics


def _upcast(tensor: Tensor) -> Tensor:
    """Half-precision autocast outputs in float32 for the loss; float32/float64 stay as they are."""
    return tensor.float() if tensor.dtype in (torch.float16, torch.bfloat16) else tensor
