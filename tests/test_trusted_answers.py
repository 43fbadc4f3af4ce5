"""Answers you can trust, end to end: ``idml train`` fits ``calibration.json`` on held-out training
classes, ``idml calibrate`` fits one on labelled images, ``idml search`` / ``serve`` answers carry
the calibrated confidence and abstain below the cut-off, a run without a calibration says which
fallback it uses, and the re-ranking flags of evaluate, search and serve."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from idml.app.calibration import CALIBRATION_FILE, find_calibration
from idml.app.cli import main
from idml.app.config import ConfigError, load_config
from idml.app.inference import Encoder
from idml.app.retrieval import AnswerPolicy, GalleryReranking, Index
from idml.app.retrieval.workflow import read_images
from idml.evaluation.confidence import (
    AnswerNeighbors,
    ConfidenceCalibration,
    LogisticCalibrator,
    PrecisionThreshold,
)
from idml.evaluation.reranking import QueryExpansion
from idml.evaluation.search import NeighborLists
from tiny_run import train_tiny

HELD_OUT = [
    "data.num_train_classes=8",
    "calibration.held_out_classes=0.5",  # digits 4-7 held out, 0-3 trained, 8-9 test
    "sampler.classes_per_batch=4",
    "optim.max_steps_per_epoch=1",  # a weak model: many wrong answers to calibrate on
]


def write_digits(root: Path, rows: range) -> Path:
    """PNGs of scikit-learn's digits ``rows`` in class folders ``0``…``9`` (a labelled folder)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    for i in rows:
        folder = root / str(digits.target[i])
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray((digits.images[i] * 15.9).astype(np.uint8)).save(folder / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def setting(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny run calibrated at the end of training, an index of 200 digits and 40 queries."""
    root = tmp_path_factory.mktemp("trust")
    run = train_tiny(root, HELD_OUT)
    gallery = write_digits(root / "gallery", range(0, 200))
    queries = write_digits(root / "queries", range(1000, 1040))
    index = root / "index"
    assert main(["index", str(gallery), "--out", str(index), "--checkpoint", str(run)]) == 0
    return {"root": root, "run": run, "gallery": gallery, "queries": queries, "index": index}


def _search(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    capsys.readouterr()
    assert main(["search", *args, "--json", "--no-progress"]) == 0
    out = capsys.readouterr().out
    return json.loads(out[out.index("{") :])


def _exit_and_error(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(list(args))
    return code, capsys.readouterr().err


def _brute_force_answers(index: Index, queries: torch.Tensor, depth: int) -> AnswerNeighbors:
    """Each query's ``depth`` nearest items from the full float64 cosine matrix (ties by item
    position), with the index's classes."""
    assert index.embeddings is not None  # an exact index keeps its vectors
    q = torch.nn.functional.normalize(queries.double(), dim=1)
    sims = q @ index.embeddings.double().T
    order = torch.sort(-sims, dim=1, stable=True).indices[:, :depth]
    return AnswerNeighbors.from_search(
        NeighborLists(order, sims.gather(1, order)), reference_labels=index.class_ids
    )


def _tolerance(calibration: ConfidenceCalibration) -> float:
    """How far a calibrated confidence may move when its similarities move by float32 rounding:
    ``|dp| ≤ ¼·Σ_j w_j/s_j·|dx_j|`` (the logistic's slope is at most ¼), with ``|dx| ≤ 2·1e-6``
    (a margin is a difference of two float32 cosines of 16-dimensional unit vectors, each within
    ~(16 + a few)·ε ≈ 3e-6 of float64 at worst; agreement counts are exact)."""
    calibrator = calibration.calibrator
    assert isinstance(calibrator, LogisticCalibrator)
    return 0.25 * sum(w / s for w, s in zip(calibrator.weights, calibrator.scale)) * 6e-6 + 1e-12


def test_held_out_classes_are_never_trained_on() -> None:
    from idml.app import build

    cfg = load_config(None, ["data.dataset=digits", *HELD_OUT])
    split = build.build_data(cfg)
    assert split.val is not None
    assert set(split.val.class_names).isdisjoint(split.train.class_names)
    assert set(split.val.class_names).isdisjoint(split.test.class_names)
    assert (len(split.train.class_names), len(split.val.class_names)) == (4, 4)
    # Without the section nothing is held out: the papers' protocol trains on every class.
    plain = build.build_data(load_config(None, ["data.dataset=digits", "data.num_train_classes=8"]))
    assert plain.val is None and len(plain.train.class_names) == 8


def test_held_out_classes_are_the_last_ids_unless_asked_to_spread_them() -> None:
    """The last ids hold out whole groups where ids run by group (Omniglot's alphabets, unseen
    like the test classes' alphabets); ``spread`` lends every group's share instead."""
    from idml.app import build

    names = {}
    for order in ("spread", "last"):
        cfg = load_config(
            None, ["data.dataset=digits", *HELD_OUT, f"calibration.held_out_order={order}"]
        )
        split = build.build_data(cfg)
        assert split.val is not None
        names[order] = sorted(split.val.class_names)
    assert names == {"spread": ["1", "3", "5", "7"], "last": ["4", "5", "6", "7"]}
    assert load_config(None, HELD_OUT).calibration.held_out_order == "last"


def test_calibration_config_is_validated() -> None:
    for bad, named in (
        ("calibration.features=[top2]", "unknown confidence score 'top2'"),
        ("calibration.calibrator=isotonic", "reads one score"),
        ("calibration.held_out_classes=1.0", "held_out_classes"),
        ("calibration.threshold_share=0", "threshold_share"),
    ):
        with pytest.raises(ConfigError, match=named):
            load_config(None, [bad])
    with pytest.raises(ConfigError, match="calibration"):
        load_config(None, ["task=classification", "calibration.held_out_classes=0.2"])


def test_train_writes_a_calibration_fitted_on_held_out_classes(setting: dict[str, Path]) -> None:
    path = setting["run"] / CALIBRATION_FILE
    calibration = ConfidenceCalibration.load(path)
    provenance = calibration.provenance
    encoder = Encoder.from_run(setting["run"])  # the best checkpoint, what idml index uses
    assert provenance["model_weights_sha256"] == encoder.info.weights_sha256
    assert provenance["reranking"] == "none" and provenance["metric"] == "cosine"
    assert "4 held-out training classes" in provenance["queries"]
    # Half of the held-out images fit the calibrator, the other half certify thresholds.
    sizes = len(calibration.ordering_set.correct), len(calibration.testing_set.correct)
    assert sizes == (80, 80)


def test_search_answers_carry_the_calibrated_confidence_and_abstain(
    setting: dict[str, Path], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    index_dir, queries = str(setting["index"]), str(setting["queries"])
    calibration = ConfidenceCalibration.load(setting["run"] / CALIBRATION_FILE)
    doc = _search(capsys, index_dir, queries, "-k", "3")
    assert doc["answers"]["confidence_kind"] == "calibrated"
    assert doc["answers"]["note"].endswith(str(setting["run"] / CALIBRATION_FILE))
    assert doc["answers"]["abstain_below"] is None and doc["answers"]["reranking"] is None
    # The confidence is the calibration's on brute-force neighbour lists, 10 deep (its features
    # read 10 neighbours though only k = 3 are shown).
    index = Index.load(setting["index"])
    files = [setting["queries"] / r["query"]["id"] for r in doc["results"]]
    encoded = Encoder.from_run(setting["run"]).embed(files)
    expected = calibration.confidence(_brute_force_answers(index, encoded.embeddings, 10))
    got = torch.tensor([r["confidence"] for r in doc["results"]], dtype=torch.float64)
    assert torch.allclose(got, expected, rtol=0, atol=_tolerance(calibration))
    assert all(r["confidence_kind"] == "calibrated" and r["answered"] for r in doc["results"])
    assert all(len(r["neighbors"]) == 3 for r in doc["results"])

    # --min-confidence: a query abstains exactly when its confidence is below the cut-off.
    cut = float(got.median())
    doc = _search(capsys, index_dir, queries, "-k", "3", "--min-confidence", str(cut))
    assert [r["answered"] for r in doc["results"]] == (got >= cut).tolist()
    assert 0 < sum(r["answered"] for r in doc["results"]) < len(got)
    assert doc["answers"]["abstain_below"] == cut

    # --target-precision: the cut-off is the threshold certified on the calibration's queries.
    threshold = calibration.threshold(0.8, 0.2)
    doc = _search(
        capsys, index_dir, queries, "-k", "3", "--target-precision", "0.8", "--delta", "0.2"
    )
    assert doc["answers"]["target_precision"]["threshold"] == threshold.threshold
    assert [r["answered"] for r in doc["results"]] == (got >= threshold.threshold).tolist()

    # CSV and the table carry the same answers.
    out = tmp_path / "answers.csv"
    args = [index_dir, queries, "-k", "2", "--min-confidence", str(cut), "--out", str(out)]
    assert main(["search", *args, "--no-progress"]) == 0
    rows = list(csv.DictReader(out.open()))
    first = {row["query_id"]: row["answered"] for row in rows}
    assert [first[r["query"]["id"]] == "True" for r in doc["results"]] == (got >= cut).tolist()
    table = capsys.readouterr().out
    assert table.startswith(f"confidence: calibrated confidence from {setting['run']}")
    assert table.count("abstained") == int((got < cut).sum())


def test_an_unreachable_target_abstains_on_everything_and_says_so() -> None:
    index = Index.create(torch.eye(3), labels=["a", "b", "c"])
    never = PrecisionThreshold(0.99, 0.1, float("inf"), 40, 0.0, float("nan"))
    policy = AnswerPolicy(threshold=never)
    result = index.search(torch.eye(3), k=1, policy=policy)
    assert result.answered.tolist() == [False, False, False]
    assert policy.describe()["abstain_below"] is None


def test_a_run_without_a_calibration_says_which_fallback_it_uses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], setting: dict[str, Path]
) -> None:
    run = train_tiny(tmp_path)  # every training class trained on: nothing held out
    assert not (run / CALIBRATION_FILE).exists()
    index_dir = tmp_path / "index"
    gallery = str(setting["gallery"])
    assert main(["index", gallery, "--out", str(index_dir), "--checkpoint", str(run)]) == 0
    doc = _search(capsys, str(index_dir), str(setting["queries"]), "-k", "2")
    note = doc["answers"]["note"]
    assert doc["answers"]["confidence_kind"] == "top1"
    assert "no calibration" in note and "top-1 cosine similarity" in note
    assert "idml calibrate" in note and str(run / CALIBRATION_FILE) in note
    for record in doc["results"]:
        assert record["confidence_kind"] == "top1" and record["answered"]
        # The top-1 cosine of unit vectors, never above 1 (float32 can round it to 1.0000001).
        assert record["confidence"] == record["neighbors"][0]["similarity"] <= 1.0
    code, err = _exit_and_error(
        capsys, "search", str(index_dir), str(setting["queries"]), "--target-precision", "0.9"
    )
    assert code == 2 and "needs a calibrated confidence" in err and "idml calibrate" in err


def test_idml_calibrate_round_trip(
    setting: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    labelled = write_digits(tmp_path / "labelled", range(300, 500))
    index_copy = tmp_path / "index"
    gallery, run = str(setting["gallery"]), str(setting["run"])
    assert main(["index", gallery, "--out", str(index_copy), "--checkpoint", run]) == 0
    # Against the index's gallery: written into the index folder, which search prefers.
    args = ["calibrate", run, "--images", str(labelled), "--index", str(index_copy)]
    assert main([*args, "--no-progress"]) == 0
    written = index_copy / CALIBRATION_FILE
    calibration = ConfidenceCalibration.load(written)
    assert calibration.to_dict() == json.loads(written.read_text())
    provenance = calibration.provenance
    assert provenance["gallery"].startswith(f"index {index_copy.resolve()} (200 items)")
    assert "200 labelled images of 10 classes" in provenance["queries"]
    model = Index.load(index_copy).model
    assert model is not None  # the index was built from a run
    assert provenance["model_weights_sha256"] == model.weights_sha256
    doc = _search(capsys, str(index_copy), str(setting["queries"]), "-k", "1")
    assert doc["answers"]["note"] == f"calibrated confidence from {written}"
    index = Index.load(index_copy)
    files = [setting["queries"] / r["query"]["id"] for r in doc["results"]]
    encoded = Encoder.from_run(setting["run"]).embed(files)
    expected = calibration.confidence(_brute_force_answers(index, encoded.embeddings, 10))
    got = torch.tensor([r["confidence"] for r in doc["results"]], dtype=torch.float64)
    assert torch.allclose(got, expected, rtol=0, atol=_tolerance(calibration))

    # Images that are gallery items would find themselves: refused, naming one.
    code, err = _exit_and_error(
        capsys, "calibrate", run, "--images", gallery, "--index", str(index_copy)
    )
    assert code == 2 and "items of index" in err
    # Unlabelled images cannot calibrate.
    loose = tmp_path / "loose"
    loose.mkdir()
    for f in sorted(labelled.rglob("*.png"))[:3]:
        (loose / f.name).write_bytes(f.read_bytes())
    code, err = _exit_and_error(capsys, "calibrate", run, "--images", str(loose))
    assert code == 2 and "need labels" in err
    # Without images a run is calibrated on its own held-out classes, into its folder: --index
    # without images is refused.
    code, err = _exit_and_error(capsys, "calibrate", run, "--index", str(index_copy))
    assert code == 2 and "--index needs --images" in err


def test_export_carries_the_run_calibration(setting: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "export"
    args = ["export", "--checkpoint", str(setting["run"]), "--out", str(out)]
    assert main([*args, "--format", "torchscript"]) == 0
    copied = out / CALIBRATION_FILE
    assert copied.read_bytes() == (setting["run"] / CALIBRATION_FILE).read_bytes()
    found = find_calibration([out], Encoder.load(out).info.weights_sha256, "none")
    assert found.path == copied


def test_a_calibration_of_other_weights_or_reranking_is_passed_over(
    setting: dict[str, Path], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    calibration = ConfidenceCalibration.load(setting["run"] / CALIBRATION_FILE)
    found = find_calibration([setting["run"]], "0" * 64, "none")
    assert found.calibration is None and "fitted for model weights" in found.note
    found = find_calibration([setting["run"]], None, "query_expansion(…), shortlist 100")
    assert found.calibration is None and "re-ranking 'none'" in found.note
    # Named explicitly, a calibration that does not apply is an error, not a fallback.
    with pytest.raises(ValueError, match=r"--calibration .*fitted with re-ranking"):
        find_calibration([], None, "other", explicit=setting["run"] / CALIBRATION_FILE)
    assert calibration.provenance["reranking"] == "none"
    doc = _search(
        capsys, str(setting["index"]), str(setting["queries"]), "--rerank", "query-expansion"
    )
    assert doc["answers"]["confidence_kind"] == "top1"
    assert "does not apply" in doc["answers"]["note"]
    assert doc["answers"]["reranking"].startswith("query_expansion(αQE 2, DBA 0, α 3)")


def test_rerank_flags_reorder_the_shortlist_as_the_library_does(
    setting: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    index = Index.load(setting["index"])
    files = sorted(setting["queries"].rglob("*.png"))
    queries = Encoder.from_run(setting["run"]).embed(files).embeddings
    reranker = QueryExpansion(query_neighbors=1, database_neighbors=2, alpha=1.0, shortlist=20)
    doc = _search(
        capsys,
        str(setting["index"]),
        str(setting["queries"]),
        "-k",
        "5",
        "--rerank",
        "query-expansion",
        "--rerank-qe",
        "1",
        "--rerank-dba",
        "2",
        "--rerank-alpha",
        "1",
        "--rerank-shortlist",
        "20",
    )
    # The library on exact float64 lists: the gallery graph and each query's shortlist of 20.
    gallery = index.embeddings
    assert gallery is not None  # an exact index keeps its vectors
    sims = torch.nn.functional.normalize(queries.double(), dim=1) @ gallery.double().T
    short = torch.sort(-sims, dim=1, stable=True).indices[:, :20]
    graph = gallery.double() @ gallery.double().T
    graph.fill_diagonal_(-torch.inf)
    g_ids = torch.sort(-graph, dim=1, stable=True).indices[:, :2]
    prepared = reranker.prepare(gallery, NeighborLists(g_ids, graph.gather(1, g_ids)))
    lists = reranker.rerank(NeighborLists(short, sims.gather(1, short).float()), prepared, queries)
    by_id = {r["query"]["id"]: [n["id"] for n in r["neighbors"]] for r in doc["results"]}
    for q, f in enumerate(files):
        expected = [index.ids[i] for i in lists.indices[q, :5].tolist()]
        assert by_id[f.relative_to(setting["queries"]).as_posix()] == expected
    # The shown similarity stays each neighbour's cosine, whatever the order.
    for record in doc["results"]:
        for n in record["neighbors"]:
            assert -1.0 <= n["similarity"] <= 1.0
    # The same through the prepared gallery side in Python.
    reranking = GalleryReranking.prepare(index, reranker)
    result = index.search(queries, k=5, reranking=reranking)
    assert result.indices.tolist() == lists.indices[:, :5].tolist()


def test_rerank_parameters_are_refused_without_their_method(
    setting: dict[str, Path], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    index_dir, queries = str(setting["index"]), str(setting["queries"])
    code, err = _exit_and_error(capsys, "search", index_dir, queries, "--rerank-k1", "5")
    assert code == 2 and "--rerank-k1 is not a parameter of a search without --rerank" in err
    code, err = _exit_and_error(
        capsys, "search", index_dir, queries, "--rerank", "query-expansion", "--rerank-k1", "5"
    )
    assert code == 2 and "not a parameter of --rerank query-expansion" in err
    code, err = _exit_and_error(
        capsys, "search", index_dir, queries, "--rerank", "k-reciprocal", "--rerank-k1", "0"
    )
    assert code == 2 and "k1 must be an integer >= 1" in err
    code, err = _exit_and_error(
        capsys, "search", index_dir, queries, "--min-confidence", "0.5", "--target-precision", "0.9"
    )
    assert code == 2 and "not both" in err


def test_evaluate_reranks_and_judges_a_calibration(
    setting: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = read_images(setting["gallery"])
    encoded = Encoder.from_run(setting["run"]).embed(source.images or [])
    emb = tmp_path / "emb.npz"
    class_names = [label for label in source.labels if label is not None]
    assert len(class_names) == len(source.labels)  # every gallery image is in a class folder
    labels = np.array([int(label) for label in class_names])
    np.savez(emb, embeddings=encoded.embeddings.numpy(), labels=labels)
    capsys.readouterr()
    args = ["evaluate", "--embeddings", str(emb), "--json", "--no-nmi", "--no-progress"]
    assert main([*args, "--rerank", "k-reciprocal", "--rerank-k1", "10"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["settings"]["reranking"] == "k_reciprocal(k1 10, k2 6, λ 0.3)"
    assert main([*args, "--calibration", str(setting["run"] / CALIBRATION_FILE)]) == 0
    metrics = json.loads(capsys.readouterr().out)["metrics"]
    assert {"ece", "r_auroc_calibrated", "conformal_precision@0.9"} <= set(metrics)
    # A run's own calibration is judged on its test classes, and the table says so.
    assert main(["evaluate", "--checkpoint", str(setting["run"]), "--no-progress"]) == 0
    table = capsys.readouterr().out
    assert "ece" in table and "r_auroc_calibrated" in table and "conformal_coverage@0.95" in table
    assert f"confidence: calibrated confidence from {setting['run']}" in table


def test_answers_that_read_every_gallery_vector_refuse_an_index_without_them() -> None:
    pytest.importorskip("faiss")
    x = torch.randn(40, 8, generator=torch.Generator().manual_seed(0))
    index = Index.create(x, labels=["a", "b"] * 20, backend="faiss", faiss_factory="Flat",
                         store_vectors=False)  # fmt: skip
    # A plain search needs only the faiss index; re-ranking and csls read every vector.
    assert index.search(x[:3], k=2).indices.shape == (3, 2)
    with pytest.raises(ValueError, match=r"re-ranking .* keeps none \(built with --no-vectors\)"):
        GalleryReranking.prepare(index, QueryExpansion(query_neighbors=1))
    with pytest.raises(ValueError, match=r"gallery graph .* --no-vectors"):
        index.gallery_neighbors(5)


def test_unlabelled_items_are_classes_of_their_own() -> None:
    index = Index.create(torch.eye(4), labels=["a", None, "a", None])
    assert index.class_ids.tolist() == [0, 2, 0, 4]


def test_calibrate_a_run_again_under_a_reranking(
    setting: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    shutil.copytree(setting["run"], run)
    args = ["calibrate", str(run), "--rerank", "query-expansion", "--rerank-qe", "1"]
    assert main([*args, "--no-progress"]) == 0
    assert "held-out training classes" in capsys.readouterr().out
    calibration = ConfidenceCalibration.load(run / CALIBRATION_FILE)
    assert calibration.provenance["reranking"] == (
        "query_expansion(αQE 1, DBA 0, α 3), shortlist 100"
    )
    index_dir = tmp_path / "index"
    gallery = str(setting["gallery"])
    assert main(["index", gallery, "--out", str(index_dir), "--checkpoint", str(run)]) == 0
    queries = str(setting["queries"])
    doc = _search(
        capsys, str(index_dir), queries, "--rerank", "query-expansion", "--rerank-qe", "1"
    )
    assert doc["answers"]["confidence_kind"] == "calibrated"
    doc = _search(capsys, str(index_dir), queries)  # without the re-ranking it was fitted under
    assert (
        doc["answers"]["confidence_kind"] == "top1" and "does not apply" in doc["answers"]["note"]
    )


def test_serve_answers_carry_the_calibrated_confidence(setting: dict[str, Path]) -> None:
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from idml.app.retrieval.server import BackgroundServer, create_app
    from idml.app.retrieval.workflow import prepare_answering

    index = Index.load(setting["index"])
    answering = prepare_answering(index, setting["index"], min_confidence=0.5)
    encoder = Encoder.from_run(setting["run"])
    files = sorted(setting["queries"].rglob("*.png"))[:6]
    encoded = encoder.embed(files)
    expected = index.search(encoded.embeddings, 3, policy=answering.policy)
    with BackgroundServer(create_app(index, encoder, answering=answering)) as server:
        info = httpx.get(f"{server.url}/info").json()["answers"]
        body = {"embedding": encoded.embeddings.tolist(), "k": 3}
        results = httpx.post(f"{server.url}/search", json=body).json()["results"]
    # /info says how answers are scored, without the server's folders.
    assert info["confidence_kind"] == "calibrated" and info["abstain_below"] == 0.5
    assert str(setting["run"]) not in json.dumps(info)
    # The same search and float64 calibrator in both, but the fp32 score kernel (torch, OpenBLAS
    # or faiss) is measured per process and thread count, and the server's thread may be given
    # another: each one's confidence is within _tolerance of the float64 one's.
    tolerance = 2 * _tolerance(ConfidenceCalibration.load(setting["run"] / CALIBRATION_FILE))
    for q, record in enumerate(results):
        assert record["confidence_kind"] == "calibrated"
        assert abs(record["confidence"] - float(expected.confidence[q])) <= tolerance
        assert record["answered"] == (record["confidence"] >= 0.5)


def test_report_of_a_calibrated_run_shows_its_reliability_and_thresholds(
    setting: dict[str, Path], tmp_path: Path
) -> None:
    from idml.app.reports import AnalysisOptions, analyse_run, read_run

    analysis = analyse_run(read_run(setting["run"]), AnalysisOptions(tsne_points=10))
    assert analysis.calibration_note.startswith("calibrated confidence from")
    assert analysis.reliability is not None and analysis.reliability.counts.sum() > 0
    assert set(analysis.thresholds) == {0.8, 0.9, 0.95}
    assert "calibrated P(top-1 right)" in analysis.risk_coverage
    assert {"ece", "r_auroc_calibrated", "conformal_coverage@0.9"} <= set(analysis.metrics)
    out = tmp_path / "report"
    assert main(["report", str(setting["run"]), "--out", str(out), "--no-progress"]) == 0
    page = (out / "index.html").read_text(encoding="utf-8")
    assert "Reliability diagram of the calibrated confidence" in page
    assert "<th>target precision</th>" in page and "calibrated P(top-1 right)" in page
