"""Galleries past one machine's memory: a compressed faiss index without stored vectors round-trips
through save, load, ``idml search``, ``idml serve`` and ``--add``; ``idml index`` and ``idml embed``
sharded over two ``torchrun`` processes give what one process gives."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from idml.app.cli import main
from idml.app.inference import Encoder
from idml.app.retrieval import Index
from idml.evaluation.search.faiss_backend import (
    DEFAULT_NPROBE,
    faiss_build,
    new_index,
    training_positions,
)
from tiny_run import IDML, subprocess_env, train_tiny, write_images

pytest.importorskip("faiss")

REPO = Path(__file__).resolve().parents[1]
COMPRESSED = "IVF2,PQ4x4"
"""Two inverted lists, 4 sub-quantisers of 4 bits (16 centroids each): 2-byte codes of the tiny
model's 16-dimensional embeddings, trainable on a gallery of a few dozen images."""


@pytest.fixture(scope="module")
def run_and_gallery(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("gallery-scale")
    run = train_tiny(root, IDML)
    gallery = write_images(root / "gallery", classes=4, per_class=12, shape=(10, 12), seed=3)
    return run, gallery


def test_trained_indexes_learn_from_an_evenly_spaced_sample() -> None:
    ivf = new_index("IVF64,PQ8", 32)
    assert training_positions(10, ivf).tolist() == list(range(10))
    assert training_positions(1000, ivf, train_size=4).tolist() == [0, 250, 500, 750]
    assert len(training_positions(10**7, ivf)) == 100_000  # max(100k, 64 lists × 64)
    assert len(training_positions(10, new_index("HNSW8", 32))) == 0  # needs no training
    x = torch.nn.functional.normalize(torch.randn(3000, 32, generator=torch.Generator()), dim=1)
    index = faiss_build(x, "IVF16,Flat")
    import faiss

    assert faiss.extract_index_ivf(index).nprobe == DEFAULT_NPROBE
    with pytest.raises(ValueError, match="sub-vector count must divide the dimension"):
        new_index("PQ7", 32)


@pytest.mark.slow
def test_compressed_index_round_trips_through_save_load_search_and_serve(
    run_and_gallery: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run, shared = run_and_gallery
    gallery = tmp_path / "gallery"
    shutil.copytree(shared, gallery)
    out = tmp_path / "index"
    args = ["index", str(gallery), "--out", str(out), "--checkpoint", str(run), "--no-progress"]
    args += ["--backend", "faiss", "--faiss-index", COMPRESSED, "--no-vectors"]
    assert main(args) == 0
    index = Index.load(out)
    assert index.embeddings is None and index.describe()["vectors"] is False
    assert len(index) == 48 and index.spot is not None and len(index.spot) == 16
    manifest = json.loads(
        (out / (out / "current").read_text().strip() / "manifest.json").read_text()
    )
    assert manifest["vectors"] is False
    # The float32 vectors are not stored: the embeddings file holds ||u|| and 16 spot vectors.
    sizes = {name: entry["bytes"] for name, entry in manifest["files"].items()}
    assert sizes["embeddings.safetensors"] < 48 * 4 + 16 * 16 * 4 + 512

    encoder = Encoder.from_run(run)
    images = sorted(gallery.rglob("*.png"))
    fresh = encoder.embed(images[:5])
    expected = index.search(fresh.embeddings, 4, fresh.uncertainty)
    capsys.readouterr()
    query = images[0]
    assert main(["search", str(out), str(query), "-k", "4", "--json", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    record = json.loads(printed[printed.index("{") :])["results"][0]
    assert [n["id"] for n in record["neighbors"]] == [
        index.ids[i] for i in expected.indices[0].tolist()
    ]

    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from idml.app.retrieval.server import BackgroundServer, create_app

    with BackgroundServer(create_app(Index.load(out), encoder, max_k=8)) as server:
        body = {"embedding": fresh.embeddings[:2].tolist(), "k": 4}
        answer = httpx.post(f"{server.url}/search", json=body, timeout=30).json()
        info = httpx.get(f"{server.url}/info", timeout=30).json()
    assert [[n["id"] for n in r["neighbors"]] for r in answer["results"]] == [
        [index.ids[i] for i in row] for row in expected.indices[:2].tolist()
    ]
    assert info["count"] == 48 and info["faiss_factory"] == COMPRESSED

    # --add embeds the new images and checks the index's model on its stored spot vectors.
    more = write_images(gallery / "z", classes=1, per_class=3, shape=(10, 12), seed=9) / "a"
    assert main(["index", str(more), "--out", str(out), "--add", "--no-progress"]) == 0
    grown = Index.load(out)
    assert len(grown) == 51 and grown.embeddings is None
    assert grown.ids[-3:] == ["0.png", "1.png", "2.png"]


def _idml(args: list[str], processes: int, cwd: Path) -> None:
    launch = [sys.executable]
    if processes > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    done = subprocess.run(
        [*launch, "-m", "idml", *args],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _version(folder: Path) -> Path:
    return folder / (folder / "current").read_text().strip()


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("backend", ["exact", "faiss"])
def test_sharded_index_and_embed_equal_one_process(
    run_and_gallery: tuple[Path, Path], tmp_path: Path, backend: str
) -> None:
    # Batch size 1: every image goes through the same kernels in both runs, so the embeddings,
    # hence the trained quantisers and codes, are the same floats, not merely close ones.
    run, gallery = run_and_gallery
    common = ["--checkpoint", str(run), "--batch-size", "1", "--no-progress"]
    if backend == "faiss":
        common += ["--backend", "faiss", "--faiss-index", COMPRESSED, "--no-vectors"]
    for processes in (1, 2):
        _idml(
            ["index", str(gallery), "--out", str(tmp_path / f"index{processes}"), *common],
            processes,
            tmp_path,
        )
    one, two = _version(tmp_path / "index1"), _version(tmp_path / "index2")
    assert (one / "items.json").read_bytes() == (two / "items.json").read_bytes()
    assert (one / "embeddings.safetensors").read_bytes() == (
        two / "embeddings.safetensors"
    ).read_bytes()
    if backend == "faiss":
        assert (one / "faiss.index").read_bytes() == (two / "faiss.index").read_bytes()
    a, b = Index.load(tmp_path / "index1"), Index.load(tmp_path / "index2")
    queries = torch.nn.functional.normalize(torch.randn(6, 16, generator=torch.Generator()), dim=1)
    assert torch.equal(a.search(queries, 5).indices, b.search(queries, 5).indices)

    if backend == "exact":
        for processes in (1, 2):
            out = tmp_path / f"embed{processes}.npz"
            _idml(
                ["embed", "--images", str(gallery), "--out", str(out), *common], processes, tmp_path
            )
        e1, e2 = np.load(tmp_path / "embed1.npz"), np.load(tmp_path / "embed2.npz")
        assert list(e1["paths"]) == list(e2["paths"])
        np.testing.assert_array_equal(e1["embeddings"], e2["embeddings"])
        np.testing.assert_array_equal(e1["uncertainty"], e2["uncertainty"])


def test_only_a_faiss_index_may_leave_its_vectors_out() -> None:
    x = torch.randn(40, 8, generator=torch.Generator())
    with pytest.raises(ValueError, match="needs backend='faiss'"):
        Index.create(x, store_vectors=False)
    flat = Index.create(x, backend="faiss", faiss_factory="Flat", store_vectors=False)
    with pytest.raises(IndexError, match="first 16 items only"):
        flat.stored_vectors([20])
    exact = Index.create(x).embeddings
    assert exact is not None  # an exact index keeps its vectors
    torch.testing.assert_close(flat.stored_vectors([3]), exact[[3]])
