"""What does the learned uncertainty respond to? ``||u||`` of clean vs altered test images.

IDML trains the uncertainty embedding on Mixup images (and optionally on low-resolution, blurred or
occluded ones, the IDML paper's Table 3), expecting ambiguous images to get a larger uncertainty
level ``||u||``. :func:`uncertainty_probe` checks that on *test* images the model never trained on:
it embeds a fixed sample of them clean, mixed with a partner (λ ~ Beta(1, 1)), at low resolution,
blurred and occluded, and reports each condition's ``||u||`` and the AUROC of ``||u||`` for telling
the altered image from its clean original (0.5: ``||u||`` does not notice; 1: always larger).

Example:
    >>> from idml.data import load_split
    >>> from idml.models.model import build_model
    >>> split = load_split("digits", per_class=6)
    >>> model = build_model("small_cnn", pretrained=False, embedding_dim=8, uncertainty=True)
    >>> probe = uncertainty_probe(model, split.test, images=16)
    >>> sorted(probe.levels)
    ['blur', 'clean', 'low_resolution', 'mixup', 'occlusion']
    >>> 0.0 <= probe.auroc["mixup"] <= 1.0
    True
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.data import Dataset

from idml.augment import GaussianBlur, LowResolution, Mixup, Occlusion
from idml.data.datasets import dataset_length
from idml.evaluation.confidence import error_auroc
from idml.models.model import EmbeddingModel


@dataclass
class UncertaintyProbe:
    """``||u||`` per condition (``(n,)`` each, the same images in the same order) and the AUROC of
    each altered condition against ``clean``."""

    levels: dict[str, Tensor]
    auroc: dict[str, float]

    def to_dict(self) -> dict[str, object]:
        return {
            "images": int(self.levels["clean"].numel()),
            "mean": {k: float(v.mean()) for k, v in self.levels.items()},
            "auroc_vs_clean": dict(self.auroc),
        }


@torch.no_grad()
def uncertainty_probe(
    model: EmbeddingModel,
    dataset: Dataset,
    images: int = 512,
    seed: int = 0,
    device: torch.device | str = "cpu",
    batch_size: int = 128,
) -> UncertaintyProbe:
    """``||u||`` of ``images`` test images (an evenly spaced sample) under each alteration.

    Alterations use the training defaults of :mod:`idml.augment` applied to every image:
    Mixup with a random partner of the sample, low resolution (÷4), Gaussian blur (σ 2) and a
    random occlusion of a quarter of the image.
    """
    if model.uncertainty_head is None:
        raise ValueError("the model has no uncertainty head; ||u|| is only defined for IDML models")
    size = dataset_length(dataset, "the uncertainty probe")
    n = min(images, size)
    if n < 2:
        raise ValueError("the uncertainty probe needs at least 2 images")
    index = torch.linspace(0, size - 1, n).round().long().tolist()
    batch = torch.stack([dataset[i][0] for i in index])
    generator = torch.Generator().manual_seed(seed)
    labels = torch.zeros(n, dtype=torch.long)
    mixed = Mixup(alpha=1.0, fraction=1.0)(batch, labels, generator).images[n:]
    conditions = {
        "clean": batch,
        "mixup": mixed,
        "low_resolution": LowResolution(fraction=1.0)(batch, labels, generator).images,
        "blur": GaussianBlur(fraction=1.0)(batch, labels, generator).images,
        "occlusion": Occlusion(fraction=1.0)(batch, labels, generator).images,
    }
    was_training = model.training
    model.eval()
    levels: dict[str, Tensor] = {}
    try:
        for name, stack in conditions.items():
            parts = [
                model.uncertainty_level(model(chunk.to(device))).float().cpu()
                for chunk in stack.split(batch_size)
            ]
            levels[name] = torch.cat(parts)
    finally:
        model.train(was_training)
    clean = levels["clean"]
    auroc = {}
    for name, values in levels.items():
        if name == "clean":
            continue
        scores = torch.cat([clean, values])
        altered = torch.cat([torch.zeros(n, dtype=torch.bool), torch.ones(n, dtype=torch.bool)])
        auroc[name] = error_auroc(scores, altered)
    return UncertaintyProbe(levels, auroc)
