"""Embedding networks: backbones (typed registry), pooling, semantic / uncertainty / PEL heads.

:func:`build_model` is the entry point (:class:`UncertaintyHeadSpec` describes an uncertainty
head); see :mod:`idml.models.backbones` for the backbone registry
and :mod:`idml.models.weights` for weight files, :mod:`idml.models.heads` for the heads and
:mod:`idml.models.model` for :class:`EmbeddingModel`; :func:`embed_dataset` embeds a whole dataset.
"""

from idml.models.backbones import (
    Backbone,
    BackboneName,
    BackboneSpec,
    MissingWeightsError,
    build_backbone,
    load_state_dict_file,
    timm_available,
    torch_cache_weights_path,
    weights_file_name,
)
from idml.models.encode import embed_dataset
from idml.models.model import (
    EmbeddingModel,
    LogVarianceHead,
    Pooling,
    SemanticHead,
    UncertaintyActivation,
    UncertaintyHead,
    UncertaintyHeadSpec,
    UncertaintyHeadSpecError,
    UncertaintyKind,
    build_model,
    global_pool,
    uncertainty_level,
    upgrade_build_config,
)

__all__ = [
    "Backbone",
    "BackboneName",
    "BackboneSpec",
    "EmbeddingModel",
    "LogVarianceHead",
    "MissingWeightsError",
    "Pooling",
    "SemanticHead",
    "UncertaintyActivation",
    "UncertaintyHead",
    "UncertaintyHeadSpec",
    "UncertaintyHeadSpecError",
    "UncertaintyKind",
    "build_backbone",
    "build_model",
    "embed_dataset",
    "global_pool",
    "load_state_dict_file",
    "timm_available",
    "torch_cache_weights_path",
    "uncertainty_level",
    "upgrade_build_config",
    "weights_file_name",
]
