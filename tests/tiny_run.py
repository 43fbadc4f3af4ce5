"""Config overrides for training runs small enough for unit tests (seconds on 2 CPU cores).

``TINY``: scikit-learn's digits at 8 px, the small CNN from scratch, two steps of one epoch, no NMI
and no TensorBoard. ``IDML``: the uncertainty head, ISM and Mixup on top (the packaged ``method/idml`` fragment).
"""

from __future__ import annotations

from pathlib import Path

from idml.app.config import fragment_overrides

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
IDML = fragment_overrides("method/idml")
CLASSIFICATION = [
    "task=classification",
    "data.dataset=digits",
    "data.image_size=16",
    "data.resize_size=null",
    "data.horizontal_flip=false",
    "data.train_crop_scale=[0.8, 1.0]",
    "data.num_workers=0",
    "model.backbone=small_cnn",
    "model.pretrained=false",
    "optim.scheduler=none",
    "optim.amp=false",
    "tensorboard=false",
]
"""The classification task on digits at 16 px (all ten classes on both sides), small CNN."""


def train_tiny(root: Path, overrides: list[str] | None = None) -> Path:
    """Train a ``TINY`` + ``overrides`` run into ``root/run`` through the CLI; returns the folder."""
    from idml.app.cli import main

    cfg = root / "tiny.yaml"
    cfg.write_text("# tiny digits run\n")
    args = ["train", str(cfg), "--out", str(root / "run"), "--no-progress"]
    for item in [*TINY, *(overrides or [])]:
        args += ["--set", item]
    if main(args) != 0:
        raise RuntimeError(f"the tiny training run in {root} failed")
    return root / "run"


def write_images(
    root: Path, classes: int, per_class: int, shape: tuple[int, int] = (12, 12), seed: int = 0
) -> Path:
    """``classes`` folders of ``per_class`` random RGB PNGs under ``root`` (a real image gallery)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    for c in range(classes):
        folder = root / chr(ord("a") + c) if classes <= 26 else root / f"c{c}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = rng.integers(0, 255, (*shape, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(folder / f"{i}.png")
    return root


def subprocess_env() -> dict[str, str]:
    """The environment of an ``idml`` subprocess (plain or under torchrun): this checkout's
    ``src`` first, one thread per process, no torchrun variables inherited from the test run."""
    import os

    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(repo / "src"), env.get("PYTHONPATH", "")])
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env
