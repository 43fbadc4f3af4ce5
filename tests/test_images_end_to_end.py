"""One way in for images, end to end through the CLI: a nested folder (two levels, labelled by the
path below the root) and a CSV with a header train the same run; ``idml embed``, ``index``,
``search`` and ``evaluate`` then agree with it on the classes and the metrics."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from idml.app.cli import main
from tiny_run import TINY

GROUPS, CHARACTERS, IMAGES = ("Greek", "Latin", "Tagalog", "Thai"), ("c01", "c02", "c03"), 6
"""12 classes Greek/c01 … Thai/c03: every character name repeats across groups, as in Omniglot."""

pytestmark = pytest.mark.slow


def _nested_folder(root: Path) -> list[tuple[str, str]]:
    """``root/<group>/<character>/<i>.png``; returns ``(relative path, label)`` in walk order."""
    rng = np.random.default_rng(0)
    rows = []
    for group in GROUPS:
        for character in CHARACTERS:
            folder = root / group / character
            folder.mkdir(parents=True)
            base = rng.integers(0, 255, (12, 12, 3))
            for i in range(IMAGES):
                noise = rng.integers(-120, 120, (12, 12, 3))
                pixels = np.clip(base + noise, 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.png")
                rows.append((f"{group}/{character}/{i}.png", f"{group}/{character}"))
    return rows


def _json(capsys: pytest.CaptureFixture[str]) -> dict:
    out = capsys.readouterr().out
    return json.loads(out[out.index("{") :])


def _train(root: Path, out: Path, *data: str) -> Path:
    cfg = root / "tiny.yaml"
    cfg.write_text("# tiny run on a user's images\n")
    overrides = [*TINY, "data.samples_per_class=null", "sampler.classes_per_batch=3"]
    overrides += ["sampler.images_per_class=3", "eval.batch_size=64", *data]
    args = ["train", str(cfg), "--out", str(out), "--no-progress"]
    for item in overrides:
        args += ["--set", item]
    assert main(args) == 0
    return out


def _recall_at_1(results: list[dict], labels: dict[str, str], skip_self: bool) -> float:
    """R@1 from `idml search` results: is the nearest other item of the query's label?"""
    hits = []
    for record in results:
        query = record["query"]["id"]
        found = [n for n in record["neighbors"] if not (skip_self and n["id"] == query)]
        hits.append(found[0]["label"] == labels[query])
    return float(np.mean(hits))


def test_folder_and_csv_train_embed_index_search_evaluate_agree(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    rows = _nested_folder(data)
    labels = sorted({label for _, label in rows})
    train_classes = set(labels[: len(labels) // 2])  # the folder's class-disjoint policy
    # A spreadsheet export of the same images: byte-order mark, a comment, the header by name.
    lines = ["# my images", "file,class,split"]
    lines += [f"{p},{c},{'train' if c in train_classes else 'test'}" for p, c in rows]
    (data / "all.csv").write_text("\ufeff" + "\n".join(lines) + "\n", encoding="utf-8")
    test_rows = [(p, c) for p, c in rows if c not in train_classes]
    (data / "test.csv").write_text("path,label\n" + "".join(f"{p},{c}\n" for p, c in test_rows))

    by_folder = _train(tmp_path, tmp_path / "folder", "data.dataset=folder", f"data.root={data}")
    by_csv = _train(tmp_path, tmp_path / "csv", "data.dataset=csv", f"data.root={data / 'all.csv'}")
    capsys.readouterr()
    # The two readers give the same sides in the same order: the same run, to the last digit.
    scored = {}
    for run in (by_folder, by_csv):
        assert main(["evaluate", "--checkpoint", str(run), "--json"]) == 0
        scored[run.name] = _json(capsys)
    assert scored["folder"]["metrics"] == scored["csv"]["metrics"]
    assert scored["folder"]["num_queries"] == len(test_rows)

    # idml embed of the whole folder: 12 classes named by their path below the root (the rule
    # every command shares; the parent folder alone would merge them into 3).
    whole = tmp_path / "all.npz"
    embed = ["embed", "--checkpoint", str(by_folder), "--no-progress", "--out"]
    assert main([*embed, str(whole), "--images", str(data)]) == 0
    assert np.load(whole)["classes"].tolist() == labels

    # idml embed of the test split of the CSV, then idml evaluate of the file: the run's metrics.
    test_file = tmp_path / "test.npz"
    assert main([*embed, str(test_file), "--images", str(data / "all.csv"), "--split", "test"]) == 0
    saved = np.load(test_file)
    assert saved["classes"].tolist() == sorted({c for _, c in test_rows})
    capsys.readouterr()
    assert main(["evaluate", "--embeddings", str(test_file), "--no-nmi", "--json"]) == 0
    from_file = _json(capsys)
    retrieval = ("recall@1", "recall@2", "recall@4", "recall@8", "r_precision", "map@r", "map")
    for name in retrieval:
        # The same images in the same single batch: identical embeddings and ranks, so the float64
        # means agree exactly.
        assert from_file["metrics"][name] == scored["folder"]["metrics"][name], name

    # idml index + search of the test images: R@1 of the nearest other item is the same number.
    index = tmp_path / "index"
    assert (
        main(["index", str(data / "test.csv"), "--out", str(index), "--checkpoint", str(by_folder)])
        == 0
    )
    assert main(["search", str(index), str(data / "test.csv"), "-k", "2", "--json"]) == 0
    found = _json(capsys)
    assert {n["label"] for r in found["results"] for n in r["neighbors"]} <= set(saved["classes"])
    truth = dict(test_rows)
    assert _recall_at_1(found["results"], truth, True) == scored["folder"]["metrics"]["recall@1"]

    # Query/gallery roles: the first two images of each test class query the rest, in evaluate
    # and in index + search alike.
    roles = ["path,label,role"] + [
        f"{p},{c},{'query' if p.endswith(('/0.png', '/1.png')) else 'gallery'}"
        for p, c in test_rows
    ]
    (data / "roles.csv").write_text("\n".join(roles) + "\n")
    role_file = tmp_path / "roles.npz"
    assert main([*embed, str(role_file), "--images", str(data / "roles.csv")]) == 0
    capsys.readouterr()
    assert main(["evaluate", "--embeddings", str(role_file), "--no-nmi", "--json"]) == 0
    by_roles = _json(capsys)
    queries = [(p, c) for p, c in test_rows if p.endswith(("/0.png", "/1.png"))]
    assert (by_roles["num_queries"], by_roles["num_references"], by_roles["same_set"]) == (
        len(queries),
        len(test_rows) - len(queries),
        False,
    )
    gallery_csv, query_csv = data / "gallery.csv", data / "queries.csv"
    gallery_csv.write_text("".join(f"{p},{c}\n" for p, c in test_rows if (p, c) not in queries))
    query_csv.write_text("".join(f"{p},{c}\n" for p, c in queries))
    gallery_index = tmp_path / "gallery-index"
    assert (
        main(
            ["index", str(gallery_csv), "--out", str(gallery_index), "--checkpoint", str(by_folder)]
        )
        == 0
    )
    assert main(["search", str(gallery_index), str(query_csv), "-k", "1", "--json"]) == 0
    searched = _json(capsys)["results"]
    assert _recall_at_1(searched, truth, False) == by_roles["metrics"]["recall@1"]


def test_training_evaluates_a_csv_test_split_by_its_roles(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    rows = _nested_folder(data)
    labels = sorted({label for _, label in rows})
    train_classes = set(labels[: len(labels) // 2])
    lines = ["path,label,split,role"]
    for path, label in rows:
        if label in train_classes:
            lines.append(f"{path},{label},train,")
        else:
            lines.append(f"{path},{label},test,{'query' if path.endswith('/0.png') else 'gallery'}")
    (data / "roles.csv").write_text("\n".join(lines) + "\n")
    run = _train(tmp_path, tmp_path / "run", "data.dataset=csv", f"data.root={data / 'roles.csv'}")
    capsys.readouterr()
    assert main(["evaluate", "--checkpoint", str(run), "--json"]) == 0
    scored = _json(capsys)
    # The six queries (one per test class) against the 30 gallery images, not 36 against 35.
    assert (scored["num_queries"], scored["num_references"], scored["same_set"]) == (6, 30, False)
    logged = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    # Training evaluated the same way: a count over 6 queries, equal up to the log's float
    # rounding (approx's rel 1e-6), while one other neighbour would move it by 1/6.
    assert logged["test/recall@1"] == pytest.approx(scored["metrics"]["recall@1"])
