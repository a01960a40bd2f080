"""The rollout stage: tasks × harnesses × samples → one trial row each in ``rollouts/``.

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
fresh session; the failed attempt's tokens are dropped, never written as a trial. Rows are
committed one per trial, so a killed run loses only the trials in flight, and a rerun does only
what is missing (infra-failed rows are retried too).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from legorl import shards
from legorl.engines.base import Engine, Generation, SamplingParams, TokenChunk
from legorl.errors import LegorlError
from legorl.harnesses import get as get_harness
from legorl.harnesses.base import (
    LOG_NAME,
    BaseHarness,
    End,
    HarnessRun,
    ProxyView,
    TrialSpec,
    classify,
    kill_host_processes,
)
from legorl.harnesses.channel import ProxyChannel
from legorl.harnesses.install import require
from legorl.harnesses.trialfiles import defuse_tree, remove_tree
from legorl.paths import RunDir
from legorl.proxy.budgets import Budgets
from legorl.schemas import Call, Kind, Outcome, Segment, TaskRow, Timings, TrialRow, trial_key


@dataclass
class RolloutConfig:
    """Options of ``legorl rollout`` (each field is a CLI option)."""

    run: Path
    harnesses: list[str]
    samples: int = 1
    concurrency: int = 1
    limit: int | None = None  # the first N tasks (by instance id)
    step: int = 0  # policy step the trials belong to
    timeout_s: float = 1800.0  # hard wall-clock limit of one harness run
    max_turns: int = 30
    max_tokens: int | None = None  # cap on one call's completion tokens
    temperature: float | None = 1.0
    retries: int = 2  # extra attempts after an infrastructure error
    backoff_s: float = 2.0
    keep_home: bool = False  # keep each trial's private HOME (large) next to its logs
    reap: bool = True


@dataclass
class Capture:
    """What the proxy captured for one session."""

    segments: list[Segment]
    calls: list[Call]
    messages: list[dict[str, Any]]
    budget_stop: str | None
    engine_errors: list[str] = field(default_factory=list)


class Closable(Protocol):
    def close(self) -> None: ...


class ProxyHandle(Protocol):
    """The proxy as the stage uses it: in-process, or an external ``legorl serve-proxy``."""

    model: str
    context_tokens: int | None

    def new_session(self, budgets: Budgets, metadata: dict[str, Any]) -> tuple[str, str, str]:
        """A fresh session: (id, OpenAI base URL, Anthropic base URL), reachable from the host."""
        ...

    def serve_session(self, session_id: str, path: Path) -> Closable:
        """Serve the session alone on a new unix socket at ``path`` (an in-container trial's one endpoint)."""
        ...

    def finish(self, session_id: str) -> Capture: ...


# --------------------------------------------------------------------------- the engine, watched


class WatchedEngine:
    """Delegates to an engine and keeps what the progress line needs: calls in flight, busy time,
    sampled tokens, failures. (Which trial an engine failure hit is recorded by the proxy session.)"""

    def __init__(self, engine: Engine):
        self.inner = engine
        self.name = engine.name
        self.max_context = engine.max_context
        self.in_flight = 0
        self.tokens = 0
        self.failures: list[tuple[float, str]] = []
        self._busy_since: float | None = None
        self._busy = 0.0
        self._mu = threading.Lock()

    def _enter(self) -> None:
        with self._mu:
            if self.in_flight == 0:
                self._busy_since = time.monotonic()
            self.in_flight += 1

    def _exit(self, tokens: int, error: BaseException | None) -> None:
        with self._mu:
            self.in_flight -= 1
            self.tokens += tokens
            if self.in_flight == 0 and self._busy_since is not None:
                self._busy += time.monotonic() - self._busy_since
                self._busy_since = None
            if error is not None:
                self.failures.append((time.time(), f"{type(error).__name__}: {error}"))

    def busy_seconds(self) -> float:
        with self._mu:
            extra = time.monotonic() - self._busy_since if self._busy_since is not None else 0.0
            return self._busy + extra

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        self._enter()
        gen: Generation | None = None
        try:
            gen = await self.inner.generate(prompt_ids, params)
            return gen
        except Exception as exc:
            self._exit(0, exc)
            raise
        finally:
            if gen is not None:
                self._exit(len(gen.token_ids), None)

    async def stream(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[TokenChunk]:
        self._enter()
        tokens, error = 0, None
        try:
            async for chunk in self.inner.stream(prompt_ids, params):
                tokens += len(chunk.token_ids)
                yield chunk
        except Exception as exc:
            error = exc
            raise
        finally:
            self._exit(tokens, error)

    async def load_weights(self, path: str) -> None:
        await self.inner.load_weights(path)

    async def close(self) -> None:
        await self.inner.close()


# --------------------------------------------------------------------------- proxies


class InProcessProxy:
    """A :class:`~legorl.proxy.server.ProxyServer` on a loopback port of this process."""

    def __init__(self, engine: Engine, tokenizer: Any, temperature: float | None = None):
        """``temperature``, when given, is what every call samples at, whatever the harness asks."""
        from legorl.proxy.core import SamplingOverride
        from legorl.proxy.server import ProxyServer

        self.engine = WatchedEngine(engine)
        sampling = SamplingOverride.policy(temperature) if temperature is not None else None
        self.server = ProxyServer(self.engine, tokenizer, sampling=sampling)
        self.model = engine.name
        self.context_tokens: int | None = engine.max_context

    def __enter__(self) -> InProcessProxy:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.close()

    def new_session(self, budgets: Budgets, metadata: dict[str, Any]) -> tuple[str, str, str]:
        sid = self.server.new_session(budgets, metadata)
        return sid, self.server.openai_base_url(sid), self.server.anthropic_base_url(sid)

    def serve_session(self, session_id: str, path: Path) -> Closable:
        return self.server.serve_session(session_id, path)

    def finish(self, session_id: str) -> Capture:
        cap = self.server.finish(session_id)
        if cap is None:
            return Capture([], [], [], None)
        return Capture(cap.segments, cap.calls, cap.messages, cap.budget_stop, cap.engine_errors)


class RemoteProxy:
    """An external ``legorl serve-proxy`` at ``url``: sessions over its HTTP API. A session's unix
    socket is served here, in the rollout process, by a forwarder bound to that session
    (:class:`~legorl.proxy.session_socket.SessionForwarder`) that relays its model routes to the
    proxy's session URL over TCP."""

    def __init__(self, url: str, api_key: str | None = None):
        import httpx

        self.url = url.rstrip("/")
        self.api_key = api_key
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=self.url, headers=headers, timeout=60)
        self._loop: Any = None  # a LoopThread serving the session sockets, started on first use
        self._forward: Any = None  # the forwarders' shared httpx.AsyncClient (lives on that loop)
        self._forwarders: dict[str, Any] = {}
        self._mu = threading.Lock()
        try:
            models = self.client.get("/v1/models").raise_for_status().json()["data"]
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            raise LegorlError(f"--proxy {url}: not a legorl proxy ({type(exc).__name__}: {exc})") from None
        self.model = str(models[0]["id"]) if models else "policy"
        self.context_tokens = models[0].get("max_model_len") if models else None

    def __enter__(self) -> RemoteProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.close()
        if self._loop is not None:
            import asyncio

            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._forward.aclose(), self._loop.loop).result(timeout=10)
            self._loop.close()
            self._loop = None

    def serve_session(self, session_id: str, path: Path) -> Closable:
        import httpx

        from legorl.proxy.session_socket import LoopThread, SessionForwarder, SessionSocket

        with self._mu:
            if self._loop is None:
                self._loop = LoopThread()
                self._forward = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0))
            app = self._forwarders[session_id] = SessionForwarder(self.url, session_id, self._forward, self.api_key)
        return SessionSocket(app, path, self._loop.loop)

    def new_session(self, budgets: Budgets, metadata: dict[str, Any]) -> tuple[str, str, str]:
        body = {"budgets": {k: v for k, v in budgets.to_dict().items() if v is not None}, "metadata": metadata}
        data = self.client.post("/sessions", json=body).raise_for_status().json()
        sid = data["session_id"]
        return sid, f"{self.url}/sess/{sid}/v1", f"{self.url}/sess/{sid}"

    def finish(self, session_id: str) -> Capture:
        with self._mu:
            forwarder = self._forwarders.pop(session_id, None)
        if forwarder is not None:
            forwarder.closed = True
        data = self.client.post(f"/sess/{session_id}/finish").raise_for_status().json()
        return Capture([Segment.from_dict(s) for s in data.get("segments") or []],
                       [Call.from_dict(c) for c in data.get("calls") or []],
                       data.get("messages") or [], data.get("budget_stop"), list(data.get("engine_errors") or []))


# --------------------------------------------------------------------------- one trial


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
    capture: Capture | None = None
    timings: Timings = field(default_factory=Timings)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_")[:150]


def _line(exc: BaseException) -> str:
    """An exception as one line of a trial's error (LegorlErrors say what happened themselves)."""
    text = str(exc) if isinstance(exc, LegorlError) else f"{type(exc).__name__}: {exc}"
    return (text.splitlines() or [type(exc).__name__])[0][:2000]


_BUDGET_TIMEOUT = "max_wall_time"


class TrialRunner:
    """Runs trials: sandbox, session, harness, patch, cleanup; retries infrastructure errors."""

    def __init__(self, cfg: RolloutConfig, proxy: ProxyHandle, create: Callable[..., Any] | None = None):
        self.cfg = cfg
        self.proxy = proxy
        self.run_dir = RunDir.at(Path(cfg.run).resolve())  # harnesses run in other directories
        if create is None:
            from legorl.sandbox.podman import PodmanBackend

            create = PodmanBackend().create
        self.create = create
        self.harnesses: dict[str, BaseHarness] = {}
        self.stopping = threading.Event()

    def harness(self, name: str) -> BaseHarness:
        if name not in self.harnesses:
            self.harnesses[name] = get_harness(name)
        return self.harnesses[name]

    def budgets(self) -> Budgets:
        cfg = self.cfg
        # The proxy ends an episode gracefully (a normal reply) shortly before the hard kill.
        wall = max(cfg.timeout_s - 30.0, cfg.timeout_s * 0.8)
        return Budgets(max_turns=cfg.max_turns, max_wall_s=wall, max_tokens_per_call=cfg.max_tokens)

    def run(self, job: TrialJob) -> TrialRow:
        cfg = self.cfg
        started = time.time()
        key = trial_key(job.task.instance_id, job.harness, cfg.step, job.sample_index)
        attempt: Attempt | None = None
        n = 0
        for n in range(1, cfg.retries + 2):
            attempt = self.attempt(job, key, n)
            if attempt.outcome is not Outcome.INFRA_ERROR or self.stopping.is_set():
                break
            if n <= cfg.retries:
                time.sleep(cfg.backoff_s * 2 ** (n - 1))
        assert attempt is not None
        infra = attempt.outcome is Outcome.INFRA_ERROR
        cap = attempt.capture or Capture([], [], [], None)
        attempt.timings.total_s = round(time.time() - started, 3)
        return TrialRow.new(
            job.task.instance_id, job.harness, cfg.step, job.sample_index,
            outcome=attempt.outcome, infra_failure=infra, model=self.proxy.model, error=attempt.error,
            exit_code=attempt.exit_code, attempts=n, patch=attempt.patch,
            # an infrastructure failure's tokens are never training data
            segments=[] if infra else cap.segments, calls=cap.calls,
            messages=None if infra else json.dumps(cap.messages, ensure_ascii=False),
            timings=attempt.timings, started_at=started, finished_at=time.time(),
        )

    def attempt(self, job: TrialJob, key: str, n: int) -> Attempt:
        cfg = self.cfg
        harness = self.harness(job.harness)
        trial_dir = self.run_dir.root / "logs" / "rollout" / f"{_safe(key)}-attempt{n}"
        if trial_dir.exists():
            remove_tree(trial_dir)
        trial_dir.mkdir(parents=True)
        # the trial folders hold what containers wrote: no other local user may even look in
        with contextlib.suppress(OSError):
            os.chmod(trial_dir.parent, 0o700)
        timings = Timings()
        box: Any = None
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
            )
            t1 = time.monotonic()
            try:
                run = harness.run(spec, box, trial_dir)
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
                             engine_error=capture.engine_errors[-1] if capture.engine_errors else None)
            outcome, error = classify(run, view, alive, patch)
            if capture.budget_stop == _BUDGET_TIMEOUT and outcome is Outcome.BUDGET:
                outcome = Outcome.TIMEOUT
            if patch_error and outcome is not Outcome.INFRA_ERROR:
                error = f"{error}; no patch: {patch_error}" if error else f"no patch: {patch_error}"
            timings.model_s = round(sum(c.latency_s or 0.0 for c in capture.calls), 3)
            return Attempt(outcome, error[:2000] if error else None, run.exit_code, patch, capture, timings)
        except Exception as exc:  # legorl's own failure (the proxy, podman) is never the agent's
            return Attempt(Outcome.INFRA_ERROR, _line(exc), timings=timings)
        finally:
            if session is not None:
                with contextlib.suppress(Exception):  # the failed attempt's capture is dropped anyway
                    self.proxy.finish(session)
            if box is not None:
                t3 = time.monotonic()
                box.remove()
                timings.sandbox_s = round((timings.sandbox_s or 0.0) + time.monotonic() - t3, 3)
            defuse_tree(trial_dir)
            if listener is not None:
                listener.close()
            if channel is not None:
                channel.close()
            for name in ("agent_s", "patch_s"):
                value = getattr(timings, name)
                if value is not None:
                    setattr(timings, name, round(value, 3))
            if not cfg.keep_home:
                remove_tree(trial_dir / "home")

    def sandbox_spec(self, job: TrialJob, key: str, harness: BaseHarness, trial_dir: Path,
                     channel: ProxyChannel | None = None) -> Any:
        """No network; an in-container harness gets its mounts and the channel (the relay as the
        container's main process)."""
        from legorl.sandbox.base import SandboxSpec

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
    def prepare(box: Any, task: TaskRow) -> None:
        from legorl.sandbox.testbed import install_testbed, strip_history

        ref = task.repo_ref or task.base_commit
        if task.repo_source and ref:
            install_testbed(box, task.repo_source, ref)
        else:
            strip_history(box)


def image_for(task: TaskRow) -> str:
    if task.image:
        return task.image
    from legorl.sandbox.host import base_image

    return base_image()


# --------------------------------------------------------------------------- the stage


@dataclass
class RolloutSummary:
    planned: int = 0
    skipped: int = 0  # already in rollouts/
    rows: list[TrialRow] = field(default_factory=list)
    wall_s: float = 0.0
    engine_busy_s: float | None = None

    @property
    def outcomes(self) -> dict[str, int]:
        return dict(Counter(str(r.outcome) for r in self.rows))

    def as_dict(self) -> dict[str, Any]:
        rows = self.rows
        sampled = sum(sum(c.completion_tokens for c in r.calls) for r in rows)

        def mean(name: str) -> float | None:
            vals = [getattr(r.timings, name) for r in rows if getattr(r.timings, name) is not None]
            return round(sum(vals) / len(vals), 3) if vals else None

        return {
            "planned": self.planned, "skipped": self.skipped, "ran": len(rows), "outcomes": self.outcomes,
            "infra_failures": sum(r.infra_failure for r in rows),
            "retried": sum(r.attempts > 1 for r in rows),
            "calls": sum(len(r.calls) for r in rows), "sampled_tokens": sampled,
            "tokens_per_s": round(sampled / self.wall_s, 2) if self.wall_s else None,
            "engine_utilisation": round(self.engine_busy_s / self.wall_s, 3)
            if self.engine_busy_s is not None and self.wall_s else None,
            "wall_s": round(self.wall_s, 2),
            "mean_timings": {n: mean(n) for n in ("sandbox_s", "agent_s", "model_s", "patch_s", "total_s")},
        }


def plan(cfg: RolloutConfig) -> tuple[list[TrialJob], int]:
    """The trials to run (missing from ``rollouts/``), and how many are already done."""
    run = RunDir.at(cfg.run)
    if not shards.part_files(run.tasks):
        raise LegorlError(f"{run.tasks}: no tasks (run `legorl tasks import` or `legorl tasks build` first)")
    tasks = sorted(shards.read_rows(run.tasks, Kind.TASKS), key=lambda t: t.instance_id)
    if cfg.limit is not None:
        tasks = tasks[: cfg.limit]
    done = shards.already_done(run.rollouts, Kind.ROLLOUTS)
    jobs, skipped = [], 0
    for task in tasks:
        for name in cfg.harnesses:
            for k in range(cfg.samples):
                if trial_key(task.instance_id, name, cfg.step, k) in done:
                    skipped += 1
                else:
                    jobs.append(TrialJob(task, name, k))
    return jobs, skipped


def rollout_stage(
    cfg: RolloutConfig,
    proxy: ProxyHandle,
    *,
    create: Callable[..., Any] | None = None,
    on_start: Callable[[int, int], None] | None = None,
    on_done: Callable[[TrialRow], None] | None = None,
) -> RolloutSummary:
    """Run every missing trial of ``cfg`` against ``proxy``, writing one row per trial."""
    if cfg.samples < 1 or cfg.concurrency < 1 or cfg.max_turns < 1 or cfg.timeout_s <= 0:
        raise LegorlError("--samples, --concurrency, --max-turns and --timeout must be positive")
    if cfg.reap:
        from legorl.sandbox.reaper import reap

        reap()
    jobs, skipped = plan(cfg)
    summary = RolloutSummary(planned=len(jobs) + skipped, skipped=skipped)
    if on_start:
        on_start(len(jobs), skipped)
    if not jobs:
        return summary
    for name in cfg.harnesses:
        if get_harness(name).needs_install:
            require(name)  # install (cached) before any sandbox starts
    if create is None:
        from legorl.sandbox.host import require_image

        for image in sorted({image_for(j.task) for j in jobs}):
            require_image(image)
    runner = TrialRunner(cfg, proxy, create)
    start = time.monotonic()
    engine = getattr(proxy, "engine", None)
    busy0 = engine.busy_seconds() if isinstance(engine, WatchedEngine) else None
    try:
        with shards.ShardWriter(RunDir.at(cfg.run).rollouts, Kind.ROLLOUTS, rows_per_file=1) as writer:
            for row in _run_all(runner, jobs, cfg.concurrency):
                writer.add(row)
                summary.rows.append(row)
                if on_done:
                    on_done(row)
    finally:
        summary.wall_s = time.monotonic() - start
        if busy0 is not None and isinstance(engine, WatchedEngine):
            summary.engine_busy_s = engine.busy_seconds() - busy0
    return summary


def _run_all(runner: TrialRunner, jobs: list[TrialJob], concurrency: int) -> Iterator[TrialRow]:
    pending = iter(jobs)
    pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="trial")
    running: set[Future[TrialRow]] = set()
    try:
        for job in pending:
            running.add(pool.submit(runner.run, job))
            if len(running) >= concurrency:
                break
        while running:
            finished, running = wait(running, return_when=FIRST_COMPLETED)
            for fut in finished:
                yield fut.result()
                nxt = next(pending, None)
                if nxt is not None:
                    running.add(pool.submit(runner.run, nxt))
    except BaseException:
        runner.stopping.set()
        kill_host_processes()  # host-side harnesses; containers go with the sandbox module's cleanup
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
