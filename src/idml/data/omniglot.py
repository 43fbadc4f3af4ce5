"""Omniglot (Lake, Salakhutdinov & Tenenbaum, Science 2015) as a class-disjoint DML benchmark.

Omniglot holds handwritten characters of 50 alphabets, each drawn once by 20 people: a class is one
character of one alphabet, an instance one drawer's version of it (105×105 one-bit PNG, black
strokes on white). The authors publish it as zip files whose layout is
``images_<part>/<Alphabet>/characterNN/<id>_<drawer>.png``:

- the two "minimal" background splits ``images_background_small1.zip`` (Balinese, Early Aramaic,
  Greek, Korean, Latin: 136 characters) and ``images_background_small2.zip`` (Greek, Japanese
  (katakana), Latin, Sanskrit, Tagalog: 156 characters);
- the full ``images_background.zip`` (964 characters) and ``images_evaluation.zip`` (659).

Protocol (zero-shot, split by alphabet): the characters of the *train* archives train, those of the
*test* archives are tested, and any alphabet present on both sides is dropped from the test side —
the two minimal splits both contain Greek and Latin, byte for byte, so the default split trains on
the 136 characters of ``small1`` (2,720 images) and tests on the 106 characters of Japanese
(katakana), Sanskrit and Tagalog from ``small2`` (2,120 images): unseen characters of unseen scripts.
With ``root`` holding the full pair instead, it trains on ``images_background`` and tests on
``images_evaluation`` (no shared alphabets).

``root`` is a folder that holds the zip files, or the folders they unzip to (an unzipped folder
is preferred over the zip of the same name). Images are decoded once into memory as ``uint8``
(about 64 MB for the minimal pair at 105 px; ``image_size`` resizes at load time).

Example (a tiny archive made on the spot):
    >>> import io, tempfile, zipfile
    >>> from PIL import Image
    >>> root = Path(tempfile.mkdtemp())
    >>> def add(archive, alphabet, char, drawers=2):
    ...     with zipfile.ZipFile(root / f"{archive}.zip", "a") as z:
    ...         for d in range(drawers):
    ...             png = io.BytesIO(); Image.new("1", (8, 8), 1).save(png, "PNG")
    ...             z.writestr(f"{archive}/{alphabet}/{char}/0_{d:02d}.png", png.getvalue())
    >>> for a, c in [("Greek", "character01"), ("Korean", "character01")]:
    ...     add("images_background_small1", a, c)
    >>> for a, c in [("Greek", "character01"), ("Tagalog", "character01")]:
    ...     add("images_background_small2", a, c)
    >>> split = load_omniglot(root)
    >>> split.num_train_classes, split.num_test_classes, list(split.test.class_names)
    (2, 1, ['Tagalog/character01'])
"""

from __future__ import annotations

import io
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np
from PIL import Image

from idml.data.datasets import DMLSplit
from idml.data.offline import ArrayOptions, array_split

MINIMAL_ARCHIVES: tuple[tuple[str, ...], tuple[str, ...]] = (
    ("images_background_small1",),
    ("images_background_small2",),
)
"""(train, test) archives of the minimal protocol (the default when they are present)."""

FULL_ARCHIVES: tuple[tuple[str, ...], tuple[str, ...]] = (
    ("images_background",),
    ("images_evaluation",),
)
"""(train, test) archives of the full Omniglot."""


@dataclass(frozen=True)
class _Character:
    alphabet: str
    character: str

    @property
    def name(self) -> str:
        return f"{self.alphabet}/{self.character}"


def _archive_source(root: Path, name: str) -> Path | None:
    """The unzipped folder ``root/name`` or the zip ``root/name.zip``, whichever exists."""
    folder, archive = root / name, root / f"{name}.zip"
    if folder.is_dir():
        return folder
    if archive.is_file():
        return archive
    return None


def _read_archive(source: Path) -> dict[_Character, list[tuple[str, bytes]]]:
    """Every PNG of one archive (zip or folder), grouped by character: ``(file name, bytes)``."""
    found: dict[_Character, list[tuple[str, bytes]]] = {}

    def add(parts: Sequence[str], read: bytes) -> None:
        # ``[<top>/]<Alphabet>/<character>/<file>.png``: the last three parts name it.
        if len(parts) < 3 or not parts[-1].lower().endswith(".png"):
            return
        found.setdefault(_Character(parts[-3], parts[-2]), []).append((parts[-1], read))

    if source.is_dir():
        for path in sorted(source.rglob("*.png")):
            add(path.relative_to(source).parts, path.read_bytes())
    else:
        try:
            with zipfile.ZipFile(source) as archive:
                for info in archive.infolist():
                    if not info.is_dir():
                        add(PurePosixPath(info.filename).parts, archive.read(info))
        except zipfile.BadZipFile as err:
            raise ValueError(
                f"{source} is not a readable zip file ({err}); download it again or unzip it "
                "next to it"
            ) from None
    if not found:
        raise ValueError(
            f"{source} holds no <Alphabet>/<character>/<image>.png files; is it an Omniglot archive?"
        )
    return found


def _decode(png: bytes, where: str) -> np.ndarray:
    try:
        with Image.open(io.BytesIO(png)) as image:
            return np.asarray(image.convert("L"), dtype=np.uint8)
    except Exception as err:  # PIL raises several types for corrupt data
        raise ValueError(f"cannot decode Omniglot image {where}: {err}") from None


def _resolve_archives(
    root: Path, train: Sequence[str] | None, test: Sequence[str] | None
) -> tuple[list[Path], list[Path]]:
    if train is None and test is None:
        pairs = (MINIMAL_ARCHIVES, FULL_ARCHIVES)
        for pair in pairs:
            if all(_archive_source(root, n) is not None for n in (*pair[0], *pair[1])):
                train, test = pair
                break
        else:
            expected = " or ".join(" + ".join(f"{n}.zip" for n in (*p[0], *p[1])) for p in pairs)
            raise FileNotFoundError(
                f"Omniglot: {root} holds neither {expected} (nor their unzipped folders); "
                "put the authors' zip files there or name them with train_archives/test_archives"
            )
    train = list(train or [])
    test = list(test or [])
    if not train or not test:
        raise ValueError("Omniglot: train_archives and test_archives must both name archives")
    sources: list[list[Path]] = [[], []]
    for side, names in enumerate((train, test)):
        for name in names:
            source = _archive_source(root, name)
            if source is None:
                raise FileNotFoundError(
                    f"Omniglot archive {root / (name + '.zip')} does not exist (nor the folder "
                    f"{root / name}); put the authors' zip file there"
                )
            sources[side].append(source)
    return sources[0], sources[1]


@dataclass(frozen=True)
class OmniglotOptions(ArrayOptions):
    """Options of :func:`load_omniglot`: those of the other in-memory datasets
    (:mod:`idml.data.offline`) and which archives train and test."""

    train_archives: Sequence[str] | None = None
    """Names (without ``.zip``) of the train archives; default: the minimal pair's when present,
    else the full pair's."""
    test_archives: Sequence[str] | None = None
    """Names of the test archives, with the same default."""


def load_omniglot(root: str | Path, options: OmniglotOptions | None = None) -> DMLSplit:
    """Omniglot split by alphabet (see the module docstring for the protocol); ``root`` is the
    folder holding the archives (zip files or their unzipped folders)."""
    options = options or OmniglotOptions()
    base = Path(root).expanduser()
    if not base.is_dir():
        raise FileNotFoundError(
            f"Omniglot folder {base} does not exist; point data.root at the folder with the "
            "images_background_small1.zip / images_background_small2.zip files"
        )
    train_sources, test_sources = _resolve_archives(
        base, options.train_archives, options.test_archives
    )
    sides: list[dict[_Character, list[tuple[str, bytes]]]] = []
    for sources in (train_sources, test_sources):
        merged: dict[_Character, list[tuple[str, bytes]]] = {}
        for source in sources:
            for char, files in _read_archive(source).items():
                merged.setdefault(char, []).extend(files)
        sides.append(merged)
    train_chars, test_chars = sides
    train_alphabets = {c.alphabet for c in train_chars}
    # Alphabets on both sides (Greek and Latin in the minimal pair) leave the test side: they are
    # the same files, and even a different drawing of a seen alphabet is not an unseen class.
    test_chars = {c: f for c, f in test_chars.items() if c.alphabet not in train_alphabets}
    if not test_chars:
        raise ValueError(
            f"Omniglot: every alphabet of {[s.name for s in test_sources]} also appears in the "
            "train archives, so no test class is left; choose other test_archives"
        )
    images: list[np.ndarray] = []
    class_ids: list[int] = []
    names: dict[int, str] = {}
    ordered = sorted(train_chars, key=lambda c: c.name) + sorted(test_chars, key=lambda c: c.name)
    everything = {**train_chars, **test_chars}
    shape: tuple[int, ...] | None = None
    for class_id, char in enumerate(ordered):
        names[class_id] = char.name
        for file_name, png in sorted(everything[char]):
            image = _decode(png, f"{char.name}/{file_name}")
            if shape is not None and image.shape != shape:
                raise ValueError(
                    f"Omniglot image {char.name}/{file_name} is {image.shape[1]}×{image.shape[0]} "
                    f"but the others are {shape[1]}×{shape[0]}; the archive is not Omniglot's"
                )
            shape = image.shape
            images.append(image)
            class_ids.append(class_id)
    return array_split(
        "omniglot",
        np.stack(images),
        np.asarray(class_ids, dtype=np.int64),
        names,
        options,
        num_train_classes=len(train_chars),
    )
