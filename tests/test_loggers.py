"""TensorBoard and MLflow (local file store, offline) hold what metrics.jsonl holds."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from idml.app.config import load_config
from idml.app.loggers import mlflow_key
from idml.app.training import Trainer
from tiny_run import TINY

RUN = [*TINY, "optim.epochs=2", "eval.ks=[1, 2]", "tensorboard=true"]


def _jsonl(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]


def _numeric(line: dict) -> dict[str, float]:
    return {k: float(v) for k, v in line.items() if k != "epoch" and isinstance(v, int | float)}


def test_tensorboard_events_equal_the_jsonl_log(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    Trainer(load_config(None, RUN), run, progress=False).fit()
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    lines = _jsonl(run)
    expected = {(k, line["epoch"]): v for line in lines for k, v in _numeric(line).items()}
    got = {(k, e.step): e.value for k in events.Tags()["scalars"] for e in events.Scalars(k)}
    assert set(got) == set(expected)
    for key, value in expected.items():
        # TensorBoard stores scalars as float32: 2^-24 relative rounding (abs 1e-30 only for values
        # below float32's normal range, whose rounding is ≤ 2^-150 absolute).
        assert got[key] == pytest.approx(value, rel=6e-8, abs=1e-30)


def test_mlflow_offline_run_holds_the_jsonl_log_and_resume_continues_it(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    run = tmp_path / "run"
    cfg = load_config(None, [*RUN, "tensorboard=false", "mlflow.enabled=true", "optim.epochs=1"])
    Trainer(cfg, run, progress=False).fit()
    more = load_config(None, [*RUN, "tensorboard=false", "mlflow.enabled=true"])
    Trainer(more, run, progress=False).fit(resume=True)  # epoch 2 into the same MLflow run

    state = json.loads((run / "mlflow.json").read_text())
    assert state["tracking_uri"] == (run / "mlruns").resolve().as_uri()  # local, no server
    client = MlflowClient(tracking_uri=state["tracking_uri"])
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    mlrun = runs[0]
    lines = _jsonl(run)
    assert len(lines) == 2
    for key in {k for line in lines for k in _numeric(line)}:
        history = client.get_metric_history(mlrun.info.run_id, mlflow_key(key))
        expected = [(line["epoch"], _numeric(line)[key]) for line in lines if key in line]
        # MLflow keeps float64 values as written: equal, not approximately.
        assert sorted((m.step, m.value) for m in history) == expected
    assert mlrun.data.tags["eval/nmi_method"] == "skipped"
    assert mlrun.data.params["loss.name"] == cfg.loss.name
    assert mlrun.data.params["eval.ks"] == "[1, 2]"


def test_mlflow_without_the_package_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import builtins

    real_import = builtins.__import__

    def no_mlflow(name: str, *args: Any, **kwargs: Any) -> ModuleType:
        if name.startswith("mlflow"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_mlflow)
    cfg = load_config(None, [*TINY, "mlflow.enabled=true"])
    with pytest.raises(ImportError, match=r"pip install 'idml\[mlflow\]'"):
        Trainer(cfg, tmp_path / "run", progress=False).fit()
