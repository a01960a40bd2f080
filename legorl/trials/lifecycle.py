"""One trial, start to finish: the lifecycle the rollout stage runs for every (task, harness, sample).

A trial is: a fresh no-network sandbox with the task's repository at ``/testbed`` → a fresh proxy
session (for a harness inside the container, served alone on a unix socket the container's relay
reaches: :mod:`legorl.harnesses.channel`) → the harness, unmodified, against ``/sess/<id>/v1``
with the task's problem statement → the patch (``git diff`` of the working tree) → the sandbox
removed → a row with what the proxy captured (segments, calls, conversation), the patch, the
outcome and where the time went.

Infrastructure failures are decided only from what the agent cannot write: setting the trial up
failed (before the harness starts), the proxy recorded an engine failure for the session, no
output of the policy ever reached the harness, or legorl itself failed
(:func:`legorl.harnesses.base.classify`). They are retried with backoff in a fresh sandbox and a
fresh session; the failed attempt's tokens are dropped, never written as a trial.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

from legorl.core.errors import ConfigError, LegorlError
from legorl.core.paths import RunDir
from legorl.core.schemas import Outcome, TaskRow, Timings, TrialRow, trial_key
from legorl.engines.config import DEFAULT_TEMPERATURE, SamplingConfig, check_temperature
from legorl.harnesses import HARNESSES, REAL, Harness, parse_names
from legorl.harnesses import get as get_harness
from legorl.harnesses.base import KILL_GRACE_S, LOG_NAME, End, HarnessRun, ProxyView, TrialSpec, classify
from legorl.harnesses.channel import ProxyChannel
from legorl.harnesses.trialfiles import defuse_tree, remove_tree
from legorl.proxy.budgets import Budgets
from legorl.proxy.clients import Closable, ProxyHandle, empty_capture
from legorl.proxy.sessions import SessionCapture
from legorl.sandbox.base import Sandbox, SandboxSpec
from legorl.trials.costs import trial_cost
from legorl.trials.fingerprints import trial_fingerprint

SandboxFactory = Callable[[SandboxSpec], Sandbox]
log = logging.getLogger(__name__)

# A call's default completion cap: a model that rambles (or loops) cannot spend a whole trial's
# wall-clock budget on one reply the harness never sees.
DEFAULT_MAX_TOKENS = 4096


@dataclass(kw_only=True)
class TrialOptions(SamplingConfig):
    """How each trial runs, as ``legorl rollout``, ``eval`` and ``loop`` take it (each field an option);
    its ``temperature`` (:class:`SamplingConfig`) is the policy's, told to the harness too, and an unset
    one is :meth:`unset_temperature`."""

    harnesses: list[str] = field(metadata={"aliases": ["--harness"], "parse": parse_names, "help": (
        f"Harness name(s), comma-separated: {', '.join(HARNESSES)}; all = the {len(REAL)} real ones (every name "
        "but simple); a plug-in as package.module:Class.")})
    samples: int = field(default=1, metadata={"help": "Trials per task and harness (a group)."})
    concurrency: int = field(default=2, metadata={"help": "Trials at once."})
    limit: int | None = field(default=None, metadata={"help": "Only the first N tasks (by instance id)."})
    timeout_s: float = field(default=1800.0, metadata={"aliases": ["--timeout"], "help": (
        "Hard wall-clock limit of one harness run, seconds (the proxy ends the episode gracefully a little "
        "before).")})
    max_turns: int = field(default=30, metadata={"help": "Model calls per trial."})
    max_tokens: int | None = field(default=DEFAULT_MAX_TOKENS, metadata={"help": (
        "Cap on one call's sampled tokens (also capped by the model's context).")})
    retries: int = field(default=2, metadata={"help": "Extra attempts after an infrastructure error."})
    harness_config: Path | None = field(default=None, metadata={"help": (
        "The harness's own config file, in its own format (mini-swe-agent: its YAML, e.g. "
        "examples/cpu-demo/mini-swe-agent.yaml); default: the config the adapter ships with.")})

    def __post_init__(self) -> None:
        if not self.harnesses:
            raise ConfigError("--harness: name at least one harness")
        if self.harness_config is not None:
            if not Path(self.harness_config).is_file():
                raise ConfigError(f"--harness-config {self.harness_config}: no such file")
            refusing = [n for n in self.harnesses if not getattr(get_harness(n), "takes_config_file", False)]
            if refusing:
                raise ConfigError(f"--harness-config: {', '.join(refusing)} take(s) no config file "
                                  "(only mini-swe-agent reads one)")
        for name, value in (("--samples", self.samples), ("--concurrency", self.concurrency),
                            ("--max-turns", self.max_turns), ("--limit", self.limit), ("--max-tokens", self.max_tokens)):
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be at least 1, got {value}")
        if self.retries < 0:
            raise ConfigError(f"--retries must be >= 0, got {self.retries}")
        if not self.timeout_s > 0:
            raise ConfigError(f"--timeout must be positive, got {self.timeout_s}")
        if self.temperature is None:
            self.temperature = self.unset_temperature()
        check_temperature(self.temperature)

    def unset_temperature(self) -> float:
        """What the trials sample at when no temperature is given."""
        return DEFAULT_TEMPERATURE


def _config_path(cfg: TrialSettings) -> str | None:
    path = getattr(cfg, "harness_config", None)  # TrialOptions has it; other TrialSettings may not
    return None if path is None else str(Path(path).resolve())


class TrialSettings(Protocol):
    """What trials are run with (the rollout stage's :class:`~legorl.stages.rollout.RolloutConfig`)."""

    run: Path
    step: int  # policy step the trials belong to
    timeout_s: float  # hard wall-clock limit of one harness run
    max_turns: int
    max_tokens: int | None  # cap on one call's completion tokens
    temperature: float | None
    retries: int  # extra attempts after an infrastructure error
    backoff_s: float
    keep_home: bool  # keep each trial's private HOME (large) next to its logs


@dataclass
class TrialJob:
    task: TaskRow
    harness: str
    sample_index: int


@dataclass
class Attempt:
    outcome: Outcome
    error: str | None
    exit_code: int | None = None
    patch: str | None = None
    capture: SessionCapture | None = None
    timings: Timings = field(default_factory=Timings)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_")[:150]


def _line(exc: BaseException) -> str:
    """An exception as one line of a trial's error (LegorlErrors say what happened themselves)."""
    text = str(exc) if isinstance(exc, LegorlError) else f"{type(exc).__name__}: {exc}"
    return (text.splitlines() or [type(exc).__name__])[0][:2000]


# How long past its wall-clock limit a harness may take to return (its own kill and cleanup).
HARNESS_GRACE_S = KILL_GRACE_S + 30.0


def run_bounded(harness: Harness, spec: TrialSpec, box: Sandbox, trial_dir: Path, limit_s: float) -> HarnessRun:
    """``harness.run``, but never past ``limit_s``: a harness that does not honour its own limit (a
    Python plug-in blocked on a pipe its helper's child holds open) is left behind in its thread,
    and the trial ends as killed at the limit; removing the sandbox then usually unblocks it."""
    done: list[HarnessRun] = []
    failed: list[BaseException] = []

    def target() -> None:
        try:
            done.append(harness.run(spec, box, trial_dir))
        except BaseException as exc:  # re-raised in the trial's thread
            failed.append(exc)

    worker = threading.Thread(target=target, name=f"harness-{spec.trial_id}"[:60], daemon=True)
    worker.start()
    worker.join(limit_s)
    if worker.is_alive():
        return HarnessRun(End.TIME_LIMIT, f"the harness did not return within {limit_s:.0f} s of its start",
                          None, True, limit_s, trial_dir / LOG_NAME)
    if failed:
        raise failed[0]
    return done[0]


class TrialRunner:
    """Runs trials: sandbox, session, harness, patch, cleanup; retries infrastructure errors."""

    def __init__(self, cfg: TrialSettings, proxy: ProxyHandle, create: SandboxFactory | None = None):
        self.cfg = cfg
        self.proxy = proxy
        self.run_dir = RunDir.at(Path(cfg.run).resolve())  # harnesses run in other directories
        if create is None:
            from legorl.sandbox.podman import PodmanBackend

            create = PodmanBackend().create
        self.create = create
        self.harnesses: dict[str, Harness] = {}
        self.stopping = threading.Event()

    def harness(self, name: str) -> Harness:
        if name not in self.harnesses:
            self.harnesses[name] = get_harness(name)
        return self.harnesses[name]

    def budgets(self) -> Budgets:
        cfg = self.cfg
        # The proxy ends an episode gracefully (a normal reply) shortly before the hard kill.
        wall = max(cfg.timeout_s - 30.0, cfg.timeout_s * 0.8)
        return Budgets(max_turns=cfg.max_turns, max_wall_s=wall, max_tokens_per_call=cfg.max_tokens)

    def run(self, job: TrialJob, first_attempt: int = 1) -> TrialRow:
        """The trial's row. ``first_attempt`` > 1: the attempts before it were lost with their
        executor worker, and count against the retries (at most ``cfg.retries + 1``)."""
        cfg = self.cfg
        started = time.time()
        key = trial_key(job.task.instance_id, job.harness, cfg.step, job.sample_index)
        attempt: Attempt | None = None
        n = 0
        sandbox_s = 0.0  # each attempt's sandbox lives as long as the attempt
        for n in range(first_attempt, max(first_attempt, cfg.retries + 1) + 1):
            t = time.monotonic()
            try:
                attempt = self.attempt(job, key, n)
            except Exception as exc:  # one trial's trouble (its folder, the host's fds) never stops the stage
                log.exception("trial %s attempt %d failed outside its own handling", key, n)
                attempt = Attempt(Outcome.INFRA_ERROR, _line(exc), timings=Timings())
            sandbox_s += time.monotonic() - t
            if attempt.outcome is not Outcome.INFRA_ERROR or self.stopping.is_set():
                break
            if n <= cfg.retries:
                time.sleep(cfg.backoff_s * 2 ** (n - 1))
        assert attempt is not None
        infra = attempt.outcome is Outcome.INFRA_ERROR
        cap = attempt.capture or empty_capture(key)
        attempt.timings.total_s = round(time.time() - started, 3)
        return TrialRow.new(
            job.task.instance_id, job.harness, cfg.step, job.sample_index,
            outcome=attempt.outcome, infra_failure=infra, model=self.proxy.model, error=attempt.error,
            exit_code=attempt.exit_code, attempts=n, patch=attempt.patch,
            # an infrastructure failure's tokens are never training data
            segments=[] if infra else cap.segments, calls=cap.calls,
            messages=None if infra else json.dumps(cap.messages, ensure_ascii=False),
            timings=attempt.timings, started_at=started, finished_at=time.time(),
            fingerprint=trial_fingerprint(job.harness, cfg, self.proxy), cost=trial_cost(cap.calls, n, sandbox_s),
        )

    def attempt(self, job: TrialJob, key: str, n: int) -> Attempt:
        cfg = self.cfg
        harness = self.harness(job.harness)
        trial_dir = self.run_dir.rollout_logs / f"{_safe(key)}-attempt{n}"
        if trial_dir.exists():
            remove_tree(trial_dir)
        trial_dir.mkdir(parents=True)
        # the trial folders hold what containers wrote: no other local user may even look in
        with contextlib.suppress(OSError):
            os.chmod(trial_dir.parent, 0o700)
        timings = Timings()
        box: Sandbox | None = None
        channel: ProxyChannel | None = None
        listener: Closable | None = None
        session: str | None = None
        t0 = time.monotonic()
        try:
            # Setting up: nothing of the agent has run yet, so every failure here is infrastructure.
            try:
                channel = ProxyChannel.create() if harness.in_container else None
                box = self.create(self.sandbox_spec(job, key, harness, trial_dir, channel))
                self.prepare(box, job.task)
                timings.sandbox_s = time.monotonic() - t0
                session, openai_url, anthropic_url = self.proxy.new_session(
                    self.budgets(), {"task_id": job.task.instance_id, "harness": job.harness, "step": cfg.step,
                                     "sample_index": job.sample_index, "attempt": n})
                if channel is not None:  # the harness sees only its session, through the relay
                    listener = self.proxy.serve_session(session, channel.socket_path)
                    channel.check(box, session)
                    anthropic_url = channel.session_url(session)
                    openai_url = anthropic_url + "/v1"
            except Exception as exc:
                return Attempt(Outcome.INFRA_ERROR, _line(exc), timings=timings)
            spec = TrialSpec(
                trial_id=key, problem_statement=job.task.problem_statement or "", model=self.proxy.model,
                openai_base_url=openai_url, anthropic_base_url=anthropic_url, max_turns=cfg.max_turns,
                timeout_s=cfg.timeout_s, temperature=cfg.temperature, context_tokens=self.proxy.context_tokens,
                harness_config=_config_path(cfg),
            )
            t1 = time.monotonic()
            try:
                run = run_bounded(harness, spec, box, trial_dir, cfg.timeout_s + HARNESS_GRACE_S)
            except LegorlError as exc:  # the sandbox failed under the harness: classified below
                run = HarnessRun(End.CRASHED, _line(exc), None, False, time.monotonic() - t1, trial_dir / LOG_NAME)
            timings.agent_s = run.duration_s
            t2 = time.monotonic()
            alive = box.alive()
            patch, patch_error = None, None
            if alive:
                try:
                    patch = box.patch()
                except (LegorlError, subprocess.TimeoutExpired) as exc:  # the agent can break (or bloat) its repo
                    patch_error = _line(exc)
            timings.patch_s = time.monotonic() - t2
            if listener is not None:  # nothing reaches the session from the container any more
                listener.close()
                listener = None
            capture = self.proxy.finish(session)
            session = None
            view = ProxyView(calls=sum(1 for c in capture.calls if not c.budget_stop),
                             budget_stop=capture.budget_stop,
                             engine_error=capture.engine_errors[-1] if capture.engine_errors else None,
                             in_flight=capture.in_flight)
            outcome, error = classify(run, view, alive, patch)
            if patch_error and outcome is not Outcome.INFRA_ERROR:
                error = f"{error}; no patch: {patch_error}" if error else f"no patch: {patch_error}"
            timings.model_s = round(sum(c.latency_s or 0.0 for c in capture.calls), 3)
            return Attempt(outcome, error[:2000] if error else None, run.exit_code, patch, capture, timings)
        except Exception as exc:  # legorl's own failure (the proxy, podman) is never the agent's
            return Attempt(Outcome.INFRA_ERROR, _line(exc), timings=timings)
        finally:
            # Each step runs whatever the one before it raised: a row is owed, and what is left
            # behind (a container, a folder) has its own sweeper (the reaper, the next attempt).
            steps: list[tuple[str, Callable[[], object]]] = []
            if session is not None:
                steps.append(("finish the session", functools.partial(self.proxy.finish, session)))
            if box is not None:
                steps.append(("remove the sandbox", functools.partial(self._remove, box, timings)))
            steps.append(("defuse the trial folder", functools.partial(defuse_tree, trial_dir)))
            if listener is not None:
                steps.append(("close the session socket", listener.close))
            if channel is not None:
                steps.append(("close the channel", channel.close))
            if not cfg.keep_home:
                steps.append(("remove the trial's home", functools.partial(remove_tree, trial_dir / "home")))
            for what, step in steps:
                try:
                    step()
                except Exception:
                    log.warning("trial %s: could not %s", key, what, exc_info=True)
            for name in ("agent_s", "patch_s"):
                value = getattr(timings, name)
                if value is not None:
                    setattr(timings, name, round(value, 3))

    @staticmethod
    def _remove(box: Sandbox, timings: Timings) -> None:
        t = time.monotonic()
        box.remove()
        timings.sandbox_s = round((timings.sandbox_s or 0.0) + time.monotonic() - t, 3)

    def sandbox_spec(self, job: TrialJob, key: str, harness: Harness, trial_dir: Path,
                     channel: ProxyChannel | None = None) -> SandboxSpec:
        """No network; an in-container harness gets its mounts and the channel (the relay as the
        container's main process)."""
        spec = SandboxSpec(
            image=image_for(job.task),
            labels={"run": self.run_dir.root.name, "trial": key, "role": "rollout"},
            mounts=tuple(harness.mounts(trial_dir)),
            deadline_s=self.cfg.timeout_s + 900.0,
        )
        if channel is None:
            return spec
        return replace(spec, mounts=(*spec.mounts, channel.mount), command=channel.command)

    @staticmethod
    def prepare(box: Sandbox, task: TaskRow) -> None:
        from legorl.sandbox.testbed import install_testbed, strip_history

        ref = task.repo_ref or task.base_commit
        if task.repo_source and ref:
            install_testbed(box, task.repo_source, ref)
        else:
            strip_history(box)


def image_for(task: TaskRow) -> str:
    """The image a task's trials run in: its own, or the base image."""
    if task.image:
        return task.image
    from legorl.sandbox.host import base_image

    return base_image()
