"""What every command shows while a stage runs: one progress bar per stage, fed by the stage's
``on_start(todo, skipped)`` / ``on_done(row)`` callbacks, and a spinner while a model loads."""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Generic, TypeVar

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from legorl.cli.common import console
from legorl.schemas import GradeRow, TrialRow

RowT = TypeVar("RowT")


class StageBar(Generic[RowT]):
    """A bar for one stage: live from the stage's ``on_start`` until its last row (or :meth:`close`),
    so that the bars of stages run one after the other never overlap (rich shows one live display).

    ``describe(row)`` is the status text after each row; ``skipped(n)``, when given, is a line printed
    when the stage skips ``n`` finished items; ``tick()``, when given, refreshes the status every second.
    """

    def __init__(self, label: str, describe: Callable[[RowT], str], *, transient: bool,
                 skipped: Callable[[int], str] | None = None, tick: Callable[[], str] | None = None):
        self.describe = describe
        self.skipped = skipped
        self.tick = tick
        self.progress = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 TextColumn("{task.fields[status]}"), console=console, transient=transient)
        self.task: TaskID | None = None
        self.todo = self.done = 0
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def on_start(self, todo: int, skipped: int) -> None:
        self.todo = todo
        self.task = self.progress.add_task("", total=todo, status="")
        self.progress.start()
        if skipped and self.skipped is not None:
            console.print(self.skipped(skipped), highlight=False)
        if self.tick is not None:
            self._ticker = threading.Thread(target=self._refresh, daemon=True)
            self._ticker.start()
        if todo == 0:
            self.close()

    def on_done(self, row: RowT) -> None:
        assert self.task is not None
        self.done += 1
        self.progress.update(self.task, advance=1, status=self.describe(row))
        if self.done >= self.todo:
            self.close()

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
            self._ticker = None
        self.progress.stop()

    def _refresh(self) -> None:
        assert self.tick is not None and self.task is not None
        while not self._stop.wait(1.0):
            self.progress.update(self.task, status=self.tick())

    def __enter__(self) -> StageBar[RowT]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Outcomes:
    """Trial outcomes counted as rows come in, as status text (``submitted 3 timeout 1``)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def add(self, row: TrialRow) -> str:
        self.counts[str(row.outcome)] = self.counts.get(str(row.outcome), 0) + 1
        return self.text()

    def text(self) -> str:
        return " ".join(f"{k} {v}" for k, v in sorted(self.counts.items()))


def graded(row: GradeRow) -> str:
    """A grade row as status text."""
    return f"{row.task_id}: {row.status} {row.reward}"


def loading(model: Path) -> AbstractContextManager[object]:
    """The spinner shown while a model directory loads."""
    return console.status(f"loading {model} …")
