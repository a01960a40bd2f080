"""`legorl train`: one policy-gradient step on the captured tokens of one rollout step."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from legorl import metric_keys as mk
from legorl.cli.common import JsonOption, RunOption, console, print_json


def register(app: typer.Typer) -> None:
    @app.command("train")
    def train_command(
        run: RunOption,
        model: Annotated[Path, typer.Option("--model", help="Model folder to start from (Hugging Face format).")],
        out: Annotated[
            Path | None, typer.Option("--out", help="Checkpoint folder (default: RUN/train/checkpoints).")
        ] = None,
        loss: Annotated[str, typer.Option("--loss", help="grpo | dr_grpo | dapo | gspo (TRL's losses).")] = "grpo",
        importance_sampling: Annotated[
            str, typer.Option("--is", help="Correction against rollout logprobs: token | sequence | none.")
        ] = "token",
        is_cap: Annotated[float, typer.Option("--is-cap", help="Truncation cap C of the importance weights.")] = 2.0,
        lr: Annotated[float, typer.Option("--lr", help="Learning rate.")] = 1e-6,
        num_iterations: Annotated[
            int, typer.Option("--num-iterations", help="Optimizer passes over each batch (PPO epochs).")
        ] = 1,
        micro_batches: Annotated[
            int, typer.Option("--micro-batches", help="Gradient-accumulation micro-batches per update.")
        ] = 1,
        groups_per_batch: Annotated[
            int | None, typer.Option("--groups-per-batch", help="Whole groups per batch (default: all).")
        ] = None,
        scale_rewards: Annotated[
            str | None, typer.Option("--scale-rewards", help="group | batch | none (default by loss).")
        ] = None,
        trial_weighting: Annotated[
            str | None, typer.Option("--trial-weighting", help="trial | token (default by loss).")
        ] = None,
        routing_replay: Annotated[
            str, typer.Option("--routing-replay", help="auto | on | off (MoE models).")
        ] = "auto",
        step: Annotated[int | None, typer.Option("--step", help="Rollout step to train on (default: latest).")] = None,
        resume: Annotated[
            bool, typer.Option("--resume", help="Continue an interrupted step, or start from the latest checkpoint.")
        ] = False,
        report_to: Annotated[
            str, typer.Option("--report-to", help="TRL reporters, comma-separated (tensorboard, wandb) or none.")
        ] = "none",
        temperature: Annotated[float | None, typer.Option(
            "--temperature", help="Only for shards that do not record their sampling (default 1.0); the proxy "
            "records it on every call and the trainer uses that: a different value here is refused.")] = None,
        seed: Annotated[int, typer.Option("--seed")] = 0,
        bf16: Annotated[bool, typer.Option("--bf16", help="Train in bfloat16.")] = False,
        json_out: JsonOption = False,
    ) -> None:
        """Train on RUN/rollouts + RUN/grades of one step; write a checkpoint and RUN/train/metrics."""
        from legorl.stages.train import run_train
        from legorl.training.config import TrainConfig

        config = TrainConfig(
            loss=loss,  # type: ignore[arg-type]
            importance_sampling=importance_sampling,  # type: ignore[arg-type]
            is_cap=is_cap,
            learning_rate=lr,
            num_iterations=num_iterations,
            micro_batches=micro_batches,
            groups_per_batch=groups_per_batch,
            scale_rewards=scale_rewards,  # type: ignore[arg-type]
            trial_weighting=trial_weighting,  # type: ignore[arg-type]
            routing_replay=routing_replay,  # type: ignore[arg-type]
            report_to=[r.strip() for r in report_to.split(",") if r.strip()],
            temperature=temperature,
            seed=seed,
            bf16=bf16,
        )
        with console.status(f"training on {run}"):
            result = run_train(run, model, step, config, resume=resume, out=out)
        if json_out:
            print_json(result.to_dict())
            return
        if result.already_done:
            console.print(f"step {result.step} already trained: {result.checkpoint}")
            return
        m = result.metrics
        console.print(
            f"step {result.step}: {result.trials} trials, {result.sequences} sequences, {result.updates} updates"
            f" -> {result.checkpoint}"
        )
        shown = [mk.REWARD_MEAN, mk.SOLVE_RATE, mk.ZERO_VARIANCE_SHARE, mk.LOSS, mk.ENTROPY,
                 mk.LOGPROB_PEARSON, mk.MISMATCH_KL, mk.IS_ESS, mk.CLIP_FRACTION, mk.GRAD_NORM,
                 mk.PERF_TOKENS_PER_S]
        console.print("  " + "  ".join(f"{k}={m[k]:.4g}" for k in shown if k in m), highlight=False)
        if result.dropped:
            console.print(f"  dropped: {result.dropped}", highlight=False)
