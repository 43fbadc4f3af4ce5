"""Index → search on a tiny trained digits run, the embed ↔ evaluate round trip, model exports."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from idml.app.cli import main
from idml.app.inference import Encoder
from idml.app.retrieval import Index, IndexFormatError
from idml.app.retrieval.workflow import read_images, search_source
from idml.models import build_model
from readme_doctest import run_readme_section
from tiny_run import IDML, train_tiny, write_images


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny trained IDML run (digits, small CNN, two steps): seconds on 2 CPU cores."""
    return train_tiny(tmp_path_factory.mktemp("run"), IDML)


@pytest.fixture(scope="module")
def gallery(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three classes (a, b, c) of four random RGB images (a real folder of PNG files)."""
    return write_images(tmp_path_factory.mktemp("gallery"), classes=3, per_class=4)


def _json_out(capsys: pytest.CaptureFixture[str]) -> dict:
    out = capsys.readouterr().out
    return json.loads(out[out.index("{") :])


def _brute_force(queries: torch.Tensor, gallery: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k by the full cosine matrix in float64; ties by lower index (a stable sort)."""
    q = torch.nn.functional.normalize(queries.double(), dim=1)
    g = torch.nn.functional.normalize(gallery.double(), dim=1)
    return torch.sort(-(q @ g.T), dim=1, stable=True).indices[:, :k]


def test_index_then_search_equals_brute_force(
    run_dir: Path, gallery: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    index_dir = tmp_path / "index"
    assert main(["index", str(gallery), "--out", str(index_dir), "--checkpoint", str(run_dir)]) == 0
    assert main(["search", str(index_dir), str(gallery), "-k", "5", "--json"]) == 0
    doc = _json_out(capsys)
    encoder = Encoder.from_run(run_dir)
    files = sorted(gallery.rglob("*.png"))
    emb = encoder.embed(files)
    expected = _brute_force(emb.embeddings, emb.embeddings, 5)
    ids = [f.relative_to(gallery).as_posix() for f in files]
    assert doc["index"] == {"count": 12, "dim": 16, "metric": "cosine", "backend": "exact"}
    assert doc["model"] == encoder.info.weights_sha256 and doc["k"] == 5
    for q, record in enumerate(doc["results"]):
        # Schema of every record (the same as the service's).
        assert set(record) == {"query", "confidence", "confidence_kind", "answered", "neighbors"}
        assert set(record["query"]) == {"id", "path", "uncertainty"}
        assert record["query"]["id"] == ids[q]
        # No calibration anywhere: the label-free top-1 similarity, every query answered.
        assert record["confidence_kind"] == "top1" and record["answered"] is True
        got = [n["id"] for n in record["neighbors"]]
        assert got == [ids[i] for i in expected[q].tolist()]
        for n in record["neighbors"]:
            assert set(n) == {"rank", "id", "path", "label", "similarity", "uncertainty"}
            i = ids.index(n["id"])
            assert n["label"] == files[i].parent.name and n["path"] == str(files[i].resolve())
            # float32 dot products of re-normalised unit vectors (d = 16) against float64: ~1e-7
            # apart typically, ≲ (16 + a few)·ε ≈ 2.4e-6 at worst: abs 1e-5.
            sim = float(emb.embeddings[q].double() @ emb.embeddings[i].double())
            assert n["similarity"] == pytest.approx(sim, abs=1e-5)
            # float32 ||u|| ≲ 1 from the same model on the same batches (equal in practice); abs
            # 1e-6 ≈ 8 ulp of 1 only allows convolutions that group their sums otherwise.
            assert n["uncertainty"] == pytest.approx(float(emb.uncertainty[i]), abs=1e-6)
        assert record["query"]["uncertainty"] == pytest.approx(float(emb.uncertainty[q]), abs=1e-6)
        assert record["confidence"] == record["neighbors"][0]["similarity"]
    # CSV (one row per neighbour) and the HTML page carry the same answers.
    out_csv, page = tmp_path / "r.csv", tmp_path / "r.html"
    args = ["search", str(index_dir), str(gallery), "-k", "2", "--out", str(out_csv)]
    assert main([*args, "--html", str(page)]) == 0
    rows = list(csv.DictReader(out_csv.open()))
    assert len(rows) == 24 and rows[0]["confidence_kind"] == "top1"
    assert rows[1]["item_id"] == doc["results"][0]["neighbors"][1]["id"]
    assert page.read_text().count("data:image/jpeg;base64,") == 12 * 3


def test_add_to_an_index_equals_a_fresh_index_of_the_union(
    run_dir: Path, gallery: Path, tmp_path: Path
) -> None:
    files = sorted(gallery.rglob("*.png"))
    first, second = gallery / "first.csv", gallery / "second.csv"
    for path, part in ((first, files[:7]), (second, files[7:])):
        path.write_text("".join(f"{f.relative_to(gallery)},{f.parent.name}\n" for f in part))
    try:
        grown, fresh = tmp_path / "grown", tmp_path / "fresh"
        # One image per batch: a batch's composition changes convolution kernels' summation order
        # (last-bit differences), which is not what this test is about.
        one = ["--batch-size", "1", "--checkpoint", str(run_dir)]
        assert main(["index", str(first), "--out", str(grown), *one]) == 0
        assert main(["index", str(second), "--out", str(grown), "--add", "--batch-size", "1"]) == 0
        assert main(["index", str(gallery), "--out", str(fresh), *one]) == 0
        a, b = Index.load(grown), Index.load(fresh)
        assert a.ids == b.ids and a.labels == b.labels and a.paths == b.paths
        assert a.embeddings is not None and b.embeddings is not None  # exact indexes keep vectors
        assert torch.equal(a.embeddings, b.embeddings) and torch.equal(a.uncertainty, b.uncertainty)
        queries = a.embeddings[:5]
        ra, rb = a.search(queries, 4), b.search(queries, 4)
        assert torch.equal(ra.indices, rb.indices) and torch.equal(ra.similarities, rb.similarities)
        # Adding the same items again is refused: ids are unique.
        assert main(["index", str(second), "--out", str(grown), "--add"]) == 2
    finally:
        first.unlink()
        second.unlink()


def test_an_index_refuses_another_model_or_dimension(
    run_dir: Path, gallery: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    index_dir = tmp_path / "index"
    assert main(["index", str(gallery), "--out", str(index_dir), "--checkpoint", str(run_dir)]) == 0
    index = Index.load(index_dir)
    # Same architecture and dimension, other weights: not comparable.
    torch.manual_seed(1)
    other = build_model("small_cnn", pretrained=False, embedding_dim=16, uncertainty=True)
    stranger = Encoder.from_model(other, image_size=8)
    emb = stranger.embed(sorted(gallery.rglob("*.png"))[:2])
    with pytest.raises(IndexFormatError, match="not comparable"):
        index.add(Index.create(emb.embeddings, emb.uncertainty, ["x", "y"], model=stranger.info))
    with pytest.raises(IndexFormatError, match="dimension 8 but the index has 16"):
        index.add(Index.create(torch.randn(2, 8), ids=["x", "y"]))
    # Query embeddings of the wrong dimension, through the CLI: a one-line error, exit code 2.
    np.savez(tmp_path / "q.npz", embeddings=np.ones((2, 8), np.float32))
    assert main(["search", str(index_dir), str(tmp_path / "q.npz")]) == 2
    err = capsys.readouterr().err
    assert "dimension 8" in err and "16" in err and "Traceback" not in err
    # An exported model of another run is refused for image queries.
    other_run = tmp_path / "other-export"
    from idml.app.deploy import export_model

    export_model(stranger, other_run, ["torchscript"])
    assert main(["search", str(index_dir), str(gallery), "--checkpoint", str(other_run)]) == 2
    assert "is not the index's model" in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "delete", "edit items"])
def test_a_damaged_index_is_refused(
    run_dir: Path, gallery: Path, tmp_path: Path, damage: str
) -> None:
    index_dir = tmp_path / "index"
    assert main(["index", str(gallery), "--out", str(index_dir), "--checkpoint", str(run_dir)]) == 0
    version = index_dir / (index_dir / "current").read_text().strip()
    emb_file, items = version / "embeddings.safetensors", version / "items.json"
    if damage == "flip a byte":
        data = bytearray(emb_file.read_bytes())
        data[-3] ^= 0x01  # inside the float data: still a readable safetensors file
        emb_file.write_bytes(bytes(data))
    elif damage == "truncate":
        emb_file.write_bytes(emb_file.read_bytes()[:-16])
    elif damage == "delete":
        items.unlink()
    else:
        doc = json.loads(items.read_text())
        doc["labels"][0] = "b"
        items.write_text(json.dumps(doc))
    with pytest.raises(IndexFormatError, match=r"checksum mismatch|missing"):
        Index.load(index_dir)


@pytest.mark.parametrize("suffix", [".npz", ".pt", ".safetensors"])
def test_embed_then_evaluate_round_trip(
    run_dir: Path, gallery: Path, tmp_path: Path, suffix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / f"emb{suffix}"
    assert (
        main(["embed", "--checkpoint", str(run_dir), "--images", str(gallery), "--out", str(out)])
        == 0
    )
    capsys.readouterr()
    assert main(["evaluate", "--embeddings", str(out), "--json", "--no-nmi"]) == 0
    report = _json_out(capsys)
    # Same numbers as evaluating the embeddings in memory.
    from idml.evaluation import EvaluationSettings, evaluate_embeddings

    encoder = Encoder.from_run(run_dir)
    files = sorted(gallery.rglob("*.png"))
    emb = encoder.embed(files)
    labels = torch.tensor([ord(f.parent.name) - ord("a") for f in files])
    direct = evaluate_embeddings(emb.embeddings, labels, EvaluationSettings(nmi=False))
    for key, value in direct.metrics.items():
        # The file holds the float32 embeddings losslessly, so both sides rank alike; the metrics
        # are fractions of counts in [0, 1], ≤ ε/2 ≈ 6e-8 apart if one side went through float32:
        # abs 1e-6 (a changed neighbour would move recall@1 by 1/12).
        assert report["metrics"][key] == pytest.approx(value, abs=1e-6)
    # The file's ||u|| levels reach the uncertainty summary as they are: float32 means of 12
    # positive values summed in other orders, ≲ 12·ε ≈ 1.4e-6 relative at worst: rel 1e-5.
    assert report["uncertainty"]["mean"] == pytest.approx(float(emb.uncertainty.mean()), rel=1e-5)
    # ISM needs uncertainty vectors, which levels are not: a clear error, not a wrong number.
    assert main(["evaluate", "--embeddings", str(out), "--introspective", "--no-nmi"]) == 2
    assert "--introspective needs the uncertainty vectors" in capsys.readouterr().err
    # The same file indexes and searches (ids = the recorded paths; labels = class names).
    index_dir = tmp_path / "index"
    assert main(["index", str(out), "--out", str(index_dir), "--checkpoint", str(run_dir)]) == 0
    index = Index.load(index_dir)
    assert index.ids == [str(f) for f in files] and index.labels[0] == "a"


def test_exports_match_the_pytorch_model(run_dir: Path, gallery: Path, tmp_path: Path) -> None:
    onnxruntime = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    out = tmp_path / "export"
    assert main(["export", "--checkpoint", str(run_dir), "--out", str(out)]) == 0
    encoder = Encoder.from_run(run_dir)
    images = torch.stack([encoder.preprocess(f) for f in sorted(gallery.rglob("*.png"))])
    assert encoder.model is not None
    with torch.no_grad():
        reference = encoder.model(images)
    ref_s, ref_u = reference.semantic, encoder.model.uncertainty_level(reference)
    # float32 throughout; the exports run the same operations with possibly another kernel order
    # (ONNX Runtime's convolutions), so sums of ~10^3 products differ by a few ulp: 1e-5 absolute on
    # unit-norm embeddings and on ||u|| ~ 0.3 is far above that and far below any real mismatch.
    scripted = Encoder.from_export(out)
    with torch.no_grad():
        got_s, got_u = scripted.net(images)  # the TorchScript module itself, on model inputs
    assert torch.allclose(got_s, ref_s, atol=1e-5, rtol=0)
    assert torch.allclose(got_u, ref_u, atol=1e-5, rtol=0)
    # Through the Encoder (preprocessing included) the export gives the run's answers.
    files = sorted(gallery.rglob("*.png"))
    via_export, via_run = scripted.embed(files), encoder.embed(files)
    # The same float32 bound as above (a few ulp of unit-norm embeddings), here with preprocessing.
    assert torch.allclose(via_export.embeddings, via_run.embeddings, atol=1e-5, rtol=0)
    # The export knows which weights it holds, and how to feed them.
    assert scripted.info.same_model(encoder.info) and scripted.info.source == str(out.resolve())
    assert scripted.info.image_size == encoder.info.image_size == 8
    session = onnxruntime.InferenceSession(str(out / "model.onnx"))
    emb, level = session.run(None, {"images": images[:5].numpy()})  # another batch size
    # ONNX Runtime's kernels: the same float32 bound as above, a few ulp; atol 1e-5.
    assert np.allclose(emb, ref_s[:5].numpy(), atol=1e-5, rtol=0)
    assert np.allclose(level, ref_u[:5].numpy(), atol=1e-5, rtol=0)
    meta = json.loads((out / "export.json").read_text())
    assert meta["model"]["weights_sha256"] == encoder.info.weights_sha256
    assert meta["input"]["shape"] == ["batch", 3, 8, 8]


def test_encoder_accepts_paths_pil_images_arrays_and_tensors(run_dir: Path, gallery: Path) -> None:
    encoder = Encoder.from_run(run_dir)
    path = sorted(gallery.rglob("*.png"))[0]
    pil = Image.open(path)
    array = np.array(pil)
    tensor = torch.from_numpy(array).permute(2, 0, 1)
    outs = [encoder.embed([x], batch_size=1) for x in (path, str(path), pil, array, tensor)]
    for out in outs[1:]:
        assert torch.equal(out.embeddings, outs[0].embeddings)
        assert torch.equal(out.uncertainty, outs[0].uncertainty)
    with pytest.raises(ValueError, match="cannot embed a dict"):
        encoder.embed([{}])  # type: ignore[list-item]  # deliberately not an image
    with pytest.raises(ValueError, match=r"values in \[0, 1\]"):
        encoder.embed([tensor.float()])


def test_readme_inference_example(run_dir: Path, gallery: Path, tmp_path: Path) -> None:
    """The README's Python inference walk-through runs as written (as a doctest)."""
    result = run_readme_section(
        "### Inference in Python", {"RUN": run_dir, "IMAGES": gallery, "OUT": tmp_path}
    )
    assert result.failed == 0 and result.attempted > 3


def test_search_source_records_follow_the_index(run_dir: Path, gallery: Path) -> None:
    encoder = Encoder.from_run(run_dir)
    source = read_images(gallery)
    emb = encoder.embed(source.images or [])
    index = Index.create(emb.embeddings, emb.uncertainty, source.ids, model=encoder.info)
    records = search_source(index, read_images(gallery / "a" / "0.png"), 3, encoder)
    assert records[0]["neighbors"][0]["id"] == "a/0.png"
    assert records[0]["query"]["id"] == "0.png"
    # Fewer items than k: the list holds what exists, then -1 ("no neighbour").
    small = Index.create(emb.embeddings[:2], emb.uncertainty[:2], ["p", "q"])
    result = small.search(emb.embeddings[:1], k=5)
    assert result.indices[0].tolist()[2:] == [-1, -1, -1]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"embeddings": torch.zeros(3, dtype=torch.long)}, r"floating \(N, d\) array"),
        ({"embeddings": torch.tensor([[0.0, float("nan")]] * 3)}, "NaN or inf"),
        ({"uncertainty": torch.ones(2)}, "uncertainty has 2 values for 3 embeddings"),
        ({"ids": ["a", "b"]}, "2 ids for 3 embeddings"),
        ({"ids": ["a", "b", "a"]}, "'a' appears more than once"),
    ],
)
def test_bad_items_are_named(kwargs: dict, match: str) -> None:
    items: dict = {"embeddings": torch.randn(3, 4)} | kwargs
    with pytest.raises(ValueError, match=match):
        Index.create(**items)


def test_saving_into_a_folder_that_is_not_an_index_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "holiday.jpg").write_bytes(b"not ours")
    with pytest.raises(
        IndexFormatError, match=r"photos exists and is not an index \(it holds holiday.jpg\)"
    ):
        Index.create(torch.randn(3, 4)).save(folder)
    assert sorted(p.name for p in folder.iterdir()) == ["holiday.jpg"]  # nothing written, lock gone


def test_faiss_backends_against_exact_search(tmp_path: Path) -> None:
    pytest.importorskip("faiss")
    g = torch.Generator().manual_seed(0)
    gallery, queries = torch.randn(300, 24, generator=g), torch.randn(7, 24, generator=g)
    exact = Index.create(gallery)
    truth = exact.search(queries, 5)
    assert torch.equal(truth.indices, _brute_force(queries, gallery, 5))  # no near-ties here
    flat = Index.create(gallery, backend="faiss", faiss_factory="Flat")
    found = flat.search(queries, 5)
    assert torch.equal(found.indices, truth.indices)
    # float32 inner products of unit vectors, faiss's BLAS vs our blocked matmul: a few ulp of 1.
    torch.testing.assert_close(found.similarities, truth.similarities, rtol=0, atol=1e-6)

    # HNSW: efSearch ≥ the gallery size visits every node of this small graph, so it is exact;
    # the parameter is changed in place, saved with the index and can be overridden on load.
    hnsw = Index.create(
        gallery, backend="faiss", faiss_factory="HNSW8", search_parameters="efSearch=4"
    )
    # faiss builds HNSW graphs with efConstruction 40 by default; idml with DEFAULT_EF_CONSTRUCTION.
    assert hnsw.faiss_index.hnsw.efSearch == 4 and hnsw.faiss_index.hnsw.efConstruction == 200
    hnsw.set_search_parameters("efSearch=400")
    assert hnsw.faiss_index.hnsw.efSearch == 400
    assert torch.equal(hnsw.search(queries, 5).indices, truth.indices)
    hnsw.save(tmp_path / "hnsw")
    assert Index.load(tmp_path / "hnsw").faiss_index.hnsw.efSearch == 400
    assert Index.load(tmp_path / "hnsw", "efSearch=16").faiss_index.hnsw.efSearch == 16
    # Grown by add, a faiss index equals a fresh one of the union (Flat: exact either way).
    rest = Index.create(gallery[200:], ids=[str(i) for i in range(200, 300)])
    grown = Index.create(gallery[:200], backend="faiss", faiss_factory="Flat").add(rest)
    assert torch.equal(grown.search(queries, 5).indices, truth.indices)

    # efConstruction given at creation shapes the graph as it is built.
    built = Index.create(
        gallery, backend="faiss", faiss_factory="HNSW8", search_parameters="efConstruction=80"
    )
    assert built.faiss_index.hnsw.efConstruction == 80
    with pytest.raises(ValueError, match=r"'nprobe=3' do not apply.*efSearch=128"):
        hnsw.set_search_parameters("nprobe=3")
    with pytest.raises(ValueError, match="apply to the faiss backend; this index is exact"):
        exact.set_search_parameters("efSearch=8")
