"""How long the command line takes to answer before any work: ``idml --help``, ``idml --version``
and each sub-command's ``--help``, as a user starts them (a fresh ``python -m idml`` process).

Each command runs ``--repeat`` times; the table gives the median and the slowest wall time, and
whether the process imported torch (it should not: the parser imports nothing heavy, each
sub-command imports what it needs when it runs). ``idml ablate --help`` lists the grid presets,
which live beside the trainer, so it is the one help that loads torch.

Example (the recorded run): ``python benchmarks/bench_cli_startup.py --repeat 10``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
COMMANDS = [
    ["--help"],
    ["--version"],
    *(
        [name, "--help"]
        for name in (
            "train",
            "evaluate",
            "embed",
            "demo",
            "report",
            "ablate",
            "index",
            "search",
            "export",
            "serve",
        )
    ),
]
# Runs the CLI as `python -m idml` does and says afterwards whether torch was imported.
PROBE = (
    "import sys\nfrom idml.app.cli import main\ntry:\n    main(sys.argv[1:])\n"
    "except SystemExit:\n    pass\nsys.stderr.write('torch imported: %s\\n' % ('torch' in sys.modules))"
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=10, help="runs of each command")
    args = p.parse_args()
    env = dict(os.environ, PYTHONPATH=f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    print(f"load average: {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} CPUs")
    print(f"{'command':<24} {'median s':>9} {'max s':>7}  torch")
    for command in COMMANDS:
        times, torch_loaded = [], False
        for _ in range(args.repeat):
            start = time.perf_counter()
            done = subprocess.run(
                [sys.executable, "-c", PROBE, *command], capture_output=True, text=True, env=env
            )
            times.append(time.perf_counter() - start)
            torch_loaded = "torch imported: True" in done.stderr
        label = "idml " + " ".join(command)
        print(
            f"{label:<24} {statistics.median(times):9.3f} {max(times):7.3f}  "
            f"{'yes' if torch_loaded else 'no'}"
        )


if __name__ == "__main__":
    main()
