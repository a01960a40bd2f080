"""Harnesses and engines named by dotted path: a real plug-in module (written here, on sys.path)
is found, checked and run; each way of getting it wrong is one line naming the spec."""

from __future__ import annotations

import asyncio
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import legorl.harnesses as harnesses
from legorl.core.errors import ConfigError, LegorlError
from legorl.engines import Engine, make_engine
from legorl.engines.base import SamplingParams
from legorl.harnesses import (
    BaseHarness,
    ProtocolHarness,
    TrialSpec,
    get,
    harness_class,
    parse_names,
)
from legorl.harnesses.base import End

PLUGIN = '''
from pathlib import Path

from legorl.engines.scripted import ScriptedEngine
from legorl.harnesses.base import BaseHarness, End, HarnessRun, ProcessHarness
from legorl.harnesses.simple import SimpleHarness


class Tweaked(SimpleHarness):
    """A BaseHarness subclass: legorl's own driver under another name and budget."""
    name = "tweaked"
    max_tokens = 64


class Fixer:
    """No legorl base class, only what the Harness protocol asks for: one model call, then it runs
    the bash command the model asked for in the sandbox and stops."""
    name = "fixer"
    in_container = False

    def mounts(self, trial_dir):
        return []

    def run(self, trial, sandbox, trial_dir):
        import json

        import openai

        client = openai.OpenAI(base_url=trial.openai_base_url, api_key="x", max_retries=0)
        tool = {"type": "function", "function": {"name": "bash", "parameters": {
            "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}
        reply = client.chat.completions.create(
            model=trial.model, messages=[{"role": "user", "content": trial.problem_statement}],
            tools=[tool], max_tokens=4096)
        (call,) = reply.choices[0].message.tool_calls
        res = sandbox.exec(json.loads(call.function.arguments)["command"], timeout=60, workdir=trial.workdir)
        log = Path(trial_dir) / "fixer.log"
        log.write_text(res.output)
        return HarnessRun(End.FINISHED, "applied", 0, False, 1.0, log)


FIXER = Fixer()  # a ready object works too


class Echo:
    """Runs in the container (so it has mounts) and ends at once, saying which trial it was."""
    name = "echo"
    in_container = True

    def mounts(self, trial_dir):
        return [(str(trial_dir), "/echo", True)]

    def run(self, trial, sandbox, trial_dir):
        return HarnessRun(End.SUBMITTED, trial.trial_id, 0, False, 0.0, Path(trial_dir) / "log")


class NoRun:
    name = "norun"
    in_container = False

    def mounts(self, trial_dir):
        return []


class Unnamed(Fixer):
    name = ""


class Abstract(ProcessHarness):
    name = "abstract"
    in_container = False


class Installs(Tweaked):
    needs_install = True


def scripted_engine(**kwargs):
    """An engine factory: any callable whose result satisfies the Engine protocol."""
    return ScriptedEngine(**kwargs)


class HalfEngine:
    name = "half"
    max_context = 10

    async def generate(self, prompt_ids, params):
        raise AssertionError


class Nameless(ScriptedEngine):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        del self.name


NOT_CALLABLE = 3
'''


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The plug-in module's (unique) name; the registry is restored after the test."""
    name = f"legorl_test_plugin_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(PLUGIN)
    (tmp_path / f"{name}_broken.py").write_text("import legorl_no_such_dependency\n")
    (tmp_path / f"{name}_raises.py").write_text("raise RuntimeError('plug-in boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(harnesses, "HARNESSES", dict(harnesses.HARNESSES))
    yield name
    for module in [m for m in sys.modules if m.startswith(name)]:
        del sys.modules[module]


def test_a_base_harness_subclass_by_either_spelling(plugin: str) -> None:
    for spec in (f"{plugin}:Tweaked", f"{plugin}.Tweaked"):
        harness = get(spec)
        assert type(harness).__name__ == "Tweaked" and isinstance(harness, BaseHarness)
        assert harness.name == "tweaked" and not harness.needs_install and harness.mounts(Path("/x")) == []
    assert parse_names(f"simple, {plugin}:Tweaked") == ["simple", f"{plugin}:Tweaked"]
    assert harnesses.HARNESSES[f"{plugin}:Tweaked"] is harness_class(f"{plugin}:Tweaked")  # loaded once


@pytest.mark.parametrize("attr", ["Fixer", "FIXER"])
def test_a_protocol_harness_is_adapted(plugin: str, attr: str, tmp_path: Path) -> None:
    harness = get(f"{plugin}:{attr}")
    assert isinstance(harness, ProtocolHarness) and isinstance(harness, BaseHarness)
    assert (harness.name, harness.in_container, harness.needs_install) == ("fixer", False, False)
    assert harness.mounts(tmp_path) == []
    assert type(harness.impl).__name__ == "Fixer"


@pytest.mark.parametrize(
    ("attr", "message"),
    [
        ("NoRun", r"not a harness: the class lacks run\(\)"),
        ("Unnamed", "name must be a non-empty string"),
        ("Abstract", "Abstract is abstract .*launch, read_end"),
        ("Installs", "needs_install is True"),
        ("Missing", "has no attribute 'Missing'"),
        ("NOT_CALLABLE", "not a harness: the int lacks name, in_container, mounts\\(\\), run\\(\\)"),
    ],
)
def test_a_wrong_harness_plugin_says_what_is_wrong(plugin: str, attr: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        get(f"{plugin}:{attr}")
    assert f"harness '{plugin}:{attr}'" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(LegorlError, match=f"^--harness: harness '{plugin}:{attr}': .*{message}"):
        parse_names(f"simple,{plugin}:{attr}")


def test_harness_modules_that_are_missing_or_broken(plugin: str) -> None:
    cases = {
        "legorl_no_such_plugin:Harness": "no module named 'legorl_no_such_plugin'",
        "legorl.no_such_module.Harness": "no module named 'legorl.no_such_module'",
        f"{plugin}_broken:Harness": f"importing {plugin}_broken failed: No module named 'legorl_no_such_dependency'",
        f"{plugin}_raises:Harness": f"importing {plugin}_raises failed: RuntimeError: plug-in boom",
        ":Harness": "write package.module:Name",
    }
    for spec, message in cases.items():
        with pytest.raises(ConfigError) as info:
            get(spec)
        assert str(info.value).startswith(f"harness {spec!r}: {message}"), info.value
    with pytest.raises(LegorlError, match=r"unknown harness 'nope' .*package\.module:Class"):
        get("nope")


def test_an_engine_plugin_is_built_and_checked(plugin: str, tiny_model: Path) -> None:
    engine = make_engine(f"{plugin}:scripted_engine", tokenizer=str(tiny_model), completions=["hi"], name="plug")
    assert isinstance(engine, Engine) and engine.name == "plug"
    generation = asyncio.run(engine.generate([1, 2, 3], SamplingParams(max_tokens=8)))
    assert generation.token_ids and generation.finish_reason == "stop"
    assert make_engine(f"{plugin}.scripted_engine", tokenizer=str(tiny_model), completions=["x"]).name == "scripted"
    with pytest.raises(ConfigError, match=r"^engine 'legorl_no_such_engine\.Engine': no module named 'legorl_no_such_engine'"):
        make_engine("legorl_no_such_engine.Engine")
    with pytest.raises(ConfigError, match=r"unknown engine 'nope'.*package\.module:Class"):
        make_engine("nope")


@pytest.mark.parametrize(
    ("attr", "message"),
    [
        ("HalfEngine", r"not an engine: the class lacks stream\(\), load_weights\(\), close\(\)"),
        ("Nameless", "not an engine: what it built lacks name"),
        ("NOT_CALLABLE", "not an engine class or factory"),
        ("Missing", "has no attribute 'Missing'"),
    ],
)
def test_a_wrong_engine_plugin_says_what_is_wrong(plugin: str, attr: str, message: str, tiny_model: Path) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        make_engine(f"{plugin}:{attr}", tokenizer=str(tiny_model), completions=["x"])
    assert str(info.value).startswith(f"engine '{plugin}:{attr}': ") and "\n" not in str(info.value)


@pytest.mark.podman
def test_a_plugin_harness_runs_a_trial_through_the_rollout_stage(plugin: str, tiny_model: Path, base_image: str,
                                                                 tmp_path: Path) -> None:
    """``--harness mypkg:Fixer`` end to end, on a plug-in engine too: a real sandbox, the real proxy;
    the patch the plug-in's command made is the trial's submission, and the row names the spec."""
    from rollout_support import fix_command, import_one, tool_call

    from legorl.core import shards
    from legorl.core.schemas import Kind, Outcome
    from legorl.proxy.clients import InProcessProxy
    from legorl.stages.rollout import RolloutConfig, rollout_stage

    run = tmp_path / f"run-{uuid.uuid4().hex[:12]}"
    task = import_one(run, tmp_path)
    spec = f"{plugin}:Fixer"
    engine = make_engine(f"{plugin}:scripted_engine", tokenizer=str(tiny_model),
                         completions=[tool_call("bash", {"command": fix_command(task)})], max_context=32768)
    with InProcessProxy(engine, str(tiny_model)) as proxy:
        summary = rollout_stage(RolloutConfig(run=run, harnesses=parse_names(spec), max_turns=2, timeout_s=120,
                                              retries=0), proxy)
    assert summary.outcomes == {"submitted": 1}
    (row,) = shards.read_rows(run / "rollouts", Kind.ROLLOUTS)
    assert row.harness == spec and row.outcome == Outcome.SUBMITTED, (row.outcome, row.error)
    assert row.patch and "+" in row.patch and len(row.calls) == 1 and row.segments


def test_a_protocol_harness_gets_mounts_and_runs_as_written(plugin: str, tmp_path: Path) -> None:
    harness = get(f"{plugin}:Echo")
    assert harness.in_container and harness.mounts(tmp_path) == [(str(tmp_path), "/echo", True)]
    run = harness.run(TrialSpec("t1", "fix it", "m", "http://x/v1", "http://x"), None, tmp_path)  # type: ignore[arg-type]
    assert (run.end, run.detail) == (End.SUBMITTED, "t1")
