"""The typer app: one command per stage, each registered from its own module."""

from __future__ import annotations

import sys

import typer

from legorl.cli import (
    dashboard,
    eval_cmd,
    grade,
    harness,
    inspect_cmd,
    loop,
    model,
    rollout,
    serve_proxy,
    setup_cmd,
    shards_cmd,
    tasks,
    train,
    vllm_cmd,
)
from legorl.cli.common import console
from legorl.errors import LegorlError

app = typer.Typer(
    name="legorl",
    help="Train coding agents with RL inside their own harnesses. Stages meet only in shards on disk.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

for module in (
    setup_cmd, tasks, model, harness, vllm_cmd, serve_proxy, rollout, grade, train, loop, eval_cmd, inspect_cmd, dashboard,
    shards_cmd,
):
    module.register(app)


def main() -> None:
    try:
        app()
    except LegorlError as exc:
        console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(1)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]")
        sys.exit(130)
