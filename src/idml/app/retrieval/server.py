"""``idml serve``: a small HTTP JSON service over an index (FastAPI + uvicorn, the ``serve`` extra).

Endpoints:

* ``GET /health`` → ``{"status": "ok"}``;
* ``GET /info`` → the index's size, dimension, backend and model (:meth:`Index.describe`) and the
  request limits;
* ``POST /search`` → ``{"k": k, "results": [record]}`` with the records of ``idml search --json``
  (:mod:`idml.app.retrieval.output`). The query is one of

  - ``multipart/form-data`` with a file field ``image`` (and an optional field ``k``),
  - JSON ``{"image": "<base64 of the file>", "k": 10}``,
  - JSON ``{"embedding": [...] or [[...], ...], "k": 10}`` (one or several embeddings).

Bad requests get a 4xx JSON ``{"error": "..."}`` naming what to fix, never a traceback: 400 (not
JSON, not an image, no query), 413 (body above ``max_bytes``), 415 (another content type), 422
(wrong embedding dimension, ``k`` out of range). An unexpected failure is a 500 with a JSON error
and the traceback goes to the server's log only. The server binds to the loopback interface
unless told otherwise: an index reveals its gallery.
"""

import base64
import binascii
import io
import logging
from typing import Any

import torch

from idml.app.inference import Encoder
from idml.app.retrieval.index import Index
from idml.app.retrieval.output import result_records

LOG = logging.getLogger("idml.serve")
DEFAULT_MAX_BYTES = 10 * 1024 * 1024
DEFAULT_MAX_K = 100


class BadRequest(Exception):
    """A request the client must fix: ``status`` and a one-line ``message``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _require_fastapi() -> Any:
    try:
        import fastapi
    except ImportError as err:
        raise ValueError("idml serve needs FastAPI and uvicorn; `pip install idml[serve]`") from err
    return fastapi


def create_app(
    index: Index,
    encoder: Encoder | None,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_k: int = DEFAULT_MAX_K,
    default_k: int = 10,
) -> Any:
    """The FastAPI application over ``index``; ``encoder`` embeds uploaded images (``None``: only
    embedding queries are accepted)."""
    fastapi = _require_fastapi()
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException as StarletteHTTPException

    app = fastapi.FastAPI(title="idml search", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(BadRequest)
    async def _bad(_: Any, err: BadRequest) -> JSONResponse:
        return JSONResponse({"error": err.message}, status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Any, err: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"error": str(err.detail)}, status_code=err.status_code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Any, err: RequestValidationError) -> JSONResponse:
        return JSONResponse({"error": f"invalid request: {err.errors()}"}, status_code=422)

    @app.exception_handler(Exception)
    async def _unexpected(_: Any, err: Exception) -> JSONResponse:
        LOG.exception("search failed")
        return JSONResponse(
            {"error": f"internal error ({type(err).__name__}); see the server log"},
            status_code=500,
        )

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/info")
    async def info() -> dict[str, Any]:
        return {
            **index.describe(),
            "accepts_images": encoder is not None,
            "max_bytes": max_bytes,
            "max_k": max_k,
        }

    @app.post("/search")
    async def search(request: fastapi.Request) -> dict[str, Any]:  # type: ignore[name-defined]
        body = await _read_body(request, max_bytes)
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind == "multipart/form-data":
            # The bounded body is handed back to Starlette's form parser (it reads ``_body``).
            request._body = body
            form = await request.form(max_files=1, max_fields=8, max_part_size=max_bytes)
            upload = form.get("image")
            if upload is None or isinstance(upload, str):
                raise BadRequest(400, "multipart request without a file field 'image'")
            image_bytes = await upload.read()
            k = _k(form.get("k"), default_k, max_k)
            query_id = upload.filename or "query"
            return await run_in_threadpool(_search_image, image_bytes, query_id, k)
        if kind == "application/json":
            payload = _json(body)
            k = _k(payload.get("k"), default_k, max_k)
            if "embedding" in payload:
                return await run_in_threadpool(_search_embedding, payload["embedding"], k)
            if "image" in payload:
                try:
                    image_bytes = base64.b64decode(str(payload["image"]), validate=True)
                except (binascii.Error, ValueError):
                    raise BadRequest(400, "'image' is not valid base64") from None
                return await run_in_threadpool(
                    _search_image, image_bytes, str(payload.get("id", "query")), k
                )
            raise BadRequest(400, "JSON body needs 'image' (base64) or 'embedding' (numbers)")
        raise BadRequest(
            415,
            f"content type {kind or '(none)'!r}: send multipart/form-data with a file 'image', "
            "or application/json with 'image' (base64) or 'embedding'",
        )

    def _search_image(data: bytes, query_id: str, k: int) -> dict[str, Any]:
        if encoder is None:
            raise BadRequest(
                422, "this server has no model to embed images; send 'embedding' instead"
            )
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(io.BytesIO(data)) as opened:
                opened.load()
                image = opened.copy()
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError):
            raise BadRequest(400, "the uploaded file is not an image PIL can decode") from None
        out = encoder.embed([image])
        result = index.search(out.embeddings, k, out.uncertainty)
        return {"k": k, "results": result_records(result, index, [query_id])}

    def _search_embedding(value: Any, k: int) -> dict[str, Any]:
        try:
            emb = torch.tensor(value, dtype=torch.float32)
        except (TypeError, ValueError, RuntimeError):
            raise BadRequest(422, "'embedding' must be a list of numbers (or of lists)") from None
        if emb.dim() == 1:
            emb = emb.unsqueeze(0)
        if emb.dim() != 2 or emb.shape[1] != index.dim or emb.shape[0] == 0:
            raise BadRequest(
                422,
                f"'embedding' must have {index.dim} numbers per query (the index's dimension), "
                f"got shape {list(emb.shape)}",
            )
        if not bool(torch.isfinite(emb).all()) or bool((emb.norm(dim=1) == 0).any()):
            raise BadRequest(422, "'embedding' values must be finite and not all zero")
        result = index.search(emb, k)
        ids = [f"query{i}" for i in range(len(emb))]
        return {"k": k, "results": result_records(result, index, ids)}

    return app


async def _read_body(request: Any, max_bytes: int) -> bytes:
    """The request body, refused with 413 as soon as it exceeds ``max_bytes``."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise BadRequest(
            413, f"request body of {declared} bytes exceeds the {max_bytes}-byte limit"
        )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise BadRequest(413, f"request body exceeds the {max_bytes}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


def _json(body: bytes) -> dict[str, Any]:
    import json

    try:
        payload = json.loads(body)
    except ValueError:
        raise BadRequest(400, "the body is not valid JSON") from None
    if not isinstance(payload, dict):
        raise BadRequest(400, "the JSON body must be an object")
    return payload


def _k(value: Any, default: int, max_k: int) -> int:
    if value is None:
        return default
    try:
        k = int(value)
    except (TypeError, ValueError):
        raise BadRequest(422, f"'k' must be an integer, got {value!r}") from None
    if not 1 <= k <= max_k:
        raise BadRequest(422, f"'k' must be between 1 and {max_k}, got {k}")
    return k


def serve(app: Any, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Run ``app`` with uvicorn until interrupted."""
    try:
        import uvicorn
    except ImportError as err:
        raise ValueError("idml serve needs uvicorn; `pip install idml[serve]`") from err
    uvicorn.run(app, host=host, port=port, log_level=log_level)


class BackgroundServer:
    """``app`` served by uvicorn in a background thread, for tests and benchmarks.

    ``port=0`` takes a free ephemeral port (read it from :attr:`port` once started). Use as a
    context manager: it returns once the server accepts connections and stops it on exit.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0):
        import uvicorn

        config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.host = host
        self.timeout = timeout
        self.port = port
        self._thread: Any = None

    def __enter__(self) -> "BackgroundServer":
        import threading
        import time

        self._thread = threading.Thread(target=self.server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self.timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self._thread.join(self.timeout)
