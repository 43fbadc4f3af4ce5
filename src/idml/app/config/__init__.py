"""Typed, validated run configuration.

One pydantic schema describes a whole run. Every model forbids unknown keys, so a typo is an error
that names the key and lists the valid ones instead of being silently dropped. YAML files in
``configs/`` are presets of this schema; ``--set key.sub=value`` overrides any field.

Composition (``include:`` of files and packaged fragments), overrides, validation and error
messages: :mod:`idml.app.config.io`; the base section and the generated ``loss`` section:
:mod:`idml.app.config.sections`. Every name is importable from here.

Example:
    >>> cfg = load_config(None, overrides=["loss.name=multi_similarity", "optim.epochs=3"])
    >>> cfg.loss.name, cfg.optim.epochs
    ('multi_similarity', 3)
    >>> try:
    ...     load_config(None, overrides=["optim.learning_rate=0.1"])
    ... except ConfigError as err:
    ...     print(str(err).splitlines()[0])
    unknown key 'optim.learning_rate'
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    Field,
    model_validator,
)

from idml.app.config.calibration import CalibrationConfig
from idml.app.config.io import (
    FRAGMENTS,
    INCLUDE_KEY,
    RUNTIME_KEYS,
    config_difference,
    config_to_dict,
    dump_config,
    fragment_names,
    fragment_overrides,
    load_config,
    merge_configs,
    read_fragment,
    stored_config_dict,
    to_overrides,
    validate_config,
)
from idml.app.config.sections import (
    DEFAULT_LOSS,
    LOSS_CONFIGS,
    PUBLISHED_METRIC,
    ConfigError,
    LossConfig,
    LossSection,
    OpenUnitInterval,
    PublishedNumbers,
    Section,
    UnitInterval,
    choices,
    loss_section,
)
from idml.augment import MixupMode
from idml.data.registry import DatasetName as Dataset
from idml.data.registry import VerifyMode
from idml.evaluation.clustering import KMeansBackend
from idml.metrics import ISMPower, ISMVariant
from idml.models.backbones import BackboneSpec
from idml.models.model import POOLING_NAMES, UncertaintyActivation, UncertaintyForm
from idml.ranking import SSRConfig as RankingConfig

# --------------------------------------------------------------------------- data
DatasetName = choices(Dataset)


class DataConfig(Section):
    """Where images come from and how they are shaped (layouts: README, "Data layouts")."""

    dataset: DatasetName = "digits"
    root: Path | None = Field(None, description="dataset folder (or CSV file); unused for digits")
    image_size: int = Field(224, gt=0, description="crop size fed to the network")
    resize_size: int | None = Field(
        256,
        description="test-time resize before the centre crop (None: the recipe's "
        "round(image_size * 256/224)). An override of image_size alone rescales a resize_size "
        "that follows that ratio",
    )
    train_crop_scale: tuple[float, float] = Field(
        (0.16, 1.0), description="RandomResizedCrop area range at train time"
    )
    horizontal_flip: bool = True
    samples_per_class: int | None = Field(
        None, gt=0, description="subsample at most this many images per class (offline data)"
    )
    num_train_classes: int | None = Field(
        None,
        gt=0,
        description="digits / fashion_mnist: train on the first N class ids, test on the rest "
        "(None: the standard half, 0-4 vs 5-9)",
    )
    num_workers: int = Field(2, ge=0)
    protocol: Literal["test", "validation"] = Field(
        "test",
        description="test: train on the train classes, evaluate on the test classes; validation: "
        "hold out the last validation_classes of the *train* classes and evaluate on them (the "
        "test classes are not used), for choosing hyper-parameters",
    )
    validation_classes: OpenUnitInterval = Field(
        0.25, description="share of the train classes held out by protocol=validation"
    )
    verify: VerifyMode = Field(
        "none",
        description="decode every image before training: raise listing the unreadable files, or "
        "skip them (counted and logged)",
    )


class SamplerConfig(Section):
    """Batch composition: class-balanced P×K (default) or plain random batches."""

    kind: Literal["balanced", "random"] = "balanced"
    classes_per_batch: int = Field(30, gt=0, description="P for the balanced sampler")
    images_per_class: int = Field(4, gt=0, description="K for the balanced sampler")
    batch_size: int = Field(120, gt=0, description="batch size of the random sampler")
    replacement: bool = Field(
        False, description="balanced: draw with replacement when a class has fewer than K images"
    )

    @property
    def effective_batch_size(self) -> int:
        if self.kind == "balanced":
            return self.classes_per_batch * self.images_per_class
        return self.batch_size


# --------------------------------------------------------------------------- model
def _known_backbone(name: str) -> str:
    BackboneSpec.parse(name)  # an unknown name raises, listing the registered ones
    return name


BackboneName = Annotated[str, AfterValidator(_known_backbone)]
"""A registered backbone (:class:`idml.models.BackboneName`: ``resnet50``, ``small_cnn``, …) or
``timm:<name>``."""


class UncertaintyHeadConfig(Section):
    """The uncertainty head (IDML).

    ``form: bounded`` (default): ``||u|| = max_norm·σ(level logit)`` starts at
    ``init_level·max_norm`` and can never exceed ``max_norm``, so ISM starts as the plain metric and
    cannot saturate (:class:`idml.models.model.BoundedUncertaintyHead`). ``form: linear`` is the
    paper's plain linear layer (``normalize``, ``activation`` and ``init_std`` apply to it only).
    """

    enabled: bool = False
    dim: int | None = Field(None, gt=0, description="d_u (None: same as embedding_dim)")
    form: choices(UncertaintyForm) = Field(
        "bounded", description="bounded level × direction (default) or the paper's linear layer"
    )
    max_norm: float = Field(
        1.0, gt=0, allow_inf_nan=False, description="bounded form: the bound u_max of ||u||"
    )
    init_level: OpenUnitInterval = Field(
        0.02, description="bounded form: ||u||/max_norm at initialisation"
    )
    normalize: bool = Field(
        False, description="L2-normalise u as the official code does (starves the head)"
    )
    activation: choices(UncertaintyActivation) = "none"
    init_std: float | None = Field(
        None,
        ge=0,
        allow_inf_nan=False,
        description="initial weights W ~ N(0, init_std²), b = 0 (None: PyTorch's default Linear "
        "init). A small value starts every ||u|| near 0, i.e. ISM near the plain metric",
    )

    @model_validator(mode="after")
    def _linear_only_keys(self) -> UncertaintyHeadConfig:
        if self.form == "bounded":
            linear_only = {
                "normalize": self.normalize,
                "activation": self.activation != "none",
                "init_std": self.init_std is not None,
            }
            if any(linear_only.values()):
                keys = ", ".join(f"model.uncertainty.{k}" for k, v in linear_only.items() if v)
                raise ValueError(
                    f"{keys} only apply to model.uncertainty.form=linear (the paper's linear "
                    "head); the bounded head sets its scale with model.uncertainty.max_norm and "
                    "model.uncertainty.init_level"
                )
        return self


class ModelConfig(Section):
    """Backbone, pooling and heads (:func:`idml.models.build_model`)."""

    backbone: BackboneName = "resnet50"
    pretrained: bool | Path = Field(
        True, description="ImageNet weights: true (cache), false, or a local weights file"
    )
    embedding_dim: int = Field(512, gt=0)
    pooling: choices(POOLING_NAMES) = "sum"
    freeze_bn: bool | None = Field(
        None, description="freeze BatchNorm statistics (None: when the backbone is pretrained)"
    )
    freeze_bn_affine: bool = False
    uncertainty: UncertaintyHeadConfig = UncertaintyHeadConfig()


# --------------------------------------------------------------------------- metric and losses
class MetricConfig(Section):
    """The metric every loss is written against; ``introspective`` switches on ISM (IDML Eq. 6)."""

    introspective: bool = False
    gamma: float = Field(0.0, ge=0, description="introspective bias γ")
    tau: float = Field(5.0, gt=0, description="weakening degree τ")
    power: ISMPower = 1
    variant: choices(ISMVariant) = "soft"
    delta_normalized: bool = Field(
        True, description="similarity form: δ between normalised vectors (False: official code)"
    )
    proxy_uncertainty: bool = Field(False, description="learnable uncertainty for each proxy")
    warmup_epochs: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="ISM warm-up: the relative uncertainty y is scaled by a factor that grows "
        "linearly from 0 to 1 over this many epochs (0: off)",
    )


# --------------------------------------------------------------------------- augmentations
class MixupConfig(Section):
    """Mixup with set labels (IDML Sec. III-C); ``interpolate``: the official code's loss interpolation."""

    enabled: bool = False
    alpha: float = Field(1.0, gt=0, description="λ ~ Beta(alpha, alpha)")
    fraction: float = Field(
        1.0, gt=0, le=1, description="mixed images added, as a fraction of the batch"
    )
    mode: choices(MixupMode) = "set"


class DegradationConfig(Section):
    """Paper Table 3 alternatives to Mixup: each degrades a fraction of a batch, labels unchanged."""

    low_resolution_fraction: UnitInterval = 0.0
    low_resolution_factor: float = Field(4.0, gt=1)
    blur_fraction: UnitInterval = 0.0
    blur_sigma: float = Field(2.0, gt=0)
    occlusion_fraction: UnitInterval = 0.0
    occlusion_area: OpenUnitInterval = 0.25


# --------------------------------------------------------------------------- SSR
class SSRSection(Section):
    """Self-supervised ranking auxiliary task (SSR, Fu et al. 2021); ``task`` holds its settings.

    ``task`` is :class:`idml.ranking.SSRConfig` (M, s, α_r, β_r, λ_r, γ_r, p_task, scheduling and
    the graded transforms' magnitudes and strength schedule under ``task.transforms``).
    """

    enabled: bool = False
    task: RankingConfig = RankingConfig()


# --------------------------------------------------------------------------- optimisation
class OptimConfig(Section):
    """AdamW with parameter groups, schedules, warm-up and clipping (recipes: README, "Presets")."""

    epochs: int = Field(60, gt=0)
    lr: float = Field(1e-4, gt=0)
    weight_decay: float = Field(1e-4, ge=0)
    backbone_lr_mult: float = Field(1.0, ge=0)
    head_lr_mult: float = Field(1.0, ge=0)
    uncertainty_lr_mult: float | None = Field(
        None,
        ge=0,
        allow_inf_nan=False,
        description="learning-rate multiplier of the uncertainty head (None: head_lr_mult, one "
        "group with the semantic head); a smaller value slows the growth of ||u||",
    )
    proxy_lr_mult: float = Field(100.0, ge=0)
    scheduler: Literal["none", "step", "cosine", "multistep"] = "step"
    step_size: int = Field(10, gt=0)
    step_gamma: float = Field(0.5, gt=0)
    milestones: list[int] = Field(
        default_factory=list, description="multistep: epochs after which lr is × step_gamma"
    )
    optimizer: Literal["adamw", "sgd"] = Field(
        "adamw", description="adamw, or SGD with momentum (the classification recipes)"
    )
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum")
    nesterov: bool = Field(False, description="SGD with Nesterov momentum")

    @model_validator(mode="after")
    def _optimizer_settings(self) -> OptimConfig:
        if self.nesterov and (self.optimizer != "sgd" or self.momentum == 0):
            raise ValueError("optim.nesterov=true needs optim.optimizer=sgd and optim.momentum > 0")
        if self.scheduler == "multistep" and not self.milestones:
            raise ValueError(
                "optim.scheduler=multistep needs optim.milestones, e.g. [75, 150, 225]"
            )
        if any(m <= 0 for m in self.milestones):
            raise ValueError(f"optim.milestones must be positive epochs, got {self.milestones}")
        return self

    warmup_epochs: int = Field(0, ge=0, description="epochs that train only heads and proxies")
    grad_clip: float | None = Field(10.0, gt=0)
    amp: bool = Field(True, description="mixed precision (CUDA only)")
    max_steps_per_epoch: int | None = Field(None, gt=0, description="cap iterations (smoke runs)")


class EvalConfig(Section):
    """Evaluation during training, as :func:`idml.evaluation.evaluate_embeddings` does it."""

    every: int = Field(1, gt=0, description="evaluate every N epochs (and after the last)")
    ks: list[int] = Field(default_factory=lambda: [1, 2, 4, 8])
    nmi: bool = True
    nmi_backend: KMeansBackend = Field(
        "auto",
        description="k-means for NMI: auto (k-NN-graph k-means when test points x classes > 5e7, "
        "e.g. SOP; else full k-means: faiss if installed, else scikit-learn), faiss, sklearn, or "
        "'knn' (k-NN-graph k-means on the search's neighbour lists)",
    )
    introspective: bool = Field(False, description="rank with ISM at test time (ablation)")
    select: str = Field("recall@1", description="metric that picks the best epoch")
    batch_size: int = Field(256, gt=0)


# --------------------------------------------------------------------------- classification
class ClassificationConfig(Section):
    """``task: classification``: a cosine classifier ``z = s·S(x, w_c)`` on the semantic embedding
    (``S_IN`` with ``metric.introspective``), Mixup/CutMix with λ-weighted set labels (IDML, TPAMI
    version; Yun et al. 2019 for CutMix)."""

    scale: float = Field(16.0, gt=0, allow_inf_nan=False, description="logit scale s = 1/T")
    mix: Literal["none", "mixup", "cutmix"] = "none"
    mix_alpha: float = Field(1.0, gt=0, allow_inf_nan=False, description="λ ~ Beta(α, α)")
    mix_prob: UnitInterval = Field(1.0, description="probability that a batch is mixed")
    keep_originals: bool = Field(
        False, description="append the mixed batch to the clean one instead of replacing it"
    )
    test_fraction: OpenUnitInterval = Field(
        0.2, description="per-class hold-out of datasets without a test side"
    )
    test_samples_per_class: int | None = Field(
        None, gt=0, description="subsample the test side (data.samples_per_class: the train side)"
    )
    ks: list[int] = Field(default_factory=lambda: [1, 5], description="top-k accuracies")
    ece_bins: int = Field(15, gt=0, description="equal-width confidence bins of the ECE")
    uncertainty_probes: bool = Field(
        True, description="log ||u|| of Mixup, CutMix and low-resolution test images"
    )


Task = Literal["metric_learning", "classification"]

_METRIC_ONLY_SECTIONS = ("loss", "mixup", "ssr", "calibration")
_METRIC_ONLY_EVAL_KEYS = ("ks", "nmi", "nmi_backend", "introspective")


class MLflowConfig(Section):
    """Mirror the run's log into MLflow (``pip install 'idml[mlflow]'``; see idml.app.loggers)."""

    enabled: bool = False
    tracking_uri: str | None = Field(
        None, description="MLflow tracking URI (default: a local file store <run>/mlruns)"
    )
    experiment: str = Field("idml", min_length=1, description="MLflow experiment name")


class Config(Section):
    """A whole run."""

    name: str = "run"
    task: Task = Field(
        "metric_learning", description="metric_learning (retrieval) or classification"
    )
    seed: int = Field(0, ge=0, description="seed of every random draw (numpy needs it >= 0)")
    device: str = Field(
        "auto", pattern=r"^(auto|cpu|mps|cuda(:\d+)?)$", description="auto, cpu, cuda, cuda:N, mps"
    )
    data: DataConfig = DataConfig()
    sampler: SamplerConfig = SamplerConfig()
    model: ModelConfig = ModelConfig()
    metric: MetricConfig = MetricConfig()
    loss: LossConfig = Field(default_factory=lambda: LOSS_CONFIGS[DEFAULT_LOSS](name=DEFAULT_LOSS))
    mixup: MixupConfig = MixupConfig()
    degradations: DegradationConfig = DegradationConfig()
    ssr: SSRSection = SSRSection()
    optim: OptimConfig = OptimConfig()
    eval: EvalConfig = EvalConfig()
    calibration: CalibrationConfig = CalibrationConfig()
    tensorboard: bool = Field(True, description="also log to TensorBoard when it is installed")
    mlflow: MLflowConfig = MLflowConfig()
    published: PublishedNumbers | None = Field(
        None, description="numbers a paper reports for this recipe (compared, never trained on)"
    )
    classification: ClassificationConfig | None = Field(
        None, description="the classification task's settings (task: classification only)"
    )

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        if self.metric.introspective and not self.model.uncertainty.enabled:
            raise ValueError(
                "metric.introspective=true needs an uncertainty head: set "
                "model.uncertainty.enabled=true"
            )
        if self.loss.probabilistic and self.metric.introspective:
            raise ValueError(
                f"loss.name={self.loss.name} models uncertainty itself; set "
                "metric.introspective=false"
            )
        if any(k <= 0 for k in self.eval.ks):
            raise ValueError(f"eval.ks must be positive integers, got {self.eval.ks}")
        return self

    @model_validator(mode="after")
    def _task_sections(self) -> Config:
        """Keys of the other task are errors that name the key; classification defaults."""
        if self.task == "metric_learning":
            if self.classification is not None:
                raise ValueError(
                    "classification: this section applies to task: classification; set "
                    "task=classification or remove the classification section"
                )
            return self
        defaults = Config()
        for section in _METRIC_ONLY_SECTIONS:
            changed = config_difference(
                {section: config_to_dict(defaults)[section]},
                {section: config_to_dict(self)[section]},
                ignore=(),
            )
            if changed:
                key = changed[0].split(":")[0]
                if section == "loss" and self.loss.name != defaults.loss.name:
                    key = "loss.name"
                    changed = [f"loss.name: {defaults.loss.name!r} -> {self.loss.name!r}"]
                raise ValueError(
                    f"{key}: {section}.* applies to task: metric_learning; task: classification "
                    "trains a cosine classifier (classification.scale, classification.mix for "
                    f"Mixup/CutMix): remove {section}.* ({changed[0]})"
                )
        for key in _METRIC_ONLY_EVAL_KEYS:
            if getattr(self.eval, key) != getattr(defaults.eval, key):
                raise ValueError(
                    f"eval.{key} applies to task: metric_learning (retrieval); task: "
                    "classification reports classification.ks top-k accuracies and the ECE: "
                    f"remove eval.{key}"
                )
        if self.data.dataset in ("cub", "cars", "sop"):
            raise ValueError(
                f"data.dataset={self.data.dataset}: a zero-shot retrieval benchmark has no "
                "classification split; use digits, fashion_mnist, folder (ImageNet/CIFAR "
                "layouts) or csv"
            )
        if self.classification is None:
            self.classification = ClassificationConfig()
        if any(k <= 0 for k in self.classification.ks):
            raise ValueError(f"classification.ks must be positive, got {self.classification.ks}")
        if "select" not in self.eval.model_fields_set:
            self.eval.select = "top1"
        if "kind" not in self.sampler.model_fields_set:
            self.sampler.kind = "random"
        return self


__all__ = [
    "DEFAULT_LOSS",
    "FRAGMENTS",
    "INCLUDE_KEY",
    "LOSS_CONFIGS",
    "PUBLISHED_METRIC",
    "RUNTIME_KEYS",
    "CalibrationConfig",
    "Config",
    "ConfigError",
    "LossConfig",
    "LossSection",
    "PublishedNumbers",
    "Section",
    "choices",
    "config_difference",
    "config_to_dict",
    "dump_config",
    "fragment_names",
    "fragment_overrides",
    "load_config",
    "loss_section",
    "merge_configs",
    "read_fragment",
    "stored_config_dict",
    "to_overrides",
    "validate_config",
]
