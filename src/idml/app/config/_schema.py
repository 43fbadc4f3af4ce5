"""The run schema (:mod:`idml.app.config`): one pydantic model per section and :class:`Config`,
a whole run.

Every section forbids unknown keys and validates on assignment (:class:`Section`). Two sections are
chosen by name from a registry: ``loss`` (:data:`idml.losses.LOSSES`; the loss's hyper-parameter
model supplies the other keys) and ``task`` (:data:`idml.app.tasks.TASKS`; the task's settings).
Both are validated as the discriminated union of the models registered *at validation time*
(:class:`NamedSections`), so a loss or task registered after this module was imported is valid too.
A task also says which other keys it reads (:attr:`idml.app.tasks.Task.reads`): a config that sets
a key its task does not read is an error naming the key.

It also holds :class:`PublishedNumbers`, the numbers a source reports for a recipe.
"""

from __future__ import annotations

import enum
import re
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeAlias

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializeAsAny,
    TypeAdapter,
    WrapValidator,
    create_model,
    field_validator,
    model_validator,
)

from idml.augment import MixupMode
from idml.data.datasets import HeldOutOrder
from idml.data.registry import DatasetName as Dataset
from idml.data.registry import VerifyMode
from idml.evaluation.clustering import KMeansBackend
from idml.evaluation.confidence import DEFAULT_FEATURES, score_from_key
from idml.losses import LOSSES, LossSpec
from idml.metrics import ISMPower, ISMVariant
from idml.models.backbones import BackboneSpec
from idml.models.model import POOLING_NAMES, LevelInput, UncertaintyActivation, UncertaintyForm
from idml.ranking import SSRConfig as RankingConfig

if TYPE_CHECKING:
    from idml.app.tasks import Task


def choices(values: Iterable[Any]) -> Any:
    """The ``Literal`` of a library's list of choices (an enum's values, a mapping's keys), so a
    config key accepts exactly what the library knows and says so when it does not.

    >>> from idml.augment import MixupMode
    >>> choices(MixupMode)
    typing.Literal['set', 'interpolate']
    """
    return Literal[tuple(v.value if isinstance(v, enum.Enum) else v for v in values)]


class ConfigError(ValueError):
    """A configuration problem, with the offending key and what to do about it."""


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


UnitInterval = Annotated[float, Field(ge=0, le=1)]
"""A number in ``[0, 1]``: a probability, or a share of a batch."""
OpenUnitInterval = Annotated[float, Field(gt=0, lt=1)]
"""A share strictly between 0 and 1."""


# --------------------------------------------------------------------------- named sections
class NamedSection(Section):
    """Base of a section whose ``name`` picks an entry of a registry, whose settings model supplies
    the other keys (``loss``, ``task``)."""

    name: str


class NamedSections(Mapping[str, type[NamedSection]]):
    """Entry name → the config model of its section (the entry's settings model with ``name``
    first), following a registry: an entry registered after this module was imported is valid too.

    Args:
        key: the config key of the section (``loss``, ``task``).
        registry: returns the registry (a mapping of name → entry), read at each use.
        settings: an entry's settings model.
        base: the base class of the generated models.
        default: the name a section without ``name`` takes.
    """

    def __init__(
        self,
        key: str,
        registry: Callable[[], Mapping[str, Any]],
        settings: Callable[[Any], type[BaseModel]],
        base: type[NamedSection],
        default: str,
    ) -> None:
        self.key = key
        self.registry = registry
        self.settings = settings
        self.base = base
        self.default = default
        self._models: dict[tuple[str, type[BaseModel]], type[NamedSection]] = {}
        self._unions: dict[tuple[type[NamedSection], ...], TypeAdapter[Any]] = {}

    def __getitem__(self, name: str) -> type[NamedSection]:
        params = self.settings(self.registry()[name])
        cache = (name, params)
        if cache not in self._models:
            title = params.__name__.removesuffix("Params") + "Config"
            bases: tuple[type[Any], ...] = (params, self.base)
            model = typing.cast(
                type[NamedSection],
                create_model(title, __base__=bases, __module__=__name__, name=(Literal[name], ...)),
            )
            model.__doc__ = params.__doc__
            globals().setdefault(title, model)  # importable by name, so a config pickles
            self._models[cache] = model
        return self._models[cache]

    def __iter__(self) -> Iterator[str]:
        return iter(self.registry())

    def __len__(self) -> int:
        return len(self.registry())

    def validate(self, value: Any) -> NamedSection:
        """``value`` as the discriminated union of the registered entries' models (a bare name
        stands for ``{name: <name>}``; a mapping without ``name`` takes the default)."""
        if isinstance(value, str):
            value = {"name": value}
        elif isinstance(value, Mapping) and "name" not in value:
            value = {"name": self.default, **value}
        members = tuple(self.values())
        if members not in self._unions:
            union: Any = typing.Union[members]  # noqa: UP007 (a runtime tuple of models)
            self._unions[members] = TypeAdapter(Annotated[union, Field(discriminator="name")])
        section: NamedSection = self._unions[members].validate_python(value)
        return section

    def field(self, description: str) -> Any:
        """The ``Config`` field of this section: its default entry, validated by :meth:`validate`."""
        return Field(
            default_factory=lambda: self[self.default](name=self.default), description=description
        )


class LossSection(NamedSection):
    """Base of the ``loss`` section: ``name`` picks a loss of :data:`idml.losses.LOSSES`, whose
    hyper-parameter model supplies the other keys."""

    @property
    def spec(self) -> LossSpec:
        """The registry entry of this loss."""
        return LOSSES[self.name]

    @property
    def probabilistic(self) -> bool:
        """The loss models uncertainty itself (PEL): the PEL head, no ISM."""
        return self.spec.probabilistic


class TaskSection(NamedSection):
    """Base of the ``task`` section: ``name`` picks a task of :data:`idml.app.tasks.TASKS`, whose
    settings model (:attr:`idml.app.tasks.Task.params`) supplies the other keys."""

    @property
    def spec(self) -> Task:
        """The registered task."""
        from idml.app.tasks import TASKS

        return TASKS[self.name]


def _tasks() -> Mapping[str, Any]:
    from idml.app.tasks import TASKS

    return TASKS


DEFAULT_LOSS = "proxy_anchor"
DEFAULT_TASK = "metric_learning"

LOSS_CONFIGS = NamedSections(
    "loss", lambda: LOSSES, lambda spec: spec.params, LossSection, DEFAULT_LOSS
)
"""Loss name → the model of its ``loss`` section (see :func:`loss_section`)."""
TASK_CONFIGS = NamedSections("task", _tasks, lambda task: task.params, TaskSection, DEFAULT_TASK)
"""Task name → the model of its ``task`` section."""
NAMED_SECTIONS: dict[str, NamedSections] = {"loss": LOSS_CONFIGS, "task": TASK_CONFIGS}
"""The sections chosen by name, by config key."""


def loss_section(name: str) -> type[LossSection]:
    """The config model of ``loss: {name: <name>, ...}``: the registered loss's hyper-parameter
    model (fields, defaults, bounds and validators) with ``name`` first.

    >>> loss_section("proxy_anchor")(name="proxy_anchor")
    ProxyAnchorConfig(name='proxy_anchor', alpha=32.0, margin=0.1)
    """
    return typing.cast(type[LossSection], LOSS_CONFIGS[name])


LossConfig = Annotated[
    SerializeAsAny[LossSection], WrapValidator(lambda value, _: LOSS_CONFIGS.validate(value))
]
"""Any registered loss's section, chosen by ``name`` (an unknown name lists the valid ones)."""
TaskConfig = Annotated[
    SerializeAsAny[TaskSection], WrapValidator(lambda value, _: TASK_CONFIGS.validate(value))
]
"""Any registered task's section, chosen by ``name`` (``task: classification`` is short for
``task: {name: classification}``)."""


# --------------------------------------------------------------------------- published numbers
PUBLISHED_METRIC = re.compile(r"^(recall@[1-9]\d*|nmi|map@r|r_precision|map|mrr|top[1-9]\d*)$")


class PublishedNumbers(Section):
    """Numbers a source reports for a recipe, in % as printed, and where they are printed."""

    source: str = Field(min_length=1, description="paper, table and row the numbers come from")
    metrics: dict[str, float] = Field(
        description="metric name (as idml evaluates it) -> value in %"
    )
    recipe: dict[str, Any] = Field(
        default_factory=dict,
        description="dotted config key -> the source's value (dataset, backbone, embedding size, "
        "schedule): the numbers are compared with a run only when it keeps them (empty: not "
        "recorded, so not checked)",
    )
    classes: int | None = Field(
        None, ge=1, description="training classes of the source's dataset (checked when known)"
    )

    @model_validator(mode="before")
    @classmethod
    def _bare_metrics(cls, raw: Any) -> Any:
        # Run folders written before ``source`` existed hold the bare metric mapping.
        if isinstance(raw, dict) and raw and not {"source", "metrics"} & set(raw):
            return {"source": "unspecified", "metrics": raw}
        return raw

    @model_validator(mode="after")
    def _known_metrics(self) -> PublishedNumbers:
        for key, value in self.metrics.items():
            if not PUBLISHED_METRIC.match(key):
                raise ValueError(
                    f"published.metrics: unknown metric {key!r}; use recall@K, nmi, map@r, "
                    "r_precision, map, mrr or (classification) topK"
                )
            if not 0.0 <= value <= 100.0:
                raise ValueError(f"published.metrics.{key}={value} is not a percentage in [0, 100]")
        return self


# --------------------------------------------------------------------------- data
# A config key's choices are the library's lists, as a ``Literal`` built at run time; to the type
# checker they are strings.
if TYPE_CHECKING:
    DatasetName: TypeAlias = str
    UncertaintyFormName: TypeAlias = str
    UncertaintyActivationName: TypeAlias = str
    LevelInputName: TypeAlias = str
    PoolingName: TypeAlias = str
    ISMVariantName: TypeAlias = str
    MixupModeName: TypeAlias = str
else:
    DatasetName = choices(Dataset)
    UncertaintyFormName = choices(UncertaintyForm)
    UncertaintyActivationName = choices(UncertaintyActivation)
    LevelInputName = choices(LevelInput)
    PoolingName = choices(POOLING_NAMES)
    ISMVariantName = choices(ISMVariant)
    MixupModeName = choices(MixupMode)


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
    validation_order: HeldOutOrder = Field(
        "last",
        description="which train classes protocol=validation holds out: the 'last' by id, "
        "'spread' evenly over the ids, or 'last_groups': the last whole groups of classes named "
        "group/class (Omniglot's alphabets), as many as come closest to validation_classes, so "
        "the validation classes come from unseen groups as zero-shot test classes do",
    )
    verify: VerifyMode = Field(
        "none",
        description="decode every image before training: raise listing the unreadable files, or "
        "skip them (counted and logged)",
    )
    decode: Literal["pil", "torchvision", "device"] = Field(
        "pil",
        description="who decodes image files: pil (the reference) or torchvision (decode_jpeg, "
        "the same pixels, ~1.5x faster per core) in the loader workers; device: the workers send "
        "the JPEG bytes and each train batch is decoded on the training device (nvJPEG on CUDA; "
        "needs augment_on=device; test images are decoded by torchvision)",
    )
    augment_on: Literal["workers", "device"] = Field(
        "workers",
        description="where the train crop and flip run: per image in the loader workers (the "
        "reference), or on whole batches on the training device, drawn from the run's seed "
        "(the same images up to one grey level, idml.data.batches)",
    )
    cache: Path | None = Field(
        None,
        description="folder of a decoded uint8 image cache written by `idml cache` (checked "
        "against the dataset's files when the run starts); no image is decoded while training",
    )

    @model_validator(mode="after")
    def _data_path(self) -> DataConfig:
        if self.decode == "device" and self.augment_on != "device":
            raise ValueError(
                "data.decode=device decodes whole batches on the device, so the crops must be cut "
                "there too: set data.augment_on=device (or data.decode=torchvision)"
            )
        if self.cache is not None and self.decode != "pil":
            raise ValueError(
                f"data.decode={self.decode} does not apply with data.cache: the cache holds "
                "decoded pixels; remove one of them"
            )
        return self


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
    form: UncertaintyFormName = Field(
        "bounded", description="bounded level × direction (default) or the paper's linear layer"
    )
    max_norm: float = Field(
        1.0, gt=0, allow_inf_nan=False, description="bounded form: the bound u_max of ||u||"
    )
    init_level: OpenUnitInterval = Field(
        0.02, description="bounded form: ||u||/max_norm at initialisation"
    )
    level_input: LevelInputName = Field(
        "standardized",
        description="bounded form: the level logit reads the features standardised over the "
        "batch (default), standardised by the running statistics in training too "
        "(standardized_running: ||u|| at test is the trained one), or their unit direction (the "
        "head before 2026-12; u barely moves)",
    )
    backbone_gradient: bool = Field(
        True,
        description="the head's gradient reaches the backbone (false: u reads the features "
        "detached and learns from them without shaping them; an ablation)",
    )
    normalize: bool = Field(
        False, description="L2-normalise u as the official code does (starves the head)"
    )
    activation: UncertaintyActivationName = "none"
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
        elif self.level_input != "standardized":
            raise ValueError(
                "model.uncertainty.level_input only applies to model.uncertainty.form=bounded "
                "(the linear layer has no level logit)"
            )
        return self


class ModelConfig(Section):
    """Backbone, pooling and heads (:func:`idml.models.build_model`)."""

    backbone: BackboneName = "resnet50"
    pretrained: bool | Path = Field(
        True, description="ImageNet weights: true (cache), false, or a local weights file"
    )
    embedding_dim: int = Field(512, gt=0)
    pooling: PoolingName = "sum"
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
    variant: ISMVariantName = "soft"
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
    """Mixed images with set labels (IDML Sec. III-C): Mixup (Zhang et al. 2018) or CutMix (Yun et
    al. 2019). Metric learning appends ``fraction`` of the batch as mixed images (``interpolate``:
    the official code's loss interpolation instead of set labels); classification mixes a whole
    batch with ``probability``, replacing it (the Mixup/CutMix recipe) or, with
    ``keep_originals``, appending it."""

    enabled: bool = False
    kind: Literal["mixup", "cutmix"] = Field(
        "mixup", description="mixup: λ·x_a + (1 − λ)·x_b; cutmix: a box of x_b pasted into x_a"
    )
    alpha: float = Field(1.0, gt=0, allow_inf_nan=False, description="λ ~ Beta(alpha, alpha)")
    fraction: float = Field(
        1.0, gt=0, le=1, description="metric learning: mixed images added, as a share of the batch"
    )
    mode: MixupModeName = Field("set", description="metric learning: set labels or interpolate")
    probability: UnitInterval = Field(
        1.0, description="classification: probability that a batch is mixed"
    )
    keep_originals: bool = Field(
        False, description="classification: append the mixed batch instead of replacing it"
    )
    uncertainty_weight: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="metric learning, EXTENSION, not the paper's IDML (0: off): weight η of a term "
        "that ties the uncertainty level of a Mixup image to its ambiguity 1 − |2λ − 1| "
        "(idml.losses.ambiguity)",
    )
    uncertainty_level: float = Field(
        0.5,
        gt=0,
        le=1,
        description="metric learning, extension: the target ||u||/max_norm of a 50/50 mix",
    )

    @model_validator(mode="after")
    def _interpolate_mixup_only(self) -> MixupConfig:
        if self.kind == "cutmix" and self.mode == "interpolate":
            raise ValueError(
                "mixup.mode=interpolate weights Mixup's losses by λ; with mixup.kind=cutmix use "
                "mixup.mode=set"
            )
        return self


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
    proxy_lr_mult: float = Field(
        100.0,
        ge=0,
        description="class proxies' learning rate as a multiple of the heads' (lr × head_lr_mult)",
    )
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

    @property
    def uncertainty_head_lr(self) -> tuple[float, str]:
        """The uncertainty head's learning-rate multiplier and the key that sets it: its own
        (``uncertainty_lr_mult``) when given, else the heads' group it then shares."""
        if self.uncertainty_lr_mult is None:
            return self.head_lr_mult, "optim.head_lr_mult"
        return self.uncertainty_lr_mult, "optim.uncertainty_lr_mult"

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
    amp: bool = Field(
        True,
        description="mixed precision: autocast in amp_dtype on an accelerator (on the CPU only "
        "when amp_dtype=bfloat16 is asked for)",
    )
    amp_dtype: Literal["auto", "bfloat16", "float16"] = Field(
        "auto",
        description="autocast dtype: auto is bfloat16 where the device supports it, else float16 "
        "(with loss scaling); auto leaves a CPU in float32",
    )
    channels_last: bool | Literal["auto"] = Field(
        "auto",
        description="model and image batches in channels-last memory format (auto: on CUDA and the "
        "CPU, whose convolutions both run it faster)",
    )
    compile: Literal["off", "default", "reduce-overhead", "max-autotune"] = Field(
        "off", description="torch.compile the backbone in this mode (off: eager)"
    )
    fused: bool | Literal["auto"] = Field(
        "auto",
        description="the optimizer's fused kernel (auto: on an accelerator; true: also on the CPU)",
    )
    sync_every: int | Literal["auto"] = Field(
        "auto",
        description="read the step's logged values and run the NaN checks every N steps (auto: 1 on "
        "the CPU, where reading costs nothing; 25 on an accelerator, whose queue a read would "
        "drain); a NaN is then caught up to N-1 steps late, always before a checkpoint",
    )

    @field_validator("sync_every")
    @classmethod
    def _positive_sync_every(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value <= 0:
            raise ValueError(
                f"optim.sync_every must be a positive number of steps or auto, got {value}"
            )
        return value

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
    train_level_images: int = Field(
        256,
        ge=0,
        description="with an uncertainty head: training images (test transform) whose mean "
        "uncertainty level in eval mode is logged after each evaluation "
        "(uncertainty/eval_train) and compared with the level training logged; a warning says "
        "when they differ more than 2-fold (0: off)",
    )


class CalibrationConfig(Section):
    """The calibrated confidence ``idml train`` fits after its last epoch.

    A calibrated confidence, ``P(top-1 right)``, must be fitted on classes the model did not train
    on, like the unseen classes it will meet (:mod:`idml.evaluation.confidence`). ``idml train``
    fits one on the run's *held-out training classes* — the ``val`` side a dataset names, or the
    share ``held_out_classes`` of the training classes kept out of training — and writes
    ``RUN/calibration.json`` (:mod:`idml.app.calibration`). Holding classes out costs the model
    those classes, so it is off by default: a run trained on all its classes (the papers'
    protocol) has no calibration until ``idml calibrate`` fits one on labelled images, and its
    answers carry the label-free top-1 similarity, saying so.
    """

    held_out_classes: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="share of the training classes kept out of training to fit the calibrated "
        "confidence on after the last epoch (0: none; a val side the dataset names is used "
        "instead when it has one; without either, fit one later with `idml calibrate`)",
    )
    held_out_order: HeldOutOrder = Field(
        "last",
        description="which training classes held_out_classes keeps out: the 'last' by id (where "
        "ids run by group — Omniglot's alphabets — whole groups, unseen like the test classes' "
        "groups; measured the better calibration on Omniglot), 'spread' evenly over the ids "
        "(every group lends some: for test classes from the training classes' groups) or "
        "'last_groups', whole groups of classes named group/class, as many as come closest to "
        "held_out_classes",
    )
    calibrator: Literal["logistic", "isotonic"] = Field(
        "logistic", description="logistic regression on the features, or isotonic on one"
    )
    features: list[str] = Field(
        default_factory=lambda: [score.key for score in DEFAULT_FEATURES],
        description="confidence scores the calibrator reads (top1, margin@k, agreement@k, "
        "csls@k, norm_u)",
    )
    threshold_share: float = Field(
        0.5,
        gt=0.0,
        lt=1.0,
        description="share of the calibration queries kept out of the fit to certify abstention "
        "thresholds (idml search --target-precision)",
    )

    @field_validator("features")
    @classmethod
    def _known_scores(cls, features: list[str]) -> list[str]:
        if not features:
            raise ValueError("calibration.features needs at least one score, e.g. [top1]")
        for key in features:
            score_from_key(key)  # a ValueError naming the known scores
        return features

    @model_validator(mode="after")
    def _one_feature_for_isotonic(self) -> CalibrationConfig:
        if self.calibrator == "isotonic" and len(self.features) != 1:
            raise ValueError(
                "calibration.calibrator=isotonic reads one score; set calibration.features to "
                f"one of {self.features}"
            )
        return self


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
    task: TaskConfig = TASK_CONFIGS.field(
        "the task (a name of idml.app.tasks.TASKS) and its settings"
    )
    seed: int = Field(0, ge=0, description="seed of every random draw (numpy needs it >= 0)")
    device: str = Field(
        "auto", pattern=r"^(auto|cpu|mps|cuda(:\d+)?)$", description="auto, cpu, cuda, cuda:N, mps"
    )
    data: DataConfig = DataConfig()
    sampler: SamplerConfig = SamplerConfig()
    model: ModelConfig = ModelConfig()
    metric: MetricConfig = MetricConfig()
    loss: LossConfig = LOSS_CONFIGS.field("the metric loss (idml.losses.LOSSES)")
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

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        if (
            self.metric.introspective
            and not self.model.uncertainty.enabled
            and self.metric.gamma == 0
        ):
            # Without a head u ≡ 0, so only γ > 0 weakens pairs (uniformly: the control that
            # separates ISM's uncertainty from a plain weakening); with γ = 0 ISM is the identity.
            raise ValueError(
                "metric.introspective=true needs an uncertainty head: set "
                "model.uncertainty.enabled=true (or metric.gamma > 0 for ISM with u = 0, a "
                "uniform weakening)"
            )
        if self.loss.probabilistic and self.metric.introspective:
            raise ValueError(
                f"loss.name={self.loss.name} models uncertainty itself; set "
                "metric.introspective=false"
            )
        if self.mixup.uncertainty_weight > 0:
            u = self.model.uncertainty
            if not (self.mixup.enabled and u.enabled and u.form == "bounded"):
                raise ValueError(
                    "mixup.uncertainty_weight > 0 (the Mixup-supervised uncertainty extension) "
                    "needs mixup.enabled=true and the bounded uncertainty head "
                    "(model.uncertainty.enabled=true, model.uncertainty.form=bounded)"
                )
        if any(k <= 0 for k in self.eval.ks):
            raise ValueError(f"eval.ks must be positive integers, got {self.eval.ks}")
        return self

    @model_validator(mode="after")
    def _task_reads(self) -> Config:
        """A key the task does not read is an error; then the task's own checks."""
        task = self.task.spec
        for key in set_keys(self):
            if not reads_key(task.reads, key):
                raise ValueError(unread_key_message(key, task))
        task.check_config(self)
        return self


RUN_KEYS: frozenset[str] = frozenset(
    {"name", "task", "seed", "device", "tensorboard", "mlflow", "published"}
)
"""Config keys every task reads (a task's :attr:`~idml.app.tasks.Task.reads` includes them)."""


def set_keys(section: BaseModel, prefix: str = "") -> Iterator[str]:
    """The dotted keys a config gave (not those left at their defaults): a section's keys, or the
    section itself when it was given empty; the ``loss`` and ``task`` sections as a whole."""
    for name in sorted(section.model_fields_set):
        value = getattr(section, name)
        path = prefix + name
        if isinstance(value, NamedSection):
            yield from [f"{path}.{key}" for key in sorted(value.model_fields_set)] or [path]
        elif not isinstance(value, Section):
            yield path
        elif value.model_fields_set:
            yield from set_keys(value, path + ".")
        else:
            yield path


def reads_key(reads: frozenset[str], key: str) -> bool:
    """Whether a task that reads ``reads`` reads ``key`` (a section stands for its keys; an
    empty section is read when any of its keys is)."""
    parts = key.split(".")
    if any(".".join(parts[:i]) in reads for i in range(1, len(parts) + 1)):
        return True
    return any(r.startswith(key + ".") for r in reads)


def unread_key_message(key: str, task: Task) -> str:
    """Why ``key`` may not be set for ``task``, and what to do."""
    from idml.app.tasks import TASKS

    section = key.split(".")[0]
    same = sorted(r for r in task.reads if r == section or r.startswith(section + "."))
    reads = f"it reads {', '.join(same)}" if same else f"it reads no {section}.* key"
    others = [name for name, other in TASKS.items() if reads_key(other.reads, key)]
    where = f" or set task.name to {' or '.join(others)}" if others else ""
    return f"{key}: task {task.name} does not read this key ({reads}); remove it{where}"


def config_keys() -> frozenset[str]:
    """Every dotted key of the schema (``loss`` and ``task`` as sections: their keys depend on
    the entry chosen)."""

    def walk(model: type[BaseModel], prefix: str) -> Iterator[str]:
        for name, info in model.model_fields.items():
            path = prefix + name
            yield path
            owner = _section_type(info.annotation)
            if owner is not None and not issubclass(owner, NamedSection):
                yield from walk(owner, path + ".")

    return frozenset(walk(Config, ""))


def _section_type(annotation: Any) -> type[Section] | None:
    """The section class of a field's annotation (``X``, ``X | None``, ``Annotated[X, ...]``)."""
    candidates = [annotation, *typing.get_args(annotation)]
    for candidate in candidates:
        for inner in [candidate, *typing.get_args(candidate)]:
            if isinstance(inner, type) and issubclass(inner, Section):
                return inner
    return None
