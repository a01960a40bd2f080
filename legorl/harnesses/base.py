"""The harness interface and the mechanics every adapter shares, written once.

:class:`Harness` is the typing contract. :class:`BaseHarness` is the abstract base of legorl's
adapters: one that runs in legorl's own process (``simple``) writes ``run`` itself. A harness that
is a separate program derives from :class:`ProcessHarness`, and its adapter knows three things
about it: which install it needs, how to launch it for one trial (command line, environment,
config files), and how to read how it ended. Everything else is here: the per-trial folder (HOME,
config, logs), where the process runs (on the host, or inside the trial container), its
environment, and turning all that plus the proxy's view into an :class:`~legorl.core.schemas.Outcome`;
running the process (the wall-clock limit, the kill of its whole process group, log capture) is
:mod:`legorl.harnesses.processes`.

Harnesses never see anything of legorl but a base URL (``/sess/<trial>/v1``, or ``/sess/<trial>``
for the Anthropic API), the task's problem statement and the repository at ``/testbed``. Inside
the container that URL is the container's own loopback, relayed to the session's socket
(:mod:`legorl.harnesses.channel`); the container has no other network.

Everything in the trial folder may have been written by the agent (it is mounted into the
container for in-container harnesses): the host reads it only through
:mod:`legorl.harnesses.trialfiles`, and nothing read there can make a trial an infrastructure
failure (:func:`classify`).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar, Protocol

from legorl.core.schemas import Outcome, budget_outcome
from legorl.harnesses.install import Installation, require
from legorl.harnesses.processes import (
    CONTAINER_TRIAL_DIR,
    LOG_NAME,
    Launch,
    ProcResult,
    run_in_sandbox,
    run_on_host,
)
from legorl.harnesses.processes import KILL_GRACE_S as KILL_GRACE_S
from legorl.harnesses.processes import tail as tail
from legorl.harnesses.trialfiles import read_trial_text
from legorl.sandbox.base import Sandbox

# What a host-run harness inherits from legorl's environment; everything else is set explicitly,
# so a user's API keys or proxy settings never leak into (or redirect) a harness.
_HOST_ENV_KEEP = ("PATH", "LANG", "LC_ALL", "TZ", "TMPDIR", "CONTAINERS_CONF", "XDG_RUNTIME_DIR")


class End(StrEnum):
    """How a harness itself says it stopped (before legorl looks at the proxy and the sandbox)."""

    SUBMITTED = "submitted"  # an explicit submit action (mini-swe-agent, OpenHands `finish`)
    FINISHED = "finished"  # stopped normally with a final answer; submitted iff it changed the repo
    GAVE_UP = "gave_up"  # e.g. repeated format errors
    MAX_TURNS = "max_turns"
    CONTEXT_OVERFLOW = "context_overflow"
    TIME_LIMIT = "time_limit"  # the harness's own wall-clock limit
    API_ERROR = "api_error"  # the harness says it gave up on the model API (a claim, see classify)
    CRASHED = "crashed"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class TrialSpec:
    """What a harness is given for one trial."""

    trial_id: str
    problem_statement: str
    model: str  # the model name the harness sends (any name: the session decides)
    openai_base_url: str  # http://HOST:PORT/sess/<id>/v1, as reachable from where the harness runs
    anthropic_base_url: str  # http://HOST:PORT/sess/<id>
    max_turns: int = 30
    timeout_s: float = 1800.0
    temperature: float | None = None  # the policy's (SamplingConfig.temperature), for a harness that sends one
    workdir: str = "/testbed"
    context_tokens: int | None = None  # the engine's context, for harnesses that must be told it
    harness_config: str | None = None  # the harness's own config file (absolute), when one was given



@dataclass
class HarnessRun:
    """What one harness run left behind."""

    end: End
    detail: str | None
    exit_code: int | None
    timed_out: bool
    duration_s: float
    log_path: Path
    extra: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class TrialPaths:
    """The per-trial folder on the host, and the path the harness process sees it under."""

    host: Path
    view: str  # == str(host) for host-run harnesses, CONTAINER_TRIAL_DIR inside the container

    def at(self, *parts: str) -> str:
        """A path under the trial folder as the harness sees it."""
        return "/".join([self.view.rstrip("/"), *parts])

    @property
    def home(self) -> str:
        return self.at("home")



class Harness(Protocol):
    """One coding-agent harness, run unmodified for one trial at a time."""

    # read-only: a class attribute (as legorl's adapters set them) satisfies them as well
    @property
    def name(self) -> str: ...

    @property
    def in_container(self) -> bool:
        """Runs inside the trial container (needs the network path and mounts)."""
        ...

    def mounts(self, trial_dir: Path) -> list[tuple[str, str, bool]]:
        """Bind mounts the trial container needs for this harness."""
        ...

    def run(self, trial: TrialSpec, sandbox: Sandbox, trial_dir: Path) -> HarnessRun: ...



class BaseHarness(ABC):
    """The base of legorl's adapters: ``name``, where the harness runs, its install (resolved on first
    use) and its mounts. Subclasses set ``name``/``in_container`` and write ``run``."""

    name: ClassVar[str]
    in_container: ClassVar[bool]
    needs_install: ClassVar[bool] = True  # False: nothing to install (runs in legorl's own process)
    takes_config_file: ClassVar[bool] = False  # reads TrialSpec.harness_config (--harness-config)

    def __init__(self, install: Installation | None = None) -> None:
        self._install = install

    @property
    def install(self) -> Installation:
        if self._install is None:
            self._install = require(self.name)
        return self._install

    def mounts(self, trial_dir: Path) -> list[tuple[str, str, bool]]:
        """Bind mounts the trial container needs: the install and the trial folder (none on the host)."""
        if not self.in_container:
            return []
        return [*self.install.mounts(), (str(trial_dir.resolve()), CONTAINER_TRIAL_DIR, False)]

    @abstractmethod
    def run(self, trial: TrialSpec, sandbox: Sandbox, trial_dir: Path) -> HarnessRun:
        """Run the harness for one trial against ``trial``'s session; what it left behind."""


class ProcessHarness(BaseHarness):
    """A harness that is its own program. Subclasses write ``launch`` and ``read_end``; the process
    (on the host or in the trial container), its limits and its logs are handled here."""

    @abstractmethod
    def launch(self, trial: TrialSpec, paths: TrialPaths, sandbox: Sandbox) -> Launch:
        """Write the harness's config into the trial folder; return how to start it."""

    @abstractmethod
    def read_end(self, paths: TrialPaths, proc: ProcResult) -> tuple[End, str | None]:
        """How the harness says it ended, from its output files and logs."""

    def paths(self, trial_dir: Path) -> TrialPaths:
        """The trial folder as host and harness see it, with the harness's private HOME in it."""
        trial_dir = trial_dir.resolve()
        paths = TrialPaths(trial_dir, CONTAINER_TRIAL_DIR if self.in_container else str(trial_dir))
        (trial_dir / "home").mkdir(parents=True, exist_ok=True)
        return paths

    def base_env(self, paths: TrialPaths) -> dict[str, str]:
        """A private HOME and XDG dirs per trial; nothing inherited that could redirect the harness."""
        home = paths.home
        env = {
            "HOME": home,
            "XDG_CONFIG_HOME": f"{home}/.config",
            "XDG_CACHE_HOME": f"{home}/.cache",
            "XDG_DATA_HOME": f"{home}/.local/share",
            "XDG_STATE_HOME": f"{home}/.local/state",
            "LANG": "C.UTF-8",
            "NO_COLOR": "1",
            "TERM": "dumb",
        }
        if not self.in_container:
            env |= {k: os.environ[k] for k in _HOST_ENV_KEEP if k in os.environ}
        return env

    def python_runner(self, runner: Path, config_name: str, trial: TrialSpec, paths: TrialPaths,
                      config: dict[str, Any], env: dict[str, str]) -> Launch:
        """A runner script of legorl's that drives the harness's Python API (OpenHands, Terminus-2):
        copied into the trial folder with the trial as JSON beside it (``config_name``; ``config`` adds
        to it), run by the harness install's Python."""
        shutil.copy(runner, paths.host / runner.name)
        trial_json = paths.host / config_name
        trial_json.write_text(json.dumps({
            "api_base": trial.openai_base_url,
            "model": trial.model,
            "temperature": trial.temperature,
            "task": trial.problem_statement,
            "max_turns": trial.max_turns,
            "workdir": trial.workdir,
            **config,
        }, indent=2))
        env = self.base_env(paths) | {
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # else ~6 s of failed cost-map fetches at import
            "PYTHONUNBUFFERED": "1",
            "PYTHONDONTWRITEBYTECODE": "1",  # the venv is mounted read-only
        } | env
        return Launch([self.install.python or "python3", paths.at(runner.name), paths.at(trial_json.name)], env)

    def run(self, trial: TrialSpec, sandbox: Sandbox, trial_dir: Path) -> HarnessRun:
        paths = self.paths(trial_dir)
        trial_dir = paths.host
        launch = self.launch(trial, paths, sandbox)
        (trial_dir / "command.txt").write_text(shlex.join(launch.argv) + "\n")
        log = trial_dir / LOG_NAME
        if self.in_container:
            proc = run_in_sandbox(sandbox, launch, trial.timeout_s, trial.workdir)
        else:
            proc = run_on_host(launch, trial.timeout_s, log, cwd=trial_dir)
        try:
            end, detail = self.read_end(paths, proc)
        except Exception as exc:  # a harness's output we cannot read is its crash, not ours
            end, detail = End.CRASHED, f"unreadable harness output: {exc}"
        if proc.timed_out:
            end = End.TIME_LIMIT if end in (End.UNKNOWN, End.CRASHED) else end
        return HarnessRun(end, detail, proc.exit_code, proc.timed_out, proc.duration_s, log)


# --------------------------------------------------------------------------- harness output


def json_lines(path: Path) -> list[dict[str, object]]:
    """The JSON objects among the lines of a log in the trial folder (harnesses that print JSONL
    events mix in other text); a huge log is read from its end, where a harness's result is."""
    events: list[dict[str, object]] = []
    try:
        text = read_trial_text(path, tail=True)
    except OSError:
        return events
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                events.append(obj)
    return events


def no_account(proc: ProcResult) -> tuple[End, str | None]:
    """How a harness ended that left no account of it (no result file, no end event): killed at the
    limit, or crashed; the detail is the end of its log."""
    return (End.UNKNOWN if proc.timed_out else End.CRASHED), proc.log_tail.strip()[-500:] or None


def json_file(path: Path, limit: int = 1 << 20) -> dict[str, Any] | None:
    """A JSON object file in the trial folder (a harness's result), or None when it is missing,
    refused, too large or garbled: all of those are the harness's (the agent's) doing."""
    try:
        raw = read_trial_text(path, limit + 1)
    except OSError:
        return None
    if len(raw) > limit:
        return None
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


# --------------------------------------------------------------------------- outcomes


@dataclass(frozen=True)
class ProxyView:
    """What the proxy saw of a trial (from its capture), for classifying the outcome."""

    calls: int = 0
    budget_stop: str | None = None  # a legorl.core.schemas.BudgetStop
    engine_error: str | None = None  # the engine failed while serving this session
    # the call the policy was still generating when the trial ended (legorl.proxy.sessions.InFlight.snapshot)
    in_flight: dict[str, Any] | None = None


_END_OUTCOMES = {
    End.SUBMITTED: Outcome.SUBMITTED,
    End.GAVE_UP: Outcome.NO_SUBMISSION,
    End.MAX_TURNS: Outcome.MAX_TURNS,
    End.CONTEXT_OVERFLOW: Outcome.CONTEXT_OVERFLOW,
    End.TIME_LIMIT: Outcome.TIMEOUT,
    End.CRASHED: Outcome.HARNESS_CRASH,
}


def classify(run: HarnessRun, proxy: ProxyView, sandbox_alive: bool, patch: str | None) -> tuple[Outcome, str | None]:
    """The trial's outcome; infrastructure only from signals the agent cannot write.

    Infrastructure: the proxy recorded an engine failure for this session, or no output of the
    policy ever reached the harness (no sampled call): until then nothing in the trial is the
    agent's doing (legorl could not launch the harness, the sandbox broke under it, the model was
    unreachable, the engine had not started the first reply when the trial ended). A first reply the
    policy was still sampling when the trial ended is the policy's: its length, not the engine's
    delay (the proxy measured both). Once the policy has spoken, the rest is the agent's outcome: a dead container
    (the agent can kill its own), the hard kill, the proxy's budget stops (they end the episode
    with a normal reply, so the harness itself thinks it finished), then the harness's own account
    — read from files the agent can write when the harness runs in its container, so it never
    says "infrastructure": an API error the proxy did not record is the harness's crash.
    """
    if proxy.engine_error:
        return Outcome.INFRA_ERROR, f"engine failed: {proxy.engine_error}"
    sampling = proxy.in_flight or {}
    if proxy.calls == 0 and int(sampling.get("sampled_tokens") or 0) == 0:
        if sampling:
            return Outcome.INFRA_ERROR, (
                f"the engine had not sampled a token of the first reply after {sampling.get('elapsed_s')} s "
                f"({run.detail or 'no calls'})")
        return Outcome.INFRA_ERROR, f"the harness never reached the model: {run.detail or 'no calls'}"
    if proxy.calls == 0 and run.timed_out:
        # The policy was still producing its first reply when the limit hit: its own length, not the
        # engine's delay (an engine that never started it leaves 0 sampled tokens, above). Every other
        # end of such a trial is judged below, as the agent's: a reply too long for its harness is too.
        return Outcome.TIMEOUT, (
            f"killed after the wall-clock limit ({run.duration_s:.0f} s) while the policy was still sampling its "
            f"first reply ({sampling.get('sampled_tokens')} tokens in {sampling.get('elapsed_s')} s, first token "
            f"after {sampling.get('first_token_s')} s)")
    if not sandbox_alive:
        return Outcome.HARNESS_CRASH, "the sandbox container died during the trial"
    if run.timed_out:
        return Outcome.TIMEOUT, f"killed after the wall-clock limit ({run.duration_s:.0f} s)"
    if proxy.budget_stop:
        return budget_outcome(proxy.budget_stop), f"proxy budget: {proxy.budget_stop}"
    if run.end is End.API_ERROR:
        return Outcome.HARNESS_CRASH, f"the harness reports an API error the proxy did not record: {run.detail}"
    if run.end is End.FINISHED:
        return (Outcome.SUBMITTED if patch else Outcome.NO_SUBMISSION), run.detail
    if run.end in _END_OUTCOMES:
        return _END_OUTCOMES[run.end], run.detail
    if run.exit_code == 0:
        return Outcome.NO_SUBMISSION, run.detail
    return Outcome.HARNESS_CRASH, run.detail or f"exit code {run.exit_code}"
