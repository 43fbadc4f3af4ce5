"""The command line's sub-commands as :class:`~idml.app.cli.command.Command` values."""

from __future__ import annotations

import pytest

from idml.app.cli import COMMANDS, build_parser, main
from idml.app.cli.command import Option
from idml.app.cli.options import NO_PROGRESS, OVERRIDES


def test_every_command_is_registered_and_prints_its_help(
    capsys: pytest.CaptureFixture[str],
) -> None:
    names = [command.name for command in COMMANDS]
    workflow = ["train", "evaluate", "embed", "demo", "report", "ablate", "cache"]
    assert names == [*workflow, "index", "search", "export", "serve"]
    for name in names:
        with pytest.raises(SystemExit) as exit_:
            main([name, "--help"])
        assert exit_.value.code == 0
        assert capsys.readouterr().out.startswith(f"usage: idml {name} ")


def test_a_shared_option_keeps_its_settings_where_a_command_changes_its_help() -> None:
    quiet = NO_PROGRESS.but(help="no progress bars")
    assert quiet.settings == {"action": "store_true", "help": "no progress bars"}
    assert "help" not in NO_PROGRESS.settings
    assert Option("-k", type=int).but(default=3).settings == {"type": int, "default": 3}


def test_a_shared_default_is_not_changed_by_a_parse() -> None:
    parser = build_parser()
    assert parser.parse_args(["train", "c.yaml", "--set", "a=1"]).overrides == ["a=1"]
    assert parser.parse_args(["ablate", "c.yaml", "--grid", "x=1,2"]).overrides == []
    assert OVERRIDES.settings["default"] == []


def test_ablate_lists_the_presets_after_its_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["ablate", "--help"])
    out = capsys.readouterr().out
    assert "grid keys are raw config keys (metric.gamma=0,2,4) or presets:\n" in out
    # Printed as written: the description is one line however wide the terminal.
    assert "Run every cell of a grid for N seeds (finished cells are reused) and write OUT/" in out
