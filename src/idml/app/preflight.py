"""Checks of a run's config that would otherwise fail, or silently mislead, only after training.

:func:`check_run_config` runs before the first optimisation step (what a config asks of the data
is checked by its task as soon as the data is loaded, e.g. a top-k accuracy of more classes than
the dataset has). It refuses settings that cannot work (``eval.select`` naming a metric the evaluation does not report, a test resize smaller than
the crop, nothing left to train) and returns warnings for settings that make a run meaningless
without breaking it (a warm-up that never ends, a test centre crop that sees a small part of each
image, learning-rate milestones the run never reaches). Every message names the keys involved and what to change.
"""

from __future__ import annotations

import torch
from torch import nn

from idml.app.build import build_loss
from idml.app.config import Config, ConfigError, config_to_dict, reads_key
from idml.app.paper import config_value
from idml.data.transforms import eval_resize_size

FLOAT32_MAX = 3.4028234663852886e38
MIN_CROP_AREA = 0.25
"""Below this share of the resized image's area a test centre crop is reported: the DML recipe
(Resize 256, CenterCrop 224) keeps 77 %."""


def check_loss_builds(cfg: Config) -> None:
    """Refuse hyper-parameters the loss itself rejects once it knows its metric (Contrastive's
    crossed margins: a distance or a similarity decides which way they may not cross), before the
    data loads rather than at the first step."""
    try:
        build_loss(cfg, num_classes=2)
    except ValueError as err:
        raise ConfigError(f"loss.name={cfg.loss.name}: {err}") from None


def check_run_config(cfg: Config) -> list[str]:
    """Raise :class:`~idml.app.config.ConfigError` for a run that cannot work; return warnings."""
    names = cfg.task.spec.metric_names(cfg)
    if cfg.eval.select not in names:
        raise ConfigError(
            f"eval.select={cfg.eval.select!r} is not a metric this {cfg.task.name} run reports; "
            f"choose one of {', '.join(names)}"
        )
    d, o = cfg.data, cfg.optim
    resize = eval_resize_size(d.image_size) if d.resize_size is None else d.resize_size
    if resize < d.image_size:
        raise ConfigError(
            f"data.resize_size={resize} is smaller than data.image_size={d.image_size}: the test "
            "centre crop would not fit; set data.resize_size >= data.image_size (or null for the "
            f"recipe's {eval_resize_size(d.image_size)})"
        )
    if cfg.published is not None and cfg.published.recipe:
        config = config_to_dict(cfg)
        for key in cfg.published.recipe:
            try:
                config_value(config, key)
            except KeyError:
                raise ConfigError(
                    f"published.recipe names {key!r}, which is not a config key; use dotted keys "
                    "such as data.dataset or optim.epochs"
                ) from None
    warnings: list[str] = []
    area = (d.image_size / resize) ** 2
    if area < MIN_CROP_AREA:
        warnings.append(
            f"data.resize_size={resize} with data.image_size={d.image_size}: the test centre crop "
            f"sees only the central {area:.0%} of each image; set data.resize_size="
            f"{eval_resize_size(d.image_size)} (the recipe's 256/224 ratio) or null"
        )
    if reads_key(cfg.task.spec.reads, "loss"):
        check_loss_builds(cfg)
    mults = [o.backbone_lr_mult, o.head_lr_mult, o.proxy_lr_mult, o.uncertainty_lr_mult or 0]
    if o.lr * max(mults) >= FLOAT32_MAX:
        raise ConfigError(
            f"optim.lr={o.lr:g} times its multipliers overflows float32 weights; use a learning "
            "rate below 1 (the presets use 1e-4)"
        )
    trains_heads = o.head_lr_mult > 0 or (o.uncertainty_lr_mult or 0) > 0
    trains_backbone = o.backbone_lr_mult > 0 and o.warmup_epochs < o.epochs
    if not trains_heads and not trains_backbone:
        raise ConfigError(
            f"nothing would train: optim.head_lr_mult={o.head_lr_mult} and the backbone is "
            f"frozen (optim.backbone_lr_mult={o.backbone_lr_mult}, optim.warmup_epochs="
            f"{o.warmup_epochs}, optim.epochs={o.epochs}); raise a learning-rate multiplier"
        )
    if o.warmup_epochs >= o.epochs and o.backbone_lr_mult > 0:
        warnings.append(
            f"optim.warmup_epochs={o.warmup_epochs} >= optim.epochs={o.epochs}: the backbone stays "
            "frozen for the whole run; lower optim.warmup_epochs (or raise optim.epochs), or set "
            "optim.backbone_lr_mult=0 to freeze it on purpose"
        )
    if o.scheduler == "multistep":
        # MultiStepLR lowers the rate after epoch m: a milestone at or past the last epoch never acts.
        unreached = [m for m in o.milestones if m >= o.epochs]
        if unreached:
            halves = sorted({min(o.epochs - 1, max(1, round(f * o.epochs))) for f in (0.5, 0.75)})
            fix = (
                f"set optim.milestones below {o.epochs}, e.g. {halves} (half and three quarters "
                "of the run), or optim.scheduler=none"
                if o.epochs > 1
                else "a one-epoch run has none to reach: set optim.scheduler=none"
            )
            warnings.append(
                f"optim.milestones={o.milestones} with optim.epochs={o.epochs}: the learning rate "
                f"never drops at {unreached} (a milestone m acts after epoch m); {fix}"
            )
    return warnings


def check_model_input(model: nn.Module, cfg: Config, channels: int = 3) -> None:
    """One forward of a blank ``data.image_size`` batch, so that a crop too small for the
    backbone's downsampling fails here, naming the keys, and not inside torch mid-epoch."""
    size = cfg.data.image_size
    was_training = model.training
    device = next(model.parameters()).device
    model.eval()
    try:
        with torch.no_grad():
            model(torch.zeros(1, channels, size, size, device=device))
    except RuntimeError as err:
        raise ConfigError(
            f"data.image_size={size} is too small for model.backbone={cfg.model.backbone} "
            f"({str(err).splitlines()[0]}); raise data.image_size"
        ) from None
    finally:
        model.train(was_training)
