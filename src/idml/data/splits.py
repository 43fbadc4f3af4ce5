"""Split policies: how a table of :class:`~idml.data.records.ImageRecords` becomes the sides a task
trains and evaluates on. The reader (:mod:`idml.data.reader`) returns records; the task picks:

- **class-disjoint** (:func:`split_by_class`): metric learning's zero-shot protocol — named train
  classes, or the first ``ceil(C/2)`` of the sorted classes (:func:`first_half`); the rest test;
- **per-class hold-out** (:func:`holdout_split`): classification on data without a test side —
  ``round(test_fraction·n_c)`` random images of each class test;
- **given** (:func:`given_split`): a CSV's split column or ``train/``, ``val/``, ``test/`` folders.

Example:
    >>> import numpy as np
    >>> records = ImageRecords(
    ...     paths=np.array(["a1", "a2", "b1", "b2", "c1"], dtype=object),
    ...     class_ids=np.array([0, 0, 1, 1, 2]),
    ...     class_names={0: "a", 1: "b", 2: "c"},
    ...     splits=np.array(["train", "train", "val", "test", "test"], dtype=object),
    ... )
    >>> sides = given_split(records)
    >>> [len(side) for side in (sides.train, sides.val, sides.test)]
    [2, 1, 2]
    >>> train, test = split_by_class(records, ["c"], "toy")
    >>> train.paths.tolist(), test.paths.tolist()
    (['c1'], ['a1', 'a2', 'b1', 'b2'])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from idml.data.records import ImageRecords, format_examples


def first_half(class_ids: np.ndarray) -> np.ndarray:
    """The first ``ceil(C/2)`` of the sorted distinct class ids: the zero-shot train classes."""
    classes = np.unique(class_ids)
    return classes[: (len(classes) + 1) // 2]


def split_by_class(
    records: ImageRecords, train_classes: Sequence[str] | None, source: str
) -> tuple[ImageRecords, ImageRecords]:
    """``(train, test)``: the images of the classes named ``train_classes`` (default: the first half
    of the sorted class ids), and the rest. An unknown name is an error naming ``source``."""
    if train_classes is None:
        return records.split_by_class(first_half(records.class_ids))
    if isinstance(train_classes, str):
        raise ValueError("train_classes must be a list of class names, not a single string")
    ids_by_name = {name: class_id for class_id, name in records.class_names.items()}
    unknown = [str(c) for c in train_classes if str(c) not in ids_by_name]
    if unknown:
        raise ValueError(
            f"train_classes names classes that are not in {source}: {format_examples(unknown)}; "
            f"known classes include {format_examples(sorted(ids_by_name))}"
        )
    return records.split_by_class(np.array([ids_by_name[str(c)] for c in train_classes]))


def holdout_rows(class_ids: np.ndarray, test_fraction: float, seed: int) -> np.ndarray:
    """Boolean mask of the test rows: ``round(test_fraction·n_c)`` random images of each class
    (at least one, and at least one left for training)."""
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must lie in (0, 1), got {test_fraction}")
    rng = np.random.default_rng(seed)
    test = np.zeros(len(class_ids), dtype=bool)
    for c in np.unique(class_ids):
        rows = np.flatnonzero(class_ids == c)
        if len(rows) < 2:
            raise ValueError(
                f"class {c} has {len(rows)} image; a hold-out split needs at least 2 per class"
            )
        count = min(max(1, round(test_fraction * len(rows))), len(rows) - 1)
        test[rng.choice(rows, count, replace=False)] = True
    return test


def holdout_split(
    records: ImageRecords, test_fraction: float, seed: int = 0
) -> tuple[ImageRecords, ImageRecords]:
    """``(train, test)`` with :func:`holdout_rows` of each class on the test side."""
    held = holdout_rows(records.class_ids, test_fraction, seed)
    return records.take(~held), records.take(held)


@dataclass(frozen=True)
class GivenSplit:
    """The sides a source's split column or split folders name (``val`` may be empty)."""

    train: ImageRecords
    val: ImageRecords
    test: ImageRecords


def given_split(records: ImageRecords) -> GivenSplit:
    """The ``train``, ``val`` and ``test`` rows of records that carry ``splits``."""
    if records.splits is None:
        raise ValueError("given_split needs records with a split per image")
    train, val, test = (records.take(records.splits == side) for side in ("train", "val", "test"))
    return GivenSplit(train, val, test)
