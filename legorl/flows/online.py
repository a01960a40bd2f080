"""The online RL loop: rollout → grade → train → reload, for N policy steps on one run directory.

Exactly what a Makefile loop over ``legorl rollout / grade / train`` does, but with one engine kept
in memory that loads each new checkpoint instead of restarting. Every step's shards stay in the
run directory with their ``step``.

It is synchronous: the trials of step S are sampled by the policy trained on steps < S, and
training step S uses only them, so the rollout policy is never stale. Rerunning resumes: each
stage skips what it already wrote, training continues an interrupted step, and the engine starts
from the latest checkpoint.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from legorl.errors import LegorlError
from legorl.flows.policy import PolicySpec, open_policy
from legorl.grading.grader import GradeOptions
from legorl.paths import Checkpoints, RunDir
from legorl.stages.grade import grade_stage, rollout_jobs
from legorl.stages.rollout import RolloutConfig, rollout_stage

if TYPE_CHECKING:
    from legorl.training.config import TrainConfig

# Wraps one phase ("rollout", "grade", "train") of one step: a caller's status line, say.
Phase = Callable[[int, str], AbstractContextManager[object]]


@dataclass
class OnlineConfig:
    """The loop's settings: each step's rollout and training, grading, and the policy's engine."""

    rollout: RolloutConfig  # every step's rollout (``run`` is the loop's run directory; ``step`` is set per step)
    train: TrainConfig
    model: Path = field(metadata={"help": (
        "Initial policy (Hugging Face folder): the trainer's base model and the proxy's tokenizer.")})
    steps: int = field(default=4, metadata={"help": "Policy steps to run (counting from step 0)."})
    grade: GradeOptions = field(default_factory=GradeOptions)  # how each step's trials are graded
    policy_temperature: float | None = None  # the proxy samples every call at it (None: as the harness asks)
    engine_name: str | None = None  # the model name the proxy answers with
    max_context: int | None = None


@dataclass
class OnlineStep:
    """What one step did: new rows, the checkpoint, the trainer's metrics, where the time went."""

    step: int
    new_trials: int
    new_grades: int
    checkpoint: Path
    metrics: dict[str, float] = field(default_factory=dict)
    rollout_s: float = 0.0
    grade_s: float = 0.0
    train_s: float = 0.0
    reload_s: float = 0.0


def run_online(cfg: OnlineConfig, *, phase: Phase | None = None,
               on_step: Callable[[OnlineStep], None] | None = None) -> list[OnlineStep]:
    """Run steps ``0 … cfg.steps - 1`` (those already done are skipped by the stages themselves)."""
    from legorl.stages.train import run_train  # imports TRL: only when the loop runs

    if cfg.steps < 1:
        raise LegorlError("--steps must be at least 1")
    run = RunDir.at(cfg.rollout.run)

    def during(step: int, name: str) -> AbstractContextManager[object]:
        return phase(step, name) if phase is not None else nullcontext()

    policy = PolicySpec(model=Checkpoints(run.checkpoints).latest() or cfg.model, tokenizer=cfg.model,
                        temperature=cfg.policy_temperature, engine_name=cfg.engine_name,
                        max_context=cfg.max_context)
    records: list[OnlineStep] = []
    with open_policy(policy) as served:
        for step in range(cfg.steps):
            t0 = time.perf_counter()
            with during(step, "rollout"):
                rolled = rollout_stage(replace(cfg.rollout, step=step), served.proxy)
            t1 = time.perf_counter()
            with during(step, "grade"):
                jobs, _ = rollout_jobs(run.rollouts)
                graded = grade_stage(run.tasks, run.grades, [j for j in jobs if j.step == step], cfg.grade,
                                     run_label=run.root.name)
            t2 = time.perf_counter()
            with during(step, "train"):
                result = run_train(run.root, cfg.model, step, cfg.train, resume=True)
            t3 = time.perf_counter()
            served.reload(result.checkpoint)
            record = OnlineStep(
                step=step, new_trials=len(rolled.rows), new_grades=len(graded.rows),
                checkpoint=result.checkpoint, metrics=dict(result.metrics),
                rollout_s=t1 - t0, grade_s=t2 - t1, train_s=t3 - t2, reload_s=time.perf_counter() - t3,
            )
            records.append(record)
            if on_step is not None:
                on_step(record)
    return records
