"""The IDML study's bookkeeping (``benchmarks/study_idml.py``): what keeps a grid honest.

A grid's arms must share one recipe (budget and knobs), and a recipe changed by ``converge --adopt``
must not silently retrain or mix with a grid run at the old one. The study itself trains for hours
and lives in ``benchmarks/``; these tests check its pure parts.
"""

from __future__ import annotations

import doctest
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "study_idml.py"


@pytest.fixture(scope="module")
def study() -> ModuleType:
    spec = importlib.util.spec_from_file_location("study_idml", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["study_idml"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("study_idml", None)


def test_the_study_examples_hold(study: ModuleType) -> None:
    result = doctest.testmod(study)
    assert result.attempted >= 3 and result.failed == 0


def test_a_grid_keeps_the_recipe_its_runs_were_trained_with(
    study: ModuleType, tmp_path: Path
) -> None:
    folder = tmp_path / "omniglot_cnn" / "proxy_anchor"
    ten = {
        "recipe": "proxy_lr×10, 10 epochs",
        "overrides": ["optim.proxy_lr_mult=10", "optim.epochs=10"],
    }
    study.pin_recipe(folder, ten)
    assert json.loads((folder / study.FOLDER_RECIPE).read_text())["overrides"] == ten["overrides"]
    study.pin_recipe(folder, dict(ten, validation_map_r=0.5))  # the same recipe: nothing to say
    assert study.pinned_recipe(folder) == "proxy_lr×10, 10 epochs"

    twenty = {
        "recipe": "proxy_lr×10, 20 epochs",
        "overrides": ["optim.proxy_lr_mult=10", "optim.epochs=20"],
    }
    with pytest.raises(SystemExit) as stop:
        study.pin_recipe(folder, twenty)
    message = str(stop.value)
    assert str(folder) in message
    assert "10 epochs" in message and "20 epochs" in message and "--out" in message
    assert study.pinned_recipe(folder) == "proxy_lr×10, 10 epochs"  # the old pin is untouched
    assert study.pinned_recipe(tmp_path / "elsewhere") is None


def test_doubling_a_budget_keeps_every_other_knob(study: ModuleType) -> None:
    name, overrides = study.doubled_budget(
        {
            "recipe": "proxy_lr×10, 20 epochs",
            "overrides": ["optim.proxy_lr_mult=10", "optim.epochs=20"],
        }
    )
    assert name == "proxy_lr×10, 40 epochs"
    assert overrides == ("optim.proxy_lr_mult=10", "optim.epochs=40")


def test_a_table_label_must_be_a_plain_name(
    study: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        study.main(["tables", "--setting", "demo", "--label", "../escape"])
    assert "--label" in capsys.readouterr().err
