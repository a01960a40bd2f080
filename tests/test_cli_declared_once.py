"""Each setting is declared once: an option that several commands take has one default and one help text.

The whole command line is enumerated through click (what ``legorl --help`` shows), so a field copied
into a second config, or a second ``typer.Option`` for a setting a config already declares, fails here.
Options that only share a name (the dashboard's ``--port`` is not the proxy's) are listed in
:data:`HOMONYMS`, each with what tells them apart; a listed name that stops differing fails too.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import typer

from legorl.cli.app import app
from legorl.core.errors import ConfigError, LegorlError
from legorl.engines.base import MIN_TEMPERATURE
from legorl.engines.config import (
    ENGINES,
    EngineConfig,
    EngineSpec,
    ProxySampling,
    SamplingConfig,
    logprob_temperature,
    sampled_temperature,
)
from legorl.flows.evaluation import EvalSettings
from legorl.flows.policy import PolicySpec
from legorl.stages.rollout import RolloutConfig
from legorl.training.config import TrainConfig
from legorl.training.options import TrainOptions
from legorl.trials.lifecycle import TrialOptions

# Different settings under one name, and what tells them apart.
HOMONYMS = {
    "--api-key": "serve-proxy: the key its clients must send; rollout/eval: the key sent to a --proxy",
    "--concurrency": "trials at once (rollout, eval, loop) vs grading or mining containers at once",
    "--dtype": "serve-proxy: the engine's dtype (unset: the engine's default) vs `vllm serve`'s, float32",
    "--force": "each command overwrites its own thing (a model, a harness install, a vLLM install)",
    "--host": "the proxy's address vs the dashboard's",
    "--id": "which tasks to import vs which tasks to check",
    "--limit": "the first N tasks of a run (rollout, eval, loop) vs rows imported (tasks import)",
    "--max-turns": "a proxy session's budget (serve-proxy) vs a trial's (rollout, eval, loop)",
    "--model": "the served policy (serve-proxy, rollout, eval), the trainer's start (train), the loop's both",
    "--name": "the name the proxy answers with vs the name a vLLM server serves",
    "--out": "grades, checkpoints, task bundles",
    "--port": "the proxy's vs the dashboard's",
    "--run": "eval's lives in RUN/eval, the others' in RUN",
    "--seed": "the trainer's vs a task miner's, a random init's, a warmup's",
    "--step": "the step trials belong to (rollout, eval) vs the step to train on (train: default the latest)",
    "--steps": "policy steps of the loop vs training steps of `model warmup`",
    "--tasks": "the tasks to grade vs the task set to evaluate",
}

# The settings the policy's sampling and engine are: the one declaration, and the commands that embed it.
DECLARED = {
    "--temperature": (SamplingConfig, "temperature", {"rollout", "eval", "loop", "train", "serve-proxy"}),
    "--top-p": (ProxySampling, "top_p", {"serve-proxy"}),
    "--engine": (EngineSpec, "engine", {"serve-proxy", "rollout", "eval", "loop"}),
    "--upstream": (EngineSpec, "upstream", {"serve-proxy", "rollout", "eval", "loop"}),
    "--reload-tolerance": (EngineSpec, "reload_tolerance", {"serve-proxy", "loop"}),
}


def _options() -> dict[str, list[tuple[str, Any]]]:
    """Every option of every command, by its first name: (the command's path, the click option)."""
    found: dict[str, list[tuple[str, Any]]] = defaultdict(list)

    def walk(command: Any, path: str) -> None:
        if hasattr(command, "commands"):  # a group (typer may bring its own click: no isinstance)
            for name, sub in command.commands.items():
                walk(sub, f"{path} {name}".strip())
            return
        for param in command.params:
            if param.param_type_name == "option":
                found[param.opts[0]].append((path, param))

    walk(typer.main.get_command(app), "")
    return found


OPTIONS = _options()


def _field(cls: type, name: str) -> dataclasses.Field[Any]:
    return next(f for f in dataclasses.fields(cls) if f.name == name)


def test_the_cli_is_enumerated() -> None:
    commands = {path for uses in OPTIONS.values() for path, _ in uses}
    assert {"rollout", "eval", "loop", "train", "serve-proxy", "grade", "tasks import", "vllm serve"} <= commands
    assert len(OPTIONS) > 100  # the whole command line, not one command


def test_an_option_several_commands_take_has_one_default_and_one_help() -> None:
    shared = {name: uses for name, uses in OPTIONS.items() if len({path for path, _ in uses}) > 1}
    assert set(DECLARED) - {"--top-p", "--reload-tolerance"} <= set(shared)
    for name, uses in shared.items():
        if name in HOMONYMS:
            continue
        helps = {option.help for _, option in uses}
        defaults = {repr(option.default) for _, option in uses}
        where = ", ".join(path for path, _ in uses)
        assert len(helps) == 1, f"{name} ({where}) has {len(helps)} help texts: declare it once\n{helps}"
        assert len(defaults) == 1, f"{name} ({where}) has defaults {defaults}: declare it once"


def test_every_homonym_is_still_shared_and_still_different() -> None:
    for name in HOMONYMS:
        uses = OPTIONS.get(name, [])
        assert len({path for path, _ in uses}) > 1, f"{name}: no longer shared; drop it from HOMONYMS"
        assert len({(option.help, repr(option.default)) for _, option in uses}) > 1, (
            f"{name}: every command now says the same; drop it from HOMONYMS")


@pytest.mark.parametrize("name", sorted(DECLARED))
def test_a_sampling_or_engine_option_comes_from_its_one_declaration(name: str) -> None:
    cls, field_name, commands = DECLARED[name]
    declared = _field(cls, field_name)
    uses = OPTIONS[name]
    assert {path for path, _ in uses} == commands
    for path, option in uses:
        assert option.help == declared.metadata["help"], path
        assert option.default == declared.default, path


def test_temperature_is_one_field_every_config_inherits() -> None:
    """Not an equal copy: the very field object SamplingConfig declares (its default, its help)."""
    declared = _field(SamplingConfig, "temperature")
    assert declared.default is None
    for cls in (TrialOptions, RolloutConfig, EvalSettings, TrainOptions, TrainConfig, ProxySampling, PolicySpec):
        assert _field(cls, "temperature") is declared, cls.__name__
    for cls in (EngineConfig, PolicySpec):
        for name in ("engine", "upstream", "reload_tolerance"):
            assert _field(cls, name) is _field(EngineSpec, name), (cls.__name__, name)
    help_text = declared.metadata["help"]
    assert OPTIONS["--temperature"][0][1].help is not None and "0 = greedy" in help_text


def test_an_unset_temperature_is_each_commands_own() -> None:
    """One default (unset), read by each command as its help says."""
    rollout = RolloutConfig(run=Path("r"), harnesses=["simple"])
    assert rollout.temperature == 1.0  # the trials' fingerprint is unchanged for a run started before
    assert EvalSettings(run=Path("r"), harnesses=["simple"]).temperature == 0.0
    assert EvalSettings(run=Path("r"), harnesses=["simple"], samples=3).temperature == 1.0
    assert EvalSettings(run=Path("r"), harnesses=["simple"], temperature=0.5).temperature == 0.5
    assert TrainOptions().temperature is None  # the trainer takes the recorded one
    assert ProxySampling().temperature is None  # serve-proxy: as each request asks
    builds: list[Callable[[], object]] = [lambda: TrialOptions(harnesses=["simple"], temperature=-1.0),
                                          lambda: TrainOptions(temperature=-1.0), lambda: ProxySampling(temperature=-1.0)]
    for build in builds:
        with pytest.raises(ConfigError, match=r"--temperature must be a finite number >= 0 \(0 = greedy\), got -1"):
            build()


def test_one_greedy_rule() -> None:
    assert sampled_temperature(0.0) == 0.0 and sampled_temperature(MIN_TEMPERATURE / 2) == 0.0
    assert sampled_temperature(MIN_TEMPERATURE) == MIN_TEMPERATURE and sampled_temperature(0.7) == 0.7
    assert logprob_temperature(0.0) == 1.0 and logprob_temperature(1e-40) == 1.0  # a greedy token's logprob is at 1
    assert logprob_temperature(0.7) == 0.7


def test_the_trainer_applies_the_proxys_greedy_rule() -> None:
    """A --temperature the proxy would sample greedily is trained greedily (scored at 1)."""
    from legorl.training.sampling import step_sampling

    class Step:
        step, trials = 0, ()

    sampling = step_sampling(Step(), MIN_TEMPERATURE / 2)
    assert (sampling.temperature, sampling.logprob_temperature) == (0.0, 1.0)
    assert step_sampling(Step(), 0.7).logprob_temperature == 0.7


def test_one_list_of_engines() -> None:
    assert ENGINES == ("embedded", "vllm")
    with pytest.raises(LegorlError, match="--engine other: choose one of embedded, vllm"):
        PolicySpec(model=Path("m"), engine="other").validate()
    with pytest.raises(ConfigError, match="--engine other: choose one of embedded, vllm"):
        EngineSpec(engine="other").check()
