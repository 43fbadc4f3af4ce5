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

import base64
import datetime
import html
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from matplotlib.figure import Figure

from idml.checkpoint import atomic_write_text
from idml.diagnostics import UncertaintyProbe
from idml.metric_display import format_metric, metric_heading, metric_sort_key
from idml.reports import figures
from idml.reports.classification import (
    CONFIDENCE_SCORES as CLASSIFICATION_SCORES,
)
from idml.reports.classification import (
    ClassificationAnalysis,
    analyse_classification_run,
)
from idml.reports.runs import AnalysisOptions, RunLog, TestAnalysis, analyse_run, read_run
from idml.reports.seeds import expand_run_dirs, seed_table, seeds_section

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


@dataclass
class RunReport:
    """One run's log, its test analysis (``None`` when skipped) and why things are missing."""

    log: RunLog
    label: str
    analysis: TestAnalysis | ClassificationAnalysis | None
    """:class:`TestAnalysis` of a metric-learning run, :class:`ClassificationAnalysis` of a
    classification run (``config.task``)."""
    notes: list[str] = field(default_factory=list)

    @property
    def metrics(self) -> dict[str, float]:
        """Test metrics of the analysed checkpoint, else of the last logged evaluation."""
        return self.analysis.metrics if self.analysis is not None else self.log.last_metrics


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
            baseline; see :mod:`idml.reports.seeds`).

    Returns:
        The path of the HTML page.
    """
    from idml.checkpoint import CheckpointError

    if not run_dirs:
        raise ValueError("give at least one run folder to report on")
    options = options or AnalysisOptions()
    run_dirs, cells = expand_run_dirs(run_dirs)
    runs = [read_run(Path(d)) for d in run_dirs]
    # Fails before the test-set analysis (minutes) when --reference names no group.
    seeds = seed_table(runs, [cells.get(r.run_dir, r.config.name) for r in runs], reference)
    reports = [RunReport(run, label, None) for run, label in zip(runs, _labels(runs), strict=True)]
    for report in reports:
        classification = report.log.config.task == "classification"
        if not analyse:
            missing = (
                "no confusion matrix, reliability diagram or mistakes"
                if classification
                else "no retrieval grid, test uncertainty or t-SNE"
            )
            report.notes.append(
                "Test-set analysis was not requested (--no-test): metrics are those of the last "
                f"logged evaluation; {missing}."
            )
            continue
        analyse_one = analyse_classification_run if classification else analyse_run
        try:
            report.analysis = analyse_one(report.log, options, device, progress)
        except CheckpointError as err:
            report.notes.append(f"No test-set analysis: {err}")
            continue
        log(
            f"analysed {report.label}: {report.analysis.checkpoint} checkpoint, "
            f"epoch {report.analysis.epoch}"
        )

    out_dir = Path(out_dir)
    figure_dir = out_dir / "figures"
    figure_dir.mkdir(parents=True, exist_ok=True)
    page = _Page(out_dir, inline)
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
    body += [_run_section(i, report, page) for i, report in enumerate(reports)]
    title = "idml report: " + ", ".join(r.label for r in reports)
    stamp = datetime.datetime.now().isoformat(timespec="seconds")
    from idml import __version__

    meta = f"Generated {stamp} by idml {__version__} from {len(reports)} run(s)."
    index = out_dir / "index.html"
    index.write_text(
        _PAGE.format(
            title=html.escape(title), style=_STYLE, meta=html.escape(meta), body="\n".join(body)
        ),
        encoding="utf-8",
    )
    return index


# --------------------------------------------------------------------------- page pieces
class _Page:
    """Writes figures into ``figures/`` and returns the ``<figure>`` markup that shows them."""

    def __init__(self, out_dir: Path, inline: bool) -> None:
        self.out_dir = out_dir
        self.inline = inline

    def figure(self, figure: Figure, name: str, caption: str) -> str:
        """Save ``figure`` as ``figures/<name>.png`` and return its escaped ``<figure>`` markup."""
        path = figures.save_png(figure, self.out_dir / "figures" / f"{name}.png")
        if self.inline:
            source = "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")
        else:
            source = f"figures/{path.name}"
        text = html.escape(caption)
        return (
            f'<figure><img src="{html.escape(source)}" alt="{text}">'
            f"<figcaption>{text}</figcaption></figure>"
        )


def _note(text: str) -> str:
    return f'<p class="note">{html.escape(text)}</p>'


def _labels(runs: Sequence[RunLog]) -> list[str]:
    """Distinct display names: the folder name, with its parent when folder names repeat."""
    labels = [run.run_dir.name or str(run.run_dir) for run in runs]
    if len(set(labels)) < len(labels):
        labels = [f"{run.run_dir.parent.name}/{run.run_dir.name}" for run in runs]
    if len(set(labels)) < len(labels):
        labels = [f"{i + 1}: {label}" for i, label in enumerate(labels)]
    return labels


def _slug(index: int, label: str) -> str:
    return f"{index + 1:02d}-" + re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("_")[:60]


def _metric_keys(reports: Sequence[RunReport]) -> list[str]:
    keys = {k for r in reports for k in r.metrics}
    return sorted(keys, key=metric_sort_key)


def _comparison(reports: Sequence[RunReport], page: _Page) -> str:
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
    # Recall@K and precision–recall are retrieval results: a report of classification runs alone
    # has none to miss.
    retrieval = any(r.log.config.task != "classification" for r in reports)
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
        parts.append(_note("No run has Recall@K results yet, so there are no Recall@K bars."))
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
            _note("No precision–recall curve: it needs the test-set analysis of a checkpoint.")
        )
    return "\n".join(parts)


_CONFIDENCE_SCORES = {
    "top1_cos": "top-1 cosine similarity",
    "norm_u": "−||u|| of the query",
    "combined": "mean rank of both",
}


def _confidence_table(
    qualities: dict[str, tuple[float, float]],
    oracle: float | None,
    answers: str,
    error: str,
    wrong_answers: str,
) -> str:
    """AUROC (detecting ``error``) and AURC (risk–coverage) of each confidence score.

    ``qualities`` maps a score's description to its ``(auroc, aurc)``; ``answers`` names what is
    answered ("queries", "test images") and ``wrong_answers`` the wrong ones.
    """
    rows = [
        f"<tr><td>{html.escape(name)}</td><td>{format_metric('auroc', auroc)}</td>"
        f"<td>{format_metric('aurc', aurc)}</td></tr>"
        for name, (auroc, aurc) in qualities.items()
    ]
    if not rows:
        return ""
    floor = (
        ""
        if oracle is None
        else f" The best any score could reach: AURC {format_metric('aurc', oracle)}."
    )
    return (
        f"<table><tr><th>confidence score</th><th>AUROC ({html.escape(error)})</th>"
        f"<th>{metric_heading('aurc')}</th></tr>"
        + "".join(rows)
        + "</table>"
        + _note(
            f"AUROC: how well the score ranks {wrong_answers} below right ones (0.5 = chance). "
            f"AURC: mean error rate when only the most confident {answers} are answered, over all "
            f"coverage levels (lower is better).{floor}"
        )
    )


def _retrieval_confidence(metrics: dict[str, float]) -> str:
    """The confidence table of a metric-learning run, from its ``auroc_*``/``aurc_*`` metrics."""
    qualities = {}
    for key, name in _CONFIDENCE_SCORES.items():
        auroc, aurc = metrics.get(f"auroc_{key}"), metrics.get(f"aurc_{key}")
        if auroc is not None and aurc is not None:
            qualities[name] = (auroc, aurc)
    return _confidence_table(
        qualities, metrics.get("aurc_oracle"), "queries", "wrong top-1", "wrong top-1 answers"
    )


def _conditions_figure(probe: UncertaintyProbe, slug: str, page: _Page) -> str:
    """||u|| of the same test images clean and altered, with each alteration's AUROC."""
    return page.figure(
        figures.uncertainty_by_condition(
            {k: v.numpy() for k, v in probe.levels.items()}, probe.auroc
        ),
        f"{slug}-uncertainty-conditions",
        f"||u|| of {probe.levels['clean'].numel()} test images, clean and altered (Mixup with a "
        "random partner, low resolution ÷4, blur σ 2, a quarter occluded); AUROC: how often the "
        "altered image gets the larger ||u||.",
    )


def _run_section(index: int, report: RunReport, page: _Page) -> str:
    run, analysis = report.log, report.analysis
    cfg = run.config
    slug = _slug(index, report.label)
    batch = cfg.sampler.effective_batch_size
    parts = [
        f"<h2>Run {html.escape(report.label)}</h2>",
        f'<p class="meta">Folder {html.escape(str(run.run_dir))}; name {html.escape(cfg.name)}; '
        f"{html.escape(run.method)}; batch {batch}; seed {cfg.seed}.</p>",
        *(_note(text) for text in report.notes),
        "<h3>Training curves</h3>",
        page.figure(
            figures.training_curves(run),
            f"{slug}-curves",
            "Mean training losses, test metrics (evaluated epochs) and learning rates per epoch.",
        ),
    ]
    if not run.ssr_enabled:
        parts.append(_note("SSR was off in this run, so there is no ranking-loss curve."))

    parts.append("<h3>Uncertainty during training</h3>")
    if run.has_uncertainty:
        parts.append(
            page.figure(
                figures.uncertainty_trend(run),
                f"{slug}-uncertainty-trend",
                "Mean uncertainty level ||u|| of original and mixed training images per epoch "
                "(IDML paper, Fig. 7).",
            )
        )
        if not run.mixup_enabled:
            parts.append(_note("Mixup was off in training, so only original images appear."))
    if run.keys("ism/pos_q50") or run.keys("ism/neg_q50"):
        parts.append("<h3>Is ISM working? Saturation of the weakening</h3>")
        parts.append(
            page.figure(
                figures.ism_saturation(run),
                f"{slug}-ism-saturation",
                "ISM's weakening factor e^(-y) of positive and negative relations over each "
                "training epoch (1: the plain metric; near 0: the pair is saturated, its "
                "similarity pinned and its gradient gone) and the share of saturated relations.",
            )
        )
    else:
        parts.append(
            _note(
                "This run has no uncertainty head (plain metric), so there is no uncertainty "
                "level to follow during training."
            )
        )

    if analysis is None:
        return "\n".join(parts)
    if isinstance(analysis, ClassificationAnalysis):
        parts.append(_classification_section(analysis, slug, page))
        return "\n".join(parts)
    parts.append("<h3>Test-set uncertainty</h3>")
    if analysis.uncertainty is not None:
        parts.append(
            page.figure(
                figures.uncertainty_histogram(analysis.uncertainty, analysis.mixed_uncertainty),
                f"{slug}-uncertainty-test",
                "Uncertainty levels ||u|| of the original test images and of Mixup images of "
                f"random test pairs, {analysis.checkpoint} checkpoint (IDML paper, Fig. 9).",
            )
        )
        if analysis.probe is not None:
            parts.append(_conditions_figure(analysis.probe, slug, page))
    else:
        parts.append(
            _note("This run has no uncertainty head (plain metric): no test uncertainty levels.")
        )
    confidence = _retrieval_confidence(analysis.metrics)
    if confidence:
        parts.append("<h3>Can the answer's confidence be trusted?</h3>")
        parts.append(confidence)
        if analysis.risk_coverage:
            parts.append(
                page.figure(
                    figures.risk_coverage_curves(
                        analysis.risk_coverage, analysis.metrics.get("aurc_oracle")
                    ),
                    f"{slug}-risk-coverage",
                    "Error rate of the top-1 answers kept when only the most confident share of "
                    "the test queries is answered, for each confidence score.",
                )
            )

    parts.append("<h3>Retrieval examples</h3>")
    if len(analysis.queries):
        parts.append(
            page.figure(
                figures.retrieval_grid(analysis),
                f"{slug}-retrieval",
                f"Random test queries (left) and their top-{analysis.neighbors.shape[1]} "
                "neighbours; green: same class, red: another class (SSR paper, Fig. 5).",
            )
        )
    else:
        parts.append(_note("No query has another image of its class, so there is no grid."))

    parts.append("<h3>Embedding t-SNE</h3>")
    if analysis.tsne is not None:
        parts.append(
            page.figure(
                figures.tsne_scatter(analysis.tsne, analysis.tsne_labels, analysis.class_names),
                f"{slug}-tsne",
                "t-SNE of L2-normalised semantic test embeddings, coloured by class.",
            )
        )
    parts.extend(_note(text) for text in analysis.notes)
    return "\n".join(parts)


_CLASSIFICATION_METRICS = {
    "ece": "expected calibration error: mean |accuracy − confidence| over the bins, weighted by "
    "their share of images (Guo et al. 2017)",
    "nll": "mean −log p(true class)",
}


def _classification_section(analysis: ClassificationAnalysis, slug: str, page: _Page) -> str:
    """Metrics, reliability diagram, confusion matrix, risk–coverage, ``||u||`` by condition and
    the most confident mistakes of a classification run's checkpoint."""
    names = analysis.class_names
    metrics = analysis.metrics
    rows = "".join(
        f'<tr><td class="text">{html.escape(metric_heading(key))}</td>'
        f"<td>{format_metric(key, value)}</td>"
        f'<td class="text">{html.escape(_describe_metric(key))}</td></tr>'
        for key, value in sorted(metrics.items(), key=lambda item: metric_sort_key(item[0]))
    )
    parts = [
        "<h3>Test metrics</h3>",
        f'<p class="meta">{analysis.checkpoint} checkpoint, epoch {analysis.epoch}; '
        f"{len(analysis.labels)} test images, {len(names)} classes.</p>",
        '<table><tr><th class="text">metric</th><th>value</th><th class="text">meaning</th></tr>'
        f"{rows}</table>",
        "<h3>Calibration</h3>",
        page.figure(
            figures.reliability_diagram(analysis.calibration, metrics.get("ece")),
            f"{slug}-reliability",
            f"Reliability diagram: test images in {len(analysis.calibration.counts)} equal-width "
            "bins of their max softmax probability; bars: accuracy of each bin, shaded: its gap to "
            "the bin's mean confidence (the ECE's terms), dashed: perfect calibration (Guo et al. "
            "2017, Fig. 1).",
        ),
        "<h3>Confusion matrix</h3>",
        page.figure(
            figures.confusion_matrix_figure(analysis.normalized_confusion, names),
            f"{slug}-confusion",
            "Share of each true class (row) predicted as each class (column); the diagonal is "
            "each class's accuracy.",
        ),
    ]
    confused = analysis.most_confused(10)
    if confused:
        counts = analysis.confusion.sum(axis=1)
        cells = "".join(
            f'<tr><td class="text">{html.escape(names[t])}</td>'
            f'<td class="text">{html.escape(names[p])}</td><td>{n}</td>'
            f"<td>{100 * n / counts[t]:.1f}</td></tr>"
            for t, p, n in confused
        )
        parts.append(
            f'<p class="meta">The {len(confused)} most frequent confusions, by name:</p>'
            '<table><tr><th class="text">true class</th><th class="text">predicted as</th>'
            f"<th>images</th><th>% of the true class</th></tr>{cells}</table>"
        )
    selective = analysis.selective
    qualities = {
        CLASSIFICATION_SCORES[key]: (q.auroc, q.aurc) for key, q in selective.quality.items()
    }
    parts.append("<h3>Can the prediction's confidence be trusted?</h3>")
    parts.append(
        _confidence_table(
            qualities, selective.oracle_aurc, "test images", "wrong prediction", "wrong predictions"
        )
    )
    curves = {CLASSIFICATION_SCORES[k]: c for k, c in selective.curves.items()}
    parts.append(
        page.figure(
            figures.risk_coverage_curves(
                curves,
                selective.oracle_aurc,
                answers="test images",
                error="misclassified",
                legend="best",
            ),
            f"{slug}-risk-coverage",
            "Error rate of the predictions kept when only the most confident share of the test "
            "images is classified, for each confidence score (Geifman & El-Yaniv 2017).",
        )
    )
    if "norm_u" not in selective.quality:
        parts.append(_note("This run has no uncertainty head, so −||u|| is not a score here."))

    parts.append("<h3>Test-set uncertainty</h3>")
    if analysis.probe is not None:
        parts.append(_conditions_figure(analysis.probe, slug, page))
    else:
        parts.append(_note("This run has no uncertainty head: no test uncertainty levels."))

    parts.append("<h3>Most confident mistakes</h3>")
    if len(analysis.mistakes):
        ids = analysis.mistakes
        parts.append(
            page.figure(
                figures.mistakes_grid(
                    analysis.mistake_images,
                    [names[int(analysis.labels[i])] for i in ids],
                    [names[int(analysis.predicted[i])] for i in ids],
                    [float(analysis.confidence[i]) for i in ids],
                ),
                f"{slug}-mistakes",
                f"The {len(ids)} misclassified test images with the highest max softmax "
                "probability: true class, predicted class and its probability p.",
            )
        )
    parts.extend(_note(text) for text in analysis.notes)
    return "\n".join(parts)


def _describe_metric(key: str) -> str:
    """One line on what a classification metric is."""
    if key in _CLASSIFICATION_METRICS:
        return _CLASSIFICATION_METRICS[key]
    if key.startswith("top") and key[3:].isdigit():
        return f"share of test images whose class is among the {key[3:]} largest logits"
    if key.startswith("u_"):
        return f"mean ||u|| of the {key[2:]} test images (probe of the run's evaluation)"
    return ""
