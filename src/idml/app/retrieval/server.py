"""``idml serve``: a small HTTP JSON service over an index (FastAPI + uvicorn, the ``serve`` extra).

Endpoints:

* ``GET /health`` → ``{"status": "ok"}``;
* ``GET /info`` → the index's size, dimension, backend and model (:meth:`Index.describe`), the
  request limits, and ``answers``: how answers are scored and when they abstain (the confidence
  kind, the calibrator, the cut-off, the re-ranking; :class:`~idml.app.retrieval.workflow.Answering`);
* ``POST /search`` → ``{"k": k, "results": [record]}`` with the records of ``idml search --json``
  (:mod:`idml.app.retrieval.output`): each answer's ``confidence``, ``confidence_kind`` and
  ``answered``. The query is one of

  - ``multipart/form-data`` with a file field ``image`` (and an optional field ``k``),
  - JSON ``{"image": "<base64 of the file>", "k": 10}``,
  - JSON ``{"embedding": [...] or [[...], ...], "k": 10}`` (one or several embeddings).

``GET /openapi.json`` is the OpenAPI document of these endpoints and ``GET /docs`` a page of it that
needs no network (:mod:`idml.app.retrieval.api_docs`).

Bad requests get a 4xx JSON ``{"error": "..."}`` naming what to fix, never a traceback: 400 (not
JSON, JSON nested deeper than :data:`MAX_JSON_DEPTH`, not an image, no query), 413 (body above
``max_bytes``, an image above ``max_pixels``: "too large"), 415 (another content type), 422
(wrong embedding dimension, NaN, inf or all-zero query, ``k`` not an integer in ``1..max_k``). An
unexpected failure is a 500 with a JSON error and the traceback goes to the server's log only.

Trust boundary: a request is untrusted. Its size, nesting, pixel count and numbers are bounded
before they are used; nothing in it names a file of the server. Answers give each neighbour's path
relative to the gallery root, or no path at all (``paths="none"``), and ``/info`` leaves out the
model's folders, so no answer reveals the server's file system. The server binds to the loopback
interface unless told otherwise: an index reveals its gallery.
"""

import base64
import binascii
import io
import json
import logging
import re
from typing import Any

import numpy as np
import torch

from idml.app.inference import Encoder
from idml.app.retrieval.index import Index
from idml.app.retrieval.output import result_records
from idml.app.retrieval.workflow import Answering

LOG = logging.getLogger("idml.serve")
DEFAULT_MAX_BYTES = 10 * 1024 * 1024
DEFAULT_MAX_K = 100
DEFAULT_MAX_PIXELS = 40_000_000
"""The largest image (width × height) a request may upload: a 40 Mpx photo decodes to 120 MB of
RGB; a small file that decodes to far more (a decompression bomb) is refused from its header."""
MAX_JSON_DEPTH = 8
"""The deepest nesting of a JSON body (a batch of embeddings needs 3); deeper is refused before
parsing, which would otherwise recurse once per level."""
PATH_STYLES = ("relative", "none")
"""What answers give as a neighbour's path: relative to the gallery root, or nothing."""
_JSON_STRING = re.compile(rb'"(?:[^"\\]+|\\.)*"')


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
    default_k: int | None = None,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    paths: str = "relative",
    answering: Answering | None = None,
) -> Any:
    """The FastAPI application over ``index``; ``encoder`` embeds uploaded images (``None``: only
    embedding queries are accepted); ``default_k`` (default ``min(10, max_k)``) answers a request
    without ``k``. ``paths`` is what answers give as a neighbour's path
    (:data:`PATH_STYLES`); ``answering`` how answers are re-ranked, scored and abstain (default:
    the top-1 similarity, no abstention); the limits are checked here, before the service
    starts."""
    for name, value in (("max_bytes", max_bytes), ("max_k", max_k), ("max_pixels", max_pixels)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    default_k = min(10, max_k) if default_k is None else default_k
    if not 1 <= default_k <= max_k:
        raise ValueError(f"default_k must be between 1 and max_k={max_k}, got {default_k}")
    if paths not in PATH_STYLES:
        raise ValueError(f"paths must be one of {PATH_STYLES}, got {paths!r}")
    answering = Answering() if answering is None else answering
    # Each item's class (what the answers report) is built on the index's first search: about
    # 3 s at 10M unlabelled items. Built here, before the service starts, no request pays it.
    _ = index.class_ids
    fastapi = _require_fastapi()
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import HTMLResponse, JSONResponse
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from idml import __version__
    from idml.app.retrieval.api_docs import docs_page, search_openapi

    # FastAPI's own /docs and /redoc load scripts from a CDN; /docs here is an offline page.
    app = fastapi.FastAPI(
        title="idml search",
        version=__version__,
        description="Nearest-neighbour search over an index written by `idml index`.",
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
    )

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return HTMLResponse(docs_page(app.openapi()))

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

    @app.get("/health", summary='liveness: {"status": "ok"}')
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/info", summary="the index (size, dimension, backend, model) and request limits")
    async def info() -> dict[str, Any]:
        described = index.describe()
        if described["model"] is not None:  # its run folder and checkpoint are the server's
            described["model"] = {
                key: value
                for key, value in described["model"].items()
                if key not in ("source", "checkpoint")
            }
        return {
            **described,
            "accepts_images": encoder is not None,
            "max_bytes": max_bytes,
            "max_k": max_k,
            "max_pixels": max_pixels,
            "paths": paths,
            "answers": answering.describe(reveal_paths=False),
        }

    @app.post(
        "/search",
        summary="neighbours of an image or of embeddings",
        openapi_extra=search_openapi(max_k, max_bytes, max_pixels, default_k, encoder is not None),
    )
    async def search(request: Request) -> dict[str, Any]:
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
                width, height = opened.size  # from the header: nothing is decoded yet
                if width * height > max_pixels:
                    raise BadRequest(
                        413,
                        f"the uploaded image is too large: {width}×{height} = "
                        f"{width * height} pixels, the limit is {max_pixels}",
                    )
                opened.load()
                image = opened.copy()
        except Image.DecompressionBombError:
            raise BadRequest(
                413, "the uploaded image is too large (a decompression bomb)"
            ) from None
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
            raise BadRequest(400, "the uploaded file is not an image PIL can decode") from None
        out = encoder.embed([image])
        return {"k": k, "results": _answer(out.embeddings, k, [query_id], out.uncertainty)}

    def _answer(
        queries: torch.Tensor, k: int, ids: list[str], uncertainty: torch.Tensor | None = None
    ) -> list[dict[str, Any]]:
        try:
            result = index.search(
                queries,
                k,
                uncertainty,
                policy=answering.policy,
                reranking=answering.reranking,
            )
        except ValueError as err:  # a query the index refuses (zero, non-finite, k)
            raise BadRequest(422, str(err)) from None
        return result_records(result, index, ids, item_paths=paths)

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
        if not bool(torch.isfinite(emb).all()) or bool((emb.abs().amax(dim=1) == 0).any()):
            raise BadRequest(422, "'embedding' values must be finite and not all zero")
        ids = [f"query{i}" for i in range(len(emb))]
        return {"k": k, "results": _answer(emb, k, ids)}

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


def json_depth(body: bytes) -> int:
    """The deepest nesting of brackets in a JSON text, strings skipped (vectorised: a 10 MB body
    of ``[`` is a few array passes, and nothing recurses)."""
    skeleton = np.frombuffer(_JSON_STRING.sub(b'""', body), dtype=np.uint8)
    steps = ((skeleton == ord("[")) | (skeleton == ord("{"))).astype(np.int64)
    steps -= (skeleton == ord("]")) | (skeleton == ord("}"))
    return int(np.cumsum(steps).max(initial=0))


def _json(body: bytes) -> dict[str, Any]:
    depth = json_depth(body)
    if depth > MAX_JSON_DEPTH:
        raise BadRequest(
            400, f"the JSON body is nested {depth} levels deep; at most {MAX_JSON_DEPTH} are read"
        )
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):
        raise BadRequest(400, "the body is not valid JSON") from None
    if not isinstance(payload, dict):
        raise BadRequest(400, "the JSON body must be an object")
    return payload


def _k(value: Any, default: int, max_k: int) -> int:
    """``k`` of a request: a JSON integer or a form field of digits, in ``1..max_k`` (``1e400``,
    ``3.5``, ``true`` and a 5000-digit number are refused before any arithmetic on them)."""
    if value is None:
        return default
    text = value.strip() if isinstance(value, str) else None
    if text is not None and text.isascii() and text.isdigit() and len(text) <= 18:
        value = int(text)
    if isinstance(value, bool) or not isinstance(value, int):
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "…"
        raise BadRequest(422, f"'k' must be an integer between 1 and {max_k}, got {shown}")
    if not 1 <= value <= max_k:
        shown = str(value) if len(str(value)) <= 40 else f"a {len(str(value))}-digit number"
        raise BadRequest(422, f"'k' must be between 1 and {max_k}, got {shown}")
    return value


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
