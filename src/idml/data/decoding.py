"""Decoding image files for :class:`~idml.data.datasets.FileImageDataset`: the PIL mode conversion to
one or three channels, an optional crop, and errors that name the file."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from torchvision import tv_tensors

Channels = Literal[1, 3]
"""Channels of the decoded images: grey or RGB."""


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


def decode_image_file(path: str, channels: Channels, box: Sequence[int] | None = None) -> Tensor:
    """Decode ``path`` with PIL into a ``uint8`` ``C×H×W`` image (RGB or grayscale).

    ``box = (x1, y1, x2, y2)`` crops before conversion. A missing file raises
    ``FileNotFoundError`` and an undecodable one :class:`CorruptImageError`, both naming the file.
    """
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
