"""What ``idml cache`` does: decode a configured dataset's images once into a ``uint8`` cache
(:mod:`idml.data.cache`) that ``data.cache`` then points training and evaluation at."""

from __future__ import annotations

from pathlib import Path

from torch import Tensor

from idml.app.config import Config, ConfigError
from idml.data import FileImageDataset
from idml.data.cache import CacheSettings, write_cache
from idml.progress import Progress


def cache_dataset(
    cfg: Config, out: Path, short_side: int | None, progress: bool = True, workers: int = 4
) -> int:
    """Write the cache of every image of ``cfg``'s dataset (train, val and test sides) to ``out``
    with :class:`~idml.data.cache.CacheSettings` of the dataset's loader; returns the count.

    The images are read as the config's loader reads them, decoded by Pillow (the reference);
    the config's own ``data.cache`` and ``data.decode`` are ignored here.
    """
    if short_side is not None and short_side < 1:
        raise ValueError(f"--short-side must be a positive number of pixels, got {short_side}")
    # Every side of the source (the validation protocol would leave the test side out).
    data = cfg.data.model_copy(update={"cache": None, "decode": "pil", "protocol": "test"})
    plain = cfg.model_copy(update={"data": data})
    split = plain.task.spec.build_data(plain)  # the split the run's task trains and tests on
    sides = [side for _, side in split.sides]
    files = [side for side in sides if isinstance(side, FileImageDataset)]
    if len(files) != len(sides):
        raise ConfigError(
            f"data.dataset={cfg.data.dataset!r} is held in memory; a cache is for datasets of "
            "image files"
        )
    settings = CacheSettings(files[0].channels, files[0].crop_to_box, short_side)
    owner: dict[str, tuple[FileImageDataset, int]] = {}
    for side in files:
        for i, path in enumerate(side.paths):
            owner.setdefault(str(path), (side, i))
    paths = list(owner)
    bar = Progress(len(paths), f"caching {cfg.data.dataset}", unit="image", enabled=progress)
    write_cache(
        out,
        paths,
        lambda i: owner[paths[i]][0].load_image(owner[paths[i]][1]).as_subclass(Tensor),
        settings,
        progress=bar.update,
        workers=workers,
    )
    bar.close()
    return len(paths)
