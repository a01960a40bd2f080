"""The online RL loop: rollout → grade → train → reload, for N policy steps on one run directory.

Exactly what a Makefile loop over ``legorl rollout / grade / train`` does, but with one engine kept
in memory that loads each new checkpoint instead of restarting. Every step's shards stay in the
run directory with their ``step``; after each step the loop compacts them (:func:`legorl.core.shards.compact`).

``max_staleness`` K = 0 (the default) is synchronous: the trials of step S are sampled by the
policy trained on steps < S, and training step S uses only them, so the rollout policy is never
stale. K >= 1 overlaps them: background threads roll out and grade steps S+1 … S+K (through the
same stages and shards; step T's grading overlaps step T + 1's rollout) while step S trains, and
the engine loads each checkpoint as soon as it exists, between calls, so a trial in flight may span
two versions. Step T's rollout starts once
the engine serves version T - K, so every call of it is at most K versions behind the step that
trains it; the trainer is held to that bound anyway (:mod:`legorl.trials.provenance`; ``stale_tokens``
says what a stale trial gets) and the loop writes each step's staleness figures to
``RUN/train/metrics`` (stage ``loop``).

Policy versions (:mod:`legorl.engines.watched`) follow the checkpoints: the initial model is
version 0 and checkpoint ``step-S`` version S + 1, so a resumed loop keeps numbering where the
killed one was. Rerunning resumes: each stage skips what it already wrote, training continues an
interrupted step, and the engine starts from the latest checkpoint.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import pyarrow.compute as pc

from legorl.core import shards
from legorl.core.errors import LegorlError
from legorl.core.paths import Checkpoints, RunDir
from legorl.core.schemas import Kind, MetricRow, trial_is_infra
from legorl.engines.config import EngineSpec
from legorl.flows.policy import Policy, PolicySpec, open_policy
from legorl.grading.grader import GradeOptions
from legorl.monitor import summaries
from legorl.stages.grade import grade_stage, rollout_jobs
from legorl.stages.rollout import RolloutConfig, rollout_stage
from legorl.trials import provenance
from legorl.trials.provenance import Staleness, StaleTokens

if TYPE_CHECKING:
    from legorl.stages.train import TrainResult
    from legorl.training.config import TrainConfig

# Wraps one phase ("rollout", "grade", "train") of one step: a caller's status line, say. With
# max_staleness >= 1 only the loop's own thread calls it: "rollout" is then the wait for the step's
# rollouts and grades (done in the background), and there is no "grade" phase of its own.
Phase = Callable[[int, str], AbstractContextManager[object]]


@dataclass
class OnlineConfig:
    """The loop's settings: each step's rollout and training, grading, and the policy's engine."""

    rollout: RolloutConfig  # every step's rollout (``run`` is the loop's run directory; ``step`` is set per step)
    train: TrainConfig
    model: Path = field(metadata={"help": (
        "Initial policy (Hugging Face folder): the trainer's base model and the proxy's tokenizer.")})
    steps: int = field(default=4, metadata={"help": "Policy steps to run (counting from step 0)."})
    max_staleness: int = field(default=0, metadata={"help": (
        "Versions a trial's calls may lag behind the step that trains it. 0: synchronous (rollout, grade, "
        "train, reload, in turn). K >= 1: steps S+1..S+K roll out and grade while step S trains, and the "
        "engine loads each checkpoint as soon as it exists (between calls).")})
    stale_tokens: StaleTokens = field(default="drop_trial", metadata={"help": (
        "What a trial with calls older than --max-staleness gets: drop_trial (left out of training, kept "
        "in the shards and counted in the metrics), mask (trained, its stale tokens without loss) or keep "
        "(trained as it is, its importance weights the only correction: pair it with --is-mode mask).")})
    grade: GradeOptions = field(default_factory=GradeOptions)  # how each step's trials are graded
    # what serves the policy: embedded, or vllm (whose weights the loop reloads each step); every call
    # samples at the rollout's temperature, whatever the harness asks
    engine: EngineSpec = field(default_factory=EngineSpec)
    engine_name: str | None = None  # the model name the proxy answers with
    max_context: int | None = None

    def __post_init__(self) -> None:
        Staleness(self.max_staleness, self.stale_tokens)  # refuses a bad K or mode now, not after a step

    @property
    def staleness(self) -> Staleness:
        return Staleness(self.max_staleness, self.stale_tokens)


@dataclass
class OnlineStep:
    """What one step did: new rows, the checkpoint, the trainer's metrics, where the time went.

    With ``max_staleness`` >= 1, ``rollout_s`` and ``grade_s`` ran in the background (overlapping the
    previous step's training); ``wait_s`` is how long training waited for them, and ``wall_s`` the
    loop's own time for the step (from the previous step's end)."""

    step: int
    new_trials: int
    new_grades: int
    checkpoint: Path
    metrics: dict[str, float] = field(default_factory=dict)
    rollout_s: float = 0.0
    grade_s: float = 0.0
    train_s: float = 0.0
    reload_s: float = 0.0
    wait_s: float = 0.0
    wall_s: float = 0.0
    staleness: dict[str, float] = field(default_factory=dict)  # provenance.staleness_metrics of the step


def initial_version(run: RunDir) -> int:
    """The policy version the loop starts from: the latest checkpoint ``step-S`` is S + 1, none is 0."""
    latest = Checkpoints(run.checkpoints).latest()
    return 0 if latest is None else int(latest.name.removeprefix("step-")) + 1


def run_online(cfg: OnlineConfig, *, phase: Phase | None = None,
               on_step: Callable[[OnlineStep], None] | None = None) -> list[OnlineStep]:
    """Run steps ``0 … cfg.steps - 1`` (those already done are skipped by the stages themselves)."""
    if cfg.steps < 1:
        raise LegorlError("--steps must be at least 1")
    run = RunDir.at(cfg.rollout.run)

    def during(step: int, name: str) -> AbstractContextManager[object]:
        return phase(step, name) if phase is not None else nullcontext()

    policy = PolicySpec(model=Checkpoints(run.checkpoints).latest() or cfg.model, tokenizer=cfg.model,
                        temperature=cfg.rollout.temperature, engine_name=cfg.engine_name,
                        max_context=cfg.max_context, **asdict(cfg.engine))
    with open_policy(policy) as served:
        assert served.engine is not None  # a model served here, never an external proxy
        if cfg.engine.upstream is not None:  # someone else's server: make it serve (and check) our starting policy
            assert policy.model is not None
            served.reload(policy.model)
        served.engine.policy_version = initial_version(run)  # before any call
        if cfg.max_staleness == 0:
            return _synchronous(cfg, run, served, during, on_step)
        return _overlapped(cfg, run, served, during, on_step)


def _synchronous(cfg: OnlineConfig, run: RunDir, served: Policy, during: Phase,
                 on_step: Callable[[OnlineStep], None] | None) -> list[OnlineStep]:
    records: list[OnlineStep] = []
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        with during(step, "rollout"):
            rolled = rollout_stage(replace(cfg.rollout, step=step), served.proxy)
        t1 = time.perf_counter()
        with during(step, "grade"):
            graded = _grade(cfg, run, step)
        t2 = time.perf_counter()
        with during(step, "train"):
            result = _train(cfg, run, step)
        t3 = time.perf_counter()
        _load(served, result.checkpoint, step)
        shards.compact_run(run.root, on_merge=summaries.merge)  # the step's small parts merged: readers' cost stays flat
        t4 = time.perf_counter()
        record = OnlineStep(
            step=step, new_trials=len(rolled.rows), new_grades=graded,
            checkpoint=result.checkpoint, metrics=dict(result.metrics),
            rollout_s=t1 - t0, grade_s=t2 - t1, train_s=t3 - t2, reload_s=t4 - t3, wall_s=t4 - t0,
        )
        records.append(record)
        if on_step is not None:
            on_step(record)
    return records


def _load(served: Policy, checkpoint: Path, step: int) -> None:
    """Serve step ``step``'s checkpoint from the next call on, as version ``step + 1`` (between calls:
    :meth:`WatchedEngine.load_weights`). Named, not counted: a resumed loop reloads checkpoints the
    engine has served before."""
    assert served.engine is not None
    asyncio.run(served.engine.load_weights(str(checkpoint), version=step + 1))


def _grade(cfg: OnlineConfig, run: RunDir, step: int) -> int:
    jobs, _ = rollout_jobs(run.rollouts, step)
    graded = grade_stage(run.tasks, run.grades, jobs, cfg.grade, run_label=run.root.name)
    return len(graded.rows)


def _train(cfg: OnlineConfig, run: RunDir, step: int) -> TrainResult:
    from legorl.stages.train import run_train  # imports TRL: only when the loop trains

    return run_train(run.root, cfg.model, step, cfg.train, resume=True, staleness=cfg.staleness)


@dataclass
class _Rolled:
    """One step's background rollout and grading, as the training thread receives it."""

    new_trials: int
    new_grades: int
    rollout_s: float
    grade_s: float


class _Ahead:
    """The background threads: one rolls out step T once the engine serves version T - K, the other
    grades each rolled-out step in turn, so step T's grading overlaps step T + 1's rollout."""

    def __init__(self, cfg: OnlineConfig, run: RunDir, served: Policy):
        self.cfg, self.run, self.served = cfg, run, served
        self.rolled: dict[int, tuple[int, float]] = {}  # step -> (new trials, rollout seconds), to grade
        self.done: dict[int, _Rolled] = {}
        self.error: BaseException | None = None
        self.stopping = False
        self._cv = threading.Condition()
        self._threads = [threading.Thread(target=self._guarded, args=(work,), name=f"legorl-{name}-ahead",
                                          daemon=True)
                         for name, work in (("rollouts", self._roll_out), ("grades", self._grade))]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def loaded(self) -> None:
        """The engine serves a new version: a step waiting for it may start."""
        with self._cv:
            self._cv.notify_all()

    def wait(self, step: int) -> _Rolled:
        """Block until ``step`` is rolled out and graded (re-raising the threads' failure)."""
        with self._cv:
            while step not in self.done and self.error is None:
                self._cv.wait()
            if self.error is not None:
                raise LegorlError(f"the background rollout failed: {type(self.error).__name__}: "
                                  f"{self.error}") from self.error
            return self.done[step]

    def stop(self, wait: bool) -> None:
        with self._cv:
            self.stopping = True
            self._cv.notify_all()
        if wait:
            for thread in self._threads:
                thread.join()

    def _version(self) -> int:
        assert self.served.engine is not None
        return self.served.engine.policy_version

    def _guarded(self, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as exc:  # handed to the training thread, which reports it
            with self._cv:
                self.error = exc
                self.stopping = True
                self._cv.notify_all()

    def _roll_out(self) -> None:
        for step in range(self.cfg.steps):
            with self._cv:
                while self._version() < step - self.cfg.max_staleness and not self.stopping:
                    self._cv.wait()
                if self.stopping:
                    return
            t0 = time.perf_counter()
            rolled = rollout_stage(replace(self.cfg.rollout, step=step), self.served.proxy)
            with self._cv:
                self.rolled[step] = (len(rolled.rows), time.perf_counter() - t0)
                self._cv.notify_all()

    def _grade(self) -> None:
        for step in range(self.cfg.steps):
            with self._cv:
                while step not in self.rolled and not self.stopping:
                    self._cv.wait()
                if self.stopping:
                    return
                new_trials, rollout_s = self.rolled.pop(step)
            t0 = time.perf_counter()
            graded = _grade(self.cfg, self.run, step)
            with self._cv:
                self.done[step] = _Rolled(new_trials, graded, rollout_s, time.perf_counter() - t0)
                self._cv.notify_all()


def _overlapped(cfg: OnlineConfig, run: RunDir, served: Policy, during: Phase,
                on_step: Callable[[OnlineStep], None] | None) -> list[OnlineStep]:
    ahead = _Ahead(cfg, run, served)
    ahead.start()
    records: list[OnlineStep] = []
    try:
        last = time.perf_counter()
        for step in range(cfg.steps):
            with during(step, "rollout"):
                rolled = ahead.wait(step)
            t1 = time.perf_counter()
            figures = _staleness_figures(run, step, cfg.staleness)
            with during(step, "train"):
                result = _train(cfg, run, step)
            t2 = time.perf_counter()
            assert served.engine is not None
            if served.engine.policy_version <= step:  # a resumed run's engine may serve a later one already
                _load(served, result.checkpoint, step)
                ahead.loaded()
            t3 = time.perf_counter()
            _write_staleness(run, step, figures)
            shards.compact_run(run.root, on_merge=summaries.merge)  # the background stages may write meanwhile
            record = OnlineStep(
                step=step, new_trials=rolled.new_trials, new_grades=rolled.new_grades,
                checkpoint=result.checkpoint, metrics=dict(result.metrics), rollout_s=rolled.rollout_s,
                grade_s=rolled.grade_s, train_s=t2 - t1, reload_s=t3 - t2, wait_s=t1 - last,
                wall_s=t3 - last, staleness=figures,
            )
            last = t3
            records.append(record)
            if on_step is not None:
                on_step(record)
    except Exception:
        ahead.stop(wait=True)  # let the stage in progress commit what it has before the engine closes
        raise
    except BaseException:
        ahead.stop(wait=False)  # interrupted: leave now (a rerun redoes what was in flight)
        raise
    ahead.stop(wait=True)
    return records


def _staleness_figures(run: RunDir, step: int, bound: Staleness) -> dict[str, float]:
    """The step's staleness figures. The trainer holds the step to the bound (``stale_tokens``); the
    loop itself never samples a stale trial (step T starts once the engine serves version T - K), but
    a run resumed with a smaller K can hold some."""
    return provenance.staleness_metrics(_step_rows(run, step), step, bound)


def _step_rows(run: RunDir, step: int) -> list[dict[str, Any]]:
    """Step ``step``'s trials that training takes (not infrastructure failures: :func:`trial_is_infra`,
    the rule training drops them by), with their calls."""
    at_step = pc.field("step") == step
    rows = shards.read(run.rollouts, Kind.ROLLOUTS, columns=["trial_id", "step", "infra_failure", "segments", "calls"],
                       where=at_step).table.to_pylist()
    grades = {g["trial_id"]: SimpleNamespace(**g) for g in shards.read(
        run.grades, Kind.GRADES, columns=["reward", "status", "infra_failure"],
        where=at_step | pc.field("step").is_null()).table.to_pylist()}  # grades written without their trial's step
    return [r for r in rows if not trial_is_infra(r["infra_failure"], grades.get(r["trial_id"]))]


def _write_staleness(run: RunDir, step: int, figures: dict[str, float]) -> None:
    """Add the step's staleness rows to ``RUN/train/metrics`` once (after the trainer's own: it
    publishes a step only when the step has no rows yet), whatever the kills and reruns."""
    if shards.part_files(run.metrics):
        table = shards.read(run.metrics, Kind.METRICS, columns=["step", "stage"]).table
        if any(s == step and g == provenance.METRICS_STAGE
               for s, g in zip(table.column("step").to_pylist(), table.column("stage").to_pylist(), strict=True)):
            return
    now = time.time()
    shards.write(run.metrics, Kind.METRICS, [
        MetricRow(step=step, key=key, value=value, stage=provenance.METRICS_STAGE, time=now)
        for key, value in figures.items()
    ])
