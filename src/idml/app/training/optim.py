"""The optimizers and learning-rate schedule of a training run, from ``optim``."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from idml.app.config import Config


def build_optimizers(
    cfg: Config, model: Any, loss: nn.Module, ssr: nn.Module | None, fused: bool = False
) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer | None]:
    """The main optimizer (backbone, heads, uncertainty head, proxies and loss parameters in
    named groups) and, for alternating SSR updates, the ranking head's own optimizer; ``fused``:
    their fused kernels (one launch for every parameter; else torch's default: ``foreach`` on
    CUDA, a loop over the parameters on the CPU)."""
    kernel: dict[str, Any] = {"fused": True} if fused else {}
    o = cfg.optim
    # The uncertainty head gets its own group only when asked to: the default layout (and so
    # the optimizer state of existing checkpoints) stays two model groups.
    own_uncertainty_group = o.uncertainty_lr_mult is not None
    uncertainty = {id(p) for p in model.uncertainty_head_parameters()}
    groups = [
        {
            "params": list(model.backbone_parameters()),
            "lr": o.lr * o.backbone_lr_mult,
            "name": "backbone",
        },
        {
            "params": [
                p
                for p in model.head_parameters()
                if not (own_uncertainty_group and id(p) in uncertainty)
            ],
            "lr": o.lr * o.head_lr_mult,
            "name": "heads",
        },
    ]
    if own_uncertainty_group:
        groups.append(
            {
                "params": list(model.uncertainty_head_parameters()),
                "lr": o.lr * o.uncertainty_head_lr[0],
                "name": "uncertainty",
            }
        )
    proxies: list[nn.Parameter] = []
    others: list[nn.Parameter] = []
    for n, p in loss.named_parameters():
        (proxies if n.startswith(("proxies", "proxy_")) else others).append(p)
    if proxies:
        # Proxies are heads of the loss: their rate follows the heads', not the backbone's, so a
        # recipe that raises the heads' rate (a pretrained backbone) keeps the proxies' ratio.
        proxy_lr = o.lr * o.head_lr_mult * o.proxy_lr_mult
        groups.append({"params": proxies, "lr": proxy_lr, "name": "proxies"})
    if others:
        groups.append({"params": others, "lr": o.lr * o.head_lr_mult, "name": "loss"})
    ranking_opt = None
    if ssr is not None:
        ranking = {
            "params": list(ssr.parameters()),
            "lr": o.lr * o.head_lr_mult,
            "name": "ranking",
        }
        if cfg.ssr.task.update == "alternating":
            ranking_opt = torch.optim.AdamW(
                [ranking], lr=o.lr, weight_decay=o.weight_decay, **kernel
            )
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
            **kernel,
        )
        return sgd, ranking_opt
    return torch.optim.AdamW(groups, lr=o.lr, weight_decay=o.weight_decay, **kernel), ranking_opt


def build_scheduler(
    cfg: Config, opt: torch.optim.Optimizer
) -> torch.optim.lr_scheduler.LRScheduler | None:
    """The learning-rate schedule ``optim.scheduler`` names, or ``None``."""
    o = cfg.optim
    if o.scheduler == "step":
        return torch.optim.lr_scheduler.StepLR(opt, step_size=o.step_size, gamma=o.step_gamma)
    if o.scheduler == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=o.epochs)
    if o.scheduler == "multistep":
        return torch.optim.lr_scheduler.MultiStepLR(
            opt, milestones=list(o.milestones), gamma=o.step_gamma
        )
    return None


def restore_schedule(
    cfg: Config,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    saved: dict[str, Any] | None,
    epochs_done: int,
    epochs_changed: bool,
) -> torch.optim.lr_scheduler.LRScheduler | None:
    """The schedule of a resumed run: the ``saved`` one when the run's length is unchanged; else
    the schedule of a fresh run of ``optim.epochs``, advanced by ``epochs_done`` steps from the base
    rates as an uninterrupted run of that length steps it (cosine's ``T_max`` is the run length,
    so the saved schedule cannot be reused)."""
    if scheduler is None or saved is None:
        return scheduler
    if not epochs_changed:
        scheduler.load_state_dict(saved)
        return scheduler
    for group, base in zip(optimizer.param_groups, scheduler.base_lrs, strict=True):
        group["lr"] = group["initial_lr"] = base
    fresh = build_scheduler(cfg, optimizer)
    assert fresh is not None  # the same optim.scheduler that built ``scheduler``
    # Stepping the schedule without optimizer steps is the point: silence torch's warning.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(epochs_done):
            fresh.step()
    return fresh
