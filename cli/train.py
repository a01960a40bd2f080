"""`legorl train`: one policy-gradient step on the captured tokens of one rollout step."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from legorl.cli.common import JsonOption, RunOption, console, print_json
from legorl.cli.options import ConfigOptions, with_configs
from legorl.core import metric_keys as mk
from legorl.training.options import TRAIN_CLI_FIELDS, TrainOptions


def _train_config(**fields: Any) -> Any:
    from legorl.training.config import TrainConfig  # imports TRL: only when the command runs

    return TrainConfig(**fields)


def register(app: typer.Typer) -> None:
    @app.command("train")
    @with_configs(config=ConfigOptions(TrainOptions, only=TRAIN_CLI_FIELDS, factory=_train_config))
    def train_command(
        config: TrainOptions,
        run: RunOption,
        model: Annotated[Path, typer.Option("--model", help="Model folder to start from (Hugging Face format).")],
        out: Annotated[
            Path | None, typer.Option("--out", help="Checkpoint folder (default: RUN/train/checkpoints).")
        ] = None,
        step: Annotated[int | None, typer.Option("--step", help="Rollout step to train on (default: latest).")] = None,
        resume: Annotated[
            bool, typer.Option("--resume", help="Continue an interrupted step, or start from the latest checkpoint.")
        ] = False,
        json_out: JsonOption = False,
    ) -> None:
        """Train on RUN/rollouts + RUN/grades of one step; write a checkpoint and RUN/train/metrics."""
        from legorl.stages.train import run_train
        from legorl.training.config import TrainConfig

        assert isinstance(config, TrainConfig)
        with console.status(f"training on {run}"):
            result = run_train(run, model, step, config, resume=resume, out=out)
        if not result.main_process:
            return  # another process of `accelerate launch`: the main one reports
        if json_out:
            print_json(result.to_dict())
            return
        if result.already_done:
            console.print(f"step {result.step} already trained: {result.checkpoint}")
            return
        m = result.metrics
        if result.skipped:
            console.print(f"step {result.step}: skipped ({result.skipped}): {result.trials} trials, no update"
                          f" -> {result.checkpoint} (the policy it started from)")
            return
        console.print(
            f"step {result.step}: {result.trials} trials, {result.sequences} sequences, {result.updates} updates"
            f" -> {result.checkpoint}"
        )
        console.print("  " + "  ".join(f"{k}={m[k]:.4g}" for k in mk.HEADLINE if k in m), highlight=False)
        if result.dropped:
            console.print(f"  dropped: {result.dropped}", highlight=False)
