"""`legorl loop`: the online RL loop, rollout → grade → train → reload, for N policy steps.

The loop itself is :mod:`legorl.flows.online` (one engine kept in memory, loading each new
checkpoint; resumable); this command parses the options, shows each phase and prints each step.
"""

from __future__ import annotations

from typing import Any

import typer

from legorl.cli.common import JsonOption, console, print_json
from legorl.cli.options import ConfigOptions, with_configs
from legorl.core import metric_keys as mk
from legorl.engines.config import EngineSpec
from legorl.flows.online import OnlineConfig
from legorl.grading.grader import GRADE_FIELDS, GradeOptions
from legorl.stages.rollout import RolloutConfig
from legorl.training.options import TRAIN_CLI_FIELDS, TrainOptions

# What `legorl loop` takes of each component's options (grading ones, GRADE_FIELDS, prefixed --grade-). The
# trainer's temperature is the rollout's (the proxy samples at it); the step is set per step.
LOOP_TRAIN_FIELDS = tuple(f for f in TRAIN_CLI_FIELDS if f != "temperature")


def register(app: typer.Typer) -> None:
    @app.command("loop")
    @with_configs(rollout=ConfigOptions(RolloutConfig, exclude=("step", "shard")),
                  grade=ConfigOptions(GradeOptions, only=GRADE_FIELDS, prefix="grade-"),
                  train=ConfigOptions(TrainOptions, only=LOOP_TRAIN_FIELDS, factory=dict),
                  loop=ConfigOptions(OnlineConfig, only=("model", "steps", "max_staleness", "stale_tokens"), factory=dict),
                  engine=ConfigOptions(EngineSpec))
    def loop_command(rollout: RolloutConfig, grade: GradeOptions, train: dict[str, Any], loop: dict[str, Any],
                     engine: EngineSpec, json_out: JsonOption = False) -> None:
        """Run the online loop: each step rolls out with the latest policy, grades, trains, reloads."""
        from legorl.flows.online import OnlineStep, run_online
        from legorl.flows.policy import require_model_dir
        from legorl.training.config import TrainConfig

        require_model_dir(loop["model"])
        engine.check()
        # The trainer reads the temperature from the calls the proxy records; passing it too keeps old
        # shards of a resumed run at it, and checks that the proxy really sampled at it.
        cfg = OnlineConfig(rollout=rollout, grade=grade, train=TrainConfig(**train, temperature=rollout.temperature),
                           engine=engine, **loop)
        run, names = rollout.run, rollout.harnesses
        phases = {"rollout": f"rollout ({', '.join(names)})", "grade": "grading", "train": "training"}
        history: list[dict[str, Any]] = []

        def show(step: OnlineStep) -> None:
            record = {
                "step": step.step, "new_trials": step.new_trials, "new_grades": step.new_grades,
                "reward_mean": step.metrics.get(mk.REWARD_MEAN), "checkpoint": str(step.checkpoint),
                "rollout_s": round(step.rollout_s, 1), "grade_s": round(step.grade_s, 1),
                "train_s": round(step.train_s, 1),
            }
            history.append(record)
            console.print(
                f"step {step.step}: reward {record['reward_mean']} · rollout {record['rollout_s']} s · "
                f"grade {record['grade_s']} s · train {record['train_s']} s → {step.checkpoint.name}",
                highlight=False,
            )

        run_online(cfg, phase=lambda step, name: console.status(f"step {step}: {phases[name]}"), on_step=show)
        if json_out:
            print_json({"run": str(run), "steps": history})
