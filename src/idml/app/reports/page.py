"""``idml report``: one offline HTML page (plus its PNG figures) for one or several runs.

The page has a comparison section (a table of every run's method and test metrics, Recall@K bars and
precision–recall curves) and a section per run: training curves, the uncertainty trend of original
vs mixed training images (Wang et al. 2022, Fig. 7), the histogram of test-set uncertainty levels of
original vs mixed test images (Fig. 9), a top-5 retrieval grid (Fu et al. 2021, Fig. 5) and a t-SNE
of test embeddings. What a run cannot show (no uncertainty head, SSR off, no checkpoint) is said in
words instead of drawn as an empty plot. The page needs no network and no JavaScript: figures are
PNG files beside it (``figures/``), or also embedded as ``data:`` URIs with ``inline=True``.
"""

from __future__ import annotations

import datetime
import html
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from idml.app.checkpoint import atomic_write_text
from idml.app.metric_display import format_metric, metric_heading, metric_sort_key
from idml.app.reports import figures
from idml.app.reports.runs import AnalysisOptions, RunLog, TestAnalysis, analyse_run, read_run
from idml.app.reports.sections import PageFigures, RunReport, note, run_section
from idml.app.reports.seeds import expand_run_dirs, seed_table, seeds_section

__all__ = ["RunReport", "write_report"]

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222;
       padding: 0 1em; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #ccc; margin-top: 2em; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: right; }
th { background: #f3f3f3; } td.text, th.text { text-align: left; }
figure { margin: 1em 0; } figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { font-size: 0.85em; color: #555; }
p.note { background: #fff8e1; border-left: 4px solid #f0b400; padding: 0.4em 0.8em; }
.meta { color: #666; font-size: 0.85em; }
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
    body = [_comparison(reports, page), seeds_section(seeds)]
    if any(len(g.runs) > 1 for g in seeds.groups) and any(
        k.startswith("recall@") for k in seeds.metrics
    ):
        labels = [g.label for g in seeds.groups]
        means = [{k: g.mean_std(k)[0] for k in seeds.metrics} for g in seeds.groups]
        stds = [{k: g.mean_std(k)[1] for k in seeds.metrics} for g in seeds.groups]
        caption = "Recall@K per group: mean over seeds with ± sample std; axes zoomed to the data."
        body.append(page.figure(figures.recall_dots(labels, means, stds), "00-seeds", caption))
    atomic_write_text(out_dir / "seeds.md", seeds.markdown())
    atomic_write_text(out_dir / "seeds.csv", seeds.csv())
    shown = [report for report in reports if report.log.run_dir in detailed]
    body += [run_section(i, report, page) for i, report in enumerate(shown)]
    title = "idml report: " + ", ".join(r.label for r in reports)
    stamp = datetime.datetime.now().isoformat(timespec="seconds")
    from idml import __version__

    meta = f"Generated {stamp} by idml {__version__} from {len(reports)} run(s)."
    index = out_dir / "index.html"
    atomic_write_text(
        index,
        _PAGE.format(
            title=html.escape(title), style=_STYLE, meta=html.escape(meta), body="\n".join(body)
        ),
    )
    return index


def _labels(runs: Sequence[RunLog]) -> list[str]:
    """Distinct display names: the folder name, with its parent when folder names repeat."""
    labels = [run.run_dir.name or str(run.run_dir) for run in runs]
    if len(set(labels)) < len(labels):
        labels = [f"{run.run_dir.parent.name}/{run.run_dir.name}" for run in runs]
    if len(set(labels)) < len(labels):
        labels = [f"{i + 1}: {label}" for i, label in enumerate(labels)]
    return labels


def _metric_keys(reports: Sequence[RunReport]) -> list[str]:
    keys = {k for r in reports for k in r.metrics}
    return sorted(keys, key=metric_sort_key)


def _comparison(reports: Sequence[RunReport], page: PageFigures) -> str:
    keys = _metric_keys(reports)
    head = "".join(f"<th>{html.escape(metric_heading(k))}</th>" for k in keys)
    rows = []
    for report in reports:
        cfg = report.log.config
        if report.analysis is not None:
            source = f"{report.analysis.checkpoint} checkpoint, epoch {report.analysis.epoch}"
        else:
            source = "last logged evaluation" if report.metrics else "not evaluated"
        if report.log.nmi_method is not None:
            source += f"; NMI: {report.log.nmi_method}"  # the analysis uses the same k-means
        cells = "".join(
            f"<td>{format_metric(k, report.metrics[k])}</td>"
            if k in report.metrics
            else "<td>–</td>"
            for k in keys
        )
        rows.append(
            f'<tr><td class="text">{html.escape(report.label)}</td>'
            f'<td class="text">{html.escape(report.log.method)}</td>'
            f'<td class="text">{html.escape(cfg.data.dataset)}, {html.escape(cfg.model.backbone)}, '
            f"d={cfg.model.embedding_dim}</td>"
            f"<td>{len(report.log.history)}/{cfg.optim.epochs}</td>"
            f'<td class="text">{html.escape(source)}</td>{cells}'
            f"<td>{report.log.training_seconds:.1f}</td></tr>"
        )
    table = (
        '<table><tr><th class="text">run</th><th class="text">method</th>'
        '<th class="text">data, backbone</th><th>epochs</th><th class="text">metrics from</th>'
        f"{head}<th>train time (s)</th></tr>\n" + "\n".join(rows) + "</table>"
    )
    parts = ["<h2>Comparison</h2>", table]
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
