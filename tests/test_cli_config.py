"""Config files (cli/options.py): ``--config FILE`` (YAML or TOML) and ``--print-config``, on every command
that takes configs: file beats default, the command line beats the file, bad files are one clear error, and
what ``--print-config`` writes reads back to the same run."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import pytest
import typer
import yaml
from toy_configs import Grading, SampleFields
from typer.testing import CliRunner

from legorl.cli.app import app as legorl_app
from legorl.cli.options import ConfigOptions, with_configs
from legorl.core.errors import ConfigError


@dataclass(frozen=True)
class Part:
    """A value the command line gives as text: "i/n"."""

    index: int
    count: int

    @classmethod
    def parse(cls, text: str) -> Part:
        index, _, count = text.partition("/")
        if not (index.isdigit() and count.isdigit()):
            raise ConfigError(f"--part {text!r}: expected i/n")
        return cls(int(index), int(count))

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",")]


@dataclass
class Sample(SampleFields):
    part: Part | None = field(default=None, metadata={"help": "i/n.", "parse": Part.parse})
    ks: list[int] | None = field(default=None, metadata={"help": "k values.", "parse": _ints})
    label: str | None = field(default=None, metadata={"help": "A label."})
    keep: bool = field(default=False, metadata={"help": "Keep things."})
    internal: int = 7  # no help: neither an option nor a key


def _app() -> tuple[typer.Typer, list[dict[str, Any]]]:
    seen: list[dict[str, Any]] = []
    app = typer.Typer()

    @app.command("main")
    @with_configs(cfg=ConfigOptions(Sample), grading=ConfigOptions(Grading, prefix="grade-"))
    def main(cfg: Sample, grading: Grading,
             verbose: Annotated[bool, typer.Option("--verbose", help="Own option.")] = False,
             out: Annotated[Path | None, typer.Option("--out", help="Own path.")] = None,
             key: Annotated[str | None, typer.Option("--key", envvar="TOY_KEY", help="A secret.")] = None) -> None:
        seen.append({"cfg": cfg, "grading": grading, "verbose": verbose, "out": out, "key": key})

    @app.command()
    def other() -> None:  # two commands, so typer keeps the subcommand name
        pass

    return app, seen


def _invoke(app: typer.Typer, *args: str, env: dict[str, str] | None = None) -> Any:
    result = CliRunner().invoke(app, list(args), env=env)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    assert result.exit_code == 0, result.output
    return result


def test_a_yaml_file_sets_options_and_the_command_line_overrides_it(tmp_path: Path) -> None:
    app, seen = _app()
    path = tmp_path / "run.yaml"
    path.write_text("run: r\nsamples: 4\nlearning_rate: 1e-5\nnames: [x, y]\npart: 1/4\nks: [1, 2]\n"
                    "grade-timeout: 5\ngrade_samples: 2\nkeep: true\nverbose: true\nout: o\n")
    _invoke(app, "main", "--config", str(path), "--samples", "9", "--grade-samples", "3")
    assert seen[-1]["cfg"] == Sample(run=Path("r"), samples=9, learning_rate=1e-5, names=["x", "y"], part=Part(1, 4),
                                     ks=[1, 2], keep=True)
    assert seen[-1]["grading"] == Grading(timeout=5.0, samples=3)  # 3 on the command line is Grading's default:
    assert (seen[-1]["verbose"], seen[-1]["out"]) == (True, Path("o"))  # what was given wins, not what differs


def test_a_toml_file_too(tmp_path: Path) -> None:
    app, seen = _app()
    path = tmp_path / "run.toml"
    path.write_text('run = "r"\nloss = "gspo"\nnames = ["x"]\npart = "0/2"\nks = [3]\ngrade_timeout = 7\nkeep = true\n')
    _invoke(app, "main", "--config", str(path), "--no-keep")
    assert seen[-1]["cfg"] == Sample(run=Path("r"), loss="gspo", names=["x"], part=Part(0, 2), ks=[3])
    assert seen[-1]["grading"] == Grading(timeout=7.0)


def test_a_null_unsets_an_option_and_the_command_line_still_wins(tmp_path: Path) -> None:
    app, seen = _app()
    path = tmp_path / "run.yaml"
    path.write_text("run: r\ntemperature: null\n")
    _invoke(app, "main", "--config", str(path))
    assert seen[-1]["cfg"].temperature is None  # click's defaults cannot carry a None: the machinery does
    _invoke(app, "main", "--config", str(path), "--temperature", "0.5")
    assert seen[-1]["cfg"].temperature == 0.5
    printed = _invoke(app, "main", "--config", str(path), "--print-config").stdout
    assert yaml.safe_load(printed)["temperature"] is None
    toml = CliRunner().invoke(app, ["main", "--config", str(path), "--print-config", "--print-format", "toml"])
    assert isinstance(toml.exception, ConfigError)
    assert "temperature is unset (null), which TOML cannot write" in str(toml.exception)


FLAGS = ("--run", "r", "--samples", "3", "--temperature", "0.25", "--loss", "gspo", "--lr", "3e-4",
         "--names", "x,y", "--part", "2/8", "--ks", "1,5", "--label", "1e-6", "--keep",
         "--grade-timeout", "12.5", "--verbose", "--out", "some dir/o")


@pytest.mark.parametrize("fmt", ["yaml", "toml"])
def test_print_config_reads_back_to_the_same_run(tmp_path: Path, fmt: str) -> None:
    app, seen = _app()
    _invoke(app, "main", *FLAGS)
    printed = _invoke(app, "main", *FLAGS, "--print-config", "--print-format", fmt).stdout
    assert len(seen) == 1  # printing does not run the command
    data = tomllib.loads(printed) if fmt == "toml" else yaml.safe_load(printed)
    assert data["part"] == "2/8" and data["ks"] == [1, 5] and data["label"] == "1e-6" and data["run"] == "r"
    assert "internal" not in data and "config_file" not in data and data.get("key") is None
    path = tmp_path / f"run.{fmt}"
    path.write_text(printed)
    _invoke(app, "main", "--config", str(path))
    assert seen[-1] == seen[0]
    assert seen[0]["cfg"] != Sample(run=Path("r"))  # the flags changed the run, so the file had to carry them
    # what it prints from the file is what it read (the --config file's format, unless told)
    assert _invoke(app, "main", "--config", str(path), "--print-config").stdout == printed


def test_a_value_from_the_environment_is_not_written(tmp_path: Path) -> None:
    app, _ = _app()
    printed = _invoke(app, "main", "--run", "r", "--print-config", env={"TOY_KEY": "secret"}).stdout
    assert "secret" not in printed and "key" not in yaml.safe_load(printed)
    printed = _invoke(app, "main", "--run", "r", "--key", "typed", "--print-config").stdout
    assert yaml.safe_load(printed)["key"] == "typed"


@pytest.mark.parametrize(("name", "text", "expected"), [
    ("run.yaml", "sampels: 3\n", "unknown key 'sampels': did you mean samples?"),
    ("run.yaml", "internal: 3\n", "unknown key 'internal'"),  # not an option: not a key either
    ("run.yaml", "lr: 0.1\n", "--lr is the command-line alias of --learning-rate; the file names it learning_rate"),
    ("run.yaml", "grade:\n  timeout: 5\n", "unknown key 'grade': the file is flat, one key per option, without "
                                          "sections (e.g. grade_timeout)"),
    ("run.yaml", "samples: many\n", "samples: expected a whole number, got \"many\""),
    ("run.yaml", "samples: 2.5\n", "samples: expected a whole number, got 2.5"),
    ("run.yaml", "keep: maybe\n", "keep: expected true or false, got \"maybe\""),
    ("run.yaml", "loss: ppo\n", "loss: expected one of grpo, gspo, got \"ppo\""),
    ("run.yaml", "label: yes\n", "label: expected a string, got true (quote it)"),
    ("run.yaml", "names: {a: 1}\n", "names: expected a list (or comma-separated text), got {\"a\": 1}"),
    ("run.yaml", "names: [a, 'b,c']\n", "names: expected a list (or comma-separated text)"),
    ("run.yaml", "part: three\n", "part: --part 'three': expected i/n"),  # the parse function's own error
    ("run.yaml", "ks: [1, x]\n", "ks: invalid literal for int()"),  # even a ValueError of one
    ("run.yaml", "label: 12\n", "label: expected a string, got 12 (quote it)"),
    ("run.yaml", "run: null\n", "run: expected a path (a string), got null"),
    ("run.yaml", "grade_samples: 2\ngrade-samples: 3\n", "grade_samples is given twice"),
    ("run.yaml", "- a\n", "expected a mapping of option names to values, got [\"a\"]"),
    ("run.yaml", "samples: [\n", "not valid YAML"),
    ("run.toml", "samples = \n", "not valid TOML"),
    ("run.toml", 'samples = "x"\n', "samples: expected a whole number, got \"x\""),
    ("run.json", "{}", "a config file is YAML (.yaml, .yml) or TOML (.toml)"),
    ("missing.yaml", None, "cannot read it"),
    # the config's own check, on a value from the file: named with the file and the key
    ("run.yaml", "run: r\nsamples: 0\n", "--samples must be >= 1 (got 0) ({path} sets samples: 0)"),
])
def test_a_bad_file_is_one_error_naming_the_file_the_key_and_what_is_expected(
        tmp_path: Path, name: str, text: str | None, expected: str) -> None:
    app, seen = _app()
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    result = CliRunner().invoke(app, ["main", "--config", str(path), "--run", "r"])
    assert isinstance(result.exception, ConfigError), result.output
    message = str(result.exception)
    if "{path}" in expected:  # the config's own message, then which value of the file it is about
        assert message.endswith(expected.replace("{path}", str(path))), message
    else:
        assert message.startswith(f"{path}: ") and expected in message, message
    assert not seen


def test_an_option_of_the_command_may_not_take_a_config_file_option_name() -> None:
    def command(cfg: Sample, print_config: bool = False) -> None:
        pass

    with pytest.raises(TypeError, match="options defined twice: print_config"):
        with_configs(cfg=ConfigOptions(Sample))(command)


@pytest.mark.heavy
def test_the_real_cli_shows_a_bad_file_as_one_line(tmp_path: Path) -> None:
    path = tmp_path / "rollout.yaml"
    path.write_text("run: r\nharnesses: [simple]\nsamples: lots\n")
    result = subprocess.run([sys.executable, "-m", "legorl.cli", "rollout", "--config", str(path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip() == f'error: {path}: samples: expected a whole number, got "lots"'


# --------------------------------------------------------------------------- every real command

# Each command's required options, then a few that differ from their defaults (of each of its configs
# where it can: a prefixed one, a parsed one, a list, a Literal, an own option).
COMMANDS: dict[str, tuple[list[str], list[str]]] = {
    "rollout": (["--run", "r", "--harness", "simple"],
                ["--samples", "3", "--shard", "1/4", "--temperature", "0.5", "--limit", "2", "--proxy", "http://p:1",
                 "--max-tools", "9", "--executor", "ray", "--json"]),
    "grade": ([], ["--run", "r", "--timeout", "5", "--no-canaries", "--shard", "0/2", "--memory", "2g", "--gold",
                   "--tasks", "t", "--cpus", "1.5"]),
    "train": (["--run", "r", "--model", "m"],
              ["--lr", "1e-5", "--loss", "dapo", "--groups-per-batch", "2", "--report-to", "none", "--no-padding-free",
               "--step", "3", "--resume", "--out", "ckpt"]),
    "loop": (["--run", "r", "--harness", "simple", "--model", "m"],
             ["--grade-timeout", "5", "--grade-confirm", "--steps", "2", "--max-staleness", "1", "--stale-tokens",
              "mask", "--seed", "3", "--max-turns", "7", "--timeout", "99.5"]),
    "eval": (["--run", "r", "--harness", "simple,mini-swe-agent"],
             ["--model", "m", "--ks", "1,2", "--samples", "2", "--grade-concurrency", "3", "--baseline", "b",
              "--temperature", "0", "--max-body-mb", "8"]),
    "serve-proxy": (["--model", "m"],
                    ["--max-turns", "5", "--max-wall", "30", "--port", "0", "--temperature", "0.7", "--dtype",
                     "bfloat16", "--max-connections", "3", "--single-session"]),
    "inspect": (["r"], ["--json"]),
    "dashboard": (["r"], ["--port", "9000", "--compare", "r2", "--poll-ms", "500"]),
    "setup": ([], ["--json"]),
}


def _configured_commands() -> set[str]:
    return {c.name for c in legorl_app.registered_commands if hasattr(c.callback, "command") and c.name}


def test_every_command_that_takes_configs_is_round_tripped_here() -> None:
    assert _configured_commands() == set(COMMANDS)


def _capture(monkeypatch: pytest.MonkeyPatch, command: str) -> list[dict[str, Any]]:
    """Stand in for the command: record what it is called with (the built configs, its own options)."""
    seen: list[dict[str, Any]] = []
    info = next(c for c in legorl_app.registered_commands if c.name == command)
    monkeypatch.setattr(info.callback, "command", lambda **kwargs: seen.append(kwargs))
    return seen


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.heavy
def test_print_config_then_config_gives_the_same_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     command: str) -> None:
    required, changed = COMMANDS[command]
    seen = _capture(monkeypatch, command)
    _invoke(legorl_app, command, *required)
    _invoke(legorl_app, command, *required, *changed)
    defaults, run = seen
    assert run != defaults
    for fmt in ("yaml", "toml"):
        printed = _invoke(legorl_app, command, *required, *changed, "--print-config", "--print-format", fmt).stdout
        path = tmp_path / f"{command}.{fmt}"
        path.write_text(printed)
        _invoke(legorl_app, command, "--config", str(path))
        assert seen[-1] == run, fmt
        assert _invoke(legorl_app, command, "--config", str(path), "--print-config").stdout == printed
    assert len(seen) == 4  # printing ran nothing


def test_the_command_line_beats_the_file_in_a_composed_command(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _capture(monkeypatch, "loop")
    path = tmp_path / "loop.yaml"
    path.write_text("run: r\nharnesses: [simple]\nmodel: m\ngrade_test_timeout: 5\nsamples: 4\nsteps: 9\n")
    _invoke(legorl_app, "loop", "--config", str(path), "--grade-timeout", "7", "--steps", "4")
    got = seen[-1]
    assert (got["grade"].test_timeout, got["rollout"].samples, got["loop"]["steps"]) == (7.0, 4, 4)
