"""The train recipe's crop and flip on whole batches, on the training device, and JPEG decoding
there: the loader workers only read files (or a cache) and the accelerator does the rest.

Per-image transforms in DataLoader workers cost about as much per image as decoding it
(``benchmarks/RESULTS.md``, data path table), and a worker ships float32 crops, four times the
bytes of the ``uint8`` pixels. :class:`DeviceBatches` wraps a loader whose workers yield each
image undecoded (the file's bytes, see :class:`UncroppedImages`) or decoded but uncropped, and
per batch

1. decodes the JPEGs with ``torchvision.io.decode_jpeg`` on the device (nvJPEG on CUDA);
2. crops Cars' boxes (zero padding outside the image, as Pillow's crop);
3. draws the ``RandomResizedCrop`` boxes and the flips of the whole batch from a CPU generator
   (:meth:`BatchCrops.draw`, torchvision's sampling rule), so the draws do not depend on the
   device and a resumed run repeats them;
4. resizes every crop to ``size × size`` with two batched matrix products by resampling weights
   that are torchvision's antialiased bilinear filter (:func:`resampling_weights`), flips folded
   into the weights, and returns float images in ``[0, 1]``.

**Same images as the reference.** For the same box and flip, the result is
``resized_crop(image, box, size, antialias=True)`` (then ``hflip``) computed in float32. The
reference transforms run that resize on ``uint8``, rounding after each of its two separable passes
(the first error, at most 0.5, passes the second pass's convex combination unchanged at most), so
the two differ by at most one grey level, ``1/255`` (``tests/test_data_paths.py``); the float
reference (``interpolate`` on float32) is matched to ``1e-5``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from idml.data.datasets import FileImageDataset, ImageDataset
from idml.data.decoding import (
    Channels,
    crop_box,
    decode_jpeg_bytes,
    jpeg_decodable,
    read_file_bytes,
)


@dataclass(frozen=True)
class CropDraws:
    """One batch's crop boxes ``(top, left, height, width)`` ``(B, 4)`` and flips ``(B,)``."""

    boxes: Tensor
    flips: Tensor


@dataclass(frozen=True)
class BatchCrops:
    """``RandomResizedCrop(size, scale, ratio)`` + horizontal flip of a batch of differently sized
    ``uint8`` images, as batched tensor ops on their device (module docstring)."""

    size: int
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip_probability: float = 0.5

    ATTEMPTS = 10
    """torchvision's RandomResizedCrop tries this many boxes before the central fallback."""

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"size must be a positive number of pixels, got {self.size}")
        if not 0.0 < self.scale[0] <= self.scale[1] <= 1.0:
            raise ValueError(f"scale must satisfy 0 < low <= high <= 1, got {self.scale}")
        if not 0.0 < self.ratio[0] <= self.ratio[1]:
            raise ValueError(f"ratio must satisfy 0 < low <= high, got {self.ratio}")
        if not 0.0 <= self.flip_probability <= 1.0:
            raise ValueError(f"flip_probability must be in [0, 1], got {self.flip_probability}")

    def draw(self, heights: Tensor, widths: Tensor, generator: torch.Generator) -> CropDraws:
        """Boxes and flips for images of ``heights`` × ``widths`` (CPU tensors), by
        torchvision's rule: up to :data:`ATTEMPTS` boxes of area ``U(scale)·H·W`` and log aspect
        ``U(log ratio)``, the first that fits, placed uniformly; else the largest central box
        whose aspect lies in ``ratio``."""
        n = len(heights)
        h_img, w_img = heights.double().unsqueeze(1), widths.double().unsqueeze(1)
        area = h_img * w_img
        u_area = torch.rand(n, self.ATTEMPTS, generator=generator, dtype=torch.float64)
        target = area * (self.scale[0] + (self.scale[1] - self.scale[0]) * u_area)
        log_lo, log_hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        u_ratio = torch.rand(n, self.ATTEMPTS, generator=generator, dtype=torch.float64)
        aspect = torch.exp(log_lo + (log_hi - log_lo) * u_ratio)
        w = torch.round(torch.sqrt(target * aspect))
        h = torch.round(torch.sqrt(target / aspect))
        fits = (w > 0) & (w <= w_img) & (h > 0) & (h <= h_img)
        first = fits.double().argmax(dim=1, keepdim=True)
        found = fits.any(dim=1)
        h_pick = h.gather(1, first).squeeze(1)
        w_pick = w.gather(1, first).squeeze(1)
        u_top, u_left = torch.rand(2, n, generator=generator, dtype=torch.float64)
        top = torch.floor(u_top * (heights - h_pick + 1))
        left = torch.floor(u_left * (widths - w_pick + 1))
        # The fallback: a central crop, clipped to the ratio range.
        in_ratio = widths.double() / heights.double()
        fw = torch.where(
            in_ratio > self.ratio[1], torch.round(heights * self.ratio[1]), widths.double()
        )
        fh = torch.where(
            in_ratio < self.ratio[0], torch.round(widths / self.ratio[0]), heights.double()
        )
        boxes = torch.stack(
            [
                torch.where(found, top, torch.div(heights - fh, 2, rounding_mode="floor")),
                torch.where(found, left, torch.div(widths - fw, 2, rounding_mode="floor")),
                torch.where(found, h_pick, fh),
                torch.where(found, w_pick, fw),
            ],
            dim=1,
        ).long()
        flips = torch.rand(n, generator=generator) < self.flip_probability
        return CropDraws(boxes, flips)

    def apply(self, images: Sequence[Tensor], draws: CropDraws) -> Tensor:
        """The crops of ``images`` (``uint8`` ``C×H×W`` on one device) resized to
        ``size × size``, flipped where drawn: float32 ``(B, C, size, size)`` in ``[0, 1]``."""
        if not images:
            raise ValueError("a batch needs at least one image")
        device = images[0].device
        boxes = draws.boxes.tolist()
        h_max = max(b[2] for b in boxes)
        w_max = max(b[3] for b in boxes)
        crops = torch.zeros(
            (len(images), images[0].shape[0], h_max, w_max), dtype=torch.float32, device=device
        )
        for b, (image, (top, left, h, w)) in enumerate(zip(images, boxes, strict=True)):
            crops[b, :, :h, :w] = image[:, top : top + h, left : left + w]
        heights, widths = draws.boxes[:, 2], draws.boxes[:, 3]
        rows = resampling_weights(heights, self.size, h_max).to(device)
        cols = resampling_weights(widths, self.size, w_max)
        cols = torch.where(draws.flips.view(-1, 1, 1), cols.flip(1), cols).to(device)
        with _full_precision_matmul():
            out = torch.matmul(rows.unsqueeze(1), crops)
            out = torch.matmul(out, cols.transpose(1, 2).unsqueeze(1))
        return out.div_(255.0).clamp_(0.0, 1.0)

    def __call__(self, images: Sequence[Tensor], generator: torch.Generator) -> Tensor:
        heights = torch.tensor([int(image.shape[1]) for image in images])
        widths = torch.tensor([int(image.shape[2]) for image in images])
        return self.apply(images, self.draw(heights, widths, generator))


def resampling_weights(lengths: Tensor, out_size: int, width: int) -> Tensor:
    """``(B, out_size, width)`` weights that resize a length-``lengths[b]`` axis (zero-padded to
    ``width``) to ``out_size`` samples: PyTorch's antialiased bilinear filter (that of Pillow), with
    ``s = L/out``, centre ``c_i = s(i + ½)``, support ``max(s, 1)``, the triangle
    ``max(0, 1 − |j − c_i + ½|/max(s, 1))`` over the window ``[⌊c_i − support + ½⌋,
    ⌊c_i + support + ½⌋)`` clipped to the axis, normalised to sum 1."""
    length = lengths.double().view(-1, 1, 1)
    scale = length / out_size
    support = torch.clamp(scale, min=1.0)
    invscale = 1.0 / support
    i = torch.arange(out_size, dtype=torch.float64).view(1, -1, 1)
    j = torch.arange(width, dtype=torch.float64).view(1, 1, -1)
    center = scale * (i + 0.5)
    lo = torch.clamp(torch.trunc(center - support + 0.5), min=0.0)
    hi = torch.minimum(torch.trunc(center + support + 0.5), length)
    weights = torch.clamp(1.0 - torch.abs((j - center + 0.5) * invscale), min=0.0)
    weights = weights * ((j >= lo) & (j < hi))
    weights = weights / weights.sum(dim=2, keepdim=True)
    return weights.float()


@contextmanager
def _full_precision_matmul() -> Iterator[None]:
    """fp32 products even where TF32 is allowed (its 10-bit inputs would cost up to a quarter of
    a grey level)."""
    if not torch.cuda.is_available():
        yield
        return
    allowed = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed


# --------------------------------------------------------------------------- loading
class UncroppedImages(Dataset[tuple[Tensor, bool, Tensor, int, int]]):
    """The images of ``dataset`` without its transform, for :class:`DeviceBatches`: item ``i`` is
    ``(payload, encoded, box, label, i)``.

    With ``encoded`` the payload of a JPEG that ``decode_jpeg`` decodes to the reference's pixels
    (:func:`~idml.data.decoding.jpeg_decodable`) is the file's bytes, with its box (``(4,)``, or
    empty) to crop after decoding; every other image (other formats, a cache, in-memory arrays)
    is decoded here, box-cropped, and ``encoded`` is ``False``.
    """

    def __init__(self, dataset: ImageDataset, encoded: bool) -> None:
        self.dataset = dataset
        self.encoded = encoded

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[Tensor, bool, Tensor, int, int]:
        data = self.dataset
        label = int(data.labels[index])
        no_box = torch.zeros(0, dtype=torch.long)
        if self.encoded and isinstance(data, FileImageDataset) and data.cache is None:
            raw = read_file_bytes(str(data.paths[index]))
            if jpeg_decodable(raw, data.channels):
                box = data.box(index)
                box_tensor = no_box if box is None else torch.tensor(box)
                payload = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                return payload, True, box_tensor, label, index
        image = data.load_image(index).as_subclass(Tensor)
        return image, False, no_box, label, index


def collate_uncropped(
    items: Sequence[tuple[Tensor, bool, Tensor, int, int]],
) -> tuple[list[Tensor], list[bool], list[Tensor], Tensor, Tensor]:
    """A batch of :class:`UncroppedImages` items: lists (the images differ in size)."""
    payloads, encoded, boxes, labels, indices = zip(*items, strict=True)
    return (
        list(payloads),
        list(encoded),
        list(boxes),
        torch.tensor(labels, dtype=torch.long),
        torch.tensor(indices, dtype=torch.long),
    )


def decode_on(
    payloads: Sequence[Tensor],
    encoded: Sequence[bool],
    boxes: Sequence[Tensor],
    channels: Channels,
    device: torch.device,
) -> list[Tensor]:
    """The batch's images as ``uint8`` ``C×H×W`` on ``device``: encoded ones decoded together by
    ``decode_jpeg`` on the device, box-cropped; the others moved there."""
    from torchvision.io import ImageReadMode, decode_jpeg

    images: list[Tensor | None] = [None] * len(payloads)
    todo = [i for i, flag in enumerate(encoded) if flag]
    if todo:
        mode = ImageReadMode.RGB if channels == 3 else ImageReadMode.GRAY
        if device.type == "cpu":
            decoded = [decode_jpeg_bytes(payloads[i], channels, f"batch item {i}") for i in todo]
        else:
            decoded = decode_jpeg([payloads[i] for i in todo], mode=mode, device=device)
        for i, image in zip(todo, decoded, strict=True):
            box = boxes[i].tolist() if boxes[i].numel() else None
            images[i] = crop_box(image, box)
    for i, flag in enumerate(encoded):
        if not flag:
            images[i] = payloads[i].to(device, non_blocking=True)
    return [image for image in images if image is not None]


class DeviceBatches:
    """Train batches decoded (optionally), cropped and flipped on ``device`` (module docstring):
    iterate for ``(images float (B, C, size, size) in [0, 1], labels, indices)`` on ``device``,
    like a DataLoader of the per-image transforms; ``len()`` is the loader's.

    ``loader`` must load :class:`UncroppedImages` with :func:`collate_uncropped`; ``generator``
    draws every batch's boxes and flips.
    """

    def __init__(
        self,
        loader: DataLoader,
        crops: BatchCrops,
        generator: torch.Generator,
        device: torch.device,
        channels: Channels = 3,
    ) -> None:
        self.loader = loader
        self.crops = crops
        self.generator = generator
        self.device = device
        self.channels: Channels = channels

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
        for payloads, encoded, boxes, labels, indices in self.loader:
            images = decode_on(payloads, encoded, boxes, self.channels, self.device)
            batch = self.crops(images, self.generator)
            yield batch, labels.to(self.device, non_blocking=True), indices
