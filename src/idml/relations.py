"""Label relations: which samples (and which class proxies) are positives of each other.

Every loss consumes relations, never raw integer labels, so that Mixup *set labels* work everywhere
(IDML, Wang et al., Sec. III-C: ``l_i = l_j`` iff ``l_i ∩ l_j ≠ ∅``). An image carries a set of up
to ``K`` labels; an original image has the singleton ``{l}``, a mixed image ``x_m = λ·x_a +
(1−λ)·x_b`` has ``{l_a, l_b}``. Two images are positives iff their label sets intersect.

Example:
    >>> import torch
    >>> labels = LabelSets.from_labels(torch.tensor([0, 0, 1]))
    >>> mixed = LabelSets.mixed(torch.tensor([0]), torch.tensor([1]))
    >>> batch = labels.cat(mixed)
    >>> batch.positive_mask().int().tolist()
    [[0, 1, 0, 1], [1, 0, 0, 1], [0, 0, 0, 1], [1, 1, 1, 0]]
    >>> batch.proxy_mask(num_classes=2).int().tolist()
    [[1, 0], [1, 0], [0, 1], [1, 1]]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from idml.checks import value_checks_enabled

PAD = -1
"""Padding value of an unused label slot."""


@dataclass(frozen=True)
class LabelSets:
    """A batch of label sets, stored as a ``(B, K)`` long tensor padded with :data:`PAD`.

    ``K = 1`` for ordinary labels, ``K = 2`` once Mixup images are in the batch.
    """

    labels: Tensor

    def __post_init__(self) -> None:
        if not isinstance(self.labels, Tensor):
            raise TypeError(f"labels must be a torch.Tensor, got {type(self.labels).__name__}")
        if self.labels.dim() != 2:
            raise ValueError(
                f"labels must be a (batch, slots) tensor of label sets, got shape {tuple(self.labels.shape)}"
            )
        if self.labels.dtype.is_floating_point or self.labels.dtype == torch.bool:
            raise ValueError(f"labels must be integers, got dtype {self.labels.dtype}")
        if value_checks_enabled() and self.labels.numel() and bool((self.labels[:, 0] < 0).any()):
            raise ValueError(
                "labels: every sample needs at least one label >= 0 in its first slot "
                f"(got {self.labels[:, 0].min().item()}); remap labels to 0..C-1"
            )

    # ----------------------------------------------------------------- constructors
    @classmethod
    def from_labels(cls, labels: Tensor) -> LabelSets:
        """Singleton sets from a ``(B,)`` integer label vector."""
        labels = torch.as_tensor(labels)
        if labels.dim() != 1:
            raise ValueError(f"labels must be a 1-D vector, got shape {tuple(labels.shape)}")
        return cls(labels.long().unsqueeze(1))

    @classmethod
    def mixed(cls, labels_a: Tensor, labels_b: Tensor) -> LabelSets:
        """Two-label sets ``{a, b}`` for Mixup images (``a == b`` gives a singleton)."""
        labels_a, labels_b = torch.as_tensor(labels_a).long(), torch.as_tensor(labels_b).long()
        if labels_a.shape != labels_b.shape or labels_a.dim() != 1:
            raise ValueError(
                f"labels_a and labels_b must be 1-D of equal length, got {tuple(labels_a.shape)} "
                f"and {tuple(labels_b.shape)}"
            )
        second = torch.where(labels_a == labels_b, torch.full_like(labels_b, PAD), labels_b)
        return cls(torch.stack([labels_a, second], dim=1))

    @classmethod
    def coerce(cls, labels: Tensor | LabelSets) -> LabelSets:
        """Accept a ``(B,)`` label vector, a ``(B, K)`` padded tensor or a :class:`LabelSets`."""
        if isinstance(labels, LabelSets):
            return labels
        labels = torch.as_tensor(labels)
        if labels.dim() == 1:
            return cls.from_labels(labels)
        return cls(labels.long())

    # ----------------------------------------------------------------- structure
    def __len__(self) -> int:
        return self.labels.shape[0]

    @property
    def device(self) -> torch.device:
        return self.labels.device

    @property
    def is_single(self) -> bool:
        """True when every sample has exactly one label (no Mixup images)."""
        return self.labels.shape[1] == 1 or bool((self.labels[:, 1:] == PAD).all())

    @property
    def primary(self) -> Tensor:
        """The first label of each set, shape ``(B,)``."""
        return self.labels[:, 0]

    def max_label(self) -> int:
        return int(self.labels.max().item()) if self.labels.numel() else -1

    def cat(self, other: LabelSets) -> LabelSets:
        """Concatenate two batches (padding the narrower one)."""
        k = max(self.labels.shape[1], other.labels.shape[1])
        return LabelSets(
            torch.cat([pad_label_width(self.labels, k), pad_label_width(other.labels, k)], dim=0)
        )

    def to(self, device: torch.device | str) -> LabelSets:
        return LabelSets(self.labels.to(device))

    def __getitem__(self, index: Tensor | slice) -> LabelSets:
        return LabelSets(self.labels[index])

    # ----------------------------------------------------------------- relations
    def membership(self, num_classes: int) -> Tensor:
        """``(B, C)`` boolean matrix: sample ``i`` carries class ``c``."""
        if value_checks_enabled() and self.max_label() >= num_classes:
            raise ValueError(
                f"labels: label {self.max_label()} is out of range for {num_classes} classes; "
                "labels must lie in 0..num_classes-1 (set num_classes to the number of training classes)"
            )
        member = torch.zeros(len(self), num_classes, dtype=torch.bool, device=self.device)
        valid = self.labels >= 0
        rows = torch.arange(len(self), device=self.device).unsqueeze(1).expand_as(self.labels)
        member[rows[valid], self.labels[valid]] = True
        return member

    def proxy_mask(self, num_classes: int) -> Tensor:
        """``(B, C)`` positives against class proxies: a mixed image is positive to both sources."""
        return self.membership(num_classes)

    def intersects(self, other: LabelSets | None = None) -> Tensor:
        """``(B, B')`` boolean matrix: the label sets of ``i`` and ``j`` intersect (self included)."""
        other = self if other is None else other
        a, b = self.labels, other.labels
        # One (B, B') comparison per pair of label slots (K·K' ≤ 4) is cheaper than a
        # (B, K, B', K') tensor reduced twice. Padding in ``a`` becomes PAD - 1, which matches
        # nothing in ``b`` (labels >= 0 or PAD), so no validity mask is needed.
        a = torch.where(a >= 0, a, PAD - 1)
        related = torch.zeros(a.shape[0], b.shape[0], dtype=torch.bool, device=a.device)
        for slot_a in range(a.shape[1]):
            column = a[:, slot_a].unsqueeze(1)
            for slot_b in range(b.shape[1]):
                related |= column == b[:, slot_b].unsqueeze(0)
        return related

    def positive_mask(self, other: LabelSets | None = None) -> Tensor:
        """Pairs whose label sets intersect; the diagonal is excluded when ``other`` is ``None``."""
        mask = self.intersects(other)
        if other is None:
            mask.fill_diagonal_(False)
        return mask

    def negative_mask(self, other: LabelSets | None = None) -> Tensor:
        """Pairs whose label sets are disjoint (never the diagonal)."""
        return ~self.intersects(other)


def pair_masks(labels: Tensor | LabelSets) -> tuple[Tensor, Tensor]:
    """``(positive, negative)`` ``B×B`` masks of a batch, self-pairs excluded from both."""
    sets = LabelSets.coerce(labels)
    return sets.positive_mask(), sets.negative_mask()


def pad_label_width(labels: Tensor, width: int) -> Tensor:
    """A ``(B, k)`` label-set tensor widened to ``(B, width)`` with :data:`PAD` columns (``width ≥ k``),
    so that batches with label sets of different sizes can be concatenated."""
    if labels.shape[1] == width:
        return labels
    pad = labels.new_full((labels.shape[0], width - labels.shape[1]), PAD)
    return torch.cat([labels, pad], dim=1)
