"""The rollout stage: tasks × harnesses × samples → one trial row each in ``rollouts/``.

What one trial is (sandbox, proxy session, harness, patch, cleanup, retries) is
:mod:`legorl.trials.lifecycle`; this stage plans the trials that are missing (of its ``--shard``, if any),
runs them on an executor (:mod:`legorl.trials.executors`: a thread pool here, or Ray tasks that reach the
proxy by its URL) against a :class:`~legorl.proxy.clients.ProxyHandle`, and commits rows one per
trial, so a killed run loses only the trials in flight, and a rerun does only what is missing
(infra-failed rows are retried too). A trial whose Ray worker was lost is an infrastructure
failure: run again while its retries last, else committed as one.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pyarrow.compute as pc

from legorl.core import shards
from legorl.core.errors import ConfigError, LegorlError
from legorl.core.paths import RUN_HELP, RunDir
from legorl.core.schemas import Kind, Outcome, TrialRow, trial_key
from legorl.engines.watched import WatchedEngine
from legorl.harnesses import get as get_harness
from legorl.harnesses.install import require
from legorl.harnesses.processes import kill_host_processes
from legorl.proxy.clients import InProcessProxy, ProxyHandle, RemoteProxy
from legorl.proxy.limits import ProxyLimits
from legorl.trials.costs import trial_cost
from legorl.trials.executors import ExecutorOptions, Work
from legorl.trials.fingerprints import trial_fingerprint
from legorl.trials.lifecycle import SandboxFactory, TrialJob, TrialOptions, TrialRunner, image_for


@dataclass(kw_only=True)
class RolloutConfig(TrialOptions, ExecutorOptions):
    """Options of ``legorl rollout``: the trials' (:class:`~legorl.trials.lifecycle.TrialOptions`), where they run
    (:class:`~legorl.trials.executors.ExecutorOptions`) and the stage's."""

    run: Path = field(metadata={"help": RUN_HELP})
    step: int = field(default=0, metadata={"help": "Policy step these trials belong to."})
    backoff_s: float = 2.0  # before retry n: backoff_s * 2**(n-1)
    keep_home: bool = False  # keep each trial's private HOME (large) next to its logs
    reap: bool = True  # remove containers earlier legorl processes left behind

    def __post_init__(self) -> None:
        TrialOptions.__post_init__(self)
        self.check_placement()


@dataclass
class RolloutSummary:
    planned: int = 0
    skipped: int = 0  # already in rollouts/
    rows: list[TrialRow] = field(default_factory=list)
    wall_s: float = 0.0
    engine_busy_s: float | None = None
    lost: list[str] = field(default_factory=list)  # "trial: error" per attempt lost with its Ray worker

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
            "workers_lost": len(self.lost), "lost": self.lost,
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
    done = shards.already_done(run.rollouts, Kind.ROLLOUTS, where=pc.field("step") == cfg.step)
    jobs, skipped = [], 0
    for task in tasks:
        for name in cfg.harnesses:
            for k in range(cfg.samples):
                key = trial_key(task.instance_id, name, cfg.step, k)
                if not cfg.owns(key):  # another shard's
                    continue
                if key in done:
                    skipped += 1
                else:
                    jobs.append(TrialJob(task, name, k))
    return jobs, skipped


def rollout_stage(
    cfg: RolloutConfig,
    proxy: ProxyHandle,
    *,
    create: SandboxFactory | None = None,
    on_start: Callable[[int, int], None] | None = None,
    on_done: Callable[[TrialRow], None] | None = None,
) -> RolloutSummary:
    """Run every missing trial of ``cfg`` against ``proxy``, writing one row per trial."""
    if cfg.reap:
        from legorl.sandbox.reaper import reap

        reap()
    jobs, skipped = plan(cfg)
    summary = RolloutSummary(planned=len(jobs) + skipped, skipped=skipped)
    if on_start:
        on_start(len(jobs), skipped)
    if not jobs:
        return summary
    remote = cfg.executor != "local"
    if remote and create is not None:
        raise ConfigError(f"--executor {cfg.executor}: workers make their own sandboxes (no sandbox factory)")
    if not remote:
        _prepare_host(cfg, jobs, install_images=create is None)
    work: _TrialWork = (RemoteTrials(cfg, proxy.model, *_proxy_address(proxy), proxy.limits) if remote
                        else LocalTrials(cfg, TrialRunner(cfg, proxy, create)))
    start = time.monotonic()
    engine = getattr(proxy, "engine", None)
    busy0 = engine.busy_seconds() if isinstance(engine, WatchedEngine) else None
    try:
        with shards.ShardWriter(RunDir.at(cfg.run).rollouts, Kind.ROLLOUTS) as writer:
            for row in cfg.make_executor().map(work, jobs, cfg.concurrency):
                writer.add(row)
                summary.rows.append(row)
                if on_done:
                    on_done(row)
    finally:
        summary.lost = work.lost_log
        summary.wall_s = time.monotonic() - start
        if busy0 is not None and isinstance(engine, WatchedEngine):
            summary.engine_busy_s = engine.busy_seconds() - busy0
    return summary


def _prepare_host(cfg: RolloutConfig, jobs: list[TrialJob], install_images: bool) -> None:
    """Harness installs and task images, before any sandbox starts (each worker host does this too)."""
    for name in cfg.harnesses:
        if get_harness(name).needs_install:
            require(name)  # install (cached)
    if install_images:
        from legorl.sandbox.host import require_image

        for image in sorted({image_for(j.task) for j in jobs}):
            require_image(image)


def _proxy_address(proxy: ProxyHandle) -> tuple[str, str | None]:
    """The URL (and API key) workers elsewhere reach ``proxy`` at."""
    if isinstance(proxy, RemoteProxy):
        return proxy.url, proxy.api_key
    if isinstance(proxy, InProcessProxy):  # loopback: workers on this machine only (see docs/scale-out.md)
        return proxy.server.base_url, None
    raise ConfigError(f"--executor: workers reach the proxy by URL, and a {type(proxy).__name__} has none")


class _TrialWork(Work[TrialJob, TrialRow]):
    """The trials as executor work; a trial lost with its worker counts against its retries."""

    def __init__(self, cfg: RolloutConfig, model: str):
        self.cfg = cfg
        self.model = model  # the proxy's, for the rows of trials lost for good
        self.lost_log: list[str] = []

    def lost(self, job: TrialJob, error: str, attempts: int) -> TrialRow | None:
        cfg = self.cfg
        key = trial_key(job.task.instance_id, job.harness, cfg.step, job.sample_index)
        self.lost_log.append(f"{key}: attempt {attempts}: {error}")
        if attempts <= cfg.retries:
            return None
        now = time.time()
        return TrialRow.new(job.task.instance_id, job.harness, cfg.step, job.sample_index,
                            outcome=Outcome.INFRA_ERROR, infra_failure=True, model=self.model, error=error,
                            attempts=attempts, started_at=now, finished_at=now,
                            fingerprint=trial_fingerprint(job.harness, cfg), cost=trial_cost([], attempts, None))

    def backoff_s(self, attempts: int) -> float:
        return self.cfg.backoff_s * 2 ** (attempts - 1)


class LocalTrials(_TrialWork):
    """Trials in this process, on the stage's own runner (and its proxy handle)."""

    def __init__(self, cfg: RolloutConfig, runner: TrialRunner):
        super().__init__(cfg, runner.proxy.model)
        self.trial_runner = runner

    def runner(self) -> Callable[[TrialJob, int], TrialRow]:
        return lambda job, lost: self.trial_runner.run(job, first_attempt=lost + 1)

    def stop(self) -> None:
        self.trial_runner.stopping.set()
        kill_host_processes()  # host-side harnesses; containers go with the sandbox module's cleanup


class RemoteTrials(_TrialWork):
    """Trials on executor workers, each process with its own runner, reaching the proxy by URL."""

    def __init__(self, cfg: RolloutConfig, model: str, proxy_url: str, api_key: str | None,
                 limits: ProxyLimits | None = None):
        # the paths as absolute ones: workers run in other directories
        config = Path(cfg.harness_config).resolve() if cfg.harness_config is not None else None
        super().__init__(replace(cfg, run=Path(cfg.run).resolve(), harness_config=config), model)
        self.proxy_url = proxy_url
        self.api_key = api_key
        self.limits = limits

    def runner(self) -> Callable[[TrialJob, int], TrialRow]:
        proxy = RemoteProxy(self.proxy_url, self.api_key, self.limits)  # open for the worker process's life
        runner = TrialRunner(self.cfg, proxy)
        prepared: set[str] = set()

        def run(job: TrialJob, lost: int) -> TrialRow:
            image = image_for(job.task)
            if image not in prepared:  # each worker host needs the harnesses and the task's image
                _prepare_host(self.cfg, [job], install_images=True)
                prepared.add(image)
            return runner.run(job, first_attempt=lost + 1)

        return run
