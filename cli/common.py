"""What every command shares: the console, run-directory options, errors, ``--json`` output."""

from __future__ import annotations

import json
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console

console = Console(stderr=True)  # progress and tables go to stderr; stdout stays clean for --json

RunOption = Annotated[
    Path, typer.Option("--run", help="Run directory; the stage derives its inputs and outputs from it.")
]
OptionalRunOption = Annotated[Path | None, typer.Option("--run", help="Run directory.")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print a machine-readable JSON result on stdout.")]


def fail(message: str, code: int = 1) -> NoReturn:
    console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def not_implemented(command: str) -> NoReturn:
    """Commands whose stage has not landed yet say so plainly (exit 2), never fake output."""
    console.print(f"[yellow]legorl {command}: not implemented yet[/]")
    raise typer.Exit(2)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def wait_for_stop(check: Callable[[], None] | None = None) -> None:
    """Block until SIGINT or SIGTERM (a serving command's foreground life); ``check`` runs twice a second."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):
        if check is not None:
            check()
