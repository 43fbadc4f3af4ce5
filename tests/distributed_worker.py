"""One process of the data-parallel tests (tests/test_distributed.py launches it; not a test itself).

``python tests/distributed_worker.py OUT --rank R --world-size W --init-file F`` joins a gloo group of
``W`` CPU processes through ``file://F`` (or, with ``--world-size 1``, runs alone, computing the
number of shards given per case in ``--cases``) and writes ``OUT/<tag>_rank<R>.pt`` holding, per case, the logged loss parts of each step
and the final weights; the test compares the files of the 2-process and the 1-process runs.

Every case trains in float64 from fixed global batches of ``B = 16`` images (4 classes × 4), split
over ranks exactly as the class-balanced sampler splits a global batch (``tensor_split``). The clipping
threshold is set high enough never to act, so the recorded gradients keep their scale.
"""

from __future__ import annotations

import argparse
import os
import warnings
from pathlib import Path
from typing import Any

import torch

import tiny_run

# The shared tiny run, at 4 classes × 4 images from 20 per class, with frozen BatchNorm statistics
# (they would differ between one process and a shard: on CPU there is no SyncBatchNorm), the
# uncertainty level read from the feature direction for the same reason (the default standardises
# the features with the batch's statistics), and clipping that never triggers.
TINY = [
    *tiny_run.TINY,
    "data.samples_per_class=20",
    "sampler.classes_per_batch=4",
    "model.freeze_bn=true",
    "model.uncertainty.level_input=direction",
    "optim.grad_clip=1000",
    "device=cpu",
]
ISM = ["model.uncertainty.enabled=true", "metric.introspective=true"]
SSR = ["ssr.enabled=true", "ssr.task.num_images=6", "ssr.task.p_task=1.0"]
CASES: dict[str, list[str]] = {
    "ms_ism_mixup": ["loss.name=multi_similarity", *ISM, "mixup.enabled=true"],
    "pa_ism": ["loss.name=proxy_anchor", *ISM],
    "ssr_joint": ["loss.name=multi_similarity", *ISM, "mixup.enabled=true", *SSR],
    "ssr_alternating": ["loss.name=proxy_anchor", *SSR, "ssr.task.update=alternating"],
    "interpolate": [
        "loss.name=proxy_anchor",
        *ISM,
        "mixup.enabled=true",
        "mixup.mode=interpolate",
    ],
    "warmup": ["loss.name=proxy_anchor", *ISM, "mixup.enabled=true", "optim.warmup_epochs=1"],
    # The classification task: introspective softmax over class weights, CutMix on every batch.
    "classification_cutmix": [
        "task=classification",
        *ISM,
        "mixup.enabled=true",
        "mixup.kind=cutmix",
        "mixup.probability=1.0",
    ],
}
METRIC_LEARNING_ONLY = ("eval.nmi",)
"""``TINY`` keys a classification config refuses (they apply to metric learning only)."""
STEPS = 3
BATCH, CLASSES = 16, 4


def global_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same ``STEPS`` global batches in every process (float64 images in [0, 1])."""
    g = torch.Generator().manual_seed(1234)
    out = []
    for step in range(STEPS):
        images = torch.rand(BATCH, 3, 8, 8, generator=g, dtype=torch.float64)
        labels = torch.arange(CLASSES).repeat_interleave(BATCH // CLASSES) + step % 2
        out.append((images, labels))
    return out


def state_of(trainer: Any) -> dict[str, torch.Tensor]:
    """Weights, and the gradients the last step applied (Adam is blind to a gradient's scale)."""
    modules = {"model": trainer.model, **trainer.training_modules()}
    state = {
        f"{name}.{key}": value.detach().clone()
        for name, module in modules.items()
        for key, value in module.state_dict().items()
    }
    for name, module in modules.items():
        for key, param in module.named_parameters():
            if param.grad is not None:
                state[f"grad.{name}.{key}"] = param.grad.detach().clone()
    return state


def run_case(name: str, context: Any, shards: int | None, run_dir: Path) -> dict[str, Any]:
    from idml.app.config import load_config
    from idml.app.training import Trainer

    base = TINY
    if "task=classification" in CASES[name]:
        base = [item for item in TINY if not item.startswith(METRIC_LEARNING_ONLY)]
    cfg = load_config(None, [*base, *CASES[name]])
    trainer = Trainer(cfg, run_dir / name, progress=False, distributed=context, shards=shards)
    for param in trainer.model.backbone_parameters():  # as train_epoch does in a warm-up epoch
        param.requires_grad_(cfg.optim.warmup_epochs == 0)
    initial = state_of(trainer)
    one_lambda = cfg.mixup.mode == "interpolate"
    aug = trainer.plan.generators(trainer.generator(0, 1), shared=one_lambda)
    ssr = trainer.plan.generators(trainer.generator(0, 2))
    parts = []
    for images, labels in global_batches():
        rows = torch.arange(BATCH).tensor_split(context.world_size)[context.rank]
        parts.append(trainer.train_step(images[rows], labels[rows], aug, ssr, ssr_on=True))
    return {"parts": parts, "state": state_of(trainer), "initial": initial}


def gather_checks(context: Any) -> dict[str, Any]:
    """all_gather_with_grad values and gradients, DDP's gradient average, uneven evaluation gathers."""
    from torch import nn

    from idml.app.distributed import (
        ParallelModules,
        all_gather_with_grad,
        gather_embeddings,
        wrap_ddp,
    )
    from idml.embeddings import Embeddings

    sizes = [3, 2]
    g = torch.Generator().manual_seed(7)
    blocks = [torch.randn(n, 4, generator=g, dtype=torch.float64) for n in sizes]
    weights = torch.randn(sum(sizes), 4, generator=g, dtype=torch.float64)
    mine = blocks[context.rank].clone().requires_grad_(True)
    gathered = all_gather_with_grad(mine)  # sizes gathered internally
    (weights * gathered.square()).sum().backward()
    start = sum(sizes[: context.rank])
    own_weights = weights[start : start + sizes[context.rank]]
    single_grad = 2 * blocks[context.rank] * own_weights  # d/dx of the same loss in one process
    out: dict[str, Any] = {
        "gathered": gathered.detach(),
        "expected": torch.cat(blocks),
        "grad_ratio": (mine.grad / single_grad).flatten(),
    }

    # DDP over a linear map: the averaged gradient equals one process's gradient on the full batch.
    torch.manual_seed(0)
    layer = nn.Linear(4, 3).double()
    reference = nn.Linear(4, 3).double()
    reference.load_state_dict(layer.state_dict())
    ddp = wrap_ddp({"layer": layer}, context)
    assert ddp is not None and isinstance(ddp.module, ParallelModules)

    def loss_of(z: torch.Tensor) -> torch.Tensor:
        return torch.logsumexp(z @ z.T, dim=1).mean()

    loss = ddp(lambda: loss_of(all_gather_with_grad(layer(mine.detach()))))
    loss.backward()
    loss_of(reference(torch.cat(blocks))).backward()
    assert layer.weight.grad is not None and reference.weight.grad is not None
    out["ddp_grad"] = layer.weight.grad.clone()
    out["single_grad"] = reference.weight.grad.clone()
    out["ddp_loss"] = float(loss)

    emb, labels = gather_embeddings(
        Embeddings(mine.detach(), mine.detach() * 2), torch.arange(sizes[context.rank]), context
    )
    out["eval_semantic"] = emb.semantic
    out["eval_uncertainty"] = emb.uncertainty
    out["eval_labels"] = labels
    out["mean"] = context.mean({"a": float(context.rank), "b": 1.5})
    out["broadcast"] = context.broadcast_object({"rank": context.rank})
    return out


def evaluation_check(context: Any, run_dir: Path) -> dict[str, Any]:
    """Sharded test-set embeddings versus one process embedding the whole test set."""
    from torch.utils.data import Subset

    from idml.app import build
    from idml.app.config import load_config
    from idml.app.tasks.metric_learning import embed_test_set
    from idml.app.training import Trainer
    from idml.embeddings import Embeddings
    from idml.models import embed_dataset

    cfg = load_config(None, [*TINY, "data.samples_per_class=39", "eval.batch_size=64"])
    trainer = Trainer(cfg, run_dir / "eval", progress=False, distributed=context)
    emb, labels = embed_test_set(trainer.evaluation_context())
    whole, whole_labels = embed_dataset(trainer.model, trainer.data.test, 64, trainer.device)
    # The same two contiguous parts embedded one after the other in this process: the batches
    # (and so the kernels oneDNN picks for each batch size) are those of the two ranks, so this
    # reference is bit-identical to the gathered embeddings by construction, on any CPU.
    parts = torch.arange(len(trainer.data.test)).tensor_split(context.world_size)
    layout = [
        embed_dataset(trainer.model, Subset(trainer.data.test, p.tolist()), 64, trainer.device)
        for p in parts
    ]
    out: dict[str, Any] = {
        "semantic": emb.semantic,
        "labels": labels,
        "whole_semantic": whole.semantic,
        "whole_labels": whole_labels,
        "layout_semantic": torch.cat([e.semantic for e, _ in layout]),
        "layout_labels": torch.cat([lab for _, lab in layout]),
    }
    try:
        from idml.evaluation import evaluate_embeddings  # noqa: F401
    except ImportError:  # the evaluation engine is a separate module; compare embeddings only
        return out
    out["metrics"] = trainer.evaluate()
    layout_emb = Embeddings(out["layout_semantic"], None)  # TINY has no uncertainty head
    layout_eval = build.evaluate(cfg, layout_emb, out["layout_labels"], trainer.device)
    out["layout_metrics"] = dict(layout_eval.metrics)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--init-file", type=Path, default=None)
    parser.add_argument("--tag", default="run")
    parser.add_argument(
        "--cases",
        default=",".join(CASES),
        help="NAME[:SHARDS],... (SHARDS: how many shards one process computes; default: 1 per rank)",
    )
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # freeze_bn on a random network warns; expected here
    torch.set_num_threads(1)
    if args.world_size > 1:
        os.environ.update(
            RANK=str(args.rank), WORLD_SIZE=str(args.world_size), LOCAL_RANK=str(args.rank)
        )
    from idml.app.distributed import destroy_distributed, init_distributed

    init = None if args.init_file is None else f"file://{args.init_file}"
    context = init_distributed(device="cpu", init_method=init)
    assert context.world_size == args.world_size and context.rank == args.rank, context
    results: dict[str, Any] = {"context": (context.rank, context.world_size, context.backend)}
    run_dir = args.out / f"{args.tag}_runs"
    if context.is_distributed:
        results["gather"] = gather_checks(context)
        results["evaluation"] = evaluation_check(context, run_dir)
    torch.set_default_dtype(torch.float64)
    for item in filter(None, args.cases.split(",")):
        name, _, shards = item.partition(":")
        results[name] = run_case(name, context, int(shards) if shards else None, run_dir)
    torch.save(results, args.out / f"{args.tag}_rank{args.rank}.pt")
    destroy_distributed(context)


if __name__ == "__main__":
    main()
