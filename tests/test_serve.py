"""``idml serve`` over real HTTP on 127.0.0.1: answers equal ``idml search``'s; bad requests get 4xx."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from idml.app.cli import main
from idml.app.inference import Encoder
from idml.app.retrieval import Index
from tiny_run import IDML, train_tiny, write_images

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("multipart")

from idml.app.retrieval.server import BackgroundServer, create_app  # noqa: E402


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    """A tiny trained run, an index of 12 PNGs, and the service on an ephemeral loopback port."""
    root = tmp_path_factory.mktemp("serve")
    run = train_tiny(root, IDML)
    gallery = write_images(root / "gallery", classes=3, per_class=4, shape=(10, 14), seed=1)
    index_dir = root / "index"
    assert main(["index", str(gallery), "--out", str(index_dir), "--checkpoint", str(run)]) == 0
    index = Index.load(index_dir)
    app = create_app(index, Encoder.from_run(run), max_bytes=20_000, max_k=8)
    with BackgroundServer(app) as server:
        yield server, index_dir, gallery


def _cli_search(index_dir: Path, query: Path, k: int, capsys: pytest.CaptureFixture[str]) -> dict:
    capsys.readouterr()
    assert (
        main(["search", str(index_dir), str(query), "-k", str(k), "--json", "--no-progress"]) == 0
    )
    out = capsys.readouterr().out
    return json.loads(out[out.index("{") :])


def _same_answers(served_record: dict, cli_record: dict, gallery: Path) -> None:
    assert served_record["confidence_kind"] == cli_record["confidence_kind"]
    # float32 similarities ≤ 1 and ||u|| ≲ 1 from the same model on the same bytes, one query a
    # batch (equal in practice): abs 1e-6 ≈ 8 ulp of 1 only allows a kernel that groups a sum
    # otherwise in the server's thread; a different neighbour would differ by far more.
    assert served_record["confidence"] == pytest.approx(cli_record["confidence"], abs=1e-6)
    assert served_record["query"]["uncertainty"] == pytest.approx(
        cli_record["query"]["uncertainty"], abs=1e-6
    )
    # Same float32 computation on the same bytes: identical neighbour lists.
    assert [n["id"] for n in served_record["neighbors"]] == [
        n["id"] for n in cli_record["neighbors"]
    ]
    for a, b in zip(served_record["neighbors"], cli_record["neighbors"]):
        # The same float32 bound as the confidence above.
        assert a["similarity"] == pytest.approx(b["similarity"], abs=1e-6)
        assert (a["label"], a["uncertainty"]) == (b["label"], b["uncertainty"])
        # The service answers with the path relative to the gallery root, `idml search` (a local
        # user) with the file itself.
        assert not Path(a["path"]).is_absolute() and str(gallery.resolve() / a["path"]) == b["path"]


def test_health_and_info(served) -> None:
    server, index_dir, _ = served
    with httpx.Client(base_url=server.url, timeout=30) as client:
        assert client.get("/health").json() == {"status": "ok"}
        info = client.get("/info").json()
    assert server.host == "127.0.0.1"
    assert info["count"] == 12 and info["dim"] == 16 and info["backend"] == "exact"
    model = Index.load(index_dir).model
    assert model is not None  # the index was built from a run
    assert info["model"]["weights_sha256"] == model.weights_sha256
    assert info["accepts_images"] is True and info["max_k"] == 8


def test_search_answers_equal_idml_search(served, capsys: pytest.CaptureFixture[str]) -> None:
    server, index_dir, gallery = served
    query = gallery / "b" / "2.png"
    expected = _cli_search(index_dir, query, 4, capsys)["results"][0]
    with httpx.Client(base_url=server.url, timeout=30) as client:
        multipart = client.post(
            "/search", files={"image": ("2.png", query.read_bytes(), "image/png")}, data={"k": "4"}
        )
        b64 = client.post(
            "/search", json={"image": base64.b64encode(query.read_bytes()).decode(), "k": 4}
        )
    for response in (multipart, b64):
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["k"] == 4 and len(body["results"]) == 1
        _same_answers(body["results"][0], expected, gallery)
    assert multipart.json()["results"][0]["query"]["id"] == "2.png"
    # Embedding queries: two at once, equal to `idml search` on an embeddings file.
    index = Index.load(index_dir)
    assert index.embeddings is not None  # an exact index keeps its vectors
    emb = index.embeddings[[0, 5]]
    np.savez(gallery.parent / "q.npz", embeddings=emb.numpy())
    expected = _cli_search(index_dir, gallery.parent / "q.npz", 3, capsys)["results"]
    with httpx.Client(base_url=server.url, timeout=30) as client:
        response = client.post("/search", json={"embedding": emb.tolist(), "k": 3})
    assert response.status_code == 200
    got = response.json()["results"]
    assert len(got) == 2
    for a, b in zip(got, expected):
        assert a["query"]["uncertainty"] is None and b["query"]["uncertainty"] is None
        _same_answers(a, b, gallery)


@pytest.mark.parametrize(
    ("request_kwargs", "status", "message"),
    [
        ({"files": {"image": ("x.png", b"not an image", "image/png")}}, 400, "not an image"),
        ({"json": {"image": "%%%"}}, 400, "not valid base64"),
        ({"content": b"{nope", "headers": {"content-type": "application/json"}}, 400, "JSON"),
        ({"json": {"k": 3}}, 400, "'image' (base64) or 'embedding'"),
        ({"json": {"embedding": [0.1] * 15}}, 422, "16 numbers per query"),
        ({"json": {"embedding": [[0.1] * 16, [0.2] * 3]}}, 422, "list of numbers"),
        ({"json": {"embedding": [0.0] * 16}}, 422, "not all zero"),
        ({"json": {"embedding": [0.1] * 16, "k": 9}}, 422, "between 1 and 8"),
        ({"json": {"embedding": [0.1] * 16, "k": "many"}}, 422, "integer"),
        ({"content": b"\x00" * 30_000, "headers": {"content-type": "image/png"}}, 413, "limit"),
        ({"json": {"image": "A" * 30_000}}, 413, "limit"),
        ({"content": b"hello", "headers": {"content-type": "text/plain"}}, 415, "content type"),
        ({"files": {"other": ("x.png", b"x", "image/png")}}, 400, "file field 'image'"),
    ],
)
def test_bad_requests_get_4xx_json(served, request_kwargs: dict, status: int, message: str) -> None:
    server, _, _ = served
    with httpx.Client(base_url=server.url, timeout=30) as client:
        response = client.post("/search", **request_kwargs)
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and message in body["error"]
    assert "Traceback" not in body["error"]


def test_unknown_routes_and_methods_are_json_errors(served) -> None:
    server, _, _ = served
    with httpx.Client(base_url=server.url, timeout=30) as client:
        missing, wrong = client.get("/nope"), client.get("/search")
    assert missing.status_code == 404 and "error" in missing.json()
    assert wrong.status_code == 405 and "error" in wrong.json()


def test_concurrent_requests_all_answer(served) -> None:
    """A bounded burst (32 requests, 8 at a time) on loopback: every answer is the same."""
    import concurrent.futures

    server, index_dir, _ = served
    vectors = Index.load(index_dir).embeddings
    assert vectors is not None  # an exact index keeps its vectors
    emb = vectors[3].tolist()

    def one(_: int) -> list[str]:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            body = client.post("/search", json={"embedding": emb, "k": 3}).json()
        return [n["id"] for n in body["results"][0]["neighbors"]]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, range(32)))
    assert all(a == answers[0] for a in answers) and len(answers[0]) == 3
    assert torch.is_tensor(Index.load(index_dir).embeddings)


def test_an_unexpected_failure_is_a_json_500_without_traceback(served) -> None:
    _, index_dir, gallery = served

    class Broken:
        def embed(self, images):
            raise RuntimeError("secret internals")

    app = create_app(Index.load(index_dir), Broken())  # type: ignore[arg-type]
    png = (gallery / "a" / "0.png").read_bytes()
    with BackgroundServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        response = client.post("/search", files={"image": ("0.png", png, "image/png")})
    assert response.status_code == 500
    body = response.json()
    assert body == {"error": "internal error (RuntimeError); see the server log"}


def test_openapi_document_and_its_offline_page(served) -> None:
    server, _, _ = served
    schema = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    assert schema["info"]["title"] == "idml search"
    assert set(schema["paths"]) == {"/health", "/info", "/search"}
    search = schema["paths"]["/search"]["post"]
    body = search["requestBody"]["content"]
    assert set(body) == {"multipart/form-data", "application/json"}
    assert body["multipart/form-data"]["schema"]["properties"]["k"]["maximum"] == 8  # max_k
    assert {"200", "400", "413", "415", "422", "500"} <= set(search["responses"])
    page = httpx.get(f"{server.url}/docs", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    text = page.text
    assert "POST /search" in text and "GET /info" in text and "multipart/form-data" in text
    # Offline: no script, and nothing fetched from another host.
    assert "<script" not in text and "https://" not in text and "http://" not in text


def test_the_service_builds_the_item_classes_before_it_starts(served) -> None:
    """An index builds each item's class on its first search (seconds at 10M items, measured in
    RESULTS.md's gallery section); the service builds it at start-up so no request pays it."""
    _, index_dir, _ = served
    index = Index.load(index_dir)
    assert "class_ids" not in vars(index)  # a cached property, not built by loading
    create_app(index, None)
    assert "class_ids" in vars(index)
    assert vars(index)["class_ids"].tolist() == Index.load(index_dir).class_ids.tolist()
