"""The SSR auxiliary task as one module: graded views, ranking head ``g`` and ranking loss.

Fu et al. 2021 (Fig. 2, Alg. 1) share the backbone ``f`` between the metric head ``q`` and a separate
MLP head ``g``; the views ``T_0(x_m)..T_N(x_m)`` of ``M`` images go through ``g ∘ f`` and the ranking
loss (eq. 17) is added to the metric loss with weight ``γ`` (eq. 18), on a fraction ``p_task`` of the
iterations. :class:`SelfSupervisedRanking` owns the transforms, ``g`` and the loss; the backbone stays in
the retrieval model and is passed in as a function, so ``g`` never becomes part of an exported model.

Training wiring (the trainer's job; this module gives the pieces)::

    ssr = SelfSupervisedRanking(model.feature_dim, SSRConfig())
    gate = ssr.make_gate(generator)                 # p_task, per iteration or per epoch
    ...
    if gate():
        out = ssr.loss(model.features, ssr.select_images(images, generator), generator)
        total = metric_loss + ssr.weight * out.loss  # eq. 18 (or a separate step when alternating)

Example:
    >>> import torch
    >>> backbone = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 16))
    >>> config = SSRConfig(num_images=4, hidden_dim=32, out_dim=8)
    >>> ssr = SelfSupervisedRanking(feature_dim=16, config=config)
    >>> out = ssr.loss(backbone, torch.rand(4, 3, 8, 8), torch.Generator().manual_seed(0))
    >>> tuple(out.similarities.shape), bool(out.loss > 0)
    ((4, 4), True)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor, nn

from idml.metrics import unit_rows
from idml.ranking.loss import RankingLoss, RankingOutput
from idml.ranking.transforms import (
    FiniteNumber,
    GradedTransformConfig,
    GradedTransforms,
    StrictPositiveInt,
    check_ranking_images,
)

FeaturesFn = Callable[[Tensor], Tensor]
"""Maps a batch of ``[0, 1]`` images ``(B, C, H, W)`` to backbone features ``(B, feature_dim)``."""

TaskDraw = Literal["iteration", "epoch"]
UpdateMode = Literal["joint", "alternating"]
ImageSource = Literal["metric_batch", "separate"]


class RankingHead(nn.Module):
    """The ranking head ``g``: ``z = normalize(W₂ · ReLU(W₁ h + b₁) + b₂)`` (Fu et al. 2021,
    "Self-supervised Ranking Framework" and Implementation Details).

    An MLP ``in_dim → hidden → out_dim`` with an L2-normalised output (defaults ``feat → 512 → ReLU →
    128``: the paper's 512-d hidden layer and its 128-d embeddings), separate from the metric head
    ``q`` so the auxiliary task has its own embedding space.
    """

    def __init__(self, in_dim: int, hidden: int = 512, out_dim: int = 128) -> None:
        super().__init__()
        for name, value in (("in_dim", in_dim), ("hidden", hidden), ("out_dim", out_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.in_dim = in_dim
        self.layers = nn.Sequential(
            nn.Linear(in_dim, hidden), nn.ReLU(), nn.Linear(hidden, out_dim)
        )

    @property
    def out_dim(self) -> int:
        """``d_r``, the dimension of the ranking embedding."""
        last = self.layers[-1]
        assert isinstance(last, nn.Linear)
        return last.out_features

    def forward(self, features: Tensor) -> Tensor:
        """Unit-norm ranking embeddings ``(B, out_dim)`` of backbone features ``(B, in_dim)``."""
        if features.dim() != 2 or features.shape[1] != self.in_dim:
            raise ValueError(
                f"features must have shape (batch, {self.in_dim}), got {tuple(features.shape)}; "
                "build the RankingHead with in_dim = the backbone's feature dimension"
            )
        return unit_rows(self.layers(features))


class SSRConfig(BaseModel):
    """Hyper-parameters of SSR, defaults from Fu et al. 2021 (Implementation Details).

    A frozen pydantic model: unknown keys are errors, integers and numbers are strict (``true`` is
    not ``1``), and each bound is a field constraint. It nests in the run config as ``ssr.task``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_images: StrictPositiveInt = Field(20, description="M: images per ranking batch")
    scale: FiniteNumber = Field(12.0, gt=0, description="s of eq. 14 and 16")
    margin: FiniteNumber = Field(0.05, description="α_r between adjacent levels (eq. 14)")
    boundary: FiniteNumber = Field(0.5, description="β_r on every view's similarity (eq. 16)")
    pos_weight: FiniteNumber = Field(1.0, ge=0, description="λ_r of L_pos (eq. 17)")
    weight: FiniteNumber = Field(
        0.8, ge=0, description="γ_r of L_ranking in the total loss (eq. 18)"
    )
    p_task: FiniteNumber = Field(
        0.8, ge=0, le=1, description="probability of running the task (Alg. 1)"
    )
    task_draw: TaskDraw = Field(
        "iteration", description="draw the p_task coin every iteration (Alg. 1) or once per epoch"
    )
    update: UpdateMode = Field(
        "joint",
        description="joint: one backward of L_metric + γ_r·L_ranking (eq. 18); alternating: a "
        "separate optimizer step on γ_r·L_ranking after the metric step (Alg. 1's two backward "
        "passes)",
    )
    source: ImageSource = Field(
        "metric_batch",
        description="ranking images drawn from the metric batch (Alg. 1) or sampled separately",
    )
    hidden_dim: StrictPositiveInt = Field(512, description="hidden width of g")
    out_dim: StrictPositiveInt = Field(128, description="d_r, the ranking embedding dimension")
    transforms: GradedTransformConfig = Field(
        default_factory=GradedTransformConfig,
        description="the graded transforms T_n (N = transforms.num_levels)",
    )


class TaskGate:
    """Decides whether the ranking task runs: ``U(0, 1) < p_task`` (Fu et al. 2021, Alg. 1).

    ``per="iteration"`` draws at every call; ``per="epoch"`` draws once in :meth:`new_epoch` (or at the
    first call of an epoch) and answers the same until the next :meth:`new_epoch`.
    """

    def __init__(
        self,
        probability: float,
        per: TaskDraw = "iteration",
        generator: torch.Generator | None = None,
    ) -> None:
        if not 0.0 <= probability <= 1.0:
            raise ValueError(f"probability (p_task) must be in [0, 1], got {probability}")
        if per not in ("iteration", "epoch"):
            raise ValueError(f"per must be 'iteration' or 'epoch', got {per!r}")
        self.probability = probability
        self.per = per
        self.generator = generator
        self._epoch_decision: bool | None = None

    def _draw(self) -> bool:
        device = self.generator.device if self.generator is not None else None
        return bool(torch.rand((), generator=self.generator, device=device) < self.probability)

    def new_epoch(self) -> None:
        """Start an epoch (draws the epoch's decision in ``per="epoch"`` mode)."""
        self._epoch_decision = self._draw() if self.per == "epoch" else None

    def __call__(self) -> bool:
        """Whether to run the ranking task at this iteration."""
        if self.per == "iteration":
            return self._draw()
        if self._epoch_decision is None:
            self._epoch_decision = self._draw()
        return self._epoch_decision


def draw_images(images: Tensor, count: int, generator: torch.Generator | None = None) -> Tensor:
    """``count`` rows of ``images`` drawn without replacement (all of them, in order, if fewer):
    one ``randperm`` on the generator's device, so a seeded draw is the same wherever it runs."""
    total = images.shape[0]
    if total <= count:
        return images
    device = generator.device if generator is not None else images.device
    chosen = torch.randperm(total, generator=generator, device=device)[:count]
    return images[chosen.to(images.device)]


class SelfSupervisedRanking(nn.Module):
    """SSR: graded views → backbone → ranking head ``g`` → ranking loss (Fu et al. 2021, eq. 10–17).

    Its parameters are those of ``g`` only (give them the heads' learning rate); the backbone is the
    retrieval model's and enters :meth:`loss` as ``features_fn``. ``weight`` is ``γ_r`` of eq. 18.

    Args:
        feature_dim: dimension of the backbone features ``g`` consumes.
        config: hyper-parameters (:class:`SSRConfig` defaults when omitted).
    """

    def __init__(self, feature_dim: int, config: SSRConfig | None = None) -> None:
        super().__init__()
        self.config = config if config is not None else SSRConfig()
        self.transforms = GradedTransforms(self.config.transforms)
        self.head = RankingHead(feature_dim, self.config.hidden_dim, self.config.out_dim)
        self.criterion = RankingLoss(
            scale=self.config.scale,
            margin=self.config.margin,
            boundary=self.config.boundary,
            pos_weight=self.config.pos_weight,
        )

    @property
    def weight(self) -> float:
        """``γ_r``: the total loss is ``L_metric + weight · RankingOutput.loss`` (eq. 18)."""
        return self.config.weight

    @property
    def num_levels(self) -> int:
        """``N``, the number of transformed views per image."""
        return self.transforms.num_levels

    def make_gate(self, generator: torch.Generator | None = None) -> TaskGate:
        """A :class:`TaskGate` with this config's ``p_task`` and ``task_draw``."""
        return TaskGate(self.config.p_task, self.config.task_draw, generator)

    def select_images(self, images: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """``M = num_images`` images drawn without replacement from a batch (all of them if fewer)."""
        check_ranking_images(images)
        return draw_images(images, self.config.num_images, generator)

    def views(self, images: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """The graded views ``(M, N + 1, C, H, W)`` of ``images`` ``(M, C, H, W)`` in ``[0, 1]``."""
        return self.transforms(images, generator)

    def loss(
        self, features_fn: FeaturesFn, images: Tensor, generator: torch.Generator | None = None
    ) -> RankingOutput:
        """``L_ranking`` (eq. 17) of ``images`` ``(M, C, H, W)`` in ``[0, 1]``, not normalised.

        All ``M·(N + 1)`` views go through ``features_fn`` in ONE call (one backbone forward, one
        BatchNorm batch); every image given is used (pick ``M`` with :meth:`select_images`).
        """
        views = self.views(images, generator)
        m, v = views.shape[:2]
        features = features_fn(views.flatten(0, 1))
        if not isinstance(features, Tensor) or features.dim() != 2 or features.shape[0] != m * v:
            shape = (
                tuple(features.shape) if isinstance(features, Tensor) else type(features).__name__
            )
            raise ValueError(
                f"features_fn must map {m * v} images to a (batch, feature_dim) tensor, got {shape}; "
                "pass the backbone's pooled-feature function (e.g. EmbeddingModel.features)"
            )
        embeddings = self.head(features).view(m, v, -1)
        return self.criterion(embeddings)

    def forward(
        self, features_fn: FeaturesFn, images: Tensor, generator: torch.Generator | None = None
    ) -> RankingOutput:
        """Same as :meth:`loss`."""
        return self.loss(features_fn, images, generator)
