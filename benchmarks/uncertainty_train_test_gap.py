"""Is the ``||u||`` a model reports at test time the ``||u||`` it trained with?

The bounded uncertainty head's level reads standardised features (a ``BatchNorm1d`` without affine
parameters, :class:`idml.models.heads.BoundedUncertaintyHead`): while training, with each batch's
own statistics; at test time, with their running averages. Training batches hold Mixup images and
come from a backbone in training mode, test batches do not, so the two can disagree. For each run
folder this prints:

- ``trained``: ``||u||`` of the untouched images of the last epoch's training batches, as the
  trainer logged it (``metrics.jsonl``, ``uncertainty/original``);
- ``eval train``: ``||u||`` of images of the training classes (the test transform, evenly spaced),
  with the model in eval mode — what ``idml embed``, ISM at test and the report's probes see;
- ``eval test``: the same for the test images;
- the level logit's shift from ``trained`` to ``eval train`` (``logit(||u||/u_max)``);
- with ``--replay N``: the head's running statistics recomputed from ``N`` training-like batches
  (the training transform, class-balanced, the run's own batch augmentations, every layer in
  training mode), as the mean distance from the checkpoint's in standard deviations; the test
  images' eval-mode ``||u||`` with every BatchNorm's statistics so replayed (a plain average over
  the batches rather than the training's moving average: if the gap were that average's noise, it
  would close here); and ``||u||`` of the untouched images of half those batches with the backbone's
  BatchNorm and the level's standardisation each in training or eval mode, which says where the
  gap comes from.

Run: ``python benchmarks/uncertainty_train_test_gap.py RUN_DIR [RUN_DIR ...] [--which latest]
[--images 512] [--replay 60] [--data-root PATH]`` (``--data-root`` where the runs' ``data.root``
has moved).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
from pathlib import Path

import torch
from torch import Tensor, nn

from idml.app import build
from idml.app.trained_run import load_trained_model
from idml.app.training.level_probe import EvalLevelProbe
from idml.augment import AugmentationPipeline
from idml.data import ImageDataset
from idml.models.heads import BoundedUncertaintyHead
from idml.models.model import EmbeddingModel

PROBE_BATCH = 128
"""Images per eval-mode forward pass."""


def training_batches(
    dataset: ImageDataset,
    count: int,
    per_batch: tuple[int, int],
    augment: AugmentationPipeline,
    seed: int,
) -> list[tuple[Tensor, Tensor]]:
    """``count`` batches as training draws them: ``per_batch`` = (classes, images per class) of
    ``dataset`` (its training transform), through the run's own batch augmentations (Mixup's
    images appended, degradations); each with the mask of its untouched images."""
    generator = torch.Generator().manual_seed(seed)
    labels = dataset.labels
    classes = labels.unique()
    n_classes, n_images = per_batch
    batches = []
    for _ in range(count):
        chosen = classes[torch.randperm(len(classes), generator=generator)[:n_classes]]
        index = torch.cat(
            [
                torch.nonzero(labels == c).flatten()[
                    torch.randperm(int((labels == c).sum()), generator=generator)[:n_images]
                ]
                for c in chosen
            ]
        )
        batch = augment(torch.stack([dataset[int(i)][0] for i in index]), labels[index], generator)
        batches.append((batch.images, ~batch.altered))
    return batches


@torch.no_grad()
def replayed(model: EmbeddingModel, batches: list[tuple[Tensor, Tensor]]) -> EmbeddingModel:
    """A copy of ``model`` whose every BatchNorm holds the plain average of ``batches``' statistics
    (run in training mode) instead of the training's exponential moving average."""
    copy_model = copy.deepcopy(model).train()
    for module in copy_model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.reset_running_stats()
            module.momentum = None  # a plain average over the replayed batches
    for images, _ in batches:
        copy_model(images)
    return copy_model.eval()


def replay_distance(model: EmbeddingModel, replay: EmbeddingModel) -> float:
    """Mean ``|replayed − stored|/σ`` of the level's standardisation means over the features."""
    stored, bn = standardisation(model), standardisation(replay)
    # track_running_stats is on (BatchNorm1d's default, which the head keeps): the buffers exist.
    assert stored.running_mean is not None and stored.running_var is not None
    assert bn.running_mean is not None
    spread = (stored.running_var + stored.eps).sqrt()  # as the layer divides: dead features too
    distance = (bn.running_mean - stored.running_mean).abs() / spread
    return float(distance.mean())


@torch.no_grad()
def levels_by_mode(
    model: EmbeddingModel, batches: list[tuple[Tensor, Tensor]]
) -> dict[tuple[str, str], float]:
    """Mean ``||u||`` of the untouched images of ``batches`` with the backbone and the head's
    standardisation each in training mode (the batch's statistics) or eval mode (the running
    ones); a copy of the model runs them, so no running statistic of ``model`` moves."""
    levels = {}
    for backbone in ("train", "eval"):
        for head in ("train", "eval"):
            copy_model = copy.deepcopy(model).train(backbone == "train")
            standardisation(copy_model).train(head == "train")
            clean = [copy_model(x).uncertainty[untouched].norm(dim=1) for x, untouched in batches]
            levels[backbone, head] = float(torch.cat(clean).mean())
    return levels


def standardisation(model: EmbeddingModel) -> nn.BatchNorm1d:
    """The bounded head's standardisation of the level's input features."""
    head = model.uncertainty_head
    if not isinstance(head, BoundedUncertaintyHead) or not isinstance(
        head.standardize, nn.BatchNorm1d
    ):
        raise SystemExit("the model's uncertainty head does not standardise its level input")
    return head.standardize


def logit(level: float) -> float:
    return math.log(level / (1.0 - level))


def measure(run: Path, args: argparse.Namespace) -> dict[str, object]:
    cfg, model = load_trained_model(run, args.which)
    head = model.uncertainty_head
    if not isinstance(head, BoundedUncertaintyHead):
        raise SystemExit(f"{run}: the model has no bounded uncertainty head")
    if args.data_root is not None:
        cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"root": args.data_root})})
    split = build.build_data(cfg)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    trained = float(json.loads(lines[-1])["uncertainty/original"])
    # The trainer's own probe, so this column is the uncertainty/eval_train that runs now log.
    cpu = torch.device("cpu")
    train_eval = EvalLevelProbe.training_images(split, args.images, PROBE_BATCH).levels(model, cpu)
    test_probe = EvalLevelProbe(split.test, args.images, PROBE_BATCH)
    test_eval = test_probe.levels(model, cpu)
    assert train_eval is not None and test_eval is not None  # the head was checked above
    u_max = head.max_norm
    row: dict[str, object] = {
        "run": str(run),
        "trained": trained,
        "eval_train": float(train_eval.mean()),
        "eval_train_cv": float(train_eval.std() / train_eval.mean()),
        "eval_test": float(test_eval.mean()),
        "eval_test_cv": float(test_eval.std() / test_eval.mean()),
        "logit_shift": logit(float(train_eval.mean()) / u_max) - logit(trained / u_max),
    }
    if args.replay > 0:
        per_batch = (cfg.sampler.classes_per_batch, cfg.sampler.images_per_class)
        augment = build.build_augmentations(cfg)
        batches = training_batches(split.train, args.replay, per_batch, augment, seed=0)
        replay = replayed(model, batches)
        row["replay_sd"] = replay_distance(model, replay)
        replayed_test = test_probe.levels(replay, cpu)
        assert replayed_test is not None
        row["replay_test"] = float(replayed_test.mean())
        row["modes"] = levels_by_mode(model, batches[: max(1, args.replay // 2)])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR")
    parser.add_argument("--which", default="latest", choices=("best", "latest"))
    parser.add_argument("--images", type=int, default=512)
    parser.add_argument("--replay", type=int, default=0, metavar="N")
    parser.add_argument("--data-root", type=Path, default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    header = (
        "| run | trained ‖u‖ | eval ‖u‖, train classes (CV) | eval ‖u‖, test (CV) | logit shift |"
    )
    rows = [measure(run, args) for run in args.runs]
    replay = args.replay > 0
    print(header + (" replay Δ mean (σ) | eval ‖u‖, test, replayed statistics |" if replay else ""))
    print("|---" * (7 if replay else 5) + "|")
    for r in rows:
        line = (
            f"| {r['run']} | {r['trained']:.4f} | {r['eval_train']:.4f} ({r['eval_train_cv']:.2f}) "
            f"| {r['eval_test']:.4f} ({r['eval_test_cv']:.2f}) | {r['logit_shift']:+.2f} |"
        )
        print(line + (f" {r['replay_sd']:.2f} | {r['replay_test']:.4f} |" if replay else ""))
    if replay:
        print(
            "\n||u|| of the untouched images of training batches (Mixup appended as trained), "
            "by the mode of the backbone's BatchNorm and of the level's standardisation:\n"
        )
        modes = [("train", "train"), ("eval", "train"), ("train", "eval"), ("eval", "eval")]
        print("| run | " + " | ".join(f"backbone {b}, level {h}" for b, h in modes) + " |")
        print("|---" * 5 + "|")
        for r in rows:
            levels = r["modes"]
            assert isinstance(levels, dict)
            print(f"| {r['run']} | " + " | ".join(f"{levels[m]:.4f}" for m in modes) + " |")


if __name__ == "__main__":
    main()
