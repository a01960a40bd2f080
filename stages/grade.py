"""The grade stage: rollouts (or gold patches, or SWE-bench predictions) + tasks -> grade rows.

Resumable: trials already graded (a grade row that is not an infrastructure failure) are skipped,
rows are committed one part file per grade as they finish, and containers a killed earlier run
left behind are reaped first. So after a SIGKILL a rerun loses nothing that was written and
grades nothing twice. ``--shard i/n`` grades only the trials whose key hashes to shard ``i``;
``--executor ray`` grades on a Ray cluster's nodes (:mod:`legorl.trials.executors`), where a grade lost
with its worker runs again and, past its retries, is an infrastructure failure.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pyarrow.compute as pc

from legorl.core import shards
from legorl.core.errors import LegorlError
from legorl.core.jsonfiles import LONE_SURROGATE, json_lines, loads, read_utf8
from legorl.core.schemas import GradeRow, GradeStatus, Kind, TaskRow, trial_key
from legorl.grading.fingerprint import grade_fingerprint
from legorl.grading.grader import GradeOptions, Grader
from legorl.trials.executors import ExecutorOptions, Work

GOLD_HARNESS = "gold"


@dataclass
class Job:
    trial_id: str
    task_id: str
    patch: str | None
    harness: str | None = None
    step: int | None = None


@dataclass
class GradeSummary:
    graded: int = 0
    skipped: int = 0  # already graded
    by_status: dict[str, int] = field(default_factory=dict)
    resolved: int = 0
    infra_errors: int = 0
    unconfirmed: int = 0  # --confirm: passes a fresh rerun did not reproduce (scored 0)
    mean_reward: float | None = None
    mean_seconds: float | None = None
    wall_s: float = 0.0
    rows: list[GradeRow] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)  # "trial: error" per grade lost with its Ray worker

    def as_dict(self) -> dict[str, object]:
        return {
            "graded": self.graded, "skipped": self.skipped, "workers_lost": len(self.lost), "lost": self.lost, "by_status": self.by_status, "resolved": self.resolved,
            "infra_errors": self.infra_errors, "unconfirmed": self.unconfirmed, "mean_reward": self.mean_reward, "mean_seconds": self.mean_seconds,
            "wall_s": round(self.wall_s, 3),
            "grades": [{"trial_id": r.trial_id, "task_id": r.task_id, "status": r.status, "reward": r.reward,
                        "resolution": r.resolution, "dropped_paths": r.dropped_paths, "apply_method": r.apply_method,
                        "suspicious": r.suspicious, "control": r.control, "confirmed": r.confirmed, "duration_s": r.duration_s,
                        "error": r.error} for r in self.rows],
        }


def gold_jobs(tasks: dict[str, TaskRow]) -> list[Job]:
    return [Job(trial_key(t.instance_id, GOLD_HARNESS, 0, 0), t.instance_id, t.patch, GOLD_HARNESS, 0)
            for t in tasks.values()]


def prediction_jobs(path: Path, tasks: dict[str, TaskRow]) -> list[Job]:
    """SWE-bench predictions: a JSON list / JSONL of ``{instance_id, model_patch[, model_name_or_path]}``
    (a JSON object keyed by instance id works too)."""
    try:
        text = read_utf8(path)
    except OSError as exc:
        raise LegorlError(f"{path}: cannot read predictions ({exc.strerror})") from exc
    try:
        items: Any
        data = loads(text)
        # one object: a single prediction (a one-line JSONL file), or predictions keyed by instance id
        items = [data] if isinstance(data, dict) and "instance_id" in data else (
            list(data.values()) if isinstance(data, dict) else data)
        if not isinstance(items, list):
            raise LegorlError(f"{path}: expected predictions (a JSON list, object or JSON lines), "
                              f"got a JSON {type(items).__name__}")
    except ValueError:
        items = json_lines(path, text, "neither JSON nor JSON lines (line {line}: {message})")
    jobs: dict[str, Job] = {}
    for index, item in enumerate(items):
        if not isinstance(item, dict) or not isinstance(item.get("instance_id"), str):
            raise LegorlError(f"{path}: prediction {index}: field 'instance_id': missing")
        iid = item["instance_id"]
        if iid not in tasks:
            raise LegorlError(f"{path}: prediction {index}: field 'instance_id': no task {iid!r} in the task set")
        patch = item.get("model_patch")
        if patch is not None and not isinstance(patch, str):
            raise LegorlError(f"{path}: prediction {index} ({iid}): field 'model_patch': not a string")
        name = item.get("model_name_or_path")
        if name is not None and not isinstance(name, str):
            raise LegorlError(f"{path}: prediction {index} ({iid}): field 'model_name_or_path': not a string")
        for field_name, value in (("model_patch", patch), ("model_name_or_path", name)):
            if value and LONE_SURROGATE.search(value):  # JSON can spell one (\ud800); no shard holds one
                raise LegorlError(f"{path}: prediction {index} ({iid}): field '{field_name}': "
                                  "holds a lone UTF-16 surrogate (not valid Unicode)")
        harness = name or "predictions"
        key = trial_key(iid, harness, 0, 0)
        if key in jobs:
            raise LegorlError(f"{path}: prediction {index} ({iid}): a second prediction for this instance")
        jobs[key] = Job(key, iid, patch, harness, 0)
    return list(jobs.values())


def rollout_jobs(rollouts_dir: Path, step: int | None = None) -> tuple[list[Job], int]:
    """Trials to grade from rollouts (of ``step`` only, when given), and how many were
    infrastructure failures (never graded)."""
    where = None if step is None else pc.field("step") == step
    table = shards.read(rollouts_dir, Kind.ROLLOUTS,
                        columns=["task_id", "harness", "step", "patch", "infra_failure"], where=where).table
    jobs, infra = [], 0
    for row in table.to_pylist():
        if row["infra_failure"]:
            infra += 1
            continue
        jobs.append(Job(row["trial_id"], row["task_id"], row["patch"], row["harness"], row["step"]))
    return jobs, infra


def grade_stage(
    tasks_dir: Path, out_dir: Path, jobs: list[Job], options: GradeOptions | None = None, *,
    run_label: str | None = None, reap: bool = True, placement: ExecutorOptions | None = None,
    on_start: Callable[[int, int], None] | None = None, on_done: Callable[[GradeRow], None] | None = None,
) -> GradeSummary:
    """Grade ``jobs`` (skipping those already graded in ``out_dir``), ``options.concurrency`` at once;
    ``placement``: of its shard only, on its executor (default: all, on threads here)."""
    import time

    placement = placement or ExecutorOptions()
    jobs = [j for j in jobs if placement.owns(j.trial_id)]
    tasks = {t.instance_id: t for t in shards.read_rows(tasks_dir, Kind.TASKS)}
    missing = sorted({j.task_id for j in jobs} - tasks.keys())
    if missing:
        raise LegorlError(f"{tasks_dir}: no task {missing[0]!r} ({len(missing)} trial task id(s) unknown)")
    if reap:
        from legorl.sandbox.reaper import reap as do_reap

        do_reap()
    done = shards.already_done(out_dir, Kind.GRADES)
    todo = [j for j in jobs if j.trial_id not in done]
    summary = GradeSummary(skipped=len(jobs) - len(todo))
    if on_start:
        on_start(len(todo), summary.skipped)
    options = options or GradeOptions()
    if run_label:
        options = replace(options, labels={**options.labels, "run": run_label})
    work = Grading(options)
    start = time.monotonic()
    try:
        with shards.ShardWriter(out_dir, Kind.GRADES) as writer:  # batched: a part per many rows
            executor = placement.make_executor()
            for row in executor.map(work, [(tasks[j.task_id], j) for j in todo], options.concurrency):
                writer.add(row)  # a full disk: a ShardError naming the folder (shards.write_table)
                summary.rows.append(row)
                if on_done:
                    on_done(row)
    finally:
        summary.lost = work.lost_log
    summary.wall_s = time.monotonic() - start
    rows = summary.rows
    summary.graded = len(rows)
    for r in rows:
        summary.by_status[r.status] = summary.by_status.get(r.status, 0) + 1
    summary.resolved = sum(bool(r.resolved) for r in rows)
    summary.infra_errors = sum(r.infra_failure for r in rows)
    summary.unconfirmed = sum(r.confirmed is False for r in rows)
    rewards = [r.reward for r in rows if r.reward is not None]
    summary.mean_reward = round(statistics.fmean(rewards), 4) if rewards else None
    times = [r.duration_s for r in rows if r.duration_s is not None and r.status != GradeStatus.EMPTY_PATCH]
    summary.mean_seconds = round(statistics.fmean(times), 3) if times else None
    return summary


class Grading(Work[tuple[TaskRow, Job], GradeRow]):
    """Grades as executor work: one grader per worker process; a grade lost with its worker runs
    again up to ``retries`` times, then is an infrastructure failure."""

    retries = 2

    def __init__(self, options: GradeOptions):
        self.options = options
        self.lost_log: list[str] = []

    def runner(self) -> Callable[[tuple[TaskRow, Job], int], GradeRow]:
        grader = Grader(self.options)

        def grade(item: tuple[TaskRow, Job], lost: int) -> GradeRow:
            task, job = item
            return grader.grade(task, job.patch, job.trial_id, harness=job.harness, step=job.step)

        return grade

    def lost(self, item: tuple[TaskRow, Job], error: str, attempts: int) -> GradeRow | None:
        job = item[1]
        self.lost_log.append(f"{job.trial_id}: attempt {attempts}: {error}")
        if attempts <= self.retries:
            return None
        return GradeRow(trial_id=job.trial_id, task_id=job.task_id, status=GradeStatus.INFRA_ERROR,
                        infra_failure=True, harness=job.harness, step=job.step, error=error,
                        fingerprint=grade_fingerprint(item[0]))

    def backoff_s(self, attempts: int) -> float:
        return 2.0 * attempts


def default_concurrency() -> int:
    return max(1, min(4, (os.cpu_count() or 2)))
