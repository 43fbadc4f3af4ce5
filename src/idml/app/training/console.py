"""What a training run tells its user: a start-up summary, one line per epoch, where a resumed run
continues and, after Ctrl-C, what is saved.

Each is a plain line handed to the trainer's ``echo`` (``idml train`` passes
:func:`idml.progress.echo`: stdout, above any live progress bar), so the terminal keeps the whole
history and a log file (``idml train … > log``) holds the same lines, per-epoch test metrics
included. Epochs are numbered from 1, as in ``metrics.jsonl`` and the checkpoint folders.

Example:
    >>> from idml.app.training.epoch_log import EpochRecord
    >>> record = EpochRecord(3, {"total": 0.43125}, {}, {}, {"recall@1": 0.512, "map": 0.2},
    ...                      seconds=41.23, steps=49, eval_seconds=3.1)
    >>> epoch_line(record, 60, best="recall@1")
    'epoch 3/60: loss 0.4313, recall@1 0.5120, 49 steps, 41.2 s + eval 3.1 s, best recall@1 so far'
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from idml.app.metric_display import metric_sort_key

if TYPE_CHECKING:
    import torch

    from idml.app.config import Config
    from idml.app.training.epoch_log import EpochRecord


EPOCH_LINE_RANKS = frozenset({0, 2, 3, 4, 5, 6})
"""The metrics of an epoch line, by :func:`~idml.app.metric_display.metric_sort_key` rank: Recall@K,
MAP@R, NMI, top-k, ECE and NLL (the papers' columns); R-Precision, MAP, MRR, ``||u||`` levels and
the confidence scores stay in ``metrics.jsonl`` and the final table."""


def describe_method(cfg: Config) -> str:
    """Short description: what the task trains (the loss, the classifier), metric (plain / ISM
    variant), Mixup or CutMix, SSR."""
    parts = cfg.task.spec.describe(cfg)
    if cfg.metric.introspective:
        variant = {"soft": "ISM", "dissimilar": "ISM-Dis", "strict": "ISM-strict"}
        parts.append(
            f"{variant[cfg.metric.variant]} (γ={cfg.metric.gamma:g}, τ={cfg.metric.tau:g})"
        )
    if cfg.mixup.enabled:
        parts.append({"mixup": "Mixup", "cutmix": "CutMix"}[cfg.mixup.kind])
    if cfg.ssr.enabled:
        parts.append("SSR")
    return " + ".join(parts)


def _class_examples(names: Sequence[str]) -> str:
    """A few class names: all of up to four, else the first two and the last."""
    shown = list(names) if len(names) <= 4 else [names[0], names[1], "…", names[-1]]
    return ", ".join(str(n) for n in shown)


def startup_summary(
    cfg: Config,
    data: Any,
    run_dir: Path,
    device: torch.device,
    processes: int = 1,
    compute: str | None = None,
) -> list[str]:
    """What the run is about to do: where it writes, the data it loaded (images and classes of
    each side, and whether the test classes are new ones), the model, the method, the schedule
    and the device (with ``compute``, how the step uses it:
    :meth:`~idml.app.training.compute.ComputePlan.describe`). ``data`` has ``name``, ``train`` and ``test`` image datasets (with
    ``class_names``), and perhaps a ``val`` one."""
    train, test = data.train, data.test
    shared = set(train.classes) & set(test.classes)
    if shared == set(train.classes) == set(test.classes):
        split = (
            f"{len(train):,} train and {len(test):,} test images of the same "
            f"{len(train.classes)} classes ({_class_examples(train.class_names)})"
        )
    else:
        other = "other " if not shared else ""
        split = (
            f"{len(train):,} train images of {len(train.classes)} classes "
            f"({_class_examples(train.class_names)}); {len(test):,} test images of "
            f"{len(test.classes)} {other}classes ({_class_examples(test.class_names)})"
        )
    val = getattr(data, "val", None)  # the images a source names for validation, if any
    if val is not None:
        split += f"; {len(val):,} validation images of {len(val.classes)} classes"
    source = f"{data.name}" + (f" from {cfg.data.root}" if cfg.data.root is not None else "")
    m = cfg.model
    weights = (
        f"weights {m.pretrained}"
        if isinstance(m.pretrained, Path)
        else ("pretrained" if m.pretrained else "from scratch")
    )
    head = " + uncertainty head" if m.uncertainty.enabled else ""
    o = cfg.optim
    warmup = f", backbone frozen for {o.warmup_epochs}" if o.warmup_epochs else ""
    schedule = "constant lr" if o.scheduler == "none" else f"{o.scheduler} schedule"
    where = f"{device}" + (f", {processes} processes" if processes > 1 else "")
    where += f" ({compute})" if compute else ""
    return [
        f"run {cfg.name} in {run_dir}",
        f"  data    {source}: {split}",
        f"  model   {m.backbone} ({weights}) at {cfg.data.image_size} px, "
        f"{m.embedding_dim}-d embedding{head}",
        f"  method  {describe_method(cfg)}",
        f"  train   {o.epochs} epochs{warmup}, batch {cfg.sampler.effective_batch_size}, "
        f"{o.optimizer} lr {o.lr:g}, {schedule}; test every {cfg.eval.every} epoch(s), "
        f"best by {cfg.eval.select}",
        f"  device  {where}",
    ]


def epoch_line(record: EpochRecord, epochs: int, best: str | None = None) -> str:
    """``epoch 3/60: loss 0.4313, recall@1 0.5120, …, 49 steps, 41.2 s + eval 3.1 s``: the mean
    loss, the test metrics of :data:`EPOCH_LINE_RANKS` on an evaluated epoch (as fractions, the
    keys of ``metrics.jsonl``), the steps and the time; ``best`` names the ``eval.select`` metric
    when this epoch is the best so far."""
    parts = []
    if "total" in record.losses:
        parts.append(f"loss {record.losses['total']:.4f}")
    shown = sorted(
        (k for k in record.metrics if metric_sort_key(k)[0] in EPOCH_LINE_RANKS),
        key=metric_sort_key,
    )
    parts += [f"{k} {record.metrics[k]:.4f}" for k in shown]
    parts.append(f"{record.steps} steps")
    took = f"{record.seconds:.1f} s"
    if record.eval_seconds:
        took += f" + eval {record.eval_seconds:.1f} s"
    parts.append(took)
    if best is not None:
        parts.append(f"best {best} so far")
    return f"epoch {record.epoch}/{epochs}: " + ", ".join(parts)


def resume_line(
    checkpoint: Path,
    done: int,
    epochs: int,
    best_epoch: int,
    best_metrics: Mapping[str, float],
    select: str,
) -> str:
    """Where a resumed run continues: after which epoch, from which checkpoint, with which best."""
    if done >= epochs:
        return (
            f"resumed {checkpoint}: all {epochs} epochs are done, nothing to train (raise "
            "optim.epochs to train longer)"
        )
    best = ""
    if best_epoch > 0 and select in best_metrics:
        best = f"; best {select} {best_metrics[select]:.4f} at epoch {best_epoch}"
    return f"resuming after epoch {done}/{epochs} from {checkpoint}{best}"


def interrupted_line(run_dir: Path, epochs: int) -> str:
    """What an interrupted run folder holds: the epochs its latest checkpoint saved, or nothing."""
    from idml.app.checkpoint import CheckpointError, read_state, resolve_checkpoint

    try:
        checkpoint = resolve_checkpoint(run_dir)
        done = int(read_state(checkpoint).get("epoch", 0))
    except CheckpointError:
        return f"interrupted before the first epoch was saved; {run_dir} holds no checkpoint"
    lost = f"; epoch {done + 1} was not finished and will be trained again" if done < epochs else ""
    return f"interrupted: {checkpoint} holds epochs 1-{done} of {epochs}{lost}"
