"""Acceptance of ``idml train --data`` (a user's own images, no config file): a nested folder two
levels deep and a CSV with a header train a run, and ``idml embed``, ``index``, ``search`` and
``evaluate`` then agree with the run on the classes (the path below the root, so the same leaf
name under two parents is two classes) and on the test metrics the training logged."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from idml.app.cli import main

pytestmark = pytest.mark.slow

ALPHABETS, CHARACTERS, IMAGES = ("alphabetA", "alphabetB", "alphabetC", "alphabetD"), 2, 5
"""8 classes ``alphabetX/char0N``: every leaf name repeats under all four parents, so a reader that
labelled an image by its parent folder alone would see 2 classes instead of 8."""

FAST = [
    "optim.epochs=1",
    "optim.max_steps_per_epoch=2",
    "eval.nmi=false",
    "data.num_workers=0",
    "model.backbone=small_cnn",
    "model.pretrained=false",
    "model.embedding_dim=16",
    "optim.amp=false",
    "tensorboard=false",
]
RETRIEVAL = ("recall@1", "recall@2", "recall@4", "recall@8", "r_precision", "map@r", "map")
EXACT = 1e-6
"""The same embeddings give the same ranks, so each metric is the same mean of per-query ratios
of counts (multiples of 1/20 for R@1 over the 20 test images); only its accumulation and the log's
float rounding may differ, far below 1e-6, while one other neighbour moves R@1 by 0.05."""


def _nested_folder(root: Path) -> list[tuple[str, str]]:
    """``root/<alphabet>/<char>/<i>.png``, 16×16 px: a colour per class under strong noise (so the
    metrics are neither 0 nor 1); returns ``(relative path, label)`` in sorted order."""
    rng = np.random.default_rng(0)
    rows = []
    for alphabet in ALPHABETS:
        for c in range(1, CHARACTERS + 1):
            folder = root / alphabet / f"char{c:02d}"
            folder.mkdir(parents=True)
            colour = rng.integers(80, 175, 3)
            for i in range(IMAGES):
                noise = rng.integers(-110, 110, (16, 16, 3))
                pixels = np.clip(colour + noise, 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.png")
                rows.append((f"{alphabet}/{folder.name}/{i}.png", f"{alphabet}/{folder.name}"))
    return rows


def _train(data: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """``idml train --data DATA --method baseline``; returns what it printed."""
    flags = [f for item in FAST for f in ("--set", item)]
    args = ["train", "--data", str(data), "--method", "baseline", "--out", str(out)]
    assert main([*args, "--no-progress", *flags]) == 0
    return capsys.readouterr().out


def _json(capsys: pytest.CaptureFixture[str]) -> dict:
    out = capsys.readouterr().out
    return json.loads(out[out.index("{") :])


def _logged_test_metrics(run: Path) -> dict[str, float]:
    """The last epoch's ``test/*`` entries of the run's ``metrics.jsonl``."""
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    return {k.removeprefix("test/"): v for k, v in last.items() if k.startswith("test/")}


def _evaluate_run(run: Path, capsys: pytest.CaptureFixture[str]) -> dict:
    """``idml evaluate --checkpoint RUN``: the run's test split, every class in the JSON."""
    assert main(["evaluate", "--checkpoint", str(run), "--json", "--per-class", "1"]) == 0
    return _json(capsys)


def _assert_same_metrics(found: dict[str, float], logged: dict[str, float]) -> None:
    assert 0 < logged["recall@1"] < 1, "a trivial R@1 would not tell two rankings apart"
    for name in RETRIEVAL:
        assert found[name] == pytest.approx(logged[name], rel=0, abs=EXACT), name


def _printed_split(printed: str) -> tuple[int, int, int]:
    """(classes, train classes, test classes) of the start-up summary ``train --data`` prints."""
    total = re.search(r"(\d+) images of (\d+) classes", printed)
    sides = re.search(r"train (\d+): .*; test (\d+): ", printed)
    assert total and sides, printed
    return int(total[2]), int(sides[1]), int(sides[2])


def test_a_nested_folder_trains_and_every_command_sees_the_same_classes_and_metrics(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "letters"
    rows = _nested_folder(data)
    labels = sorted({label for _, label in rows})
    test_classes = labels[len(labels) // 2 :]  # --data's class-disjoint split: the sorted 2nd half
    test_rows = [(p, c) for p, c in rows if c in test_classes]
    run = tmp_path / "run"
    printed = _train(data, run, capsys)
    assert _printed_split(printed) == (8, 4, 4)
    assert "alphabetC/char01, alphabetC/char02, alphabetD/char01, alphabetD/char02" in printed
    logged = _logged_test_metrics(run)

    # idml evaluate of the run: its test split (4 classes, 20 images), the metrics it logged.
    scored = _evaluate_run(run, capsys)
    assert (scored["num_queries"], len(scored["per_class"])) == (len(test_rows), 4)
    assert sorted(scored["per_class"]) == test_classes  # by the classes' paths, not labels 0–3
    _assert_same_metrics(scored["metrics"], logged)

    # idml embed of the whole folder: the 8 classes by their path below the root.
    embedded = tmp_path / "all.npz"
    embed = ["embed", "--checkpoint", str(run), "--images", str(data), "--out", str(embedded)]
    assert main([*embed, "--batch-size", "20", "--no-progress"]) == 0
    saved = np.load(embedded)
    assert saved["classes"].tolist() == labels
    names = saved["classes"][saved["labels"]]
    paths = [Path(p).relative_to(data).as_posix() for p in saved["paths"]]
    assert sorted(zip(paths, names.tolist())) == rows

    # idml evaluate of the file's test images: the metrics the run logged. --batch-size 20 puts
    # the 20 test images (the sorted second half) in one batch of their own, in the order the
    # run's evaluation embedded them in its single batch: the same embeddings, bit for bit.
    test = np.isin(names, test_classes)
    assert test.tolist() == [False] * 20 + [True] * 20
    vectors = saved["embeddings"][test]
    test_file = tmp_path / "test.npz"
    np.savez(test_file, embeddings=vectors, labels=saved["labels"][test])
    assert main(["evaluate", "--embeddings", str(test_file), "--no-nmi", "--json"]) == 0
    _assert_same_metrics(_json(capsys)["metrics"], logged)

    # idml index + search of the folder: neighbours labelled with the same 8 classes, and the
    # nearest other test image of each test query gives the run's R@1. The index scores the same
    # embeddings in other matrix shapes, so a cosine may move by its float32 rounding, at most
    # d·2⁻²⁴ ≈ 1e-6 for unit vectors of d=16; a nearest neighbour more than twice that ahead of
    # the next keeps its rank (checked, as this holds for this data but not for every data).
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    cosines = np.sort(unit @ unit.T - 2 * np.eye(len(unit)), axis=1)
    assert (cosines[:, -1] - cosines[:, -2]).min() > 2e-6, "near-tied nearest neighbours"
    index = tmp_path / "index"
    indexing = ["index", str(data), "--out", str(index), "--checkpoint", str(run)]
    assert main([*indexing, "--batch-size", "20", "--no-progress"]) == 0
    capsys.readouterr()
    searching = ["search", str(index), str(data), "-k", str(len(rows)), "--json"]
    assert main([*searching, "--batch-size", "20", "--no-progress"]) == 0
    results = _json(capsys)["results"]
    assert len(results) == len(rows)
    assert {n["label"] for r in results for n in r["neighbors"]} == set(labels)
    truth = dict(rows)
    hits = []
    for record in results:
        query = record["query"]["id"]
        if truth[query] in test_classes:
            others = [n for n in record["neighbors"] if n["id"] != query]
            nearest = next(n for n in others if n["label"] in test_classes)
            hits.append(nearest["label"] == truth[query])
    assert len(hits) == len(test_rows)
    assert float(np.mean(hits)) == pytest.approx(logged["recall@1"], rel=0, abs=EXACT)


def test_a_csv_with_a_header_trains_and_evaluates_the_same_classes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "letters"
    rows = _nested_folder(data)
    labels = sorted({label for _, label in rows})
    # A split unlike the folder's: one character of every alphabet trains, the other tests, so
    # the test split holds four classes that share one leaf name, char02.
    test_classes = [c for c in labels if c.endswith("char02")]
    lines = ["file,class,split"]
    lines += [f"{p},{c},{'test' if c in test_classes else 'train'}" for p, c in rows]
    listing = data / "my images.csv"
    listing.write_text("\n".join(lines) + "\n")
    run = tmp_path / "run"
    printed = _train(listing, run, capsys)
    assert _printed_split(printed) == (8, 4, 4)
    logged = _logged_test_metrics(run)

    scored = _evaluate_run(run, capsys)
    test_rows = [(p, c) for p, c in rows if c in test_classes]
    assert (scored["num_queries"], len(scored["per_class"])) == (len(test_rows), 4)
    assert sorted(scored["per_class"]) == test_classes  # four classes named char02, told apart
    _assert_same_metrics(scored["metrics"], logged)

    # idml embed of the CSV's test split: its four classes, and the run's metrics again.
    test_file = tmp_path / "test.npz"
    embed = ["embed", "--checkpoint", str(run), "--images", str(listing), "--split", "test"]
    assert main([*embed, "--out", str(test_file), "--no-progress"]) == 0
    saved = np.load(test_file)
    assert saved["classes"].tolist() == test_classes
    assert main(["evaluate", "--embeddings", str(test_file), "--no-nmi", "--json"]) == 0
    _assert_same_metrics(_json(capsys)["metrics"], logged)
