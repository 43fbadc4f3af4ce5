"""`idml report`: the page and its figures for tiny finished runs (plain, and IDML with SSR), the
test-set analysis against independent recomputations, and a headless-browser load with no errors."""

from __future__ import annotations

import base64
import io
import json
import math
import shutil
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from browser import CHROMIUM, load_in_chromium
from idml.app import build
from idml.app.cli import main
from idml.app.config import dump_config, load_config
from idml.app.reports import AnalysisOptions, analyse_run, read_run, write_report
from idml.app.trained_run import load_trained_model
from idml.app.training import Trainer
from tiny_run import IDML, TINY

SSR = ["ssr.enabled=true", "ssr.task.p_task=1.0", "ssr.task.num_images=4"]
HOSTILE_NAME = "plain<script>alert(1)</script>&"


class _Images(HTMLParser):
    """Collects the ``src`` of every ``<img>`` and all text of the page."""

    def __init__(self) -> None:
        super().__init__()
        self.sources: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "img":
            self.sources.append(dict(attrs)["src"] or "")

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def _parse(page: Path) -> _Images:
    parser = _Images()
    parser.feed(page.read_text(encoding="utf-8"))
    return parser


def _check_png(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(io.BytesIO(data)) as image:
        image.verify()
        return image.size


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two finished tiny runs: plain (no uncertainty, no SSR) and IDML + SSR over two epochs."""
    root = tmp_path_factory.mktemp("runs")
    made = {}
    for key, extra in (
        ("plain", ["loss.name=multi_similarity", f"name={HOSTILE_NAME}"]),
        ("idml", ["loss.name=multi_similarity", *IDML, *SSR, "optim.epochs=2", "name=idml"]),
    ):
        cfg = load_config(None, [*TINY, *extra])
        Trainer(cfg, root / key, progress=False).fit()
        made[key] = root / key
    return made


@pytest.fixture(scope="module")
def report(runs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The report of both runs, made through the CLI."""
    out = tmp_path_factory.mktemp("report")
    assert (
        main(["report", str(runs["plain"]), str(runs["idml"]), "--out", str(out), "--no-progress"])
        == 0
    )
    return out / "index.html"


# --------------------------------------------------------------------------- the page
@pytest.mark.slow
def test_report_page_shows_every_figure_as_an_existing_nonempty_png(report: Path) -> None:
    parsed = _parse(report)
    names = sorted(Path(src).name for src in parsed.sources)
    assert all(src.startswith("figures/") for src in parsed.sources)
    for src in parsed.sources:
        width, height = _check_png((report.parent / src).read_bytes())
        assert width > 50 and height > 50
    # Plain run: curves, risk–coverage, retrieval grid, t-SNE; the IDML run adds the uncertainty
    # trend, ISM's saturation, the test histogram and ||u|| of clean vs altered test images.
    expected = {
        "00-recall.png",
        "00-precision-recall.png",
        "01-plain-curves.png",
        "01-plain-risk-coverage.png",
        "01-plain-retrieval.png",
        "01-plain-tsne.png",
        "02-idml-curves.png",
        "02-idml-uncertainty-trend.png",
        "02-idml-ism-saturation.png",
        "02-idml-uncertainty-test.png",
        "02-idml-uncertainty-conditions.png",
        "02-idml-risk-coverage.png",
        "02-idml-retrieval.png",
        "02-idml-tsne.png",
    }
    assert set(names) == expected


@pytest.mark.slow
def test_report_says_what_a_plain_run_cannot_show_and_escapes_user_text(
    report: Path, runs: dict[str, Path]
) -> None:
    html = report.read_text(encoding="utf-8")
    text = " ".join(_parse(report).text)
    plain_section = text[text.index("Run plain") : text.index("Run idml")]
    assert "no uncertainty head" in plain_section
    assert "SSR was off" in plain_section
    idml_section = text[text.index("Run idml") :]
    assert "no uncertainty head" not in idml_section and "SSR was off" not in idml_section
    # The run name holds markup: it must appear as text, never as a tag.
    assert "<script>alert(1)</script>" not in html
    assert "plain&lt;script&gt;alert(1)&lt;/script&gt;&amp;" in html
    assert HOSTILE_NAME in text


@pytest.mark.slow
def test_comparison_table_holds_the_analysed_checkpoints_metrics(
    report: Path, runs: dict[str, Path]
) -> None:
    text = " ".join(_parse(report).text)
    for key in ("plain", "idml"):
        log = read_run(runs[key])
        # The best checkpoint is the epoch whose logged recall@1 was highest.
        logged = [line for line in log.history if "test/recall@1" in line]
        best = max(logged, key=lambda line: line["test/recall@1"])
        assert f"{100 * best['test/recall@1']:.2f}" in text
        assert f"epoch {best['epoch']}" in text  # numbered from 1, as in the log


@pytest.fixture(scope="module")
def analysis(runs: dict[str, Path]) -> Any:
    options = AnalysisOptions(num_queries=4, max_mixed=150, tsne_points=120, seed=3)
    return analyse_run(read_run(runs["idml"]), options)


@pytest.mark.slow
def test_analysis_agrees_with_the_log_and_independent_recomputation(
    analysis: Any, runs: dict[str, Path]
) -> None:
    run = runs["idml"]
    history = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    best = max(history, key=lambda line: line["test/recall@1"])
    assert analysis.epoch == best["epoch"]  # both numbered from 1
    for key, value in analysis.metrics.items():
        # Fractions of counts in [0, 1] from the same checkpoint and test split: the same ranking
        # gives the same value up to a float32 rounding (ε/2 ≈ 6e-8) on either side: abs 1e-6.
        assert value == pytest.approx(best[f"test/{key}"], abs=1e-6), key

    # Embeddings straight from the model, without the report's code.
    cfg, model = load_trained_model(run)
    test = build.build_data(cfg).test
    images = torch.stack([test[i][0] for i in range(len(test))])
    with torch.no_grad():
        out = model(images)
    labels = test.labels.numpy()
    # float32, the same model on other batch compositions: convolution sums grouped otherwise put a
    # few ulp on each activation, ~1e-6 relative on ||u|| after the heads: rtol 1e-5.
    np.testing.assert_allclose(analysis.uncertainty, out.uncertainty.norm(dim=1).numpy(), rtol=1e-5)
    np.testing.assert_array_equal(analysis.labels, labels)

    # Top-5 by brute-force cosine similarity, the query excluded.
    unit = torch.nn.functional.normalize(out.semantic, dim=1)
    sims = unit[analysis.queries] @ unit.T
    sims[torch.arange(len(analysis.queries)), torch.as_tensor(analysis.queries)] = -math.inf
    order = sims.sort(dim=1, descending=True, stable=True).indices[:, :5].numpy()
    np.testing.assert_array_equal(analysis.neighbors, order)
    np.testing.assert_array_equal(
        analysis.correct, labels[order] == labels[analysis.queries][:, None]
    )
    # Grid pixels are the dataset's images: query first, then its neighbours. Copies of the same
    # float32 pixels (clamped to [0, 1], which they are): numpy's default rtol 1e-7, below one
    # float32 ulp, is equality in effect.
    np.testing.assert_allclose(
        analysis.grid_images[:, 0], images[analysis.queries].permute(0, 2, 3, 1).numpy()
    )
    np.testing.assert_allclose(
        analysis.grid_images[1, 1:], images[order[1]].permute(0, 2, 3, 1).numpy()
    )
    # Queries are distinct and each has another image of its class.
    assert len(set(analysis.queries.tolist())) == 4
    counts = np.bincount(labels)
    assert (counts[labels[analysis.queries]] > 1).all()

    # Interpolated precision at recall 0, 0.1, ..., 1 never increases with recall.
    levels, precision = analysis.pr_curve
    # float64 recall levels k/10 vs numpy's linspace: an ulp or two: atol 1e-12. Each query's
    # interpolated precision is non-increasing; their float64 means over the queries may invert by
    # ~Q·ε ≪ 1e-12.
    np.testing.assert_allclose(levels, np.linspace(0, 1, 11), atol=1e-12)
    assert (np.diff(precision) <= 1e-12).all() and 0 < precision[-1] <= precision[0] <= 1

    # Mixed test images: as many as asked, finite positive levels; t-SNE of the asked subsample.
    assert analysis.mixed_uncertainty.shape == (150,)
    assert np.isfinite(analysis.mixed_uncertainty).all() and (analysis.mixed_uncertainty > 0).all()
    assert analysis.tsne.shape == (120, 2) and analysis.tsne_labels.shape == (120,)
    assert np.isfinite(analysis.tsne).all()


@pytest.mark.slow
def test_mixed_test_images_are_convex_mixtures_of_test_pairs(runs: dict[str, Path]) -> None:
    """Replays the analysis's Mixup draw: each mixed level is the model's ||u|| of λ·x_a+(1−λ)·x_b."""
    from idml.app.reports.runs import _mixed_uncertainty
    from idml.augment import Mixup

    cfg, model = load_trained_model(runs["idml"])
    test = build.build_data(cfg).test
    options = AnalysisOptions(max_mixed=30, batch_size=16)
    levels = _mixed_uncertainty(
        cfg, model, test, options, torch.device("cpu"), torch.Generator().manual_seed(5)
    )
    # Same generator stream: the loader's shuffle, then Mixup per batch.
    generator = torch.Generator().manual_seed(5)
    loader = torch.utils.data.DataLoader(test, batch_size=16, shuffle=True, generator=generator)
    expected = []
    for images, labels, _ in loader:
        batch = Mixup(alpha=cfg.mixup.alpha, fraction=1.0)(images, labels, generator)
        info = batch.mixup
        assert info is not None  # a Mixup batch records its draw
        lam = info.lam.view(-1, 1, 1, 1)
        mixed = lam * images[info.index_a] + (1 - lam) * images[info.index_b]
        with torch.no_grad():
            expected.append(model(mixed).uncertainty.norm(dim=1))
        if sum(len(e) for e in expected) >= 30:
            break
    # float32: the analysis may form λ·x_a + (1 − λ)·x_b in another order (an ulp per pixel) and
    # batch it otherwise; that moves ||u|| by ~1e-6 relative through the network: rtol 1e-5.
    np.testing.assert_allclose(levels, torch.cat(expected)[:30].numpy(), rtol=1e-5)


@pytest.mark.slow
def test_inline_report_embeds_every_figure(runs: dict[str, Path], tmp_path: Path) -> None:
    page = write_report([runs["idml"]], tmp_path, analyse=False, inline=True)
    sources = _parse(page).sources
    # Logs only: recall bars, curves, uncertainty trend, ISM saturation.
    assert len(sources) == 4
    for src in sources:
        prefix = "data:image/png;base64,"
        assert src.startswith(prefix)
        _check_png(base64.b64decode(src[len(prefix) :]))
    text = " ".join(_parse(page).text)
    assert "not requested" in text


@pytest.mark.slow
def test_run_without_checkpoints_still_reports_its_logs(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    copy = tmp_path / "no-checkpoints"
    shutil.copytree(runs["plain"], copy, ignore=shutil.ignore_patterns("checkpoints"))
    page = write_report([copy], tmp_path / "out")
    text = " ".join(_parse(page).text)
    assert "No test-set analysis" in text and "holds no checkpoint" in text
    assert {Path(s).name for s in _parse(page).sources} == {
        "00-recall.png",
        "01-no-checkpoints-curves.png",
    }


# --------------------------------------------------------------------------- logs only (fast)
def _fake_run(root: Path, epochs: int = 3, uncertainty: bool = False) -> Path:
    """A run folder written by hand: config.yaml and metrics.jsonl, no checkpoint."""
    overrides = [*TINY, f"optim.epochs={epochs}", "name=fake"]
    if uncertainty:
        overrides += IDML
    root.mkdir(parents=True)
    dump_config(load_config(None, overrides), root / "config.yaml")
    lines = []
    for epoch in range(epochs):
        line = {"epoch": epoch, "steps": 2, "seconds": 1.5, "loss/metric": 1.0 / (epoch + 1)}
        line["loss/total"] = line["loss/metric"]
        line["lr/backbone"] = 0.001
        if uncertainty:
            line["uncertainty/original"] = 2.0 - 0.1 * epoch
            line["uncertainty/mixed"] = 2.5 - 0.1 * epoch
        if epoch % 2 == 1 or epoch == epochs - 1:
            line["test/recall@1"] = 0.5 + 0.1 * epoch
            line["test/recall@2"] = 0.7 + 0.1 * epoch
        lines.append(json.dumps(line))
    (root / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return root


def test_read_run_exposes_series_and_last_metrics(tmp_path: Path) -> None:
    log = read_run(_fake_run(tmp_path / "r", epochs=4, uncertainty=True))
    epochs, values = log.series("test/recall@1")
    # float64 values written as 0.5 + 0.1·epoch (0.7 + 0.1 reads 0.7999999999999999) and read back
    # losslessly from JSON: an ulp from the decimals, rel 1e-12 (approx's default 1e-6 was loose).
    assert epochs.tolist() == [2, 4] and values == pytest.approx([0.6, 0.8], rel=1e-12)
    assert log.last_metrics == pytest.approx({"recall@1": 0.8, "recall@2": 1.0}, rel=1e-12)
    # Exact: four epochs of 1.5 s, sums of dyadic numbers.
    assert log.training_seconds == 6.0
    assert log.has_uncertainty and log.mixup_enabled and not log.ssr_enabled
    assert log.keys("uncertainty/") == ["uncertainty/original", "uncertainty/mixed"]
    assert log.method.startswith("proxy_anchor + ISM (γ=0, τ=5) + Mixup")


def test_logs_only_report_of_two_runs(tmp_path: Path) -> None:
    plain = _fake_run(tmp_path / "a" / "run")
    idml = _fake_run(tmp_path / "b" / "run", uncertainty=True)
    page = write_report([plain, idml], tmp_path / "out", analyse=False)
    parsed = _parse(page)
    # Same folder names: labels fall back to parent/folder.
    assert sorted(Path(s).name for s in parsed.sources) == [
        "00-recall.png",
        "01-a_run-curves.png",
        "02-b_run-curves.png",
        "02-b_run-uncertainty-trend.png",
    ]
    for src in parsed.sources:
        _check_png((page.parent / src).read_bytes())
    text = " ".join(parsed.text)
    # Last logged evaluation: recall@1 0.7 (epoch 3) for both runs, in the comparison table, in
    # the seed table (two recipes of one seed each) and beside each run's heading.
    assert text.count("70.00") == 6 and "last logged evaluation" in text
    assert "||u|| of original and mixed training images" in text


def test_the_uncertainty_trend_names_every_kind_of_training_image_it_plots(
    tmp_path: Path,
) -> None:
    run = _fake_run(tmp_path / "run", uncertainty=True)
    log = run / "metrics.jsonl"
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    for line in lines:
        line["uncertainty/degraded"] = 3.0
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    text = " ".join(_parse(write_report([run], tmp_path / "out", analyse=False)).text)
    assert "||u|| of original, mixed and degraded training images" in text


def test_the_report_says_when_the_test_time_u_is_not_the_trained_one(tmp_path: Path) -> None:
    """The last epoch that logged both levels decides: a drift there beyond 2-fold is a note under
    the uncertainty trend; an earlier drift that closed again is not."""
    run = _fake_run(tmp_path / "run", epochs=4, uncertainty=True)
    log = run / "metrics.jsonl"
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    lines[1]["uncertainty/eval_train"] = 10.0  # epoch 2: 1.9 trained, drifted
    lines[3]["uncertainty/eval_train"] = 0.4  # epoch 4: 1.7 trained, 4.25 times below
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    text = " ".join(_parse(write_report([run], tmp_path / "out", analyse=False)).text)
    assert "After epoch 4, the training images' ||u|| in eval mode (0.4) is 4.25 times below" in (
        text
    )
    assert "eval_train: a fixed set of training images with the model in eval mode" in text
    lines[3]["uncertainty/eval_train"] = 1.8
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    text = " ".join(_parse(write_report([run], tmp_path / "out2", analyse=False)).text)
    assert "in eval mode (" not in text


@pytest.mark.parametrize(
    ("damage", "error", "message"),
    [
        ("missing", FileNotFoundError, "does not exist"),
        ("no-log", FileNotFoundError, r"metrics\.jsonl is missing"),
        ("no-config", FileNotFoundError, r"config\.yaml is missing"),
        ("torn-line", ValueError, r"metrics\.jsonl, line 3, is not JSON"),
        ("empty-log", ValueError, "has not finished an epoch"),
        ("bad-key", ValueError, "unknown key 'optim.epoks'"),
    ],
)
def test_bad_run_folders_are_refused_with_the_file_named(
    tmp_path: Path, damage: str, error: type[Exception], message: str
) -> None:
    run = _fake_run(tmp_path / "run")
    log = run / "metrics.jsonl"
    if damage == "missing":
        run = tmp_path / "nowhere"
    elif damage == "no-log":
        log.unlink()
    elif damage == "no-config":
        (run / "config.yaml").unlink()
    elif damage == "torn-line":
        log.write_text(log.read_text()[:-20])
    elif damage == "empty-log":
        log.write_text("")
    elif damage == "bad-key":
        raw = yaml.safe_load((run / "config.yaml").read_text())
        raw["optim"]["epoks"] = 3
        (run / "config.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(error, match=message):
        write_report([run], tmp_path / "out", analyse=False)
    assert main(["report", str(run), "--out", str(tmp_path / "out"), "--no-test"]) == 2


def test_report_refuses_analysis_options_with_no_test(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # --no-test skips the analysis, so its options would be silently ignored.
    argv = ["report", str(tmp_path / "run"), "--no-test", "--queries", "3", "--device", "cpu"]
    assert main(argv) == 2
    assert "--queries, --device only apply to the test-set analysis" in capsys.readouterr().err


def test_report_options_are_validated() -> None:
    with pytest.raises(ValueError, match="which must be 'best' or 'latest'"):
        AnalysisOptions(which="last")
    with pytest.raises(ValueError, match="num_queries must be >= 1"):
        AnalysisOptions(num_queries=0)
    with pytest.raises(ValueError, match="at least one run folder"):
        write_report([], Path("unused"))


# --------------------------------------------------------------------------- headless browser
@pytest.mark.slow
@pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (Debian: apt-get install -y chromium)"
)
def test_page_loads_in_headless_chromium_without_errors(report: Path, tmp_path: Path) -> None:
    result = load_in_chromium(report, tmp_path / "profile")
    assert result["loaded"]
    assert result["errors"] == []
    assert result["failed"] == []
    assert len(result["images"]) == len(_parse(report).sources) >= 9
    assert all(complete and width > 0 for complete, width in result["images"])
    # Offline: nothing but the page and its figures was requested.
    assert all(url.startswith("file://") for url in result["urls"]), result["urls"]


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")
def test_headless_check_catches_a_broken_page(tmp_path: Path) -> None:
    """The browser check can fail: a missing image and a script error are both reported."""
    page = tmp_path / "broken.html"
    page.write_text(
        '<!DOCTYPE html><html><head><meta charset="utf-8"><link rel="icon" href="data:,">'
        '<title>x</title></head><body><img src="missing.png"><script>undefinedFunction()</script>'
        "</body></html>"
    )
    result = load_in_chromium(page, tmp_path / "profile")
    assert result["loaded"]
    assert any(
        "missing.png" in json.dumps(e) or "ERR_FILE_NOT_FOUND" in json.dumps(e)
        for e in result["errors"] + result["failed"]
    )
    assert any("undefinedFunction" in json.dumps(e) for e in result["errors"])
    assert result["images"] == [[True, 0]]


@pytest.mark.parametrize(
    ("last", "says"),
    [
        (
            {"ism/pos_q10": 0.62, "ism/pos_q50": 0.91, "ism/u_cv": 0.4},
            "In the last epoch (2) ISM weakens pairs unevenly: positive pairs' weakening e^(-y) "
            "has 10th percentile 0.620 and median 0.910; ||u|| varies by 40 % across a batch.",
        ),
        (
            {"ism/pos_q10": 0.993, "ism/pos_q50": 0.996, "ism/u_cv": 0.012},
            "In the last epoch (2) ISM acts as the identity (or a uniform rescaling): the 10th "
            "percentile of the positive pairs' weakening e^(-y) is 0.993 (> 0.98); ||u|| varies by "
            "1.2 % across a batch (< 5 %).",
        ),
    ],
)
def test_the_ism_verdict_reads_the_last_epoch_by_the_monitors_rule(
    last: dict[str, float], says: str
) -> None:
    from idml.app.reports.runs import RunLog
    from idml.app.reports.sections import ism_verdict

    first = {"epoch": 1, "ism/pos_q10": 0.5, "ism/pos_q50": 0.5, "ism/u_cv": 0.9}
    run = RunLog(Path("run"), load_config(None), (first, {"epoch": 2, **last}))
    assert ism_verdict(run).startswith(says)
