"""Decoding image files for :class:`~idml.data.datasets.FileImageDataset`: the PIL mode conversion to
one or three channels, an optional crop, and errors that name the file.

Two decoders give the same pixels (``decoder``):

* ``"pil"`` (the reference): Pillow, any format it reads;
* ``"torchvision"``: ``torchvision.io.decode_jpeg`` (libjpeg-turbo without Pillow's image objects:
  about 1.5 times the images per second per core on 500 × 375 JPEGs, ``benchmarks/RESULTS.md``)
  for baseline and progressive JPEGs of one or three components; every other file (PNG, CMYK
  JPEG, …) goes to Pillow. Both libraries run libjpeg-turbo's default IDCT and chroma upsampling,
  so the pixels are the same bytes (``tests/test_data_paths.py``).

The crop to a box follows Pillow's ``Image.crop``: a box reaching outside the image is padded with
zeros.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from torchvision import tv_tensors

Channels = Literal[1, 3]
"""Channels of the decoded images: grey or RGB."""

# idml decodes through torchvision.io on purpose (TorchCodec, which torchvision 0.29 recommends
# instead, is not a dependency); its deprecation notice would otherwise repeat for every image.
warnings.filterwarnings(
    "ignore",
    message="The image decoding and encoding capabilities of TorchVision are deprecated",
    category=DeprecationWarning,
)

Decoder = Literal["pil", "torchvision"]
"""Which library decodes image files (module docstring)."""
DECODERS: tuple[Decoder, ...] = ("pil", "torchvision")


class CorruptImageError(ValueError):
    """An image file exists but cannot be decoded (truncated, not an image, unsupported)."""


_WIDE_INTEGER_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")


def convert_mode(image: Image.Image, channels: Channels) -> Image.Image:
    """An image of any mode Pillow reads as 8-bit RGB (``channels=3``) or L, range preserved.

    Pillow's own ``convert`` clips 16- and 32-bit integer pixels to 255 (mid-grey 30000/65535
    becomes white) and float pixels likewise; here 16-bit integers are scaled by 255/65535 (a
    32-bit ``I`` image is taken as 16-bit data, which is what PNG and TIFF readers give it) and
    float images by 255 when they lie in ``[0, 1]``. Palette, CMYK, RGBA and 1-bit images go
    through Pillow's conversion, which maps them correctly (alpha is dropped).
    """
    target = "RGB" if channels == 3 else "L"
    if image.mode in _WIDE_INTEGER_MODES or image.mode == "F":
        array = np.asarray(image, dtype=np.float64)
        if image.mode == "F":
            scale = 255.0 if array.size and np.nanmax(array) <= 1.0 else 1.0
        else:
            scale = 255.0 / 65535.0
        grey = np.clip(np.rint(np.nan_to_num(array) * scale), 0, 255).astype(np.uint8)
        image = Image.fromarray(grey)  # 2-D uint8: mode L
    return image.convert(target)


def decode_image_file(
    path: str, channels: Channels, box: Sequence[int] | None = None, decoder: Decoder = "pil"
) -> Tensor:
    """Decode ``path`` into a ``uint8`` ``C×H×W`` image (RGB or grayscale).

    ``box = (x1, y1, x2, y2)`` crops before conversion. ``decoder``: see the module docstring. A
    missing file raises ``FileNotFoundError`` and an undecodable one :class:`CorruptImageError`,
    both naming the file.
    """
    if decoder == "torchvision":
        data = read_file_bytes(path)
        if jpeg_decodable(data, channels):
            return tv_tensors.Image(crop_box(decode_jpeg_bytes(data, channels, path), box))
    elif decoder != "pil":
        raise ValueError(f"decoder must be one of {DECODERS}, got {decoder!r}")
    try:
        with Image.open(path) as opened:
            # load() forces the full decode, so truncated files fail here rather than mid-transform.
            opened.load()
            image = opened.crop(tuple(int(v) for v in box)) if box is not None else opened
            image = convert_mode(image, channels)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"image {path} does not exist; the dataset changed since it was loaded — reload it"
        ) from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as err:
        raise CorruptImageError(
            f"cannot decode image {path} ({type(err).__name__}: {err}); replace the file, or "
            "set data.verify=skip (load_split(verify='skip')) to drop unreadable images"
        ) from err
    array = np.array(image, dtype=np.uint8)
    tensor = torch.from_numpy(array)
    tensor = tensor.unsqueeze(0) if tensor.dim() == 2 else tensor.permute(2, 0, 1)
    return tv_tensors.Image(tensor)


def read_file_bytes(path: str) -> bytes:
    """The bytes of an image file; a missing file is the ``FileNotFoundError`` of
    :func:`decode_image_file`."""
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except FileNotFoundError:
        raise FileNotFoundError(
            f"image {path} does not exist; the dataset changed since it was loaded — reload it"
        ) from None


def jpeg_decodable(data: bytes, channels: Channels) -> bool:
    """Whether ``data`` is a JPEG that ``torchvision.io.decode_jpeg`` decodes to the reference's
    pixels: a grey JPEG (one component), or a colour one (three) decoded to RGB. Pillow's colour
    to grey conversion (ITU-R 601 luma of RGB) is not libjpeg's (the Y channel), and Pillow's CMYK
    conversion is the reference, so those, and every other format, go to Pillow."""
    if data[:3] != b"\xff\xd8\xff":
        return False
    components = jpeg_components(data)
    return components == 1 or (components == 3 and channels == 3)


def jpeg_components(data: bytes) -> int | None:
    """The component count of a JPEG's frame header (``SOFn``), or ``None`` if none is found."""
    pos = 2
    while pos + 4 <= len(data):
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:  # no length
            pos += 2
            continue
        length = int.from_bytes(data[pos + 2 : pos + 4], "big")
        # SOF0..SOF15 except DHT (C4), JPG (C8) and DAC (CC): precision, height, width, components.
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            return data[pos + 9] if pos + 9 < len(data) else None
        pos += 2 + length
    return None


def decode_jpeg_bytes(data: bytes | Tensor, channels: Channels, source: str) -> Tensor:
    """Decode one JPEG on the CPU with ``torchvision.io.decode_jpeg`` into ``uint8`` ``C×H×W``."""
    from torchvision.io import ImageReadMode, decode_jpeg

    encoded = (
        data if isinstance(data, Tensor) else torch.frombuffer(bytearray(data), dtype=torch.uint8)
    )
    mode = ImageReadMode.RGB if channels == 3 else ImageReadMode.GRAY
    try:
        return decode_jpeg(encoded, mode=mode)
    except RuntimeError as err:
        raise CorruptImageError(
            f"cannot decode image {source} ({str(err).splitlines()[0][:200]}); replace the file, "
            "or set data.verify=skip (load_split(verify='skip')) to drop unreadable images"
        ) from err


def crop_box(image: Tensor, box: Sequence[int] | None) -> Tensor:
    """``image[:, y1:y2, x1:x2]`` for ``box = (x1, y1, x2, y2)``, zero-padded where the box leaves
    the image, as Pillow's ``Image.crop`` does; the image itself without a box."""
    if box is None:
        return image
    x1, y1, x2, y2 = (int(v) for v in box)
    _, height, width = image.shape
    if 0 <= x1 <= x2 <= width and 0 <= y1 <= y2 <= height:
        return image[:, y1:y2, x1:x2]
    out = image.new_zeros((image.shape[0], max(y2 - y1, 0), max(x2 - x1, 0)))
    sy0, sy1, sx0, sx1 = max(y1, 0), min(y2, height), max(x1, 0), min(x2, width)
    if sy0 < sy1 and sx0 < sx1:
        out[:, sy0 - y1 : sy1 - y1, sx0 - x1 : sx1 - x1] = image[:, sy0:sy1, sx0:sx1]
    return out
