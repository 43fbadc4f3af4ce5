"""Parse the papers' published numbers into configs/published.json (run from the repository root).

Sources (all in %, as printed):

* Fu et al. 2021, "Deep Metric Learning with Self-Supervised Ranking" (AAAI), Tables 1–3, from the
  text extraction of the paper (one flattened line per table: each method's name, its setting, then
  its numbers; ``-`` for a number the paper leaves out).
* Wang et al. 2022, "Introspective Deep Metric Learning" (TPAMI), Sec. IV: the IDML-ProxyAnchor
  Recall@1 and MAP@R and the gains over ProxyAnchor stated in the text (its Table I did not
  survive the extraction); the ProxyAnchor baseline is IDML minus the stated gain.
* The README of the authors' released code (github.com/wzzheng/IDML), IDML-ProxyAnchor rows, as
  transcribed in ``idml_proxy_anchor.csv``.

``python scripts/parse_published.py [SHARED]`` reads ``SHARED`` (default ``../shared``: the seeds
and published folders beside the checkout) and writes ``configs/published.json``, which
``scripts/make_presets.py`` turns into the presets' ``published`` blocks. The package never reads
either file at run time.
"""

from __future__ import annotations

import csv
import json
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "configs" / "published.json"

SSR = "Fu et al. 2021 (SSR, AAAI)"
IDML = "Wang et al. 2022 (IDML, TPAMI)"
README = "IDML authors' README (github.com/wzzheng/IDML)"

_RK = {
    "cub": ("recall@1", "recall@2", "recall@4", "recall@8", "nmi"),
    "cars": ("recall@1", "recall@2", "recall@4", "recall@8", "nmi"),
    "sop": ("recall@1", "recall@10", "recall@100", "recall@1000", "nmi"),
}
_RANKING = {d: ("map", "r_precision") for d in ("cub", "cars", "sop")}
_VALUE = re.compile(r"^(\d+\.\d+|-)$")
_SETTING = re.compile(r"^(G|BN|R)?\d+$")


def _table_body(text: str, number: int, header_end: str) -> str:
    """The flattened rows of table ``number``: after its last header cell, before its caption."""
    caption = f" Table {number}:"
    for line in text.splitlines():
        if caption in line and header_end in line:
            return line[line.index(header_end) + len(header_end) : line.index(caption)]
    raise ValueError(f"table {number} (header ending {header_end!r}) not found in the seed text")


def _rows(body: str, width: int, has_setting: bool) -> list[tuple[str, str | None, list[str]]]:
    """(method, setting, values) for each row: name tokens up to [setting +] ``width`` values."""
    tokens = body.split()
    rows: list[tuple[str, str | None, list[str]]] = []
    name: list[str] = []
    i = 0
    while i < len(tokens):
        start = i + 1 if has_setting else i
        values = tokens[start : start + width]
        row_starts = (
            name
            and (not has_setting or _SETTING.match(tokens[i]))
            and len(values) == width
            and all(_VALUE.match(v) for v in values)
        )
        if row_starts:
            rows.append((" ".join(name), tokens[i] if has_setting else None, values))
            name = []
            i = start + width
        else:
            name.append(tokens[i])
            i += 1
    if name:
        raise ValueError(f"unparsed tokens at the end of a table: {' '.join(name)!r}")
    return rows


def _record(
    paper: str,
    table: str,
    method: str,
    setting: str | None,
    columns: Mapping[str, tuple[str, ...]],
    values: list[str],
) -> list[dict[str, Any]]:
    out = []
    for dataset, names in columns.items():
        chunk, values = values[: len(names)], values[len(names) :]
        metrics = {k: float(v) for k, v in zip(names, chunk, strict=True) if v != "-"}
        if metrics:
            out.append(
                {
                    "paper": paper,
                    "table": table,
                    "row": method,
                    "setting": setting,
                    "dataset": dataset,
                    "metrics": metrics,
                }
            )
    return out


def parse_ssr_table(text: str, number: int) -> list[dict[str, Any]]:
    """Rows of SSR Table 1 (Dim) or 2 (Setting): R@K and NMI on CUB, Cars and SOP."""
    out: list[dict[str, Any]] = []
    body = _table_body(text, number, "R@1 R@10 R@100 R@1000 NMI ")
    for method, setting, values in _rows(body, 15, has_setting=True):
        out += _record(SSR, f"Table {number}", method, setting, _RK, values)
    return out


def parse_ssr(text: str) -> list[dict[str, Any]]:
    """Every row of the SSR paper's Tables 1 (Dim), 2 (Setting) and 3 (MAP, RP at R128)."""
    out = parse_ssr_table(text, 1) + parse_ssr_table(text, 2)
    body = _table_body(text, 3, "MAP RP MAP RP MAP RP ")
    for method, _, values in _rows(body, 6, has_setting=False):
        out += _record(SSR, "Table 3", method, "R128", _RANKING, values)
    return out


def parse_idml_text(text: str) -> list[dict[str, Any]]:
    """IDML-ProxyAnchor and ProxyAnchor R@1 and MAP@R from the IDML paper's Sec. IV prose."""
    pct = r"\$?([\d.]+)\$?\\?%\$?"
    claim = re.search(
        rf"{pct}, {pct}, and {pct} at Recall@1 and {pct}, {pct}, and {pct} at M@R", text
    )
    gain = re.search(
        rf"surpasses the original performance by {pct}, {pct}, and {pct} at Recall@1 and "
        rf"{pct}, {pct}, and {pct} at M@R",
        text,
    )
    if claim is None or gain is None:
        raise ValueError("the IDML-ProxyAnchor sentence of Sec. IV was not found in the seed text")
    idml = [float(v) for v in claim.groups()]
    delta = [float(v) for v in gain.groups()]
    out = []
    for i, dataset in enumerate(("cub", "cars", "sop")):
        r1, mapr = idml[i], idml[3 + i]
        base_r1, base_mapr = round(r1 - delta[i], 1), round(mapr - delta[3 + i], 1)
        for row, metrics in (
            ("IDML-ProxyAnchor", {"recall@1": r1, "map@r": mapr}),
            ("ProxyAnchor (IDML minus the stated gain)", {"recall@1": base_r1, "map@r": base_mapr}),
        ):
            out.append(
                {
                    "paper": IDML,
                    "table": "Sec. IV text",
                    "row": row,
                    "setting": "R512",
                    "dataset": dataset,
                    "metrics": metrics,
                }
            )
    return out


def parse_readme_csv(path: Path) -> list[dict[str, Any]]:
    """The IDML-ProxyAnchor rows of the authors' README (blank cells are not reported)."""
    out = []
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            metrics = {
                k: float(v)
                for k, v in row.items()
                if k not in ("dataset", "method", "backbone", "embedding_dim") and v
            }
            out.append(
                {
                    "paper": README,
                    "table": "Results",
                    "row": row["method"],
                    "setting": f"R{row['embedding_dim']}",
                    "dataset": row["dataset"],
                    "metrics": metrics,
                }
            )
    return out


def parse_all(shared: Path) -> list[dict[str, Any]]:
    """Every published row of every source under ``shared`` (seeds/ and published/)."""
    seeds = shared / "seeds"
    ssr = (seeds / "002_6859ff73e889d62e.txt").read_text()
    idml = (seeds / "000_def8003a61007ac8.txt").read_text()
    return (
        parse_ssr(ssr)
        + parse_idml_text(idml)
        + parse_readme_csv(shared / "published" / "idml_proxy_anchor.csv")
    )


def main(argv: list[str]) -> None:
    shared = Path(argv[0]) if argv else ROOT.parent / "shared"
    if not (shared / "seeds").is_dir():
        sys.exit(f"{shared}/seeds not found; pass the folder holding seeds/ and published/")
    rows = parse_all(shared)
    OUT.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    print(f"wrote {len(rows)} rows to {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main(sys.argv[1:])
