"""`legorl loop`: the online RL loop, rollout → grade → train → reload, for N policy steps.

A thin composition of the stage functions on one run directory, exactly what a Makefile loop over
`legorl rollout / grade / train` does, but with one engine kept in memory that loads each new
checkpoint instead of restarting. Every step's shards stay in the run directory with their `step`.

It is synchronous: the trials of step S are sampled by the policy trained on steps < S, and
`train --step S` trains only on them, so the rollout policy is never stale. Rerunning resumes: each
stage skips what it already wrote, and training continues an interrupted step.
"""

from __future__ import annotations

import asyncio
import time
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
        from transformers import AutoTokenizer

        from legorl.engines.embedded import EmbeddedEngine
        from legorl.harnesses import parse_names
        from legorl.paths import RunDir
        from legorl.stages.grade import grade_stage, rollout_jobs
        from legorl.stages.rollout import InProcessProxy, RolloutConfig, rollout_stage
        from legorl.stages.train import latest_checkpoint, run_train
        from legorl.training.config import TrainConfig

        if steps < 1:
            fail("--steps must be at least 1")
        if not (model / "config.json").exists():
            fail(f"--model {model}: not a model directory (no config.json)")
        layout = RunDir.at(run)
        names = parse_names(harness)
        # The trainer reads the temperature from the calls the proxy records; passing it too keeps old
        # shards of a resumed run at it, and checks that the proxy really sampled at it.
        train_config = TrainConfig(
            loss=loss,  # type: ignore[arg-type]
            importance_sampling=importance_sampling,  # type: ignore[arg-type]
            learning_rate=lr, num_iterations=num_iterations, temperature=temperature, seed=seed,
        )
        policy = latest_checkpoint(layout.checkpoints) or model
        engine = EmbeddedEngine(policy)
        history: list[dict[str, Any]] = []
        with InProcessProxy(engine, AutoTokenizer.from_pretrained(model), temperature=temperature) as proxy:
            for step in range(steps):
                t0 = time.monotonic()
                with console.status(f"step {step}: rollout ({', '.join(names)})"):
                    rolled = rollout_stage(RolloutConfig(
                        run=run, harnesses=names, samples=samples, concurrency=concurrency, limit=limit, step=step,
                        timeout_s=timeout, max_turns=max_turns, max_tokens=max_tokens, temperature=temperature,
                    ), proxy)
                t1 = time.monotonic()
                jobs, _ = rollout_jobs(layout.rollouts)
                with console.status(f"step {step}: grading"):
                    graded = grade_stage(layout.tasks, layout.grades, [j for j in jobs if j.step == step],
                                         concurrency=grade_concurrency, timeout=grade_timeout,
                                         run_label=layout.root.name)
                t2 = time.monotonic()
                with console.status(f"step {step}: training"):
                    result = run_train(run, model, step, train_config, resume=True)
                t3 = time.monotonic()
                asyncio.run(engine.load_weights(str(result.checkpoint)))
                record = {
                    "step": step, "new_trials": len(rolled.rows), "new_grades": len(graded.rows),
                    "reward_mean": result.metrics.get(mk.REWARD_MEAN), "checkpoint": str(result.checkpoint),
                    "rollout_s": round(t1 - t0, 1), "grade_s": round(t2 - t1, 1), "train_s": round(t3 - t2, 1),
                }
                history.append(record)
                console.print(
                    f"step {step}: reward {record['reward_mean']} · rollout {record['rollout_s']} s · "
                    f"grade {record['grade_s']} s · train {record['train_s']} s → {result.checkpoint.name}",
                    highlight=False,
                )
        asyncio.run(engine.close())
        if json_out:
            print_json({"run": str(run), "steps": history})
