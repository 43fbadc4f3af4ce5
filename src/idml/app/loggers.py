"""Experiment loggers behind one interface: each receives what ``metrics.jsonl`` holds, per epoch.

``metrics.jsonl`` in the run folder is the record every tool of idml reads; the loggers mirror it
into the dashboards people already run:

* :class:`TensorBoardLogger` — event files in ``<run>/tensorboard`` (``tensorboard`` is in the
  ``test`` extra and installed by ``make setup``; used whenever it is importable and
  ``tensorboard: true``). Scalars are stored as float32 by TensorBoard.
* :class:`MLflowLogger` — an MLflow run (``mlflow.enabled: true``; ``pip install 'idml[mlflow]'``),
  by default in a local file store ``<run>/mlruns`` that needs no server
  (``mlflow ui --backend-store-uri <run>/mlruns``). The run's config is logged as parameters, each
  numeric log entry as a metric at step = epoch (MLflow refuses ``@`` in names, so ``recall@1`` is
  logged as ``recall_at_1``), text entries such as ``eval/nmi_method`` as tags. A resumed training
  run continues the same MLflow run.

A logger is only a mirror: it never decides what is logged, so all of them hold the same numbers.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Protocol


class RunLogger(Protocol):
    """What the trainer calls: one ``log`` per epoch with the JSONL line, ``close`` at the end."""

    def log(self, line: dict[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


def _numbers(line: dict[str, Any]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in line.items()
        if k != "epoch" and isinstance(v, int | float) and not isinstance(v, bool)
    }


class TensorBoardLogger:
    """Scalars of every epoch into ``<log_dir>`` (TensorBoard event files)."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(log_dir))

    def log(self, line: dict[str, Any], step: int) -> None:
        for key, value in _numbers(line).items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def mlflow_key(key: str) -> str:
    """``test/recall@1`` → ``test/recall_at_1``: MLflow names allow ``[/\\w.\\- :]`` only."""
    return key.replace("@", "_at_")


def _flatten(raw: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in raw.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[mlflow_key(prefix + key)] = (
                json.dumps(value) if isinstance(value, list) else str(value)
            )
    return out


class MLflowLogger:
    """One MLflow run per training run; resumed training continues it (``<run>/mlflow.json``)."""

    STATE_FILE = "mlflow.json"

    def __init__(
        self,
        run_dir: Path,
        run_name: str,
        params: dict[str, Any],
        tracking_uri: str | None = None,
        experiment: str = "idml",
        resume: bool = False,
    ) -> None:
        try:
            from mlflow.entities import Param
            from mlflow.tracking import MlflowClient
        except ImportError as err:
            raise ImportError(
                "mlflow.enabled=true needs MLflow: pip install 'idml[mlflow]' "
                "(or set mlflow.enabled=false)"
            ) from err
        uri = tracking_uri or (run_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):
            # MLflow 3 keeps the local file store behind an explicit opt-in; a local store that
            # needs no server or database is what this logger's default is for.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._client = MlflowClient(tracking_uri=uri)
        state_path = run_dir / self.STATE_FILE
        state = json.loads(state_path.read_text()) if resume and state_path.is_file() else None
        if state is not None and state.get("tracking_uri") == uri:
            self.run_id = state["run_id"]
            self._client.update_run(self.run_id, status="RUNNING")
        else:
            found = self._client.get_experiment_by_name(experiment)
            exp_id = found.experiment_id if found else self._client.create_experiment(experiment)
            self.run_id = self._client.create_run(exp_id, run_name=run_name).info.run_id
            flat = _flatten(params)
            batch = [Param(k, v[:6000]) for k, v in flat.items()]
            for start in range(0, len(batch), 100):  # MLflow takes at most 100 params a call
                self._client.log_batch(self.run_id, params=batch[start : start + 100])
            state_path.write_text(json.dumps({"run_id": self.run_id, "tracking_uri": uri}))
        self.tracking_uri = uri

    def log(self, line: dict[str, Any], step: int) -> None:
        from mlflow.entities import Metric, RunTag

        stamp = int(time.time() * 1000)
        metrics = [Metric(mlflow_key(k), v, stamp, step) for k, v in _numbers(line).items()]
        tags = [RunTag(mlflow_key(k), v) for k, v in line.items() if isinstance(v, str)]
        self._client.log_batch(self.run_id, metrics=metrics, tags=tags)

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


def tensorboard_available() -> bool:
    """Whether TensorBoard's writer can be imported (it is optional outside the test extra)."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        return False
    return True
