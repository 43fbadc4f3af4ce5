"""Uncertainty-generating augmentations on batches of ``[0, 1]`` images.

- :class:`Mixup` (Zhang et al. 2018, with IDML's *set labels*, Wang et al. 2022 §III-C): for a mixed
  image ``x_m = λ·x_a + (1 − λ)·x_b`` with ``λ ~ Beta(a, a)`` and the partner ``b`` given by a random
  permutation of the batch, the label is the set ``{l_a, l_b}``. Mixed images are *added* to the
  batch, so they serve as anchors, positives and negatives alike. The official code's alternative,
  loss interpolation ``L(orig) + λ·L(mixed, l_a) + (1 − λ)·L(mixed, l_b)``, is ``mode="interpolate"``
  (one ``λ`` shared by the batch, as that formula needs).
- The IDML paper's Table 3 alternatives, each applied to a fraction of the batch with labels
  unchanged: :class:`LowResolution` (down-scale by a factor, up-scale back), :class:`GaussianBlur`
  and :class:`Occlusion` (one random erased rectangle, Zhong et al. 2020).

Every augmentation takes a ``torch.Generator`` for reproducibility (draws happen on the generator's
device, then move to the images' device, so a CPU generator drives CUDA batches too) and returns an
:class:`AugmentedBatch` that says which rows were mixed or degraded (to log ``||u||`` of altered vs
original images). They compose with :func:`apply_augmentations`.

Example:
    >>> import torch
    >>> g = torch.Generator().manual_seed(0)
    >>> images, labels = torch.rand(4, 3, 8, 8), torch.tensor([0, 0, 1, 2])
    >>> batch = apply_augmentations(images, labels, [Mixup(fraction=0.5), GaussianBlur(fraction=0.5)], g)
    >>> batch.images.shape, int(batch.mixed.sum()), int(batch.degraded.sum())
    (torch.Size([6, 3, 8, 8]), 2, 3)
    >>> bool((batch.images >= 0).all() and (batch.images <= 1).all())
    True
"""

from idml.augment.batch import (
    AugmentationPipeline,
    AugmentedBatch,
    BatchAugmentation,
    LossFn,
    MixupInfo,
    MixupMode,
    UncertaintyAugmentation,
    apply_augmentations,
    sample_beta,
)
from idml.augment.degradations import Degradation, GaussianBlur, LowResolution, Occlusion
from idml.augment.mixing import CutMix, Mixup, cutmix_boxes

__all__ = [
    "AugmentationPipeline",
    "AugmentedBatch",
    "BatchAugmentation",
    "CutMix",
    "Degradation",
    "GaussianBlur",
    "LossFn",
    "LowResolution",
    "Mixup",
    "MixupInfo",
    "MixupMode",
    "Occlusion",
    "UncertaintyAugmentation",
    "apply_augmentations",
    "cutmix_boxes",
    "sample_beta",
]
