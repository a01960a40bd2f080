"""Config dataclasses as CLI options (cli/options.py): types, defaults, help, prefixes, errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import typer
from toy_configs import Grading, SampleFields
from typer.testing import CliRunner

from legorl.cli.options import ConfigOptions, with_configs
from legorl.core.errors import ConfigError


def _upper(text: str) -> list[str]:
    return [t.upper() for t in text.split("+")]


@dataclass
class Sample(SampleFields):
    shouted: list[str] = field(default_factory=list, metadata={"help": "Plus-separated.", "parse": _upper})
    keep: bool = field(default=False, metadata={"help": "Keep things."})
    internal: int = 7  # no help: not an option


def _app(**configs: ConfigOptions) -> tuple[typer.Typer, list[dict[str, object]]]:
    seen: list[dict[str, object]] = []
    app = typer.Typer()

    if "grading" in configs:
        @app.command("main")
        @with_configs(**configs)
        def composed(cfg: Sample, grading: Grading) -> None:
            seen.append({"cfg": cfg, "grading": grading})
    else:
        @app.command("main")
        @with_configs(**configs)
        def single(cfg: Sample, verbose: bool = typer.Option(False, "--verbose", help="Own option.")) -> None:
            seen.append({"cfg": cfg, "verbose": verbose})

    @app.command()
    def other() -> None:  # two commands, so typer keeps the subcommand name
        pass

    return app, seen


def test_fields_become_options_with_their_types_defaults_and_help() -> None:
    app, seen = _app(cfg=ConfigOptions(Sample))
    runner = CliRunner()
    result = runner.invoke(app, ["main", "--run", "r", "--samples", "4", "--lr", "3e-4", "--loss", "gspo",
                                 "--names", "x, y", "--shouted", "p+q", "--keep", "--verbose"])
    assert result.exit_code == 0, result.output
    cfg = seen[0]["cfg"]
    assert cfg == Sample(run=Path("r"), samples=4, learning_rate=3e-4, loss="gspo", names=["x", "y"],
                         shouted=["P", "Q"], keep=True)
    assert seen[0]["verbose"] is True
    help_text = CliRunner().invoke(app, ["main", "--help"], terminal_width=200).output
    for text in ("--samples", "Trials per task.", "--lr", "Learning rate.", "--names", "--verbose"):
        assert text in help_text
    assert "--learning-rate" in help_text and "--internal" not in help_text
    assert "[default: 1]" in help_text and "a,b" in help_text


@dataclass
class Switches:
    on: bool = field(default=True, metadata={"help": "Defaults to on."})
    off: bool = field(default=False, metadata={"help": "Defaults to off."})


def test_bool_options_turn_both_ways() -> None:
    seen: list[Switches] = []
    app = typer.Typer()

    @app.command("main")
    @with_configs(cfg=ConfigOptions(Switches))
    def main(cfg: Switches) -> None:
        seen.append(cfg)

    @app.command()
    def other() -> None:
        pass

    for args, expected in (([], Switches()), (["--no-on", "--off"], Switches(on=False, off=True)),
                           (["--on", "--no-off"], Switches())):
        result = CliRunner().invoke(app, ["main", *args])
        assert result.exit_code == 0, result.output
        assert seen[-1] == expected


def test_defaults_come_from_the_dataclass() -> None:
    app, seen = _app(cfg=ConfigOptions(Sample))
    result = CliRunner().invoke(app, ["main", "--run", "r"])
    assert result.exit_code == 0, result.output
    assert seen[0]["cfg"] == Sample(run=Path("r"))


def test_required_field_bad_value_and_validation() -> None:
    app, _ = _app(cfg=ConfigOptions(Sample))
    runner = CliRunner()
    missing = runner.invoke(app, ["main"])
    assert missing.exit_code != 0 and "--run" in missing.output
    bad_type = runner.invoke(app, ["main", "--run", "r", "--samples", "many"])
    assert bad_type.exit_code != 0 and "--samples" in bad_type.output
    bad_choice = runner.invoke(app, ["main", "--run", "r", "--loss", "ppo"])
    assert bad_choice.exit_code != 0 and "--loss" in bad_choice.output
    invalid = runner.invoke(app, ["main", "--run", "r", "--samples", "0"])
    assert isinstance(invalid.exception, ConfigError) and "--samples must be >= 1" in str(invalid.exception)


def test_several_configs_with_a_prefix_and_clashes_refused() -> None:
    app, seen = _app(cfg=ConfigOptions(Sample, only=("run", "samples")),
                     grading=ConfigOptions(Grading, prefix="grade-"))
    result = CliRunner().invoke(app, ["main", "--run", "r", "--grade-timeout", "5", "--grade-samples", "2"])
    assert result.exit_code == 0, result.output
    assert seen[0]["grading"] == Grading(timeout=5.0, samples=2)
    assert seen[0]["cfg"] == Sample(run=Path("r"))
    with pytest.raises(TypeError, match="options defined twice: samples"):
        _app(cfg=ConfigOptions(Sample), grading=ConfigOptions(Grading))
    with pytest.raises(TypeError, match="no documented field"):
        ConfigOptions(Sample, only=("internal",)).fields()
