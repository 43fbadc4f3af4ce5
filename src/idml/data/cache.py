"""A decoded ``uint8`` copy of a dataset's images, written once, memory-mapped by every epoch.

Decoding a 500 × 375 JPEG costs more than everything else the loader does to it (about 430 images
per second per core with Pillow, ``benchmarks/RESULTS.md``); the cache pays it once. A cache is a
folder (written by ``idml cache``, or :func:`write_cache`)::

    manifest.json   format, version, parameters, count, the two files' SHA-256, one entry per image:
                    its path, and the size and modification time of the file it was decoded from
    index.npy       (N, 4) int64: byte offset, channels, height, width of each image
    pixels.u8       every image, C×H×W uint8, one after the other

Each image is stored as :meth:`~idml.data.FileImageDataset.load_image` returns it (channel
conversion, Cars' box crop) and, when its shorter side is longer than ``short_side``, resized so
that it is ``short_side`` (the transforms' own antialiased bilinear resize on ``uint8``; never
enlarged). What that changes:

* images already within ``short_side`` are stored as decoded: every transform gives the
  reference's pixels exactly;
* the test transform (``Resize(resize_size)`` + centre crop) of an image stored at
  ``short_side = resize_size`` is the reference's exactly (the same resize, done once ahead);
* a train crop of a resized image is cut from the smaller image: the same crop geometry, with the
  detail finer than the stored resolution lost (bounded in ``tests/test_data_paths.py``). The
  default ``short_side`` (512) keeps CUB's and SOP's images as they are and reduces the large
  Cars photographs only.

**Checks.** :func:`open_cache` verifies both files' SHA-256 against the manifest (one read of the
cache, about a second per GB) and :meth:`ImageCache.check_sources` that every image a dataset
names is in the cache and that its source file has the size and modification time it had when
cached; anything else is an error that names the file and says to run ``idml cache`` again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torchvision.transforms.v2 import functional as TF

from idml.data.records import format_examples

FORMAT = "idml-image-cache"
VERSION = 1
MANIFEST = "manifest.json"
INDEX = "index.npy"
PIXELS = "pixels.u8"
DEFAULT_SHORT_SIDE = 512
_HASH_CHUNK = 1 << 24


class CacheError(ValueError):
    """An image cache that is missing, corrupt or stale."""


@dataclass(frozen=True)
class CacheSettings:
    """What the cached pixels are: the loader's channel count and box crop, and the resize."""

    channels: int
    crop_to_box: bool
    short_side: int | None = DEFAULT_SHORT_SIDE
    """Images whose shorter side is longer are resized down to it; ``None``: stored as decoded."""


def stored_size(height: int, width: int, short_side: int | None) -> tuple[int, int]:
    """The stored ``(height, width)`` of an image: its shorter side reduced to ``short_side``
    when longer (the other side scaled to keep the aspect ratio, as ``Resize(short_side)``)."""
    short = min(height, width)
    if short_side is None or short <= short_side:
        return height, width
    long = int(short_side * max(height, width) / short)  # torchvision's Resize(int) rounds down
    return (short_side, long) if height <= width else (long, short_side)


def fit(image: Tensor, short_side: int | None) -> Tensor:
    """``image`` (``uint8`` ``C×H×W``) as the cache stores it."""
    size = stored_size(image.shape[1], image.shape[2], short_side)
    if size == tuple(image.shape[1:]):
        return image
    return TF.resize(image, list(size), antialias=True)


def _source_stamp(path: str) -> tuple[int, int]:
    stat = os.stat(path)
    return stat.st_size, stat.st_mtime_ns


def write_cache(
    folder: str | Path,
    paths: Sequence[str],
    load: Callable[[int], Tensor],
    settings: CacheSettings,
    progress: Callable[[int], object] = lambda _: None,
    workers: int = 4,
) -> Path:
    """Write a cache of ``paths`` into ``folder``: image ``i`` is ``load(i)`` (``uint8``
    ``C×H×W``), stored as :func:`fit` makes it, decoded on ``workers`` threads (Pillow and
    libjpeg release the GIL). Written into a hidden folder and renamed into place, so a killed
    writer leaves no half cache; an existing cache in ``folder`` is replaced. ``progress`` hears
    of every image written."""
    folder = Path(folder)
    if len(set(paths)) != len(paths):
        raise ValueError("each image path may be cached once; the list repeats some")
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        index = np.zeros((len(paths), 4), dtype=np.int64)
        entries = []
        pixels_hash = hashlib.sha256()
        offset = 0

        def prepared(i: int) -> tuple[tuple[int, int], Tensor]:
            # The stamp before the decode: a file replaced meanwhile looks changed, never current.
            stamp = _source_stamp(paths[i])
            return stamp, fit(load(i), settings.short_side).contiguous()

        with open(tmp / PIXELS, "wb") as out, ThreadPoolExecutor(max(workers, 1)) as pool:
            chunk = 64 * max(workers, 1)  # images in flight: bounded memory, in order
            for c0 in range(0, len(paths), chunk):
                done = pool.map(prepared, range(c0, min(c0 + chunk, len(paths))))
                for i, (stamp, image) in enumerate(done, start=c0):
                    data = image.numpy().tobytes()
                    out.write(data)
                    pixels_hash.update(data)
                    index[i] = (offset, *image.shape)
                    offset += len(data)
                    entries.append({"path": paths[i], "bytes": stamp[0], "mtime_ns": stamp[1]})
                    progress(1)
            out.flush()
            os.fsync(out.fileno())
        np.save(tmp / INDEX, index)
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "channels": settings.channels,
            "crop_to_box": settings.crop_to_box,
            "short_side": settings.short_side,
            "count": len(paths),
            "files": {
                PIXELS: {"sha256": pixels_hash.hexdigest(), "bytes": offset},
                INDEX: {"sha256": _file_sha256(tmp / INDEX), "bytes": (tmp / INDEX).stat().st_size},
            },
            "images": entries,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest) + "\n")
        if folder.exists():
            if not (folder / MANIFEST).is_file():
                raise FileExistsError(
                    f"{folder} exists and is not an image cache; choose another folder"
                )
            old = folder.parent / f".{folder.name}.old-{os.getpid()}"
            os.replace(folder, old)
            os.replace(tmp, folder)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class ImageCache:
    """An opened cache (:func:`open_cache`): ``image(path)`` is the stored ``uint8`` ``C×H×W``
    image. The pixels are memory-mapped, so DataLoader workers share the page cache."""

    def __init__(self, folder: Path, manifest: dict[str, Any], index: np.ndarray) -> None:
        self.folder = folder
        self.settings = CacheSettings(
            manifest["channels"], manifest["crop_to_box"], manifest["short_side"]
        )
        self._entries: list[dict[str, Any]] = manifest["images"]
        self._row = {entry["path"]: i for i, entry in enumerate(self._entries)}
        self._index = index
        size = manifest["files"][PIXELS]["bytes"]
        self._pixels = (
            np.memmap(folder / PIXELS, dtype=np.uint8, mode="r", shape=(size,))
            if size
            else np.zeros(0, np.uint8)
        )

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, path: object) -> bool:
        return path in self._row

    def image(self, path: str) -> Tensor:
        """The stored image of ``path`` (a copy: the memory map stays read-only)."""
        row = self._row.get(path)
        if row is None:
            raise CacheError(
                f"image {path} is not in the cache {self.folder}; run `idml cache` again for this "
                "dataset"
            )
        offset, channels, height, width = (int(v) for v in self._index[row])
        count = channels * height * width
        view = self._pixels[offset : offset + count].reshape(channels, height, width)
        return torch.from_numpy(np.array(view))

    def check_sources(self, paths: Iterable[str], channels: int, crop_to_box: bool) -> None:
        """Refuse the cache for a dataset it does not hold: other loader settings, images it
        lacks, or source files changed since they were cached (size or modification time)."""
        expected = (channels, crop_to_box)
        if (self.settings.channels, self.settings.crop_to_box) != expected:
            raise CacheError(
                f"the cache {self.folder} holds images with channels={self.settings.channels}, "
                f"crop_to_box={self.settings.crop_to_box} but the dataset reads channels="
                f"{channels}, crop_to_box={crop_to_box}; run `idml cache` again with this config"
            )
        missing, changed = [], []
        for path in paths:
            row = self._row.get(path)
            if row is None:
                missing.append(path)
                continue
            entry = self._entries[row]
            try:
                stamp = _source_stamp(path)
            except OSError:
                changed.append(f"{path} (gone)")
                continue
            if stamp != (entry["bytes"], entry["mtime_ns"]):
                changed.append(path)
        if missing or changed:
            parts = []
            if missing:
                parts.append(f"{len(missing)} image(s) are not in it ({format_examples(missing)})")
            if changed:
                parts.append(
                    f"{len(changed)} source file(s) changed since they were cached "
                    f"({format_examples(changed)})"
                )
            raise CacheError(
                f"the image cache {self.folder} does not match the dataset: "
                + "; ".join(parts)
                + ". Run `idml cache` again"
            )


def open_cache(folder: str | Path, verify: bool = True) -> ImageCache:
    """Open the cache in ``folder``, checking its manifest and (``verify``) both files' SHA-256."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        raise CacheError(
            f"{folder}: not an image cache (no {MANIFEST}); write one with `idml cache CONFIG "
            f"--out {folder}`"
        )
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CacheError(f"{path}: unreadable ({err}); run `idml cache` again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CacheError(f"{path}: not an idml image cache manifest")
    if manifest.get("version") != VERSION:
        raise CacheError(
            f"{path}: cache format version {manifest.get('version')!r}, this idml reads {VERSION}; "
            "run `idml cache` again"
        )
    for name in (INDEX, PIXELS):
        entry = manifest["files"][name]
        file = folder / name
        if not file.is_file() or file.stat().st_size != entry["bytes"]:
            raise CacheError(
                f"{file}: missing or not {entry['bytes']} bytes long; the cache is incomplete, "
                "run `idml cache` again"
            )
        if verify and _file_sha256(file) != entry["sha256"]:
            raise CacheError(
                f"{file}: checksum mismatch with {path}; the cache was modified or damaged, run "
                "`idml cache` again"
            )
    index = np.load(folder / INDEX)
    count = manifest["count"]
    if index.shape != (count, 4) or len(manifest["images"]) != count:
        raise CacheError(
            f"{folder / INDEX}: does not describe {count} images; run `idml cache` again"
        )
    return ImageCache(folder, manifest, index)
