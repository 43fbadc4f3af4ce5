"""Torch datasets of a DML split and the :class:`DMLSplit` that pairs them.

Every dataset yields ``(image, label, index)``: ``image`` a float tensor ``C×H×W`` in ``[0, 1]``
(*not* normalised — the model applies its backbone's normalisation in ``forward``, so pixel
augmentations such as Mixup, blur and SSR's graded transforms all act on ``[0, 1]`` images),
``label`` the class remapped to ``0..C−1`` within the split, and ``index`` the position of the image
in the dataset (so exported embeddings can be traced back to files). The original class ids of the
source are kept in :attr:`ImageDataset.class_ids` and :attr:`ImageDataset.classes`.

A transform receives the decoded image as a ``uint8`` :class:`torchvision.tv_tensors.Image`
``C×H×W`` (see :mod:`idml.data.transforms`); whatever it returns — ``uint8`` or float tensor, or a
PIL image — is brought to float ``[0, 1]``.

Example:
    >>> import numpy as np
    >>> images = np.zeros((4, 8, 8), dtype=np.uint8)
    >>> train = ArrayImageDataset(images[:2], class_ids=np.array([3, 3]))
    >>> test = ArrayImageDataset(images[2:], class_ids=np.array([5, 6]), channels=1)
    >>> split = DMLSplit(train, test, name="toy")
    >>> image, label, index = split.test[1]
    >>> tuple(image.shape), image.dtype, label, index, split.test.classes
    ((1, 8, 8), torch.float32, 1, 1, (5, 6))
"""

from __future__ import annotations

import copy
import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence, Sized
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal, TypeVar

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from torch.utils.data import Dataset
from torchvision import tv_tensors
from torchvision.transforms.v2 import functional as TF

from idml.data.cache import ImageCache
from idml.data.decoding import DECODERS, Channels, CorruptImageError, Decoder, decode_image_file
from idml.data.decoding import convert_mode as convert_mode
from idml.data.records import ImageRecords, format_examples

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self needs Python 3.11; idml supports 3.10

logger = logging.getLogger(__name__)

Transform = Callable[[Tensor], object]
"""A callable from a ``uint8`` ``C×H×W`` image to an image tensor (e.g. a torchvision v2 pipeline)."""

_DatasetT = TypeVar("_DatasetT", bound="ImageDataset")


def dataset_length(dataset: Dataset, needed_for: str) -> int:
    """``len(dataset)`` of a map-style dataset, or a ``TypeError`` naming ``needed_for`` where
    the dataset has no length (an ``IterableDataset``): torch's ``Dataset`` does not declare
    ``__len__``, so every caller that counts images asks here.

    Example:
        >>> dataset_length(ArrayImageDataset(np.zeros((3, 4, 4), np.uint8), np.arange(3)), "a count")
        3
    """
    if not isinstance(dataset, Sized):
        raise TypeError(
            f"{needed_for} needs a map-style dataset (one with __len__ and __getitem__); "
            f"a {type(dataset).__name__} has no length"
        )
    return len(dataset)


@dataclass(frozen=True)
class ImageFailure:
    """One image that failed verification: its dataset index, its source and why."""

    index: int
    source: str
    reason: str


@dataclass(frozen=True)
class VerificationReport:
    """Outcome of :meth:`ImageDataset.verify`: how many images were decoded and which failed."""

    checked: int
    failures: tuple[ImageFailure, ...]

    @property
    def ok(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        """One line: the count of unreadable images and the first few of them."""
        if self.ok:
            return f"all {self.checked} images decode"
        listed = [f"{f.source} ({f.reason})" for f in self.failures]
        return f"{len(self.failures)} of {self.checked} images cannot be read: {format_examples(listed)}"

    def raise_if_failed(self) -> None:
        """Raise :class:`CorruptImageError` listing the unreadable images, if there are any."""
        if not self.ok:
            raise CorruptImageError(
                f"{self.summary()}. Replace or delete these files, or set data.verify=skip "
                "(load_split(verify='skip')) to drop them (they are counted and logged)"
            )


def to_float_image(image: object) -> Tensor:
    """A transform's output as a float ``C×H×W`` tensor: ``uint8`` is divided by 255, PIL converted.

    Float tensors are passed through unchanged (they are assumed to be in ``[0, 1]`` already).
    """
    if isinstance(image, Image.Image):
        image = TF.pil_to_tensor(image)
    if not isinstance(image, Tensor):
        raise TypeError(
            f"the dataset transform must return a tensor or PIL image, got {type(image).__name__}"
        )
    if image.dim() != 3:
        raise ValueError(
            f"the dataset transform must return a C×H×W image, got shape {tuple(image.shape)}"
        )
    if image.dtype == torch.uint8:
        return image.as_subclass(Tensor).float().div_(255.0)
    if not image.dtype.is_floating_point:
        raise ValueError(f"the dataset transform returned dtype {image.dtype}; use uint8 or float")
    return image.as_subclass(Tensor)


class ImageDataset(Dataset[tuple[Tensor, int, int]]):
    """Base class: labelled images of one side of a DML split.

    Labels are the original class ids remapped to ``0..C−1`` in increasing order of id:
    ``labels[i] = searchsorted(classes, class_ids[i])``. Subclasses implement :meth:`load_image`
    (decode one image to ``uint8`` ``C×H×W``), :meth:`describe` and :meth:`_take`.
    """

    def __init__(
        self,
        class_ids: np.ndarray | Tensor | Sequence[int],
        class_names: Mapping[int, str] | None = None,
        transform: Transform | None = None,
        channels: Channels = 3,
    ) -> None:
        if channels not in (1, 3):
            raise ValueError(f"channels must be 1 (grayscale) or 3 (RGB), got {channels!r}")
        ids = np.asarray(class_ids, dtype=np.int64).reshape(-1)
        classes, labels = np.unique(ids, return_inverse=True)
        names = class_names or {}
        self.class_ids: Tensor = torch.from_numpy(ids)
        """Original class id of each image, as numbered by the source."""
        self.labels: Tensor = torch.from_numpy(labels.astype(np.int64).reshape(-1))
        """Label of each image in ``0..C−1`` (what samplers, losses and evaluation consume)."""
        self.classes: tuple[int, ...] = tuple(int(c) for c in classes)
        """Original class id of each label: ``classes[label]``."""
        self.class_names: tuple[str, ...] = tuple(names.get(c, str(c)) for c in self.classes)
        """Human-readable name of each label."""
        self.transform = transform
        self.channels: Channels = channels
        self.skipped: tuple[ImageFailure, ...] = ()
        """Images dropped by ``verified(on_failure='skip')`` (indices refer to the unfiltered set)."""

    # ----------------------------------------------------------------- subclass hooks
    def load_image(self, index: int) -> Tensor:
        """Decode image ``index`` to a ``uint8`` ``C×H×W`` tensor (no transform applied)."""
        raise NotImplementedError

    def describe(self, index: int) -> str:
        """Where image ``index`` comes from (a file path, or an array position), for messages."""
        raise NotImplementedError

    def _take(self: _DatasetT, rows: np.ndarray) -> _DatasetT:
        raise NotImplementedError

    # ----------------------------------------------------------------- Dataset protocol
    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[Tensor, int, int]:
        index = int(index)
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for a dataset of {len(self)} images")
        index %= len(self)
        decoded = self.load_image(index)
        image = decoded if self.transform is None else self.transform(decoded)
        return to_float_image(image), int(self.labels[index]), index

    # ----------------------------------------------------------------- views
    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def roles(self) -> np.ndarray | None:
        """``"query"``/``"gallery"`` per image when the source gives evaluation roles, else ``None``."""
        return None

    def class_counts(self) -> Tensor:
        """Number of images of each label, ``(C,)``."""
        return torch.bincount(self.labels, minlength=self.num_classes)

    def subset(self: _DatasetT, indices: Sequence[int] | np.ndarray | Tensor) -> _DatasetT:
        """The dataset restricted to ``indices`` (labels re-derived, so they stay ``0..C'−1``)."""
        rows = np.asarray(indices, dtype=np.int64).reshape(-1)
        if len(rows) and (rows.min() < 0 or rows.max() >= len(self)):
            raise IndexError(
                f"subset indices must lie in [0, {len(self)}), got {rows.min()}..{rows.max()}"
            )
        return self._take(rows)

    def with_transform(self: _DatasetT, transform: Transform | None) -> _DatasetT:
        """A shallow copy that applies ``transform`` (image data is shared, not copied)."""
        clone = copy.copy(self)
        clone.transform = transform
        return clone

    def verify(self, workers: int = 4) -> VerificationReport:
        """Decode every image once and report the ones that cannot be read; never raises for them.

        Decoding runs in ``workers`` threads (PIL releases the GIL while decoding).
        """

        def check(index: int) -> ImageFailure | None:
            try:
                self.load_image(index)
            except (CorruptImageError, FileNotFoundError) as err:
                return ImageFailure(index, self.describe(index), _short_reason(err))
            return None

        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        with ThreadPoolExecutor(max_workers=workers) as pool:
            results = list(pool.map(check, range(len(self))))
        return VerificationReport(len(self), tuple(r for r in results if r is not None))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({len(self)} images, {self.num_classes} classes, "
            f"channels={self.channels}, transform={self.transform!r})"
        )


def _short_reason(err: Exception) -> str:
    cause = err.__cause__ if err.__cause__ is not None else err
    return f"{type(cause).__name__}: {cause}".splitlines()[0][:200]


class FileImageDataset(ImageDataset):
    """Images decoded from files, one :class:`~idml.data.records.ImageRecords` row each.

    With ``crop_to_box`` and records that carry boxes (Cars196), each image is cropped to its
    annotated box before the transform. ``decoder`` chooses the library that decodes the files
    (:mod:`idml.data.decoding`: Pillow, the reference, or torchvision's ``decode_jpeg`` for
    JPEGs); with a ``cache`` (:mod:`idml.data.cache`, see :meth:`reading`) images are read
    decoded from it instead.
    """

    def __init__(
        self,
        records: ImageRecords,
        transform: Transform | None = None,
        channels: Channels = 3,
        crop_to_box: bool = False,
        decoder: Decoder = "pil",
        cache: ImageCache | None = None,
    ) -> None:
        if crop_to_box and records.boxes is None:
            raise ValueError(
                "crop_to_box=True needs records with bounding boxes (only Cars196 has them)"
            )
        if decoder not in DECODERS:
            raise ValueError(f"decoder must be one of {DECODERS}, got {decoder!r}")
        super().__init__(records.class_ids, records.class_names, transform, channels)
        self.records = records
        self.crop_to_box = crop_to_box
        self.decoder: Decoder = decoder
        self.cache = cache

    def reading(
        self, decoder: Decoder | None = None, cache: ImageCache | None = None
    ) -> FileImageDataset:
        """A shallow copy that decodes with ``decoder``, or reads from ``cache``, which must hold
        every image of this dataset as it loads them (checked:
        :meth:`~idml.data.cache.ImageCache.check_sources`)."""
        if cache is not None:
            cache.check_sources(
                (str(p) for p in self.records.paths), self.channels, self.crop_to_box
            )
        clone = copy.copy(self)
        clone.decoder = decoder if decoder is not None else self.decoder
        clone.cache = cache
        return clone

    def box(self, index: int) -> tuple[int, int, int, int] | None:
        """The box image ``index`` is cropped to, or ``None``."""
        if not self.crop_to_box or self.records.boxes is None:
            return None
        x1, y1, x2, y2 = (int(v) for v in self.records.boxes[index])
        return x1, y1, x2, y2

    @property
    def paths(self) -> np.ndarray:
        """Image file path of each index."""
        return self.records.paths

    @property
    def roles(self) -> np.ndarray | None:
        roles = self.records.roles
        # A CSV's role column may leave a side without roles (its training images).
        return roles if roles is not None and bool((roles != "").any()) else None

    def load_image(self, index: int) -> Tensor:
        path = str(self.records.paths[index])
        if self.cache is not None:
            return tv_tensors.Image(self.cache.image(path))
        return decode_image_file(path, self.channels, self.box(index), self.decoder)

    def describe(self, index: int) -> str:
        return str(self.records.paths[index])

    def _take(self, rows: np.ndarray) -> FileImageDataset:
        taken = FileImageDataset(
            self.records.take(rows),
            self.transform,
            self.channels,
            self.crop_to_box,
            self.decoder,
            self.cache,
        )
        taken.skipped = self.skipped
        return taken


class ArrayImageDataset(ImageDataset):
    """Images held in memory as ``uint8`` arrays ``(N, H, W)`` or ``(N, H, W, 3)``.

    Stored once as an ``(N, C, H, W)`` tensor, so DataLoader workers share it instead of copying.
    Grayscale images are repeated to 3 channels when ``channels=3``; RGB images are reduced with
    the ITU-R 601 luma weights when ``channels=1``.
    """

    def __init__(
        self,
        images: np.ndarray | Tensor,
        class_ids: np.ndarray | Tensor | Sequence[int],
        class_names: Mapping[int, str] | None = None,
        transform: Transform | None = None,
        channels: Channels = 3,
        source: str = "array",
    ) -> None:
        super().__init__(class_ids, class_names, transform, channels)
        data = torch.as_tensor(np.asarray(images))
        if data.dtype != torch.uint8:
            raise ValueError(f"images must be uint8 (0..255), got {data.dtype}; rescale them first")
        if data.dim() == 3:
            data = data.unsqueeze(1)
        elif data.dim() == 4 and data.shape[-1] in (1, 3):
            data = data.permute(0, 3, 1, 2)
        else:
            raise ValueError(
                f"images must be (N, H, W) or (N, H, W, 1|3), got shape {tuple(data.shape)}"
            )
        if len(data) != len(self.labels):
            raise ValueError(
                f"images has {len(data)} entries but class_ids has {len(self.labels)}; "
                "pass one class id per image"
            )
        self.images: Tensor = data.contiguous()
        """All images, ``uint8`` ``(N, C_stored, H, W)`` as stored (before channel conversion)."""
        self.source = source
        self._class_names_by_id = dict(zip(self.classes, self.class_names))

    def load_image(self, index: int) -> Tensor:
        image = self.images[index]
        if self.channels == 3 and image.shape[0] == 1:
            image = image.expand(3, -1, -1).clone()
        elif self.channels == 1 and image.shape[0] == 3:
            image = TF.rgb_to_grayscale(image, num_output_channels=1)
        return tv_tensors.Image(image)

    def describe(self, index: int) -> str:
        return f"{self.source}[{index}]"

    def _take(self, rows: np.ndarray) -> ArrayImageDataset:
        taken = ArrayImageDataset(
            self.images[torch.from_numpy(rows)].permute(0, 2, 3, 1),
            self.class_ids[torch.from_numpy(rows)],
            self._class_names_by_id,
            self.transform,
            self.channels,
            self.source,
        )
        taken.skipped = self.skipped
        return taken


HeldOutOrder = Literal["last", "spread", "last_groups"]
"""Which training classes a validation or calibration carve holds out: :func:`held_out_positions`
(``"last"``, ``"spread"``) or :func:`last_whole_groups` (``"last_groups"``)."""


def held_out_positions(classes: int, held_out: int, order: Literal["last", "spread"]) -> np.ndarray:
    """Positions (in class-id order) of the ``held_out`` of ``classes`` classes to hold out.

    ``"last"``: the last ones — where ids run by group (Omniglot's alphabets) whole groups, unseen
    like the groups of zero-shot test classes. ``"spread"``: one from each of ``held_out`` equal
    runs of ids, at its middle, so every group lends its share (for test classes drawn from the
    training classes' groups).

    >>> held_out_positions(8, 4, "spread").tolist(), held_out_positions(8, 4, "last").tolist()
    ([1, 3, 5, 7], [4, 5, 6, 7])
    >>> held_out_positions(136, 34, "spread")[:4].tolist()
    [2, 6, 10, 14]
    """
    if order == "last":
        return np.arange(classes - held_out, classes)
    return ((np.arange(held_out) + 0.5) * classes / held_out).astype(np.int64)


def class_group(name: str) -> str:
    """The group of a class named ``group/class`` (Omniglot's ``Korean/character01``: its
    alphabet; a folder dataset's class two folders deep: the outer folder); ``""`` for a name
    without a ``/``."""
    return name.rpartition("/")[0]


def last_whole_groups(class_names: Sequence[str], fraction: float, key: str) -> np.ndarray:
    """Positions (in class-id order) of the classes of the last whole groups
    (:func:`class_group`, ordered by their first class id): as many groups as bring the held-out
    share of classes closest to ``fraction`` (the fewer on a tie), at least one and never all.

    Zero-shot test classes come from groups the model never saw (Omniglot's test alphabets), so a
    validation side that holds out whole groups has the same shift; held-out classes of groups
    that also train (``"last"`` cuts through a group where ``fraction`` falls inside it) do not.
    ``key`` names the setting in errors.

    >>> names = ["Greek/a", "Greek/b", "Korean/a", "Korean/b", "Korean/c", "Latin/a", "Latin/b"]
    >>> last_whole_groups(names, 0.25, "key").tolist(), last_whole_groups(names, 0.6, "key").tolist()
    ([5, 6], [2, 3, 4, 5, 6])
    """
    groups = [class_group(name) for name in class_names]
    if "" in groups:
        raise ValueError(
            f"{key}: holding out whole groups needs class names of the form group/class (as "
            "Omniglot's alphabet/character, or class folders two deep); the class names "
            f"{format_examples([n for n in class_names if '/' not in n])} have no group; hold "
            "out classes with order 'last' or 'spread' instead"
        )
    order = list(dict.fromkeys(groups))  # first appearance in class-id order
    if len(order) < 2:
        raise ValueError(
            f"{key}: all {len(groups)} classes are in the one group {order[0]!r}, so no whole "
            "group can be held out while another trains; use order 'last' or 'spread'"
        )
    counts = Counter(groups)
    sizes = np.array([counts[g] for g in reversed(order)])
    shares = np.cumsum(sizes)[:-1] / len(groups)  # the last 1, 2, … groups; never all
    taken = set(order[len(order) - 1 - int(np.argmin(np.abs(shares - fraction))) :])
    return np.array([i for i, g in enumerate(groups) if g in taken], dtype=np.int64)


@dataclass(frozen=True)
class TrainTestPair:
    """What every train/test split shares: the two sides' images, the check that neither side is
    empty, and re-attaching transforms. Subclasses are frozen dataclasses that add the checks of
    their protocol in ``__post_init__``."""

    train: ImageDataset
    test: ImageDataset
    name: str

    @property
    def sides(self) -> tuple[tuple[str, ImageDataset], ...]:
        """``(("train", train), ("test", test))``: the sides with the names messages give them."""
        return (("train", self.train), ("test", self.test))

    def _check_sides_have_images(self, advice: str = "") -> None:
        """Raise a ``ValueError`` naming the first side that has no images, followed by ``advice``."""
        for side, dataset in self.sides:
            if len(dataset) == 0:
                raise ValueError(f"{self.name}: the {side} split has no images{advice}")

    @property
    def num_train_classes(self) -> int:
        return self.train.num_classes

    def with_transforms(
        self, train_transform: Transform | None, test_transform: Transform | None
    ) -> Self:
        """The same split with the given transforms (image data shared)."""
        return replace(
            self,
            train=self.train.with_transform(train_transform),
            test=self.test.with_transform(test_transform),
        )


@dataclass(frozen=True)
class DMLSplit(TrainTestPair):
    """A class-disjoint train/test pair: the zero-shot protocol of deep metric learning
    (test classes unseen in training; e.g. IDML and SSR, "Datasets": CUB's first 100 classes train).

    Construction checks that neither side is empty and that no original class id is on two
    sides; labels are remapped to ``0..C−1`` independently within each side. ``val``: the
    validation images a source names (a ``val`` split), evaluated instead of the test side by
    :meth:`validation`; ``None`` when it names none.
    """

    val: ImageDataset | None = None

    def __post_init__(self) -> None:
        self._check_sides_have_images(
            "; check the dataset root and the class split options (train_classes / "
            "num_train_classes)"
        )
        named = [("train", self.train), ("test", self.test)]
        if self.val is not None:
            named.insert(1, ("val", self.val))
        for i, (side, dataset) in enumerate(named):
            for other, other_dataset in named[i + 1 :]:
                shared = sorted(set(dataset.classes) & set(other_dataset.classes))
                if shared:
                    raise ValueError(
                        f"{self.name}: {side} and {other} share {len(shared)} class(es) (original "
                        f"ids {format_examples(shared)}); a DML split must be class-disjoint — "
                        "fix the split column/files or the train_classes option"
                    )

    @property
    def sides(self) -> tuple[tuple[str, ImageDataset], ...]:
        val = () if self.val is None else (("val", self.val),)
        return (("train", self.train), *val, ("test", self.test))

    def with_transforms(
        self, train_transform: Transform | None, test_transform: Transform | None
    ) -> Self:
        """The same split with the given transforms (the val side evaluates: the test one)."""
        val = None if self.val is None else self.val.with_transform(test_transform)
        return replace(super().with_transforms(train_transform, test_transform), val=val)

    @property
    def num_test_classes(self) -> int:
        return self.test.num_classes

    def verified(
        self,
        on_failure: Literal["raise", "skip"] = "raise",
        workers: int = 4,
        min_images_per_class: int = 2,
    ) -> DMLSplit:
        """Decode every image of both sides; raise on unreadable ones, or drop and count them.

        With ``"skip"`` the dropped images are logged as a warning and recorded in each side's
        ``skipped``; a class left with fewer than ``min_images_per_class`` images is an error.
        """
        if on_failure not in ("raise", "skip"):
            raise ValueError(f"on_failure must be 'raise' or 'skip', got {on_failure!r}")
        sides: dict[str, ImageDataset] = {}
        for side, dataset in self.sides:
            report = dataset.verify(workers=workers)
            if on_failure == "raise" or report.ok:
                report.raise_if_failed()
                sides[side] = dataset
                continue
            logger.warning("%s %s: skipping %s", self.name, side, report.summary())
            bad = np.array([f.index for f in report.failures], dtype=np.int64)
            kept = dataset.subset(np.setdiff1d(np.arange(len(dataset)), bad))
            kept.skipped = dataset.skipped + report.failures
            counts = np.bincount(
                np.searchsorted(dataset.classes, kept.class_ids.numpy()),
                minlength=dataset.num_classes,
            )
            small = [dataset.class_names[c] for c in np.flatnonzero(counts < min_images_per_class)]
            if small:
                raise ValueError(
                    f"{self.name} {side}: after dropping unreadable images, class(es) "
                    f"{format_examples(small)} have fewer than {min_images_per_class} images; "
                    "replace the unreadable files"
                )
            sides[side] = kept
        return DMLSplit(sides["train"], sides["test"], self.name, sides.get("val"))

    def validation(self, fraction: float = 0.25, order: HeldOutOrder = "last") -> DMLSplit:
        """The split hyper-parameters are chosen on, so that the test classes are never looked at:
        train against the source's ``val`` side when it has one, else a split of the *train*
        classes alone — ``ceil(fraction·C)`` classes (the last by original class id, or spread
        over the ids) or the last whole groups closest to ``fraction`` (``order``) become the
        evaluation side, the others train. The test side is dropped.
        """
        if self.val is not None:
            return DMLSplit(self.train, self.val, f"{self.name}/validation")
        kept, held = self._carve_train_classes(
            fraction, order, "data.validation_classes", "data.validation_order"
        )
        return DMLSplit(kept, held, f"{self.name}/validation")

    def held_out(self, fraction: float, order: HeldOutOrder = "last") -> DMLSplit:
        """The same split with ``ceil(fraction·C)`` *train* classes moved to the ``val`` side,
        which the model never trains on (e.g. to fit a calibrated confidence on classes it did not
        learn, like the unseen test classes it will meet): the last ones by original class id,
        spread evenly over the ids, or the last whole groups (``order``, :data:`HeldOutOrder`). A
        split whose source names a ``val`` side already is returned as it is.
        """
        if self.val is not None:
            return self
        kept, held = self._carve_train_classes(
            fraction, order, "calibration.held_out_classes", "calibration.held_out_order"
        )
        return DMLSplit(kept, self.test, self.name, held)

    def _carve_train_classes(
        self, fraction: float, order: HeldOutOrder, key: str, order_key: str
    ) -> tuple[ImageDataset, ImageDataset]:
        """``(train without a share fraction of its classes, those classes)`` — which ones:
        :func:`held_out_positions` or :func:`last_whole_groups` — the second with the test side's
        transform (it is evaluated, never trained on); ``key`` and ``order_key`` name the share's
        and the order's setting in errors."""
        if not 0.0 < fraction < 1.0:
            raise ValueError(
                f"{key}: the share of train classes must lie in (0, 1), got {fraction}"
            )
        classes = np.asarray(self.train.classes)
        if order == "last_groups":
            positions = last_whole_groups(
                self.train.class_names, fraction, f"{order_key}=last_groups"
            )
            groups = dict.fromkeys(class_group(self.train.class_names[i]) for i in positions)
            logger.info(
                "%s: holding out the groups %s (%d of %d classes) for %s=%s",
                self.name,
                ", ".join(groups),
                len(positions),
                len(classes),
                key,
                fraction,
            )
        else:
            held_out = int(np.ceil(fraction * len(classes)))
            if not 1 <= held_out < len(classes):
                raise ValueError(
                    f"{self.name}: a share of {fraction} of {len(classes)} train classes leaves "
                    f"no class on one side; change {key}"
                )
            positions = held_out_positions(len(classes), held_out, order)
        ids = self.train.class_ids.numpy()
        held = np.isin(ids, classes[positions])
        return (
            self.train.subset(np.flatnonzero(~held)),
            self.train.subset(np.flatnonzero(held)).with_transform(self.test.transform),
        )

    def summary(self) -> dict[str, object]:
        """Counts for logs and reports: images and classes per side, skipped images."""
        counts: dict[str, object] = {"name": self.name}
        for side, dataset in self.sides:
            counts[f"{side}_images"] = len(dataset)
            counts[f"{side}_classes"] = dataset.num_classes
        counts["skipped_images"] = sum(len(dataset.skipped) for _, dataset in self.sides)
        return counts
