"""The OpenAPI description of ``idml serve`` and its ``GET /docs`` page.

FastAPI writes the OpenAPI document (``GET /openapi.json``) from the routes; ``POST /search`` reads
its body itself (a multipart upload or JSON, bounded in size), so its request and answers are
described here (:func:`search_openapi`). FastAPI's own ``/docs`` page loads Swagger UI from a CDN,
which a server on an offline machine cannot reach; :func:`docs_page` renders the same document as
plain HTML instead: every endpoint, its request body and its answers, no script and no network.
"""

from __future__ import annotations

import html
import json
from typing import Any

ERROR = {
    "type": "object",
    "properties": {"error": {"type": "string", "description": "what is wrong and what to send"}},
    "required": ["error"],
}

NEIGHBOR = {
    "type": "object",
    "properties": {
        "rank": {"type": "integer", "description": "1 for the nearest"},
        "id": {"type": "string"},
        "path": {
            "type": ["string", "null"],
            "description": "the gallery image's path relative to the gallery root (null when the "
            "server answers with ids only)",
        },
        "label": {"type": ["string", "null"], "description": "the gallery item's class"},
        "similarity": {"type": ["number", "null"], "description": "cosine similarity"},
        "uncertainty": {"type": ["number", "null"], "description": "the item's ||u||"},
    },
}

RECORD = {
    "type": "object",
    "description": "one query's answer, as `idml search --json` writes it",
    "properties": {
        "query": {
            "type": "object",
            "properties": {
                "id": {"type": "string"},
                "path": {"type": ["string", "null"]},
                "uncertainty": {"type": ["number", "null"], "description": "the query's ||u||"},
            },
        },
        "confidence": {"type": ["number", "null"], "description": "top-1 cosine similarity"},
        "confidence_kind": {"type": "string", "example": "top1_cosine"},
        "neighbors": {"type": "array", "items": NEIGHBOR, "description": "nearest first"},
    },
}


def search_openapi(
    max_k: int, max_bytes: int, max_pixels: int, default_k: int, accepts_images: bool
) -> dict:
    """The ``openapi_extra`` of ``POST /search``: its two request forms and its answers."""
    k = {
        "type": "integer",
        "minimum": 1,
        "maximum": max_k,
        "default": default_k,
        "description": "neighbours to return",
    }
    embedding = {
        "type": "object",
        "properties": {
            "embedding": {
                "description": "one embedding (a list of numbers, the index's dimension) or "
                "several (a list of such lists)",
                "oneOf": [
                    {"type": "array", "items": {"type": "number"}},
                    {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
                ],
            },
            "k": k,
        },
        "required": ["embedding"],
    }
    image = {
        "type": "object",
        "properties": {
            "image": {"type": "string", "format": "byte", "description": "base64 of an image file"},
            "id": {"type": "string", "description": "the query's id in the answer"},
            "k": k,
        },
        "required": ["image"],
    }
    upload = {
        "type": "object",
        "properties": {"image": {"type": "string", "format": "binary"}, "k": k},
        "required": ["image"],
    }
    images = "" if accepts_images else " This server has no model: embedding queries only."
    content: dict[str, Any] = {
        "application/json": {
            "schema": {"oneOf": [embedding, image] if accepts_images else [embedding]}
        }
    }
    if accepts_images:
        content["multipart/form-data"] = {"schema": upload}
    errors = {
        "400": "not JSON (or nested too deep), not an image, or no query in the body",
        "413": f"too large: a body above {max_bytes} bytes or an image above {max_pixels} pixels",
        "415": "another content type",
        "422": f"wrong embedding dimension, a NaN, infinite or all-zero query, or k not an "
        f"integer in 1..{max_k}",
        "500": "unexpected failure (the traceback is in the server's log only)",
    }
    return {
        "description": "Nearest gallery items of an uploaded image (multipart field `image`, or "
        f"base64 in JSON) or of embeddings (JSON), with similarities and ||u||.{images}",
        "requestBody": {"required": True, "content": content},
        "responses": {
            "200": {
                "description": "one record per query",
                "content": {
                    "application/json": {
                        "schema": {
                            "type": "object",
                            "properties": {
                                "k": {"type": "integer"},
                                "results": {"type": "array", "items": RECORD},
                            },
                        }
                    }
                },
            },
            **{
                status: {
                    "description": text,
                    "content": {"application/json": {"schema": ERROR}},
                }
                for status, text in errors.items()
            },
        },
    }


def docs_page(schema: dict[str, Any]) -> str:
    """An offline HTML page of an OpenAPI document: per endpoint its summary, description, request
    body schemas and answers (schemas as indented JSON)."""
    info = schema.get("info", {})
    parts = [
        f"<h1>{html.escape(str(info.get('title', 'API')))} {html.escape(str(info.get('version', '')))}</h1>",
        f"<p>{html.escape(str(info.get('description', '')))}</p>",
        '<p>The machine-readable document: <a href="/openapi.json">/openapi.json</a> '
        "(OpenAPI " + html.escape(str(schema.get("openapi", ""))) + ").</p>",
    ]
    for path, methods in schema.get("paths", {}).items():
        for method, operation in methods.items():
            parts.append(f"<h2><code>{method.upper()} {html.escape(path)}</code></h2>")
            for key in ("summary", "description"):
                if operation.get(key):
                    parts.append(f"<p>{html.escape(str(operation[key]))}</p>")
            body = operation.get("requestBody", {}).get("content", {})
            for kind, spec in body.items():
                parts.append(f"<h3>Request: <code>{html.escape(kind)}</code></h3>")
                parts.append(_schema_block(spec.get("schema", {})))
            for status, answer in operation.get("responses", {}).items():
                parts.append(
                    f"<h3>{html.escape(status)}: {html.escape(str(answer.get('description', '')))}"
                    "</h3>"
                )
                for spec in answer.get("content", {}).values():
                    if spec.get("schema"):
                        parts.append(_schema_block(spec["schema"]))
    style = (
        "body{font-family:system-ui,sans-serif;max-width:60em;margin:2em auto;padding:0 1em}"
        "pre{background:#f6f6f6;padding:.6em;overflow-x:auto;font-size:.85em}"
        "h2{border-bottom:1px solid #ccc;margin-top:2em}"
    )
    title = html.escape(str(info.get("title", "API")))
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
        f'<link rel="icon" href="data:,"><style>{style}</style></head><body>'
        + "\n".join(parts)
        + "</body></html>"
    )


def _schema_block(schema: dict[str, Any]) -> str:
    return f"<pre>{html.escape(json.dumps(schema, indent=2, ensure_ascii=False))}</pre>"
