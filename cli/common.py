"""What every command shares: the console, run-directory options, errors, ``--json`` output."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console, RenderableType
from rich.status import Status
from rich.text import Text

from legorl.core.paths import RUN_HELP

# Not a terminal (CI, nohup, `> log`): a plain timestamped line at least this often while something runs.
LOG_INTERVAL_S = 30.0
# Not a terminal: tables take at most this width (COLUMNS, when set, wins); a line of text is never wrapped.
LOG_TABLE_WIDTH = 160


class Ticker:
    """Calls ``beat`` every ``interval`` seconds on a daemon thread until :meth:`stop`."""

    def __init__(self, interval: float, beat: Callable[[], None]):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval, beat), daemon=True)
        self._thread.start()

    def _run(self, interval: float, beat: Callable[[], None]) -> None:
        while not self._stop.wait(interval):
            beat()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()


def elapsed(seconds: float) -> str:
    """``42s``, ``3m05s``, ``1h02m``."""
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class _LogStatus(Status):
    """``console.status`` in a log: a line when it starts, one every :data:`LOG_INTERVAL_S` while it runs,
    and one when it ends (rich's spinner shows nothing until then when not in a terminal)."""

    def start(self) -> None:
        self._t0 = time.monotonic()
        log_line(f"{self._text()} …")
        self._ticker = Ticker(LOG_INTERVAL_S, lambda: log_line(f"{self._text()} … {elapsed(self._since())}"))

    def _text(self) -> str:
        """The status as plain text, without the trailing ellipsis a spinner's text often has."""
        text = Text.from_markup(self.status).plain if isinstance(self.status, str) else str(self.status)
        return text.rstrip(" .…")

    def _since(self) -> float:
        return time.monotonic() - self._t0

    def stop(self) -> None:
        self._ticker.stop()

    def __exit__(self, exc_type: type[BaseException] | None, exc_val: BaseException | None,
                 exc_tb: TracebackType | None) -> None:
        self.stop()
        log_line(f"{self._text()}: {'done' if exc_type is None else 'stopped'} after {elapsed(self._since())}")


class _Console(Console):
    def status(self, status: RenderableType, **kwargs: Any) -> Status:
        if self.is_interactive:
            return super().status(status, **kwargs)
        return _LogStatus(status, console=self)


def _console() -> _Console:
    on_stderr = _Console(stderr=True)
    # FORCE_COLOR makes rich treat a pipe as a terminal: colours, yes; live redraws in a log, no
    # (unless TTY_INTERACTIVE=1 asks for them).
    if on_stderr.is_interactive and (sys.stderr.isatty() or os.environ.get("TTY_INTERACTIVE") == "1"):
        return on_stderr
    return _Console(stderr=True, force_interactive=False, soft_wrap=True,
                    width=None if "COLUMNS" in os.environ else LOG_TABLE_WIDTH)


console = _console()  # progress and tables go to stderr; stdout stays clean for --json


def log_line(text: str) -> None:
    """One timestamped line (how progress reads in a log)."""
    console.print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}", highlight=False, markup=False)


RunOption = Annotated[Path, typer.Option("--run", help=RUN_HELP)]
OptionalRunOption = Annotated[Path | None, typer.Option("--run", help=RUN_HELP)]
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
