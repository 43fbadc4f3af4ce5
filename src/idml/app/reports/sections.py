"""The pieces of the report page (:mod:`idml.app.reports.page`): the figure writer, and one section per
run — training curves and uncertainty, then the test-set analysis its task draws
(:meth:`idml.app.tasks.Task.report_section`: retrieval, uncertainty and t-SNE figures of a
metric-learning run, :func:`retrieval_section`; calibration, confusion and mistakes of a
classification run, :func:`classification_section`) — saying in words what a run cannot show."""

from __future__ import annotations

import base64
import html
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from idml.app.metric_display import (
    format_metric,
    metric_heading,
    metric_label,
    metric_sort_key,
    table_decimals,
)
from idml.app.reports import figures
from idml.app.reports.classification import (
    CONFIDENCE_SCORES as CLASSIFICATION_SCORES,
)
from idml.app.reports.classification import (
    ClassificationAnalysis,
)
from idml.app.reports.runs import RunLog, TestAnalysis
from idml.app.training.level_probe import LOG_KEY as EVAL_LEVEL_KEY
from idml.app.training.level_probe import drift_ratio, level_drift
from idml.app.training.monitoring import identity_reasons
from idml.diagnostics import UncertaintyProbe


@dataclass
class RunReport:
    """One run's log, its test analysis (``None`` when skipped) and why things are missing."""

    log: RunLog
    label: str
    analysis: Any
    """What the run's task analysed (:meth:`idml.app.tasks.Task.analyse`; a :class:`TestAnalysis`
    for metric learning), or ``None``."""
    notes: list[str] = field(default_factory=list)

    @property
    def metrics(self) -> dict[str, float]:
        """Test metrics of the analysed checkpoint, else of the last logged evaluation."""
        return self.analysis.metrics if self.analysis is not None else self.log.last_metrics


class PageFigures:
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


def note(text: str) -> str:
    return f'<p class="note">{html.escape(text)}</p>'


def collapsible(summary: str, body: str, opened: bool = False, detail: str = "") -> str:
    """``body`` under a heading line ``summary`` (with a grey ``detail``) that opens and closes
    it: a ``<details>`` element, closed unless ``opened`` (no script needed)."""
    extra = f' <span class="meta">{html.escape(detail)}</span>' if detail else ""
    state = " open" if opened else ""
    return f"<details{state}><summary>{html.escape(summary)}{extra}</summary>\n{body}\n</details>"


def section_slug(index: int, label: str) -> str:
    return f"{index + 1:02d}-" + re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("_")[:60]


_CONFIDENCE_SCORES = {
    "calibrated": "calibrated P(top-1 right)",
    "top1": "top-1 similarity",
    "margin@10": "margin to the nearest other label (10-NN)",
    "agreement@5": "5-NN agreement with the top-1 label",
    "agreement@10": "10-NN agreement with the top-1 label",
    "csls@10": "hubness-corrected top-1 similarity (CSLS, 10-NN)",
    "norm_u": "−||u|| of the query",
}


def _confidence_table(
    qualities: dict[str, tuple[float, float]],
    oracle: float | None,
    answers: str,
    auroc_key: str,
    wrong_answers: str,
) -> str:
    """AUROC (right answers ranked above wrong ones) and AURC (risk–coverage) of each confidence
    score, in the units of the run's other tables (:func:`~idml.app.metric_display.metric_unit`).

    ``qualities`` maps a score's description to its ``(auroc, aurc)``; ``answers`` names what is
    answered ("queries", "test images"), ``wrong_answers`` the wrong ones, and ``auroc_key`` the
    AUROC as the run's metrics name it (``r_auroc`` for retrieval, R-AUROC as the URL benchmark
    names it; ``auroc`` for classification).
    """
    rows = [
        f"<tr><td>{html.escape(name)}</td><td>{format_metric(auroc_key, auroc)}</td>"
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
    chance = format_metric(auroc_key, 0.5, percent_digits=0)
    return (
        f"<table><tr><th>confidence score</th><th>{html.escape(metric_heading(auroc_key))}</th>"
        f"<th>{html.escape(metric_heading('aurc'))}</th></tr>"
        + "".join(rows)
        + "</table>"
        + note(
            f"{metric_label(auroc_key)}: how well the score ranks {wrong_answers} below right ones "
            f"({chance} = chance). "
            f"AURC: mean error rate when only the most confident {answers} are answered, over all "
            f"coverage levels (lower is better).{floor}"
        )
    )


def _retrieval_confidence(metrics: dict[str, float]) -> str:
    """The confidence table of a metric-learning run, from its ``r_auroc_*``/``aurc_*`` metrics."""
    qualities = {}
    for key, name in _CONFIDENCE_SCORES.items():
        auroc, aurc = metrics.get(f"r_auroc_{key}"), metrics.get(f"aurc_{key}")
        if auroc is not None and aurc is not None:
            qualities[name] = (auroc, aurc)
    return _confidence_table(
        qualities, metrics.get("aurc_oracle"), "queries", "r_auroc", "wrong top-1 answers"
    )


def _calibrated_answers(analysis: TestAnalysis, slug: str, page: PageFigures) -> str:
    """The calibrated confidence on the test queries: its reliability diagram, and for each
    target precision the threshold certified on the calibration queries against what it did."""
    assert analysis.reliability is not None
    metrics = analysis.metrics
    parts = [
        page.figure(
            figures.reliability_diagram(
                analysis.reliability, metrics.get("ece"), "calibrated P(top-1 right)", "queries"
            ),
            f"{slug}-reliability",
            f"Reliability diagram of the calibrated confidence on the test queries, in "
            f"{len(analysis.reliability.counts)} equal-width bins: bars, the share of right top-1 "
            "answers in each bin; shaded, its gap to the bin's mean confidence (the ECE's terms); "
            "dashed, perfect calibration (Guo et al. 2017, Fig. 1).",
        )
    ]
    rows = []
    for target, outcome in analysis.thresholds.items():
        t = outcome.threshold
        cut = f"{t.threshold:.4f}" if t.certified else "none certified: abstain"
        rows.append(
            f"<tr><td>{target:g}</td><td>{cut}</td><td>{_percent(t.calibration_coverage)}</td>"
            f"<td>{_percent(outcome.precision)}</td><td>{_percent(outcome.coverage)}</td></tr>"
        )
    if rows:
        delta = next(iter(analysis.thresholds.values())).threshold.delta
        parts.append(
            "<table><tr><th>target precision</th><th>threshold</th>"
            "<th>calibration coverage</th><th>test precision</th><th>test coverage</th></tr>"
            + "".join(rows)
            + "</table>"
            + note(
                f"Abstention: answer only queries whose calibrated confidence reaches the "
                f"threshold certified on the calibration's held-out queries (Learn then Test, "
                f"δ = {delta:g}: precision ≥ target with probability ≥ {1 - delta:g} when "
                "calibration and test queries are exchangeable; classes other than the "
                "calibration's make it an estimate). Test precision: share of right top-1 answers "
                "among the answered test queries."
            )
        )
    return "\n".join(parts)


def _percent(share: float) -> str:
    return "–" if share != share else f"{100 * share:.1f} %"


def _conditions_figure(probe: UncertaintyProbe, slug: str, page: PageFigures) -> str:
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


def run_section(index: int, report: RunReport, page: PageFigures, opened: bool = True) -> str:
    """One run's figures and notes, under a heading that opens and closes them (closed unless
    ``opened``: a page of many runs shows their headings first)."""
    metrics = report.metrics
    first = sorted(metrics, key=metric_sort_key)[:1]
    detail = "; ".join(
        [report.log.method] + [f"{metric_heading(k)} {format_metric(k, metrics[k])}" for k in first]
    )
    body = _run_body(index, report, page)
    return collapsible(f"Run {report.label}", body, opened=opened, detail=detail)


def _run_body(index: int, report: RunReport, page: PageFigures) -> str:
    run, analysis = report.log, report.analysis
    cfg = run.config
    slug = section_slug(index, report.label)
    batch = cfg.sampler.effective_batch_size
    parts = [
        f'<p class="meta">Folder {html.escape(str(run.run_dir))}; name {html.escape(cfg.name)}; '
        f"{html.escape(run.method)}; batch {batch}; seed {cfg.seed}.</p>",
        *(note(text) for text in report.notes),
        "<h3>Training curves</h3>",
        page.figure(
            figures.training_curves(run),
            f"{slug}-curves",
            "Mean training losses, test metrics (evaluated epochs) and learning rates per epoch.",
        ),
    ]
    if not run.ssr_enabled:
        parts.append(note("SSR was off in this run, so there is no ranking-loss curve."))

    parts.append("<h3>Uncertainty during training</h3>")
    if run.has_uncertainty:
        kinds = [k.removeprefix("uncertainty/") for k in run.keys("uncertainty/")]
        trained = [k for k in kinds if k != EVAL_LEVEL_KEY]
        *others, last = trained or kinds
        shown = f"{', '.join(others)} and {last}" if others else last
        at_eval = (
            f"; {EVAL_LEVEL_KEY}: a fixed set of training images with the model in eval mode, as "
            "at test, after each evaluation. Far from original, the level at test is not the one "
            "the model trained with"
            if EVAL_LEVEL_KEY in kinds
            else ""
        )
        parts.append(
            page.figure(
                figures.uncertainty_trend(run),
                f"{slug}-uncertainty-trend",
                f"Mean uncertainty level ||u|| of {shown} training images per epoch (original: "
                f"those no augmentation changed; IDML paper, Fig. 7){at_eval}.",
            )
        )
        drift = level_drift_note(run)
        if drift is not None:
            parts.append(note(drift))
        if not run.mixup_enabled:
            parts.append(note("Mixing was off in training, so no mixed images appear."))
        elif not run.keys("uncertainty/original"):
            parts.append(note("Every training image was mixed, so only mixed images appear."))
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
        parts.append(note(ism_verdict(run)))
    else:
        parts.append(
            note(
                "This run has no uncertainty head (plain metric), so there is no uncertainty "
                "level to follow during training."
            )
        )

    if analysis is not None:
        parts.append(cfg.task.spec.report_section(analysis, slug, page))
    return "\n".join(parts)


def ism_verdict(run: RunLog) -> str:
    """Whether ISM weakened pairs unevenly in the run's last epoch, or acted as the identity (or
    a uniform rescaling), by the training monitor's own rule
    (:func:`~idml.app.training.monitoring.identity_reasons`), with the numbers it read."""
    last: dict[str, float] = {}
    for key in ("pos_q10", "pos_q50", "u_cv"):
        values = run.series(f"ism/{key}")[1]
        if len(values):
            last[key] = float(values[-1])
    epoch = int(run.series("ism/pos_q50")[0][-1]) if "pos_q50" in last else None
    when = f"In the last epoch ({epoch})" if epoch is not None else "In the last epoch"
    reasons = identity_reasons(last)
    if reasons:
        return (
            f"{when} ISM acts as the identity (or a uniform rescaling): {'; '.join(reasons)}. "
            "The run then trains like the plain metric, and whatever IDML gains here is Mixup's."
        )
    found = []
    if "pos_q10" in last:
        found.append(
            f"positive pairs' weakening e^(-y) has 10th percentile {last['pos_q10']:.3f} and "
            f"median {last.get('pos_q50', float('nan')):.3f}"
        )
    if "u_cv" in last:
        found.append(f"||u|| varies by {100 * last['u_cv']:.0f} % across a batch")
    return f"{when} ISM weakens pairs unevenly: {'; '.join(found) or 'no factors were logged'}."


def level_drift_note(run: RunLog) -> str | None:
    """What the report says when, at the last epoch that logged both, the eval-mode ``||u||`` of
    the training images (``uncertainty/eval_train``) is more than
    :data:`~idml.app.training.level_probe.DRIFT_FACTOR` times the trained one (or that fraction of
    it); ``None`` when it is not, or when the log has no such epoch."""
    both = [line for line in run.history if drift_ratio(line) is not None]
    if not both:
        return None
    last = both[-1]
    trained, at_eval = last["uncertainty/original"], last[f"uncertainty/{EVAL_LEVEL_KEY}"]
    factor = level_drift(trained, at_eval)
    if factor is None:
        return None
    direction = "above" if at_eval > trained else "below"
    return (
        f"After epoch {int(last['epoch'])}, the training images' ||u|| in eval mode "
        f"({at_eval:.4g}) is {factor:.3g} times {direction} the level training logged for them "
        f"({trained:.4g}): the test-set uncertainty below, and ISM at test, describe a u that "
        "training never used."
    )


def retrieval_section(analysis: TestAnalysis, slug: str, page: PageFigures) -> str:
    """Test-set uncertainty, confidence, the retrieval grid and the t-SNE of a metric-learning
    run's checkpoint."""
    parts = ["<h3>Test-set uncertainty</h3>"]
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
            note("This run has no uncertainty head (plain metric): no test uncertainty levels.")
        )
    confidence = _retrieval_confidence(analysis.metrics)
    if confidence:
        parts.append("<h3>Can the answer's confidence be trusted?</h3>")
        parts.append(confidence)
        parts.append(note(f"Answers' confidence: {analysis.calibration_note}"))
        if analysis.reliability is not None:
            parts.append(_calibrated_answers(analysis, slug, page))
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
        parts.append(note("No query has another image of its class, so there is no grid."))

    parts.append("<h3>Embedding t-SNE</h3>")
    if analysis.tsne is not None:
        parts.append(
            page.figure(
                figures.tsne_scatter(analysis.tsne, analysis.tsne_labels, analysis.class_names),
                f"{slug}-tsne",
                "t-SNE of L2-normalised semantic test embeddings, coloured by class.",
            )
        )
    parts.extend(note(text) for text in analysis.notes)
    return "\n".join(parts)


_CLASSIFICATION_METRICS = {
    "ece": "expected calibration error: mean |accuracy − confidence| over the bins, weighted by "
    "their share of images (Guo et al. 2017)",
    "nll": "mean −log p(true class)",
}


def classification_section(analysis: ClassificationAnalysis, slug: str, page: PageFigures) -> str:
    """Metrics, reliability diagram, confusion matrix, risk–coverage, ``||u||`` by condition and
    the most confident mistakes of a classification run's checkpoint."""
    names = analysis.class_names
    metrics = analysis.metrics
    # The ||u|| levels of clean and altered images are read against each other: one precision.
    digits = table_decimals({key: [value] for key, value in metrics.items()})
    rows = "".join(
        f'<tr><td class="text">{html.escape(metric_heading(key))}</td>'
        f"<td>{format_metric(key, value, **digits[key])}</td>"
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
            qualities, selective.oracle_aurc, "test images", "auroc", "wrong predictions"
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
        parts.append(note("This run has no uncertainty head, so −||u|| is not a score here."))

    parts.append("<h3>Test-set uncertainty</h3>")
    if analysis.probe is not None:
        parts.append(_conditions_figure(analysis.probe, slug, page))
    else:
        parts.append(note("This run has no uncertainty head: no test uncertainty levels."))

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
    parts.extend(note(text) for text in analysis.notes)
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
