"""What a user sees in a terminal and a log: a fast ``--help`` and ``--version``, a start-up summary,
one line per epoch with its test metric (piped or not), and a Ctrl-C that leaves a resumable run
and says how to resume it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import idml
from idml.app.cli import COMMANDS

REPO = Path(__file__).resolve().parents[1]

# Runs the CLI as `python -m idml` does, then reports which heavy modules the process imported.
PROBE = (
    "import sys\nfrom idml.app.cli import main\ntry:\n    main(sys.argv[1:])\n"
    "except SystemExit:\n    pass\n"
    "sys.stderr.write('heavy: %s\\n' % sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _probe(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", PROBE, *args],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )


# `idml ablate --help` lists the grid presets, defined beside the trainer: the one help that may
# load torch (it is made only when that help is printed, never for `idml --help`).
HELP_WITHOUT_TORCH = [["--help"], ["--version"]] + [
    [c.name, "--help"] for c in COMMANDS if c.name != "ablate"
]


@pytest.mark.parametrize("args", HELP_WITHOUT_TORCH, ids=" ".join)
def test_help_and_version_import_neither_torch_nor_numpy(args: list[str]) -> None:
    done = _probe(*args)
    assert "heavy: []" in done.stderr, done.stderr
    assert done.stdout.strip(), "nothing printed"


def test_help_answers_quickly() -> None:
    """``idml --help`` measured as a user starts it, in a fresh ``python -m idml`` process.

    The target is under 1 s; the bound is twice that on purpose: Python's start-up plus argparse
    take 0.1-0.3 s (0.10 s median on 2 cores at load 5, benchmarks/bench_cli_startup.py), while
    importing torch, which the parser used to do, takes 4-16 s on the same cores, so 2 s separates
    the two on any CI machine without failing on a loaded one. Three tries, the fastest counts
    (one scheduling hiccup does not fail it); the test above checks the cause (no torch import)
    exactly."""
    fastest = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "idml", "--help"],
            capture_output=True,
            text=True,
            env=_env(),
            timeout=120,
        )
        fastest = min(fastest, time.perf_counter() - start)
        assert done.returncode == 0, done.stderr
        assert "usage: idml" in done.stdout and "train" in done.stdout
    assert fastest < 2.0, f"idml --help took {fastest:.2f} s"


def test_version() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "idml", "--version"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    assert done.returncode == 0
    assert done.stdout.strip() == f"idml {idml.__version__}"


def test_lazy_package_exports_stay_importable() -> None:
    from idml import Embeddings, IntrospectiveMetric

    assert Embeddings.__module__ == "idml.embeddings"
    assert IntrospectiveMetric is idml.IntrospectiveMetric
    assert set(idml.__all__) <= set(dir(idml))
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        idml.Nope  # noqa: B018
