"""SSR: the self-supervised ranking auxiliary task (Fu et al. 2021, AAAI, Fig. 2 and Alg. 1).

* :mod:`idml.ranking.transforms` — graded transforms ``T_0..T_N`` (crop, perspective, colour jitter).
* :mod:`idml.ranking.loss` — ``L_sort``, ``L_pos`` and ``L_ranking`` (eq. 14, 16, 17).
* :mod:`idml.ranking.ssr` — the ranking head ``g``, the config, the task gate and
  :class:`SelfSupervisedRanking`, which bundles them around a backbone passed in as a function.
"""

from idml.ranking.loss import (
    RankingLoss,
    RankingOutput,
    order_accuracy,
    positive_loss,
    sort_loss,
    view_similarities,
)
from idml.ranking.ssr import (
    FeaturesFn,
    ImageSource,
    RankingHead,
    SelfSupervisedRanking,
    SSRConfig,
    TaskDraw,
    TaskGate,
    UpdateMode,
    draw_images,
)
from idml.ranking.transforms import (
    GradedLevels,
    GradedTransformConfig,
    GradedTransforms,
    GradedViewParams,
    color_jitter,
)

__all__ = [
    "FeaturesFn",
    "GradedLevels",
    "GradedTransformConfig",
    "GradedTransforms",
    "GradedViewParams",
    "ImageSource",
    "RankingHead",
    "RankingLoss",
    "RankingOutput",
    "SSRConfig",
    "SelfSupervisedRanking",
    "TaskDraw",
    "TaskGate",
    "UpdateMode",
    "color_jitter",
    "draw_images",
    "order_accuracy",
    "positive_loss",
    "sort_loss",
    "view_similarities",
]
