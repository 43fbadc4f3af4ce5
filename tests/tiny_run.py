"""Config overrides for training runs small enough for unit tests (seconds on 2 CPU cores).

``TINY``: scikit-learn's digits at 8 px, the small CNN from scratch, two steps of one epoch, no NMI
and no TensorBoard. ``IDML``: the uncertainty head, ISM and Mixup on top.
"""

from __future__ import annotations

TINY = [
    "data.dataset=digits",
    "data.image_size=8",
    "data.resize_size=null",
    "data.train_crop_scale=[0.8, 1.0]",
    "data.horizontal_flip=false",
    "data.num_workers=0",
    "data.samples_per_class=40",
    "model.backbone=small_cnn",
    "model.pretrained=false",
    "model.embedding_dim=16",
    "sampler.classes_per_batch=5",
    "sampler.images_per_class=4",
    "optim.epochs=1",
    "optim.max_steps_per_epoch=2",
    "optim.lr=0.001",
    "optim.amp=false",
    "eval.nmi=false",
    "tensorboard=false",
]
IDML = ["model.uncertainty.enabled=true", "metric.introspective=true", "mixup.enabled=true"]
