"""The rollout stage: tasks × harnesses × samples → one trial row each in ``rollouts/``.

What one trial is (sandbox, proxy session, harness, patch, cleanup, retries) is
:mod:`legorl.trials`; this stage plans the trials that are missing, runs them on a thread pool
against a :class:`~legorl.proxy.clients.ProxyHandle`, and commits rows one per trial, so a killed
run loses only the trials in flight, and a rerun does only what is missing (infra-failed rows are
retried too).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from legorl import shards
from legorl.engines.watched import WatchedEngine
from legorl.errors import LegorlError
from legorl.harnesses import get as get_harness
from legorl.harnesses.install import require
from legorl.harnesses.processes import kill_host_processes
from legorl.paths import RunDir
from legorl.proxy.clients import ProxyHandle
from legorl.schemas import Kind, TrialRow, trial_key
from legorl.trials import SandboxFactory, TrialJob, TrialOptions, TrialRunner, image_for


@dataclass(kw_only=True)
class RolloutConfig(TrialOptions):
    """Options of ``legorl rollout``: the trials' (:class:`~legorl.trials.TrialOptions`) and the stage's."""

    run: Path = field(metadata={"help": "Run directory; the stage derives its inputs and outputs from it."})
    step: int = field(default=0, metadata={"help": "Policy step these trials belong to."})
    backoff_s: float = 2.0  # before retry n: backoff_s * 2**(n-1)
    keep_home: bool = False  # keep each trial's private HOME (large) next to its logs
    reap: bool = True  # remove containers earlier legorl processes left behind


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
