"""The names of :mod:`idml.trained_run` (loading trained runs for inference, embedding images,
scoring a checkpoint), importable from ``idml.export`` as well."""

from idml.trained_run import (
    TrainedRun,
    embed_images,
    evaluate_checkpoint,
    list_images,
    load_trained_model,
    load_trained_run,
)

__all__ = [
    "TrainedRun",
    "embed_images",
    "evaluate_checkpoint",
    "list_images",
    "load_trained_model",
    "load_trained_run",
]
