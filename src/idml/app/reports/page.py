"""``idml report``: one offline HTML page (plus its PNG figures) for one or several runs.

The page leads with the answer: the seed table (each recipe's mean ± std over its seeds, the
reference first, Δ against it with its 95 % interval, marked better or worse where a test over the
seeds finds it significant after Holm's correction over the table) with its Recall@K figure and the
papers' numbers; a single run has no seed table, its own numbers are the answer. Then the runs one
by one: a comparison of every run (tables of its method and test metrics, Recall@K dots,
precision–recall curves) and a section per run — training curves, the
uncertainty trend of original vs mixed training images (Wang et al. 2022, Fig. 7), the histogram
of test-set uncertainty levels of original vs mixed test images (Fig. 9), a top-5 retrieval grid
(Fu et al. 2021, Fig. 5) and a t-SNE of test embeddings. With several runs these are collapsed
(``<details>``, one click opens each), so a grid of eight arms is a page of its table, not 30,000 px
of figures. What a run cannot show (no uncertainty head, SSR off, no checkpoint) is said in words
instead of drawn as an empty plot.

The page fits a 1400 px screen: wide tables are split by metric family, each repeating the row
labels (:mod:`idml.app.reports.tables`), and numbers keep the precision their spread needs. It
needs no network and no JavaScript: figures are PNG files beside it (``figures/``), or also
embedded as ``data:`` URIs with ``inline=True``.
"""

from __future__ import annotations

import datetime
import html
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from idml.app.checkpoint import atomic_write_text
from idml.app.metric_display import format_metric, metric_heading, metric_sort_key, table_decimals
from idml.app.reports import figures
from idml.app.reports.runs import AnalysisOptions, RunLog, TestAnalysis, analyse_run, read_run
from idml.app.reports.sections import PageFigures, RunReport, collapsible, note, run_section
from idml.app.reports.seeds import expand_run_dirs, seed_table, seeds_section
from idml.app.reports.tables import Cell, html_table, split_columns, text_cell

RUN_METRICS_PER_TABLE = 9
"""Metric columns per table of the run comparison (one column each): fits 1400 px."""

__all__ = ["RunReport", "write_report"]

# Fits 1400 px: the body is at most 1200 px wide; number cells never wrap (the tables are split
# instead), labels wrap; figures shrink to the column; long words (paths) break.
_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222;
       padding: 0 1em; overflow-wrap: anywhere; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #ccc; margin-top: 2em; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }
caption { text-align: left; font-size: 0.85em; color: #555; padding-bottom: 0.2em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: right; white-space: nowrap;
         overflow-wrap: normal; }
th { background: #f3f3f3; white-space: normal; }  /* a long heading wraps; numbers never */
td.text, th.text { text-align: left; white-space: normal; max-width: 24em;
                   overflow-wrap: break-word; }
td.significant { font-weight: bold; }
td .interval { font-size: 0.85em; font-weight: normal; color: #555; }
figure { margin: 1em 0; } figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { font-size: 0.85em; color: #555; }
p.note { background: #fff8e1; border-left: 4px solid #f0b400; padding: 0.4em 0.8em; }
.meta { color: #666; font-size: 0.85em; }
details { margin: 1em 0; border-top: 1px solid #ccc; }
details > summary { cursor: pointer; font-size: 1.25em; font-weight: bold; padding: 0.5em 0; }
details > summary .meta { font-weight: normal; }
"""

_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>{title}</title>
<style>{style}</style>
</head>
<body>
<h1>{title}</h1>
<p class="meta">{meta}</p>
{body}
</body>
</html>
"""


def write_report(
    run_dirs: Sequence[Path],
    out_dir: Path,
    options: AnalysisOptions | None = None,
    analyse: bool = True,
    inline: bool = False,
    device: torch.device | None = None,
    progress: bool = False,
    log: Callable[[str], object] = lambda _: None,
    reference: str | None = None,
    sections_per_group: int | None = None,
    on_skip: Callable[[str], object] = lambda _: None,
) -> Path:
    """Write ``out_dir/index.html`` and ``out_dir/figures/*.png`` for the given run folders.

    Args:
        run_dirs: run folders written by ``idml train`` or ``idml ablate`` folders (at least one).
        out_dir: where the page and its figures go (created).
        options: test-set analysis settings (checkpoint, queries, sample sizes, seed).
        analyse: load each run's checkpoint and analyse the test split; ``False`` draws only what
            the logs hold (training curves, uncertainty trend, Recall@K of the last evaluation).
        inline: also embed every figure in the page as a base64 ``data:`` URI (one-file page).
        device: where to embed test images (default CPU).
        progress: progress bars while embedding.
        log: receives a line per run analysed.
        reference: label of the group the seed table's Δ is taken against (default: the
            baseline; see :mod:`idml.app.reports.seeds`).
        sections_per_group: analyse and draw at most this many runs of each seed group (the
            first seeds); every run still counts in the comparison and seed tables (``None``: all).
        on_skip: hears, in one line each, of every part of the page that could not be made (a
            run whose checkpoint cannot be read): the page notes it too, but a person reads the
            terminal (``idml report`` prints them, and fails with ``--strict``).

    Returns:
        The path of the HTML page.
    """
    from idml.app.checkpoint import CheckpointError

    if not run_dirs:
        raise ValueError("give at least one run folder to report on")
    options = options or AnalysisOptions()
    run_dirs, cells = expand_run_dirs(run_dirs)
    runs = [read_run(Path(d)) for d in run_dirs]
    # Fails before the test-set analysis (minutes) when --reference names no group.
    seeds = seed_table(runs, [cells.get(r.run_dir, r.config.name) for r in runs], reference)
    reports = [RunReport(run, label, None) for run, label in zip(runs, _labels(runs), strict=True)]
    if sections_per_group is not None and sections_per_group < 1:
        raise ValueError(f"sections_per_group must be >= 1, got {sections_per_group}")
    detailed = {run.run_dir for group in seeds.groups for run in group.runs[:sections_per_group]}
    for report in reports:
        if report.log.run_dir not in detailed:
            continue
        if not analyse:
            missing = report.log.config.task.spec.without_analysis()
            report.notes.append(
                "Test-set analysis was not requested (--no-test): metrics are those of the last "
                f"logged evaluation; {missing}."
            )
            continue
        try:
            report.analysis = analyse_run(report.log, options, device, progress)
        except CheckpointError as err:
            report.notes.append(f"No test-set analysis: {err}")
            on_skip(f"{report.label}: no test-set analysis: {err}")
            continue
        log(
            f"analysed {report.label}: {report.analysis.checkpoint} checkpoint, "
            f"epoch {report.analysis.epoch}"
        )

    out_dir = Path(out_dir)
    figure_dir = out_dir / "figures"
    figure_dir.mkdir(parents=True, exist_ok=True)
    page = PageFigures(out_dir, inline)
    # Seeds of one recipe averaged: the seed table is the answer and leads; the single runs
    # follow, collapsed. One run (or one seed each): its own numbers lead, open. One run alone has
    # nothing to compare: no seed table, only the paper's numbers after its own, if it has any.
    averaged = any(len(g.runs) > 1 for g in seeds.groups)
    body = [seeds_section(seeds)] if seeds.compares else []
    if averaged and any(k.startswith("recall@") for k in seeds.metrics):
        labels = [g.label for g in seeds.groups]
        means = [{k: g.mean_std(k)[0] for k in seeds.metrics} for g in seeds.groups]
        stds = [{k: g.mean_std(k)[1] for k in seeds.metrics} for g in seeds.groups]
        caption = "Recall@K per group: mean over seeds with ± sample std; axes zoomed to the data."
        body.append(page.figure(figures.recall_dots(labels, means, stds), "00-seeds", caption))
    comparison = _comparison(reports, page)
    runs_heading = (
        f"Every run ({len(reports)}): method and test metrics of each"
        if len(reports) > 1
        else "The run: method and test metrics"
    )
    body.append(collapsible(runs_heading, comparison, opened=not averaged))
    if not seeds.compares:
        body.append(seeds_section(seeds))
    atomic_write_text(out_dir / "seeds.md", seeds.markdown())
    atomic_write_text(out_dir / "seeds.csv", seeds.csv())
    shown = [report for report in reports if report.log.run_dir in detailed]
    body += [run_section(i, report, page, opened=len(shown) == 1) for i, report in enumerate(shown)]
    title = "idml report: " + (
        ", ".join(r.label for r in reports)
        if len(reports) <= 4
        else f"{len(reports)} runs of {len(seeds.groups)} recipes"
    )
    stamp = datetime.datetime.now().isoformat(timespec="seconds")
    from idml import __version__

    meta = f"Generated {stamp} by idml {__version__} from {len(reports)} run(s)."
    index = out_dir / "index.html"
    atomic_write_text(
        index,
        _PAGE.format(
            title=html.escape(title),
            style=_STYLE,
            meta=html.escape(meta),
            body="\n".join(p for p in body if p),
        ),
    )
    return index


def _labels(runs: Sequence[RunLog]) -> list[str]:
    """Distinct display names: the shortest ending of the folder paths that tells the runs apart
    (``seed0``, else ``base/seed0``, ``s3/cells/base/seed0``, ...), numbered if none does."""
    parts = [run.run_dir.parts or (str(run.run_dir),) for run in runs]
    for depth in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [f"{i + 1}: {label}" for i, label in enumerate(labels)]


def _metric_keys(reports: Sequence[RunReport]) -> list[str]:
    keys = {k for r in reports for k in r.metrics}
    return sorted(keys, key=metric_sort_key)


def _comparison(reports: Sequence[RunReport], page: PageFigures) -> str:
    """Every run: what it is (method, data, epochs, where its metrics come from, time) and its
    test metrics, in tables split by metric family; Recall@K dots and precision–recall curves."""
    runs = []
    for report in reports:
        cfg = report.log.config
        if report.analysis is not None:
            source = f"{report.analysis.checkpoint} checkpoint, epoch {report.analysis.epoch}"
        else:
            source = "last logged evaluation" if report.metrics else "not evaluated"
        if report.log.nmi_method is not None:
            source += f"; NMI: {report.log.nmi_method}"  # the analysis uses the same k-means
        runs.append(
            [
                text_cell(report.label),
                text_cell(report.log.method),
                text_cell(f"{cfg.data.dataset}, {cfg.model.backbone}, d={cfg.model.embedding_dim}"),
                Cell(f"{len(report.log.history)}/{cfg.optim.epochs}"),
                text_cell(source),
                Cell(f"{report.log.training_seconds:.1f}"),
            ]
        )
    head = ["run", "method", "data, backbone", "epochs", "metrics from", "train time (s)"]
    tables = [
        html_table(
            [text_cell(h) if i != 3 and i != 5 else Cell(h) for i, h in enumerate(head)], runs
        )
    ]
    keys = _metric_keys(reports)
    digits = table_decimals({k: [r.metrics[k] for r in reports if k in r.metrics] for k in keys})
    for caption, chunk in split_columns(keys, RUN_METRICS_PER_TABLE):
        rows = [
            [text_cell(report.label)]
            + [
                Cell(
                    format_metric(k, report.metrics[k], **digits[k]) if k in report.metrics else "–"
                )
                for k in chunk
            ]
            for report in reports
        ]
        tables.append(
            html_table([text_cell("run"), *(Cell(metric_heading(k)) for k in chunk)], rows, caption)
        )
    parts = ["\n".join(tables)]
    # Recall@K and precision–recall are retrieval results: a report of runs whose tasks report
    # no Recall@K (classification) has none to miss.
    retrieval = any(
        any(
            name.startswith("recall@") for name in r.log.config.task.spec.metric_names(r.log.config)
        )
        for r in reports
    )
    names = [r.label for r in reports]
    if any(k.startswith("recall@") for k in keys):
        dots = figures.recall_dots(names, [r.metrics for r in reports])
        parts.append(
            page.figure(
                dots,
                "00-recall",
                "Recall@K on the test split, per run; each panel's axis is zoomed to the data.",
            )
        )
    elif retrieval:
        parts.append(note("No run has Recall@K results yet, so there are no Recall@K bars."))
    curves = [
        (r.label, r.analysis.pr_curve) for r in reports if isinstance(r.analysis, TestAnalysis)
    ]
    if curves:
        figure = figures.pr_curves([c[0] for c in curves], [c[1] for c in curves])
        parts.append(
            page.figure(
                figure,
                "00-precision-recall",
                "Interpolated precision at recall 0, 0.1, …, 1 over each query's ranked test "
                "gallery, averaged over queries (TREC 11-point curve).",
            )
        )
    elif retrieval:
        parts.append(
            note("No precision–recall curve: it needs the test-set analysis of a checkpoint.")
        )
    return "\n".join(parts)
