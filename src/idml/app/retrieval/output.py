"""Search results as records, JSON, CSV, a text table and an offline HTML page.

One record per query (the JSON schema of ``idml search --json`` and of ``idml serve``'s
``POST /search``)::

    {"query": {"id", "path", "uncertainty"},          # uncertainty = the query's ||u|| (or null)
     "confidence": float, "confidence_kind": "calibrated" | "top1",
     "answered": bool,                                 # false: the query abstains
     "neighbors": [{"rank", "id", "path", "label", "similarity", "uncertainty"}, ...]}

``confidence`` is the answer's (its nearest item's) confidence: ``P(top-1 right)`` when a
calibration applies, else the top-1 cosine similarity; ``answered`` is false when it lies below the
abstention cut-off (:mod:`idml.app.retrieval.confidence`). ``similarity`` is the cosine similarity
of the normalised semantic embeddings, ``uncertainty`` the item's ``||u||``. A neighbour's ``path`` is one of :data:`PATH_STYLES`: the absolute file (``idml
search``, for a person on the machine that holds the gallery), the path relative to the gallery
root (``idml serve``'s default: nothing of the server's folders), or ``null`` (ids only). A path
that leads outside the index's root (unless it was built to allow that) is ``null`` in every style. Numbers that do not exist (no uncertainty for a bare-embedding query, no
neighbour) are ``null``, never ``NaN``, so every output is valid JSON.
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, SupportsFloat

from idml.app.retrieval.index import Index, SearchResult

PATH_STYLES = ("absolute", "relative", "none")
"""How a neighbour's path is given (module docstring)."""

CSV_COLUMNS = (
    "query_id",
    "query_path",
    "query_uncertainty",
    "confidence",
    "confidence_kind",
    "answered",
    "rank",
    "item_id",
    "item_path",
    "item_label",
    "similarity",
    "item_uncertainty",
)


def _num(value: SupportsFloat) -> float | None:
    value = float(value)
    return None if math.isnan(value) or math.isinf(value) else value


def result_records(
    result: SearchResult,
    index: Index,
    query_ids: Sequence[str],
    query_paths: Sequence[str | None] | None = None,
    item_paths: str = "absolute",
) -> list[dict[str, Any]]:
    """One record per query (schema in the module docstring), neighbours best first, their
    ``path`` in the style ``item_paths`` (one of :data:`PATH_STYLES`)."""
    if len(query_ids) != len(result):
        raise ValueError(f"{len(query_ids)} query ids for {len(result)} results")
    if item_paths not in PATH_STYLES:
        raise ValueError(f"item_paths must be one of {PATH_STYLES}, got {item_paths!r}")
    paths = list(query_paths) if query_paths is not None else [None] * len(result)
    records = []
    for q in range(len(result)):
        neighbors = []
        for rank, (item, sim) in enumerate(
            zip(result.indices[q].tolist(), result.similarities[q].tolist()), start=1
        ):
            if item < 0:
                continue
            neighbors.append(
                {
                    "rank": rank,
                    "id": index.ids[item],
                    "path": _item_path(index, item, item_paths),
                    "label": index.labels[item],
                    "similarity": _num(sim),
                    "uncertainty": _num(index.uncertainty[item]),
                }
            )
        records.append(
            {
                "query": {
                    "id": query_ids[q],
                    "path": paths[q],
                    "uncertainty": _num(result.query_uncertainty[q]),
                },
                "confidence": _num(result.confidence[q]),
                "confidence_kind": result.confidence_kind,
                "answered": bool(result.answered[q]),
                "neighbors": neighbors,
            }
        )
    return records


def _item_path(index: Index, item: int, style: str) -> str | None:
    if style == "none":
        return None
    file = index.item_file(item)  # None outside the root: never shown, never opened
    if file is None:
        return None
    if style == "absolute":
        return str(file)
    return index.paths[item] if index.root is not None else None


def to_json(
    records: list[dict[str, Any]],
    index: Index,
    k: int,
    answers: dict[str, Any] | None = None,
) -> str:
    """The ``idml search --json`` document: the index's description, ``k``, how the answers were
    scored (``answers``: :meth:`~idml.app.retrieval.confidence.AnswerPolicy.describe` and the
    re-ranking) and the records."""
    info = index.describe()
    doc = {
        "index": {key: info[key] for key in ("count", "dim", "metric", "backend")},
        "model": None if index.model is None else index.model.weights_sha256,
        "k": k,
        "answers": answers,
        "results": records,
    }
    return json.dumps(doc, indent=2)


def write_csv(records: list[dict[str, Any]], path: Path) -> None:
    """One row per (query, neighbour), columns :data:`CSV_COLUMNS`."""
    with open(path, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(CSV_COLUMNS)
        for r in records:
            q = r["query"]
            head = [
                q["id"],
                q["path"],
                q["uncertainty"],
                r["confidence"],
                r["confidence_kind"],
                r["answered"],
            ]
            for n in r["neighbors"]:
                writer.writerow(
                    [
                        *head,
                        n["rank"],
                        n["id"],
                        n["path"],
                        n["label"],
                        n["similarity"],
                        n["uncertainty"],
                    ]
                )


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def format_table(records: list[dict[str, Any]], note: str | None = None) -> str:
    """A plain-text table per query, for the terminal, after ``note`` (how answers are scored)."""
    lines = [] if note is None else [note]
    for r in records:
        q = r["query"]
        lines.append(
            f"query {q['id']}  ||u|| {_fmt(q['uncertainty'])}  confidence "
            f"({r['confidence_kind']}) {_fmt(r['confidence'])}  {_verdict(r)}"
        )
        width = max((len(str(n["id"])) for n in r["neighbors"]), default=2)
        lines.append(f"  {'rank':>4}  {'id'.ljust(width)}  similarity  ||u||   label")
        for n in r["neighbors"]:
            lines.append(
                f"  {n['rank']:>4}  {str(n['id']).ljust(width)}  {_fmt(n['similarity']):>10}  "
                f"{_fmt(n['uncertainty'])}  {n['label'] if n['label'] is not None else '-'}"
            )
    return "\n".join(lines)


def _verdict(record: dict[str, Any]) -> str:
    """``answered`` or ``abstained`` (the confidence is below the cut-off)."""
    return "answered" if record["answered"] else "abstained"


def _thumbnail(path: str | None, size: int = 96) -> str:
    """A data URI of a JPEG thumbnail (the page works offline and without the files), or ''."""
    if path is None:
        return ""
    from PIL import Image

    try:
        with Image.open(path) as image:
            image = image.convert("RGB")
            image.thumbnail((size, size))
            buffer = io.BytesIO()
            image.save(buffer, format="JPEG", quality=85)
    except (OSError, ValueError):
        return ""
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


def write_html(records: list[dict[str, Any]], path: Path, title: str = "idml search") -> None:
    """An offline page: each query image, then its neighbours with similarity and ``||u||``.

    Each query is a tile followed by its neighbours' fixed-width tiles, which wrap onto further
    lines beside it, so any ``k`` fits the screen; ``||u||`` gets the decimals that tell the
    page's levels apart (:func:`~idml.app.metric_display.decimals_for`), and is left out for a
    model without an uncertainty head (every level 0); long ids break instead of widening a tile.
    """
    from idml.app.metric_display import decimals_for

    levels = [r["query"]["uncertainty"] for r in records]
    levels += [n["uncertainty"] for r in records for n in r["neighbors"]]
    known = [v for v in levels if v is not None]
    digits = decimals_for(known, minimum=4)
    # A model without an uncertainty head gives every item ||u|| = 0: nothing to show.
    shown = any(known)

    def level(value: float | None) -> list[str]:
        if not shown:
            return []
        return ["||u|| " + ("n/a" if value is None else f"{value:.{digits}f}")]

    def tile(css: str, image: str, lines: list[str]) -> str:
        text = "".join(f"<div>{line}</div>" for line in lines)
        return f'<figure class="{css}"><img src="{image}" alt=""><figcaption>{text}</figcaption></figure>'

    rows = []
    for r in records:
        q = r["query"]
        tiles = [
            tile(
                "item query",
                _thumbnail(q["path"]),
                [
                    f"<b>{html.escape(str(q['id']))}</b>",
                    *level(q["uncertainty"]),
                    f"{html.escape(r['confidence_kind'])} {_fmt(r['confidence'])}",
                    _verdict(r),
                ],
            )
        ]
        for n in r["neighbors"]:
            lines = [
                f"#{n['rank']} {html.escape(str(n['id']))}",
                f"sim {_fmt(n['similarity'])}",
                *level(n["uncertainty"]),
            ]
            if n["label"] is not None:
                lines.append(html.escape(str(n["label"])))
            tiles.append(tile("item", _thumbnail(n["path"]), lines))
        query, neighbours = tiles[0], "".join(tiles[1:])
        rows.append(
            f'<section class="row">{query}<div class="neighbours">{neighbours}</div></section>'
        )
    style = (
        "body{font-family:sans-serif;margin:1em;overflow-wrap:anywhere}"
        ".row{display:flex;gap:10px;margin-bottom:14px;padding-bottom:8px;"
        "border-bottom:1px solid #ddd}"
        ".neighbours{display:flex;flex-wrap:wrap;gap:6px;flex:1}"
        ".item{width:112px;margin:0;text-align:center;font-size:12px;flex:none}"
        ".item.query{background:#eef}"
        ".item img{width:96px;height:96px;object-fit:contain;image-rendering:pixelated;"
        "background:#f4f4f4}"
    )
    page = (
        f"<!doctype html><html lang='en'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>"
        f"<link rel='icon' href='data:,'><title>{html.escape(title)}</title>"
        f"<style>{style}</style></head><body><h1>{html.escape(title)}</h1>"
        f"{''.join(rows)}</body></html>"
    )
    path.write_text(page)
