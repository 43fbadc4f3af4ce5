"""Typed, validated run configuration.

One pydantic schema describes a whole run. Every model forbids unknown keys, so a typo is an error
that names the key and lists the valid ones instead of being silently dropped. YAML files in
``configs/`` are presets of this schema; ``--set key.sub=value`` overrides any field.

Composition: a YAML config may start with ``include:``, one entry or a list. An entry ending in
``.yaml``/``.yml`` is a file, relative to the including file; any other entry names a fragment
packaged with idml (:data:`FRAGMENTS`, listed by :func:`fragment_names`): ``method/<baseline|plain|
ism|mixup|idml|ssr|idml_ssr>``, ``dataset/<cub|cars|sop|digits_demo>``, ``loss/<name>`` (the loss
and the sampler the IDML paper trains it with) and ``backbone/<resnet50|small_cnn>``. Fragments
may include fragments. They merge deeply, in order, then the file's own keys (later wins;
mappings merge key by key, values and lists are replaced, and a ``loss`` naming another loss
replaces the whole section); ``--set`` overrides apply after that. A missing file or name, an
include cycle, a fragment that is not a mapping and an unknown key inside a fragment are
errors (:class:`ConfigError`) naming the file and the chain of files that included it; the checks that
relate several keys run on the merged config. A run stores the merged config (no ``include:``),
so a run folder never depends on the fragments. ``method/idml`` is the one definition of "IDML =
uncertainty head + ISM + Mixup": the presets, ``idml ablate``'s ``method``/``metric``/``mixup``
axes, ``idml demo`` and the tests read it. A method fragment switches its own components on and
leaves every other key alone (``method/baseline`` switches all of them off).

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

import copy
import difflib
import enum
import re
import typing
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializeAsAny,
    TypeAdapter,
    ValidationError,
    WrapValidator,
    create_model,
    model_validator,
)

from idml.augment import MixupMode
from idml.data.registry import DatasetName as Dataset
from idml.data.registry import VerifyMode
from idml.evaluation.clustering import KMeansBackend
from idml.losses import LOSSES, LossParams, LossSpec
from idml.metrics import ISMPower, ISMVariant
from idml.models.backbones import BackboneSpec
from idml.models.model import POOLING_NAMES, UncertaintyActivation, UncertaintyForm
from idml.ranking import SSRConfig as RankingConfig


def choices(values: Iterable[Any]) -> Any:
    """The ``Literal`` of a library's list of choices (an enum's values, a mapping's keys), so a
    config key accepts exactly what the library knows and says so when it does not.

    >>> choices(MixupMode)
    typing.Literal['set', 'interpolate']
    """
    return Literal[tuple(v.value if isinstance(v, enum.Enum) else v for v in values)]


class ConfigError(ValueError):
    """A configuration problem, with the offending key and what to do about it."""


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


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
    validation_classes: float = Field(
        0.25, gt=0, lt=1, description="share of the train classes held out by protocol=validation"
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
    init_level: float = Field(
        0.02, gt=0, lt=1, description="bounded form: ||u||/max_norm at initialisation"
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


class LossSection(Section):
    """Base of the ``loss`` section: ``name`` picks a loss of :data:`idml.losses.LOSSES`, whose
    hyper-parameter model supplies the other keys (:func:`loss_section`)."""

    name: str

    @property
    def spec(self) -> LossSpec:
        """The registry entry of this loss."""
        return LOSSES[self.name]

    @property
    def probabilistic(self) -> bool:
        """The loss models uncertainty itself (PEL): the PEL head, no ISM."""
        return self.spec.probabilistic


DEFAULT_LOSS = "proxy_anchor"
_LOSS_SECTIONS: dict[tuple[str, type[LossParams]], type[LossSection]] = {}


def loss_section(name: str) -> type[LossSection]:
    """The config model of ``loss: {name: <name>, ...}``: the registered loss's hyper-parameter
    model (fields, defaults, bounds and validators) with ``name`` first.

    >>> loss_section("proxy_anchor")(name="proxy_anchor")
    ProxyAnchorConfig(name='proxy_anchor', alpha=32.0, margin=0.1)
    """
    spec = LOSSES[name]
    key = (name, spec.params)
    if key not in _LOSS_SECTIONS:
        title = spec.params.__name__.removesuffix("Params") + "Config"
        section = create_model(
            title,
            __base__=(spec.params, LossSection),
            __module__=__name__,
            name=(Literal[name], ...),  # type: ignore[valid-type]
        )
        section.__doc__ = spec.params.__doc__
        _LOSS_SECTIONS[key] = section
    return _LOSS_SECTIONS[key]


class _LossSections(Mapping[str, type[LossSection]]):
    """Loss name → its config model, following the loss registry (a loss registered after this
    module was imported is a valid ``loss.name`` too)."""

    def __getitem__(self, name: str) -> type[LossSection]:
        return loss_section(name)

    def __iter__(self) -> typing.Iterator[str]:
        return iter(LOSSES)

    def __len__(self) -> int:
        return len(LOSSES)


LOSS_CONFIGS: Mapping[str, type[LossSection]] = _LossSections()
_LOSS_UNIONS: dict[tuple[type[LossSection], ...], TypeAdapter[Any]] = {}


def _validate_loss(value: Any, handler: Any) -> LossSection:
    """The ``loss`` section as the discriminated union of the registered losses' models."""
    members = tuple(LOSS_CONFIGS.values())
    if members not in _LOSS_UNIONS:
        union = typing.Union[members]  # noqa: UP007 (a runtime tuple of models)
        _LOSS_UNIONS[members] = TypeAdapter(Annotated[union, Field(discriminator="name")])
    return _LOSS_UNIONS[members].validate_python(value)


LossConfig = Annotated[SerializeAsAny[LossSection], WrapValidator(_validate_loss)]
"""Any registered loss's section, chosen by ``name`` (an unknown name lists the valid ones)."""


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

    low_resolution_fraction: float = Field(0.0, ge=0, le=1)
    low_resolution_factor: float = Field(4.0, gt=1)
    blur_fraction: float = Field(0.0, ge=0, le=1)
    blur_sigma: float = Field(2.0, gt=0)
    occlusion_fraction: float = Field(0.0, ge=0, le=1)
    occlusion_area: float = Field(0.25, gt=0, lt=1)


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
    mix_prob: float = Field(1.0, ge=0, le=1, description="probability that a batch is mixed")
    keep_originals: bool = Field(
        False, description="append the mixed batch to the clean one instead of replacing it"
    )
    test_fraction: float = Field(
        0.2, gt=0, lt=1, description="per-class hold-out of datasets without a test side"
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

_METRIC_ONLY_SECTIONS = ("loss", "mixup", "ssr")
_METRIC_ONLY_EVAL_KEYS = ("ks", "nmi", "nmi_backend", "introspective")


class MLflowConfig(Section):
    """Mirror the run's log into MLflow (``pip install 'idml[mlflow]'``; see idml.loggers)."""

    enabled: bool = False
    tracking_uri: str | None = Field(
        None, description="MLflow tracking URI (default: a local file store <run>/mlruns)"
    )
    experiment: str = Field("idml", min_length=1, description="MLflow experiment name")


PUBLISHED_METRIC = re.compile(r"^(recall@[1-9]\d*|nmi|map@r|r_precision|map|mrr|top[1-9]\d*)$")


class PublishedNumbers(Section):
    """Numbers a source reports for a recipe, in % as printed, and where they are printed."""

    source: str = Field(min_length=1, description="paper, table and row the numbers come from")
    metrics: dict[str, float] = Field(
        description="metric name (as idml evaluates it) -> value in %"
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


# --------------------------------------------------------------------------- loading
def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read a YAML preset (or the defaults), resolve its ``include:``, apply ``key.sub=value``
    overrides and validate.

    Values in overrides are parsed as YAML scalars (``3``, ``1e-4``, ``true``, ``[1, 2]``).
    """
    raw: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist; see configs/ for the presets")
        raw, included = _resolve_file(path, chain=())
        source = str(path) + (f" (includes {', '.join(included)})" if included else "")
    before = copy.deepcopy(raw.get("data")) if isinstance(raw.get("data"), dict) else {}
    keys = set()
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like key.sub=value")
        _set_path(raw, key.strip(), _parse_value(value))
        keys.add(key.strip())
    if "data.image_size" in keys and "data.resize_size" not in keys:
        _follow_image_size(raw, before)
    return validate_config(raw, source=source)


# --------------------------------------------------------------------------- composition
FRAGMENTS = Path(__file__).with_name("fragments")
"""The packaged fragments: ``include: method/idml`` reads ``FRAGMENTS / "method/idml.yaml"``."""

INCLUDE_KEY = "include"


def fragment_names() -> list[str]:
    """Names of the packaged fragments (``method/idml``, ``dataset/cub``, …), sorted."""
    return sorted(p.relative_to(FRAGMENTS).with_suffix("").as_posix() for p in _fragment_files())


def _fragment_files() -> list[Path]:
    return sorted(FRAGMENTS.rglob("*.yaml"))


def read_fragment(name: str) -> dict[str, Any]:
    """A packaged fragment with its own includes resolved: the partial config it stands for.

    >>> read_fragment("method/mixup")
    {'mixup': {'enabled': True}}
    """
    raw, _ = _resolve_file(_fragment_path(name, "read_fragment"), chain=(), check_keys=True)
    return raw


def fragment_overrides(name: str) -> list[str]:
    """A packaged fragment as ``key.sub=value`` overrides, in the fragment's order (for grids and
    override lists that build on another config).

    >>> fragment_overrides("method/idml")
    ['model.uncertainty.enabled=true', 'metric.introspective=true', 'mixup.enabled=true']
    """
    return to_overrides(read_fragment(name))


def to_overrides(raw: Mapping[str, Any]) -> list[str]:
    """A (partial) config mapping as ``key.sub=value`` overrides that :func:`load_config` reads
    back to it, one per value, in the mapping's order.

    >>> to_overrides({"data": {"resize_size": None, "train_crop_scale": [0.7, 1.0]}})
    ['data.resize_size=null', 'data.train_crop_scale=[0.7, 1.0]']
    """
    return [f"{key}={_yaml_scalar(value)}" for key, value in _flatten(raw)]


def merge_configs(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """``update`` merged into a copy of ``base``: mappings merge key by key, everything else
    (values, lists) is replaced. A ``loss`` that names another loss replaces the whole section,
    since the settings of one loss are unknown keys to another.

    >>> merge_configs({"optim": {"lr": 1e-4, "epochs": 60}}, {"optim": {"epochs": 3}})
    {'optim': {'lr': 0.0001, 'epochs': 3}}
    """
    merged = copy.deepcopy(dict(base))
    for key, value in update.items():
        old = merged.get(key)
        if isinstance(old, dict) and isinstance(value, Mapping):
            if key == "loss" and "name" in value and value["name"] != old.get("name"):
                merged[key] = copy.deepcopy(dict(value))
            else:
                merged[key] = merge_configs(old, value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _fragment_path(name: str, where: str) -> Path:
    found = FRAGMENTS / f"{name}.yaml"
    if not found.is_file():
        raise ConfigError(
            f"{where}: no packaged fragment {name!r}; the fragments are "
            f"{', '.join(fragment_names())} (a file path ends in .yaml)"
        )
    return found


def _show(path: Path) -> str:
    """A fragment by its name when it is packaged, by its path otherwise."""
    try:
        return path.resolve().relative_to(FRAGMENTS.resolve()).with_suffix("").as_posix()
    except ValueError:
        return str(path)


def _read_yaml(path: Path, chain: tuple[str, ...]) -> dict[str, Any]:
    where = f"config file {path}" + "".join(f", included from {c}" for c in reversed(chain))
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8-sig")) or {}
    except UnicodeDecodeError:
        raise ConfigError(
            f"{where} is not UTF-8 text (a binary file?); give a YAML config"
        ) from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{where} is not valid YAML: {err}") from err
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must hold a mapping of keys, got {type(raw).__name__}")
    return raw


def _resolve_file(
    path: Path, chain: tuple[tuple[str, Path], ...], check_keys: bool = False
) -> tuple[dict[str, Any], list[str]]:
    """The file's mapping with its includes merged in (in order, the file's own keys last), and
    the fragments it pulled in, depth first. ``chain``: the including files, outermost first, as
    (shown name, resolved path)."""
    shown = _show(path)
    raw = _read_yaml(path, tuple(name for name, _ in chain))
    inner = (*chain, (shown, path.resolve()))
    names = " -> ".join(name for name, _ in inner)
    if check_keys:
        _check_fragment_keys(raw, f"{shown} (include chain: {names})")
    entries = raw.pop(INCLUDE_KEY, None)
    if entries is None:
        return raw, []
    if isinstance(entries, str):
        entries = [entries]
    if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        raise ConfigError(
            f"{INCLUDE_KEY} in {names}: give a fragment name or a .yaml path, or a list of them; "
            f"got {entries!r}"
        )
    merged: dict[str, Any] = {}
    included: list[str] = []
    for entry in entries:
        if entry.endswith((".yaml", ".yml")):
            target = Path(entry) if Path(entry).is_absolute() else path.parent / entry
            if not target.is_file():
                raise ConfigError(
                    f"{INCLUDE_KEY} in {names}: {entry} does not exist (looked for {target}; "
                    "paths are relative to the including file)"
                )
        else:
            target = _fragment_path(entry, f"{INCLUDE_KEY} in {names}")
        if target.resolve() in {resolved for _, resolved in inner}:
            raise ConfigError(
                f"{INCLUDE_KEY} cycle: {names} -> {_show(target)}; a file cannot include itself"
            )
        part, nested = _resolve_file(target, inner, check_keys=True)
        merged = merge_configs(merged, part)
        included += [*nested, _show(target)]
    return merge_configs(merged, raw), included


def _check_fragment_keys(raw: dict[str, Any], where: str) -> None:
    """Unknown keys of one fragment, named with the file that holds them.

    Only unknown keys: a fragment is a partial config, so the checks that relate several keys
    (an ISM metric needs the uncertainty head) run on the merged result.
    """
    body = {k: v for k, v in raw.items() if k != INCLUDE_KEY}
    loss = body.get("loss")
    if isinstance(loss, dict) and "name" not in loss:
        body.pop("loss")  # which loss's keys these are depends on the fragments around it
    try:
        Config.model_validate(body)
    except ValidationError as err:
        unknown = [e for e in err.errors() if e["type"] in _UNKNOWN_KEY_ERRORS]
        if unknown:
            raise ConfigError(_explain(unknown, body, f"fragment {where}")) from None


_UNKNOWN_KEY_ERRORS = ("extra_forbidden", "unexpected_keyword_argument")


def _flatten(raw: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    items: list[tuple[str, Any]] = []
    for key, value in raw.items():
        if isinstance(value, Mapping) and value:
            items += _flatten(value, f"{prefix}{key}.")
        else:
            items.append((f"{prefix}{key}", value))
    return items


def _yaml_scalar(value: Any) -> str:
    """``value`` as the YAML text an override reads back to it (``true``, ``0.5``, ``[1, 2]``)."""
    return (
        yaml.safe_dump(value, default_flow_style=True, width=1 << 16)
        .removesuffix("\n...\n")
        .strip()
    )


def _follow_image_size(raw: dict[str, Any], before: dict[str, Any]) -> None:
    """``--set data.image_size=N`` alone: a resize_size that kept the recipe's 256/224 ratio to
    the old crop keeps it to the new one (a preset's 256 for 224 becomes 73 for 64); a resize
    that did not follow the ratio was chosen on purpose and stays."""
    from idml.data.transforms import eval_resize_size

    data = raw.get("data")
    fields = DataConfig.model_fields
    old_size = before.get("image_size", fields["image_size"].default)
    old_resize = before.get("resize_size", fields["resize_size"].default)
    new_size = data.get("image_size") if isinstance(data, dict) else None
    if not (isinstance(old_size, int) and isinstance(new_size, int) and new_size > 0):
        return
    if old_resize == eval_resize_size(old_size):
        data["resize_size"] = eval_resize_size(new_size)  # type: ignore[index]


def validate_config(raw: dict[str, Any], source: str = "config") -> Config:
    """Validate a raw mapping; errors name the key, the problem and the valid keys."""
    loss = raw.get("loss")
    if isinstance(loss, dict) and "name" not in loss:
        raw = {**raw, "loss": {"name": DEFAULT_LOSS, **loss}}
    raw = _keep_linear_head_of_old_runs(raw)
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_explain(err.errors(), raw, source)) from None


_LINEAR_HEAD_KEYS = ("normalize", "activation", "init_std")


def _keep_linear_head_of_old_runs(raw: dict[str, Any]) -> dict[str, Any]:
    """A run written before ``model.uncertainty.form`` existed spells out every key of its
    uncertainty head but ``form``; it was the linear head, so it stays one (its checkpoints hold
    that head's weights)."""
    model = raw.get("model")
    head = model.get("uncertainty") if isinstance(model, dict) else None
    if isinstance(head, dict) and "form" not in head and all(k in head for k in _LINEAR_HEAD_KEYS):
        return {**raw, "model": {**model, "uncertainty": {**head, "form": "linear"}}}
    return raw


RUNTIME_KEYS: frozenset[str] = frozenset(
    {"device", "data.num_workers", "tensorboard", "eval.batch_size"}
    | {"mlflow.enabled", "mlflow.tracking_uri", "mlflow.experiment"}
)
"""Config keys that say where and how fast a run goes, and cannot change its numbers."""


def config_difference(
    stored: Mapping[str, Any],
    wanted: Mapping[str, Any],
    ignore: Collection[str] = RUNTIME_KEYS,
    prefix: str = "",
) -> list[str]:
    """``"key: old -> new"`` for every dotted key whose value differs between two config dicts,
    keys in ``ignore`` aside.

    >>> config_difference({"a": {"b": 1, "c": 2}, "device": "cpu"}, {"a": {"b": 1, "c": 3}, "device": "cuda"})
    ['a.c: 2 -> 3']
    """
    diffs: list[str] = []
    for key in sorted(set(stored) | set(wanted)):
        dotted = prefix + key
        if dotted in ignore:
            continue
        a, b = stored.get(key), wanted.get(key)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            diffs.extend(config_difference(a, b, ignore, dotted + "."))
        elif a != b:
            diffs.append(f"{dotted}: {a!r} -> {b!r}")
    return diffs


def stored_config_dict(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A stored run's config (``state.json``, ``result.json``) as the current schema reads it.

    Keys added to the schema after the run was written take their defaults — chosen so that they
    keep the old behaviour (see :func:`_keep_linear_head_of_old_runs`) — so comparing it with a
    config of today shows only real differences. A config the schema no longer accepts is
    returned as stored, and every difference shows.
    """
    try:
        return config_to_dict(validate_config(dict(raw)))
    except ConfigError:
        return dict(raw)


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """JSON-compatible dict (paths as strings) that :func:`validate_config` reads back."""
    return cfg.model_dump(mode="json")


def _parse_value(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _set_path(raw: dict[str, Any], dotted: str, value: Any) -> None:
    node = raw
    parts = dotted.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set {dotted!r}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _field_types(owner: Any) -> dict[str, Any]:
    """Field name → annotation of a pydantic model (empty otherwise)."""
    members = [a for a in typing.get_args(owner) if a is not type(None)]
    if len(members) == 1:  # an optional section, ``Section | None``
        owner = members[0]
    if isinstance(owner, type) and issubclass(owner, BaseModel):
        return {name: f.annotation for name, f in owner.model_fields.items()}
    return {}


def _owner_of(loc: tuple[Any, ...], raw: dict[str, Any]) -> Any:
    """The model that owns the key at ``loc[-1]``."""
    owner: Any = Config
    node: Any = raw
    for i, part in enumerate(loc[:-1]):
        if _is_loss_tag(loc, i):
            owner = LOSS_CONFIGS[part]  # discriminated-union tag in the error location
            continue
        annotation = _field_types(owner).get(str(part))
        node = node.get(part, {}) if isinstance(node, dict) else {}
        if part == "loss" and owner is Config:
            name = node.get("name") if isinstance(node, dict) else None
            owner = LOSS_CONFIGS.get(str(name), LOSS_CONFIGS[DEFAULT_LOSS])
        elif _field_types(annotation):
            owner = annotation
        else:
            break
    return owner


def _is_loss_tag(loc: tuple[Any, ...], i: int) -> bool:
    """Whether ``loc[i]`` is the loss union's tag (``loss.<name>[.<key>]``), not a key that happens
    to share a loss's name (``loss.margin.margin``: the margin loss's ``margin``)."""
    return i == 1 and loc[0] == "loss" and loc[1] in LOSS_CONFIGS


def _explain(errors: list[Any], raw: dict[str, Any], source: str) -> str:
    lines: list[str] = []
    for item in errors:
        loc = tuple(item["loc"])
        # Drop the discriminator tag from the printed key path.
        shown = ".".join(str(p) for i, p in enumerate(loc) if not _is_loss_tag(loc, i))
        kind = item["type"]
        if kind in ("extra_forbidden", "unexpected_keyword_argument"):
            valid = sorted(_field_types(_owner_of(loc, raw)))
            close = difflib.get_close_matches(str(loc[-1]), valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            lines.append(f"unknown key {shown!r}{hint}")
            lines.append(f"  valid keys here: {', '.join(valid)}")
        elif kind in ("union_tag_invalid", "union_tag_not_found"):
            lines.append(f"{shown or 'loss'}.name: {item['msg']}")
            lines.append(f"  valid loss names: {', '.join(LOSS_CONFIGS)}")
        elif kind == "value_error" and not shown:
            lines.append(str(item["msg"]).removeprefix("Value error, "))
        else:
            given = item.get("input")
            message = str(item["msg"]).removeprefix("Value error, ")
            lines.append(f"{shown}: {message} (got {given!r})")
    lines.append(f"  in {source}")
    return "\n".join(lines)


def dump_config(cfg: Config, path: Path) -> None:
    """Write the fully resolved config as YAML (so a run records every default it used)."""
    path.write_text(yaml.safe_dump(copy.deepcopy(config_to_dict(cfg)), sort_keys=False))
