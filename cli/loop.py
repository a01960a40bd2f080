"""`legorl loop`: the online RL loop, rollout → grade → train → reload, for N policy steps.

The loop itself is :mod:`legorl.flows.online` (one engine kept in memory, loading each new
checkpoint; resumable); this command parses the options, shows each phase and prints each step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from legorl import metric_keys as mk
from legorl.cli.common import JsonOption, RunOption, console, fail, print_json


def register(app: typer.Typer) -> None:
    @app.command("loop")
    def loop_command(
        run: RunOption,
        model: Annotated[Path, typer.Option("--model", help="Initial policy (Hugging Face folder).")],
        harness: Annotated[str, typer.Option(help="Harness name(s), comma-separated.")],
        steps: Annotated[int, typer.Option(help="Policy steps to run (counting from step 0).")] = 4,
        samples: Annotated[int, typer.Option(help="Trials per task and harness at each step (a group).")] = 4,
        limit: Annotated[int | None, typer.Option(help="Only the first N tasks.")] = None,
        concurrency: Annotated[int, typer.Option(help="Trials at once.")] = 2,
        grade_concurrency: Annotated[int, typer.Option(help="Grading containers at once.")] = 2,
        max_turns: Annotated[int, typer.Option(help="Model calls per trial.")] = 8,
        max_tokens: Annotated[int | None, typer.Option(help="Cap on one call's sampled tokens.")] = None,
        timeout: Annotated[float, typer.Option(help="Hard wall-clock limit of one harness run, seconds.")] = 600.0,
        grade_timeout: Annotated[float, typer.Option(help="Seconds the hidden tests may run.")] = 300.0,
        temperature: Annotated[float, typer.Option(help="Policy sampling temperature (rollout and trainer).")] = 1.0,
        loss: Annotated[str, typer.Option(help="grpo | dr_grpo | dapo | gspo.")] = "grpo",
        importance_sampling: Annotated[str, typer.Option("--is", help="token | sequence | none.")] = "token",
        lr: Annotated[float, typer.Option(help="Learning rate.")] = 1e-5,
        num_iterations: Annotated[int, typer.Option(help="Optimizer passes over each step's batch.")] = 1,
        seed: Annotated[int, typer.Option()] = 0,
        json_out: JsonOption = False,
    ) -> None:
        """Run the online loop: each step rolls out with the latest policy, grades, trains, reloads."""
        from legorl.flows.online import OnlineConfig, OnlineStep, run_online
        from legorl.flows.policy import require_model_dir
        from legorl.harnesses import parse_names
        from legorl.stages.rollout import RolloutConfig
        from legorl.training.config import TrainConfig

        if steps < 1:
            fail("--steps must be at least 1")
        require_model_dir(model)
        names = parse_names(harness)
        # The trainer reads the temperature from the calls the proxy records; passing it too keeps old
        # shards of a resumed run at it, and checks that the proxy really sampled at it.
        train_config = TrainConfig(
            loss=loss,  # type: ignore[arg-type]
            importance_sampling=importance_sampling,  # type: ignore[arg-type]
            learning_rate=lr, num_iterations=num_iterations, temperature=temperature, seed=seed,
        )
        cfg = OnlineConfig(
            rollout=RolloutConfig(run=run, harnesses=names, samples=samples, concurrency=concurrency, limit=limit,
                                  timeout_s=timeout, max_turns=max_turns, max_tokens=max_tokens,
                                  temperature=temperature),
            train=train_config, model=model, steps=steps, grade_concurrency=grade_concurrency,
            grade_timeout_s=grade_timeout, policy_temperature=temperature,
        )
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
