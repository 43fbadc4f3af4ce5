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
from typing import Any

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


def _num(value: float) -> float | None:
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
    """An offline page: each query image, then its neighbours with similarity and ``||u||``."""
    rows = []
    for r in records:
        q = r["query"]
        cells = [
            f'<td class="q"><img src="{_thumbnail(q["path"])}" alt=""><br>'
            f"<b>{html.escape(str(q['id']))}</b><br>||u|| {_fmt(q['uncertainty'])}<br>"
            f"{html.escape(r['confidence_kind'])} {_fmt(r['confidence'])}<br>{_verdict(r)}</td>"
        ]
        for n in r["neighbors"]:
            label = "" if n["label"] is None else f"<br>{html.escape(str(n['label']))}"
            cells.append(
                f'<td><img src="{_thumbnail(n["path"])}" alt=""><br>#{n["rank"]} '
                f"{html.escape(str(n['id']))}<br>sim {_fmt(n['similarity'])}<br>"
                f"||u|| {_fmt(n['uncertainty'])}{label}</td>"
            )
        rows.append("<tr>" + "".join(cells) + "</tr>")
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        "<style>body{font-family:sans-serif}td{text-align:center;font-size:12px;padding:4px;"
        "vertical-align:top}td.q{background:#eef}img{max-width:96px;max-height:96px}</style>"
        f"</head><body><h1>{html.escape(title)}</h1><table>{''.join(rows)}</table></body></html>"
    )
    path.write_text(page)
