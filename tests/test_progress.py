"""Progress off a terminal: plain lines, no carriage returns, a bounded number per loop."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from idml.progress import Progress
from tiny_run import TINY

REPO = Path(__file__).resolve().parents[1]


class _Clock:
    def __init__(self, step: float) -> None:
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_plain_lines_at_most_one_per_interval_plus_the_last() -> None:
    out = io.StringIO()
    clock = _Clock(0.5)  # 0.5 s per update: 100 updates take 50 s
    bar = Progress(100, "epoch 2/5", stream=out, interval=10.0, clock=clock)
    for i in range(100):
        bar.update(loss=1.0 / (i + 1))
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert 5 <= len(lines) <= 1 + 50 // 10  # one per 10 s of the 50 s, and the closing one
    # 10 s after the start (0.5 s) the 20th update has run: 2 steps/s, 80 steps left.
    assert lines[0] == "epoch 2/5: step 20/100 (20%), loss 0.0500, 2.0 step/s, ETA 0:00:40"
    assert lines[-1].startswith("epoch 2/5: step 100/100 (100%), loss 0.0100, ")
    assert lines[-1].endswith("elapsed")


def test_disabled_writes_nothing() -> None:
    out = io.StringIO()
    with Progress(3, "embed", stream=out, enabled=False) as bar:
        bar.update(3)
    assert out.getvalue() == ""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_train_under_a_pipe_writes_plain_epoch_lines(tmp_path: Path) -> None:
    (tmp_path / "run.yaml").write_text("name: piped\n")
    sets = [*TINY, "optim.epochs=2", "optim.max_steps_per_epoch=3"]
    cmd = [sys.executable, "-m", "idml", "train", str(tmp_path / "run.yaml")]
    cmd += ["--out", str(tmp_path / "run")] + [a for s in sets for a in ("--set", s)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stderr and "\r" not in done.stdout
    for epoch in ("epoch 1/2", "epoch 2/2"):
        lines = [line for line in done.stderr.splitlines() if line.startswith(f"{epoch}:")]
        # The closing line always; a tiny epoch ends long before the 10 s interval elapses.
        assert len(lines) == 1, done.stderr
        assert lines[0].startswith(f"{epoch}: step 3/3 (100%), loss ")
        assert "step/s" in lines[0]
    assert any(line.startswith("embed: batch ") for line in done.stderr.splitlines())
    # What a log file of stdout keeps: one line per epoch with its test metric (not only with
    # --no-progress), numbered as in metrics.jsonl.
    epochs = [line for line in done.stdout.splitlines() if line.startswith("epoch ")]
    assert [line.split(":")[0] for line in epochs] == ["epoch 1/2", "epoch 2/2"], done.stdout
    assert all(
        re.search(r", recall@1 [01]\.\d{4}, ", line) and "3 steps" in line for line in epochs
    )


def test_evaluate_under_a_pipe_shows_progress_by_default(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    np.save(tmp_path / "x.npy", rng.normal(size=(60, 8)).astype(np.float32))
    np.save(tmp_path / "y.npy", np.repeat(np.arange(6), 10))
    base = [sys.executable, "-m", "idml", "evaluate", "--embeddings", str(tmp_path / "x.npy")]
    base += ["--labels", str(tmp_path / "y.npy"), "--json"]
    done = subprocess.run(base, capture_output=True, text=True, env=_env(), timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.lstrip().startswith("{")  # progress stays off stdout
    assert "\r" not in done.stderr
    assert any(line.startswith("retrieval: tile ") for line in done.stderr.splitlines())
    quiet = subprocess.run(
        [*base, "--no-progress"], capture_output=True, text=True, env=_env(), timeout=600
    )
    assert quiet.returncode == 0 and "retrieval:" not in quiet.stderr
