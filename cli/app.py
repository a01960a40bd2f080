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
from legorl.core.errors import LegorlError

# --help in a terminal is rich's boxed table, fitted to the window. Anywhere else (a pipe, a log, CI) it is
# click's plain text with no width limit: rich would fit it to 80 columns and cut option names short.
_HELP_IN_TERMINAL = sys.stdout.isatty()

app = typer.Typer(
    name="legorl",
    help="Train coding agents with RL inside their own harnesses. Stages meet only in shards on disk.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich" if _HELP_IN_TERMINAL else None,
    context_settings={} if _HELP_IN_TERMINAL else {"terminal_width": 100_000},
)

for module in (
    setup_cmd, tasks, model, harness, vllm_cmd, serve_proxy, rollout, grade, train, loop, eval_cmd, inspect_cmd, dashboard,
    shards_cmd,
):
    module.register(app)


# What to do after Ctrl-C, for the commands that pick up where they stopped.
RESUME_HINTS = {
    "rollout": "rerun the same command to resume",
    "grade": "rerun the same command to resume",
    "eval": "rerun the same command to resume",
    "loop": "rerun the same command to resume",
    "train": "rerun it with --resume to continue the step",
    "tasks import": "rerun the same command to resume",
}


def interrupted(argv: list[str]) -> str:
    """The line Ctrl-C leaves: what was stopped and, for a command that resumes, how."""
    words = [a for a in argv[:2] if not a.startswith("-")]
    command = next((" ".join(words[:n]) for n in (2, 1) if " ".join(words[:n]) in RESUME_HINTS), None)
    return f"interrupted — {RESUME_HINTS[command]}" if command else "interrupted"


def main() -> None:
    try:
        app()
    except LegorlError as exc:
        console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(1)
    except KeyboardInterrupt:  # before typer runs the command (while importing)
        console.print(interrupted(sys.argv[1:]), style="yellow", highlight=False)
        sys.exit(130)
    except SystemExit as exc:
        # typer turns Ctrl-C into a silent exit 130 (an Exit raised from the KeyboardInterrupt)
        if isinstance(getattr(exc.__context__, "__cause__", None), KeyboardInterrupt):
            console.print(interrupted(sys.argv[1:]), style="yellow", highlight=False)
        raise
