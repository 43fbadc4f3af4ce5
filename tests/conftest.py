"""Shared test set-up: make the helper modules next to the tests importable (``tiny_run``)."""

from __future__ import annotations

import sys
from pathlib import Path

# --import-mode=importlib does not put the tests folder on sys.path; the helpers need it.
sys.path.insert(0, str(Path(__file__).resolve().parent))
