"""Convert the CIFAR-10/100 "python version" archives to PNG folders for ``task: classification``.

The CIFAR python batches are Python pickles: unpickling runs whatever code the file asks for, so
this script refuses to read them unless ``--trust-pickle`` is given — use it only on the archive
from the official site (https://www.cs.toronto.edu/~kriz/cifar.html), checked against its MD5.
idml itself never reads pickles; it trains on the folders this writes::

    OUT/train/<class name>/<index>.png      OUT/val/<class name>/<index>.png

Run: ``python scripts/cifar_to_png.py cifar-100-python/ data/cifar100 --trust-pickle``
(the extracted folder with ``data_batch_*``/``test_batch`` or ``train``/``test`` and ``meta``).
"""

from __future__ import annotations

import argparse
import pickle
import sys
import warnings
from pathlib import Path

import numpy as np
from PIL import Image


def _load(path: Path) -> dict:
    with path.open("rb") as handle:
        # Reached only with --trust-pickle (module docstring).
        return pickle.load(handle, encoding="latin1")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "source", type=Path, help="extracted cifar-10-batches-py or cifar-100-python"
    )
    parser.add_argument("out", type=Path, help="output folder (train/ and val/ are created)")
    parser.add_argument("--trust-pickle", action="store_true", help="allow reading the pickles")
    args = parser.parse_args()
    if not args.trust_pickle:
        print(
            f"{args.source} holds Python pickles, which can run arbitrary code when read; pass "
            "--trust-pickle if it is the official CIFAR archive",
            file=sys.stderr,
        )
        return 2
    warnings.warn(f"reading pickled CIFAR batches from {args.source}", stacklevel=1)
    if (args.source / "meta").is_file():  # CIFAR-100
        names = _load(args.source / "meta")["fine_label_names"]
        sides = {"train": ["train"], "val": ["test"]}
        key = "fine_labels"
    elif (args.source / "batches.meta").is_file():  # CIFAR-10
        names = _load(args.source / "batches.meta")["label_names"]
        sides = {"train": [f"data_batch_{i}" for i in range(1, 6)], "val": ["test_batch"]}
        key = "labels"
    else:
        print(
            f"{args.source}: neither meta (CIFAR-100) nor batches.meta (CIFAR-10)", file=sys.stderr
        )
        return 2
    for side, files in sides.items():
        count = 0
        for name in files:
            batch = _load(args.source / name)
            images = np.asarray(batch["data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
            for image, label in zip(images.transpose(0, 2, 3, 1), batch[key]):
                folder = args.out / side / names[label]
                folder.mkdir(parents=True, exist_ok=True)
                Image.fromarray(image).save(folder / f"{count:05d}.png")
                count += 1
        print(f"{side}: {count} images -> {args.out / side}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
