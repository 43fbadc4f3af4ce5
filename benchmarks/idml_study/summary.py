"""The README's table of every cell of the study, drawn from the committed study tables
(``benchmarks/study/idml_*.md``) so that its numbers cannot drift from the evidence.

A cell is one setting × loss × variant: a row of the README's table, read from the comparisons one
study table holds for one group (a loss, or a degradation). Each column is a comparison that
isolates ISM — ISM against the baseline, IDML against Mixup only, against its own ``u`` frozen and
against the same weakening applied uniformly — given as Δ MAP@R with the table's own ▲/▼ (Holm
within that table), and R@1 beside it where R@1 is beyond noise. ``python benchmarks/study_idml.py
summary`` rewrites the README's block between :data:`BEGIN` and :data:`END`; a cell is added by a
line in :data:`CELLS`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

from idml_study.design import (
    ARMS,
    COMPARISONS,
    DEGRADATION_ARMS,
    DEGRADATION_COMPARISONS,
    DETACHED_COMPARISONS,
    REPO,
    RUNNING_DETACHED_COMPARISONS,
    SETTINGS,
    TABLES,
    U_HIGH_COMPARISONS,
    Arm,
    controls_of,
)

README = REPO / "README.md"
BEGIN = (
    "<!-- study summary: drawn from benchmarks/study by `python benchmarks/study_idml.py "
    "summary`; add a cell in benchmarks/idml_study/summary.py, never edit here -->"
)
END = "<!-- end of study summary -->"
CLAIM_SEEDS = 10
"""Seeds per arm a claim needs; a cell compared on fewer says how many."""
HEADER = (
    "| setting · loss · `u` starts at | ISM acts (q10 / q50) | ISM only − baseline | "
    "IDML − Mixup only | IDML − `u` frozen | IDML − uniform weakening |",
    "| --- | --- | --- | --- | --- | --- |",
)


@dataclass(frozen=True)
class Family:
    """Which comparisons of a study table fill a row's four columns (``None``: the table has no
    such arm, the cell stays empty), and the arm whose weakening "ISM acts" shows."""

    ism_only: str | None
    vs_mixup: str | None
    vs_frozen: str
    vs_uniform: str
    acting: str

    @property
    def columns(self) -> tuple[str | None, ...]:
        return (self.ism_only, self.vs_mixup, self.vs_frozen, self.vs_uniform)


def family(
    comparisons: Sequence[tuple[str, str, str]],
    arms: Mapping[str, Arm],
    acting: str,
    ism_only: tuple[str, str] | None = None,
    mixup: str | None = None,
) -> Family:
    """The columns of an ISM arm ``acting`` and its two controls, found in ``arms`` as
    :func:`~idml_study.design.with_controls` made them (the same arm with ``u`` frozen; no head with
    γ matched to it), each as ``comparisons`` labels it; ``ism_only`` is the ``(reference, arm)``
    that column compares, ``mixup`` the Mixup-only arm ``acting`` is compared with."""

    def label(reference: str, arm: str) -> str:
        (name,) = [name for name, ref, a in comparisons if (ref, a) == (reference, arm)]
        return name

    frozen, uniform = controls_of(arms, acting)
    return Family(
        label(*ism_only) if ism_only else None,
        label(mixup, acting) if mixup else None,
        label(frozen, acting),
        label(uniform, acting),
        arms[acting].label,
    )


MAIN = family(COMPARISONS, ARMS, "idml", ("baseline", "ism"), mixup="mixup")
U_HIGH = family(U_HIGH_COMPARISONS, ARMS, "idml_u_high", mixup="mixup")
DETACHED = family(DETACHED_COMPARISONS, ARMS, "idml_detached", mixup="mixup")
RUNNING_DETACHED = family(
    RUNNING_DETACHED_COMPARISONS, ARMS, "idml_running_detached", mixup="mixup"
)
DEGRADED = family(DEGRADATION_COMPARISONS, DEGRADATION_ARMS, "deg_ism", ("deg_baseline", "deg_ism"))
DEGRADED_U_HIGH = family(
    DEGRADATION_COMPARISONS,
    DEGRADATION_ARMS,
    "deg_ism_u_high",
    ("deg_baseline", "deg_ism_u_high"),
)


@dataclass(frozen=True)
class Cell:
    """A row of the README's table: its label, the study table and group (the first column) it is
    read from, which comparisons (``family``), and a mark put after each number (the footnote that
    says the columns mean something else there)."""

    label: str
    table: str
    group: str
    family: Family = MAIN
    mark: str = ""


DIGITS, OMNIGLOT, LITE0 = "idml_demo.md", "idml_omniglot_cnn.md", "idml_omniglot_lite0_"
DEGRADATION_TABLE = "idml_omniglot_cnn_degradations.md"
LITE0_DEGRADATION_TABLE = LITE0 + "degradations.md"
CELLS: tuple[Cell, ...] = (
    Cell("digits · Multi-Similarity · 0.02", DIGITS, "Multi-Similarity"),
    Cell("digits · ProxyAnchor · 0.02", DIGITS, "ProxyAnchor"),
    Cell("digits · Contrastive · 0.02", DIGITS, "Contrastive"),
    Cell("digits · Multi-Similarity · 0.25", DIGITS, "Multi-Similarity", U_HIGH),
    Cell("digits · ProxyAnchor · 0.25", DIGITS, "ProxyAnchor", U_HIGH),
    Cell("digits · Contrastive · 0.25", DIGITS, "Contrastive", U_HIGH),
    Cell("Omniglot · Multi-Similarity · 0.02", OMNIGLOT, "Multi-Similarity"),
    Cell("Omniglot · Multi-Similarity · 0.25", OMNIGLOT, "Multi-Similarity", U_HIGH),
    Cell("Omniglot · ProxyAnchor · 0.02", OMNIGLOT, "ProxyAnchor"),
    Cell("Omniglot · ProxyAnchor · 0.25", OMNIGLOT, "ProxyAnchor", U_HIGH),
    Cell(
        "Omniglot · ProxyAnchor · 0.02, 20 epochs",
        "idml_omniglot_cnn_proxy_anchor_20_epochs.md",
        "ProxyAnchor",
    ),
    Cell(
        "Omniglot · ProxyAnchor · 0.02, 160 epochs (converged)",
        "idml_omniglot_cnn_proxy_anchor_160_epochs.md",
        "ProxyAnchor",
    ),
    Cell(
        "Omniglot · Multi-Similarity · 0.02, 20 epochs",
        "idml_omniglot_cnn_multi_similarity_20_epochs.md",
        "Multi-Similarity",
    ),
    Cell(
        "Omniglot · Multi-Similarity · 0.02, 80 epochs (converged)",
        "idml_omniglot_cnn_multi_similarity_80_epochs.md",
        "Multi-Similarity",
    ),
    Cell("Omniglot · Contrastive · 0.02", OMNIGLOT, "Contrastive"),
    Cell(
        "Omniglot · Contrastive · 0.02, 20 epochs",
        "idml_omniglot_cnn_contrastive_20_epochs.md",
        "Contrastive",
    ),
    Cell(
        "Omniglot · Contrastive · 0.02, 40 epochs (converged) §",
        "idml_omniglot_cnn_contrastive_40_epochs.md",
        "Contrastive",
    ),
    Cell(
        "Omniglot · Contrastive · 0.02, 40 epochs, head detached from the backbone",
        "idml_omniglot_cnn_contrastive_40_epochs.md",
        "Contrastive",
        DETACHED,
    ),
    Cell(
        "Omniglot · Contrastive · 0.02, 40 epochs, head detached, level as at test",
        "idml_omniglot_cnn_contrastive_40_epochs.md",
        "Contrastive",
        RUNNING_DETACHED,
    ),
    Cell(
        "Omniglot · Contrastive · 0.02, 40 epochs, IDML's validated m_pos 0.1 §",
        "idml_omniglot_cnn_contrastive_idml_recipe.md",
        "Contrastive",
    ),
    Cell(
        "Omniglot, pretrained Lite0 · Multi-Similarity · 0.02, 8 epochs",
        LITE0 + "multi_similarity_8_epochs.md",
        "Multi-Similarity",
    ),
    Cell(
        "Omniglot, pretrained Lite0 · ProxyAnchor · 0.02, 16 epochs ‡",
        LITE0 + "proxy_anchor_16_epochs.md",
        "ProxyAnchor",
    ),
    Cell(
        "Omniglot, pretrained Lite0 · Multi-Similarity · 0.02, 16 epochs",
        LITE0 + "multi_similarity_16_epochs.md",
        "Multi-Similarity",
    ),
    Cell(
        "Omniglot, pretrained Lite0 · Contrastive · 0.02, 64 epochs",
        LITE0 + "contrastive_64_epochs.md",
        "Contrastive",
    ),
    Cell(
        "Omniglot, low-res training · Multi-Similarity · 0.02",
        DEGRADATION_TABLE,
        "low_resolution",
        DEGRADED,
        "†",
    ),
    Cell(
        "Omniglot, low-res training · Multi-Similarity · 0.25",
        DEGRADATION_TABLE,
        "low_resolution",
        DEGRADED_U_HIGH,
        "†",
    ),
    Cell(
        "Omniglot, blurred training · Multi-Similarity · 0.02",
        DEGRADATION_TABLE,
        "blur",
        DEGRADED,
        "†",
    ),
    Cell(
        "Omniglot, occluded training · Multi-Similarity · 0.02",
        DEGRADATION_TABLE,
        "occlusion",
        DEGRADED,
        "†",
    ),
    Cell(
        "Omniglot, pretrained Lite0, low-res training · Multi-Similarity · 0.02, 16 epochs",
        LITE0_DEGRADATION_TABLE,
        "low_resolution",
        DEGRADED,
        "†",
    ),
    Cell(
        "Omniglot, pretrained Lite0, low-res training · Multi-Similarity · 0.25, 16 epochs",
        LITE0_DEGRADATION_TABLE,
        "low_resolution",
        DEGRADED_U_HIGH,
        "†",
    ),
    Cell(
        "Omniglot, pretrained Lite0, occluded training · Multi-Similarity · 0.02, 16 epochs",
        LITE0_DEGRADATION_TABLE,
        "occlusion",
        DEGRADED,
        "†",
    ),
)


SUPERSEDED = (
    "superseded: measured with the old uncertainty head, whose u did not move, and baseline "
    "recipes that did not train"
)
SET_ASIDE: dict[str, str] = {
    "idml_demo_degradations.md": "the paper's Table 3 on digits: the degradations cost the "
    "baseline nothing measurable, so there is nothing for ISM to recover",
    "idml_fashion_lite0.md": SUPERSEDED,
    "idml_omniglot_lite0.md": SUPERSEDED,
    "idml_fashion_lite0_8_epochs.md": "no evidence either way: the validated baselines end below "
    "the training-free features in MAP@R on the test classes",
}
"""The study tables that are no row of the summary, each with the reason the README gives."""
STUDY_TABLE = re.compile(rf"idml_(?:{'|'.join(SETTINGS)})(?:_\w+)?\.md")
"""The names ``tables`` gives the tables it writes: ``idml_<setting>[_<label>].md``."""


def unsummarised(tables: Path = TABLES) -> list[str]:
    """The study tables in ``tables`` that no cell reads and :data:`SET_ASIDE` gives no reason for
    leaving out: a finished grid the README does not show yet."""
    read = {cell.table for cell in CELLS}
    return sorted(
        path.name
        for path in tables.glob("idml_*.md")
        if STUDY_TABLE.fullmatch(path.name) and path.name not in read | SET_ASIDE.keys()
    )


@dataclass(frozen=True)
class Delta:
    """One metric of a comparison as a study table prints it: the mean paired difference in points
    (as printed, two decimals) and its ▲/▼ (empty: not beyond noise after Holm)."""

    value: Decimal
    marker: str


@dataclass(frozen=True)
class Comparison:
    n: int
    recall_at_1: Delta
    map_at_r: Delta


@dataclass(frozen=True)
class StudyTable:
    """What the summary reads from a study table: each ``(group, comparison)``'s differences and
    each ``(group, arm)``'s weakening percentiles ("q10 / q50" as printed)."""

    comparisons: dict[tuple[str, str], Comparison]
    weakening: dict[tuple[str, str], str]


DIFFERENCE_COLUMNS = ("n", "Δ R@1 [95 % CI]", "Δ MAP@R [95 % CI]")
DELTA = re.compile(r"^([+-]\d+\.\d+)\s*([▲▼]?)\s*\[")


def _delta(text: str, where: str) -> Delta:
    match = DELTA.match(text)
    if match is None:
        raise ValueError(f"{where}: {text!r} is not a difference as the study tables print one")
    return Delta(Decimal(match[1]), match[2])


def markdown_tables(lines: Iterable[str]) -> list[list[dict[str, str]]]:
    """Every Markdown table in ``lines``, each as its rows keyed by the header's cells (a header
    cell that repeats, like the study tables' ``d_z`` and ``p (Holm)``, keys its last column; the
    summary reads neither).

    >>> markdown_tables(["text", "| | a |", "|---|---|", "| x | 1 |", "", "| b |", "|---|"])
    [[{'': 'x', 'a': '1'}], []]
    """
    tables: list[list[dict[str, str]]] = []
    header: list[str] | None = None
    previous = ""
    for line in lines:
        if line.startswith("|"):
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", line.strip()):
                header = [cell.strip() for cell in previous.strip().strip("|").split("|")]
                tables.append([])
            elif header is not None and tables and len(cells) == len(header):
                tables[-1].append(dict(zip(header, cells, strict=True)))
        else:
            header = None
        previous = line
    return tables


def read_study_table(path: Path) -> StudyTable:
    """The comparisons and the weakening percentiles of the study table at ``path``."""
    comparisons: dict[tuple[str, str], Comparison] = {}
    weakening: dict[tuple[str, str], str] = {}
    for table in markdown_tables(path.read_text().splitlines()):
        for row in table:
            group = next(iter(row.values()))
            if "comparison" in row:
                missing = [c for c in DIFFERENCE_COLUMNS if c not in row]
                if missing:
                    raise ValueError(
                        f"{path}: a differences table without the columns {missing}; the summary "
                        "reads the header `tables` writes (idml_study.tables.difference_table)"
                    )
                key = (group, row["comparison"])
                if key in comparisons:
                    raise ValueError(f"{path}: {key} appears twice")
                where = f"{path}, {group}, {row['comparison']}"
                comparisons[key] = Comparison(
                    int(row["n"]),
                    _delta(row["Δ R@1 [95 % CI]"], where),
                    _delta(row["Δ MAP@R [95 % CI]"], where),
                )
            elif "pos q10 / q50" in row:
                weakening[(group, row["arm"])] = row["pos q10 / q50"]
    return StudyTable(comparisons, weakening)


def points(value: Decimal) -> str:
    """A difference in points to one decimal (a half rounded away from zero, as the tables' two
    decimals are read by eye), with a real minus sign; no sign on zero.

    >>> [points(Decimal(x)) for x in ("-1.83", "0.04", "-0.04", "+0.85", "-1.25", "+3.79")]
    ['−1.8', '0.0', '0.0', '+0.9', '−1.3', '+3.8']
    """
    rounded = value.quantize(Decimal("0.1"), rounding=ROUND_HALF_UP)
    if rounded == 0:
        return "0.0"
    return f"{rounded:+}".replace("-", "−")


def column(comparison: Comparison, mark: str) -> str:
    """A column's text: Δ MAP@R (bold with its ▲/▼ where beyond noise), R@1 beside it where R@1 is,
    the seeds where fewer than a claim needs, then ``mark``."""
    map_at_r = comparison.map_at_r
    text = points(map_at_r.value)
    if map_at_r.marker:
        text = f"**{text} {map_at_r.marker}**"
    if comparison.recall_at_1.marker:
        recall = comparison.recall_at_1
        text += f" (R@1 {points(recall.value)} {recall.marker})"
    if comparison.n < CLAIM_SEEDS:
        text += f" ({comparison.n} seeds)"
    return f"{text} {mark}" if mark else text


def summary_row(cell: Cell, table: StudyTable, where: Path) -> str:
    """The README row of ``cell``, read from ``table`` (the study table at ``where``)."""
    weakening = table.weakening.get((cell.group, cell.family.acting))
    if weakening is None:
        raise ValueError(f"{where}: no weakening for {cell.group}, {cell.family.acting}")
    cells = [cell.label, weakening]
    for name in cell.family.columns:
        if name is None:
            cells.append("")
            continue
        comparison = table.comparisons.get((cell.group, name))
        if comparison is None:
            raise ValueError(f"{where}: no comparison {cell.group}, {name!r} for {cell.label!r}")
        cells.append(column(comparison, cell.mark))
    return "| " + " | ".join(cells) + " |"


def summary_table(cells: Sequence[Cell] = CELLS, tables: Path = TABLES) -> list[str]:
    """The README's block: the header and a row per cell, each read from its study table."""
    read: dict[str, StudyTable] = {}
    rows = list(HEADER)
    for cell in cells:
        path = tables / cell.table
        if cell.table not in read:
            read[cell.table] = read_study_table(path)
        rows.append(summary_row(cell, read[cell.table], path))
    return rows


def with_summary(readme: str, rows: Sequence[str]) -> str:
    """``readme`` with the block between :data:`BEGIN` and :data:`END` replaced by ``rows``."""
    if readme.count(BEGIN) != 1 or readme.count(END) != 1:
        raise ValueError(
            f"the README must hold the study summary's markers once each: {BEGIN!r} and {END!r}"
        )
    head, rest = readme.split(BEGIN)
    _, tail = rest.split(END)
    return head + BEGIN + "\n" + "\n".join(rows) + "\n" + END + tail


def summary(readme: Path = README) -> bool:
    """Rewrite ``readme``'s study summary from the study tables; ``True`` when it changed."""
    text = readme.read_text()
    updated = with_summary(text, summary_table())
    if updated != text:
        readme.write_text(updated)
    return updated != text
