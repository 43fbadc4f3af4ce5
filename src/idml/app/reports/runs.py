"""What a report knows about a run: its log (no model needed) and a fresh test-set analysis.

:func:`read_run` reads a run folder written by :class:`~idml.app.training.Trainer` (``config.yaml`` and
``metrics.jsonl``). :func:`analyse_run` loads the run's checkpoint and measures on the test split
everything the figures need: retrieval metrics and the precision–recall curve, each test image's
uncertainty level ``||u||`` next to that of Mixup images made from test images (Wang et al. 2022,
Fig. 9), the top-``k`` neighbours of sampled queries (Fu et al. 2021, Fig. 5) and a t-SNE of the
semantic embeddings (van der Maaten & Hinton 2008).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Subset

from idml.app.config import Config, load_config
from idml.app.run_folder import log_epochs_from_one
from idml.app.training.console import describe_method
from idml.diagnostics import UncertaintyProbe, uncertainty_probe
from idml.evaluation.confidence import ThresholdOutcome, risk_coverage
from idml.evaluation.evaluate import EvaluationReport
from idml.evaluation.reliability import CalibrationBins
from idml.evaluation.report import RetrievalResult
from idml.models import embed_dataset


# --------------------------------------------------------------------------- run log
@dataclass(frozen=True)
class RunLog:
    """A run folder's config and per-epoch log (one dict per line of ``metrics.jsonl``).

    Log keys (see :mod:`idml.app.training`): ``epoch`` (numbered from 1, also in logs written
    when they were numbered from 0: :func:`read_run` renumbers those), ``seconds``, ``steps``,
    ``loss/<part>``, ``lr/<group>``, ``uncertainty/<original|mixed|degraded>`` (mean ``||u||``;
    original: the rows no augmentation changed), and on evaluated epochs ``test/<metric>`` and
    ``uncertainty/eval_train`` (training images in eval mode, :mod:`idml.app.training.level_probe`).
    """

    run_dir: Path
    config: Config
    history: tuple[dict[str, float], ...]

    @property
    def name(self) -> str:
        """The run's config name."""
        return self.config.name

    def keys(self, prefix: str) -> list[str]:
        """Log keys starting with ``prefix``, in first-seen order."""
        seen: dict[str, None] = {}
        for line in self.history:
            for key in line:
                if key.startswith(prefix):
                    seen[key] = None
        return list(seen)

    def series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """``(epochs, values)`` of one key over the epochs that logged a finite value."""
        points = [
            (int(line["epoch"]), float(line[key]))
            for line in self.history
            if isinstance(line.get(key), (int, float)) and math.isfinite(float(line[key]))
        ]
        if not points:
            return np.zeros(0), np.zeros(0)
        epochs, values = zip(*points, strict=True)
        return np.asarray(epochs), np.asarray(values)

    @property
    def has_uncertainty(self) -> bool:
        """The model has an uncertainty head (IDML) whose levels were logged."""
        return bool(self.keys("uncertainty/"))

    @property
    def ssr_enabled(self) -> bool:
        """The run trained with the SSR auxiliary task."""
        return self.config.ssr.enabled

    @property
    def mixup_enabled(self) -> bool:
        """The run trained on mixed images (Mixup or CutMix, ``mixup.enabled``)."""
        return self.config.mixup.enabled

    @property
    def training_seconds(self) -> float:
        """Sum of the logged epoch times (training only, evaluation excluded)."""
        return float(sum(float(line.get("seconds", 0.0)) for line in self.history))

    @property
    def last_metrics(self) -> dict[str, float]:
        """Test metrics of the last evaluated epoch (``{}`` if none was evaluated)."""
        for line in reversed(self.history):
            found = {k[5:]: float(v) for k, v in line.items() if k.startswith("test/")}
            if found:
                return found
        return {}

    @property
    def nmi_method(self) -> str | None:
        """How the last evaluation computed NMI (``eval/nmi_method``; ``None`` in older logs)."""
        for line in reversed(self.history):
            if isinstance(line.get("eval/nmi_method"), str):
                return str(line["eval/nmi_method"])
        return None

    @property
    def method(self) -> str:
        """Short description: loss, metric (plain / ISM variant), Mixup, SSR."""
        return describe_method(self.config)


def read_run(run_dir: Path) -> RunLog:
    """Read ``config.yaml`` and ``metrics.jsonl`` of a run folder written by ``idml train``.

    Raises:
        FileNotFoundError: the folder or one of the two files is missing.
        ValueError: a file is not valid (names the file and line), or no epoch has finished.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(
            f"run folder {run_dir} does not exist; pass a folder written by `idml train`"
        )
    config_path, log_path = run_dir / "config.yaml", run_dir / "metrics.jsonl"
    for path in (config_path, log_path):
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing; {run_dir} is not a run folder written by `idml train`"
            )
    config = load_config(config_path)
    history = []
    for number, line in enumerate(log_path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{log_path}, line {number}, is not JSON ({err.msg}); the run was probably cut "
                "off while writing: delete that line"
            ) from err
        if not isinstance(entry, dict) or "epoch" not in entry:
            raise ValueError(f"{log_path}, line {number}: expected an object with an 'epoch' key")
        history.append(entry)
    if not history:
        raise ValueError(f"{log_path} is empty: the run has not finished an epoch yet")
    return RunLog(run_dir, config, tuple(log_epochs_from_one(history)))


# --------------------------------------------------------------------------- analysis
@dataclass(frozen=True)
class AnalysisOptions:
    """How much of the test split the analysis looks at (all sampling uses ``seed``)."""

    which: str = "best"
    """Checkpoint: ``best`` (falls back to ``latest`` for runs never evaluated) or ``latest``."""
    num_queries: int = 6
    """Queries in the retrieval grid."""
    top_k: int = 5
    """Neighbours per query in the retrieval grid (Fu et al. 2021, Fig. 5: top 5)."""
    max_mixed: int = 2000
    """Mixed test images for the uncertainty histogram."""
    tsne_points: int = 1000
    """Test embeddings in the t-SNE (a random subsample above this)."""
    mistakes: int = 12
    """Classification runs: the most confident wrong predictions in the mistakes grid."""
    batch_size: int = 128
    seed: int = 0

    def __post_init__(self) -> None:
        if self.which not in ("best", "latest"):
            raise ValueError(f"which must be 'best' or 'latest', got {self.which!r}")
        for name in ("num_queries", "top_k", "max_mixed", "tsne_points", "mistakes", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class TestAnalysis:
    """Test-split measurements of one checkpoint (arrays are NumPy, on the CPU)."""

    checkpoint: str
    """Which checkpoint was analysed: ``best`` or ``latest``."""
    epoch: int
    """Its epoch (numbered from 1)."""
    metrics: dict[str, float]
    labels: np.ndarray
    class_names: tuple[str, ...]
    pr_curve: tuple[np.ndarray, np.ndarray]
    """``(recall levels, interpolated precision)``: at each level ``ρ`` the mean over queries of
    ``max_{t/R ≥ ρ} t/p_t`` (``p_t``: rank of the t-th relevant image; the TREC 11-point curve)."""
    uncertainty: np.ndarray | None
    """``||u||`` of every test image (``None`` without an uncertainty head)."""
    mixed_uncertainty: np.ndarray | None
    """``||u||`` of Mixup images ``λ·x_a + (1 − λ)·x_b`` of random test pairs, ``λ ~ Beta(a, a)``."""
    queries: np.ndarray
    """``(Q,)`` test indices of the retrieval-grid queries."""
    neighbors: np.ndarray
    """``(Q, k)`` their nearest test images (self excluded), nearest first."""
    grid_images: np.ndarray
    """``(Q, 1 + k, H, W, C)`` pixels in [0, 1]: each query followed by its neighbours."""
    tsne: np.ndarray | None
    """``(n, 2)`` t-SNE of a subsample of semantic embeddings (``None`` when too few points)."""
    tsne_labels: np.ndarray
    notes: list[str] = field(default_factory=list)
    probe: UncertaintyProbe | None = None
    """``||u||`` of a sample of test images clean and altered (``None`` without uncertainty)."""
    risk_coverage: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    """Confidence score → ``(coverage, risk)``: answering only the most confident queries, the
    share answered and the share of those whose top-1 neighbour has another class."""
    calibration_note: str = ""
    """The run's calibrated confidence (where it came from), or why there is none."""
    reliability: CalibrationBins | None = None
    """The calibrated confidence's ECE bins on the test queries (``None`` without one)."""
    thresholds: dict[float, ThresholdOutcome] = field(default_factory=dict)
    """Target precision → the certified abstention threshold and what it did on the test queries."""

    @property
    def correct(self) -> np.ndarray:
        """``(Q, k)``: neighbour shares the query's class (Fu et al. 2021, Fig. 5: green vs red)."""
        return self.labels[self.neighbors] == self.labels[self.queries][:, None]


def analyse_run(
    log: RunLog,
    options: AnalysisOptions | None = None,
    device: torch.device | None = None,
    progress: bool = False,
) -> Any:
    """Load the run's checkpoint and measure the test split as the run's task does it
    (:meth:`idml.app.tasks.Task.analyse`: a :class:`TestAnalysis` for metric learning), on
    ``device`` (default CPU) with ``options`` (default ``AnalysisOptions()``).

    Raises:
        idml.app.checkpoint.CheckpointError: the run folder holds no (readable) checkpoint.
    """
    options = options or AnalysisOptions()
    device = device or torch.device("cpu")
    return log.config.task.spec.analyse(log, options, device, progress)


def analyse_retrieval_run(
    log: RunLog, options: AnalysisOptions, device: torch.device, progress: bool = False
) -> TestAnalysis:
    """A metric-learning run's :class:`TestAnalysis` (module docstring)."""
    from idml.app import build
    from idml.app.calibration import find_calibration
    from idml.app.inference import weights_sha256
    from idml.app.trained_run import load_trained_run

    run = load_trained_run(log.run_dir, which=options.which)
    found = find_calibration([log.run_dir], weights_sha256(run.model), "none")
    cfg, model = run.config, run.model.to(device)
    epoch = int(run.state.get("epoch", 0))
    test = build.build_data(cfg).test
    embeddings, labels = embed_dataset(model, test, options.batch_size, device, progress=progress)
    report = build.evaluate(
        cfg,
        embeddings,
        labels,
        device,
        roles=test.roles,
        calibration=found.calibration,
        num_neighbors=options.top_k,
    )
    metrics, pr_curve, curves = _evaluate(report)
    generator = torch.Generator().manual_seed(options.seed)

    uncertainty = mixed = probe = None
    notes: list[str] = []
    if embeddings.uncertainty is not None:
        uncertainty = embeddings.uncertainty_level().numpy()
        mixed = _mixed_uncertainty(cfg, model, test, options, device, generator)
        probe = uncertainty_probe(model, test, seed=options.seed, device=device)

    queries, neighbors = _sample_queries(labels, report.retrieval, options, generator)
    grid = _load_images(test, np.concatenate([queries[:, None], neighbors], axis=1))

    tsne, tsne_labels = _tsne(embeddings.semantic, labels, options, generator)
    if tsne is None:
        notes.append(f"t-SNE skipped: only {len(labels)} test images (it needs at least 10).")
    return TestAnalysis(
        checkpoint=run.which,
        epoch=epoch,
        metrics=metrics,
        labels=labels.numpy(),
        class_names=tuple(test.class_names),
        pr_curve=pr_curve,
        uncertainty=uncertainty,
        mixed_uncertainty=mixed,
        queries=queries,
        neighbors=neighbors,
        grid_images=grid,
        tsne=tsne,
        tsne_labels=tsne_labels,
        notes=notes,
        probe=probe,
        risk_coverage=curves,
        calibration_note=found.note,
        reliability=None if report.confidence is None else report.confidence.reliability,
        thresholds={} if report.confidence is None else dict(report.confidence.thresholds),
    )


def _evaluate(
    report: EvaluationReport,
) -> tuple[
    dict[str, float],
    tuple[np.ndarray, np.ndarray],
    dict[str, tuple[np.ndarray, np.ndarray]],
]:
    """The retrieval metrics of a test-set evaluation as training computes them (ISM only with
    ``eval.introspective``; its ``num_neighbors`` nearest test images per query come from the same
    search, so the retrieval grid shows what Recall@K counted), the interpolated
    precision–recall curve and the risk–coverage curves."""
    curve = report.retrieval.pr_curve
    pr = (np.asarray(curve.recall_levels, float), np.asarray(curve.interpolated_precision, float))
    return dict(report.metrics), pr, _curves(report)


def _curves(report: EvaluationReport) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Risk–coverage curves of the top-1 cosine, the calibrated confidence when the run has one,
    and −||u||."""
    r = report.retrieval
    recall = r.per_query.get("recall@1")
    if recall is None or r.neighbor_values.shape[1] == 0:
        return {}
    top1 = r.neighbor_values[:, 0].double()
    answered = ~torch.isnan(recall) & ~torch.isnan(top1)
    errors = recall[answered] == 0
    scores = {"top-1 cosine": top1[answered] if r.values_are_similarities else -top1[answered]}
    if report.confidence is not None and report.confidence.kind == "calibrated":
        scores["calibrated P(top-1 right)"] = report.confidence.confidence[answered]
    if report.uncertainty_levels is not None:
        scores["−||u||"] = -report.uncertainty_levels.double()[answered]
    out = {}
    for name, confidence in scores.items():
        coverage, risk = risk_coverage(confidence, errors)
        out[name] = (coverage.numpy(), risk.numpy())
    return out


@torch.no_grad()
def _mixed_uncertainty(
    cfg: Config,
    model: torch.nn.Module,
    test: torch.utils.data.Dataset,
    options: AnalysisOptions,
    device: torch.device,
    generator: torch.Generator,
) -> np.ndarray:
    """``||u||`` of Mixup images of random test pairs (Wang et al. 2022, Fig. 9).

    The training augmentation (:class:`~idml.augment.Mixup`) applied to shuffled batches of test
    images: one mixed image per image, its partner drawn by a random permutation of the batch (so
    itself with probability ``1/B``) and ``λ ~ Beta(a, a)`` with the run's ``mixup.alpha`` (1 when
    the run trained without Mixup).
    """
    from idml.augment import Mixup

    mixup = Mixup(alpha=cfg.mixup.alpha if cfg.mixup.enabled else 1.0, fraction=1.0)
    loader = DataLoader(test, batch_size=options.batch_size, shuffle=True, generator=generator)
    was_training = model.training
    model.eval()
    levels: list[Tensor] = []
    count = 0
    for images, labels, _ in loader:
        if count >= options.max_mixed:
            break
        batch = mixup(images, labels, generator)
        mixed = batch.images[batch.mixed][: options.max_mixed - count]
        out = model(mixed.to(device))
        levels.append(out.uncertainty.float().norm(dim=1).cpu())
        count += len(mixed)
    model.train(was_training)
    return torch.cat(levels).numpy()


def _sample_queries(
    labels: Tensor, retrieval: RetrievalResult, options: AnalysisOptions, generator: torch.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """``num_queries`` random queries (every test image, or those of role ``query``) that have
    another image of their class, and their nearest neighbours: test image indices, ``(Q,)`` and
    ``(Q, k)`` (empty when no image qualifies)."""
    neighbors = retrieval.neighbor_indices.cpu()
    rows = retrieval.query_rows
    rows = torch.arange(len(labels)) if rows is None else rows.cpu()
    k = min(options.top_k, neighbors.shape[1])
    eligible = torch.nonzero(torch.bincount(labels)[labels[rows]] > 1).flatten()
    if k < 1 or len(eligible) == 0:
        return np.zeros(0, np.int64), np.zeros((0, max(k, 0)), np.int64)
    pick = torch.randperm(len(eligible), generator=generator)[: options.num_queries]
    chosen = eligible[pick].sort().values
    return rows[chosen].numpy(), neighbors[chosen, :k].numpy()


def _load_images(dataset: torch.utils.data.Dataset, indices: np.ndarray) -> np.ndarray:
    """Pixels of ``indices`` (any shape) as ``indices.shape + (H, W, C)`` in [0, 1]."""
    flat = indices.reshape(-1).tolist()
    if not flat:
        return np.zeros((*indices.shape, 1, 1, 3))
    loader = DataLoader(Subset(dataset, flat), batch_size=len(flat), shuffle=False)
    images = next(iter(loader))[0].clamp(0, 1).permute(0, 2, 3, 1).numpy()
    return images.reshape(*indices.shape, *images.shape[1:])


def _tsne(
    semantic: Tensor, labels: Tensor, options: AnalysisOptions, generator: torch.Generator
) -> tuple[np.ndarray | None, np.ndarray]:
    """t-SNE (van der Maaten & Hinton 2008) of at most ``tsne_points`` normalised embeddings."""
    from sklearn.manifold import TSNE

    n = len(labels)
    if n < 10:
        return None, labels.numpy()
    chosen = torch.randperm(n, generator=generator)[: options.tsne_points].sort().values
    points = torch.nn.functional.normalize(semantic[chosen].float(), dim=1).numpy()
    # Perplexity must stay below the number of points; 30 is the usual value.
    perplexity = float(min(30.0, (len(chosen) - 1) / 3))
    embedded = TSNE(
        n_components=2, perplexity=perplexity, init="pca", random_state=options.seed
    ).fit_transform(points)
    return embedded, labels[chosen].numpy()
