"""What every command shows while a stage runs: one progress bar per stage, fed by the stage's
``on_start(todo, skipped)`` / ``on_done(row)`` callbacks, and a spinner while a model loads.

In a terminal these are rich's live bars. Anywhere else (CI, ``nohup``, ``> log``) rich would print
nothing until the end, so a stage writes plain timestamped lines instead, all in one format
(``rollout 3/8 · 1m12s · eta 2m01s · submitted 3``): one when it starts, one when an item finishes
(at most one per :data:`MIN_GAP_S`; always the last), and one every :data:`~legorl.cli.common.LOG_INTERVAL_S`
while nothing finishes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Generic, TypeVar

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from legorl.cli.common import LOG_INTERVAL_S, Ticker, console, elapsed, log_line
from legorl.core.schemas import GradeRow, TrialRow

RowT = TypeVar("RowT")

MIN_GAP_S = 5.0  # not a terminal: finished items print a line at most this often


class StageBar(Generic[RowT]):
    """A bar for one stage: live from the stage's ``on_start`` until its last row (or :meth:`close`),
    so that the bars of stages run one after the other never overlap (rich shows one live display).

    ``describe(row)`` is the status text after each row; ``skipped(n)``, when given, is a line printed
    when the stage skips ``n`` finished items; ``tick()``, when given, refreshes the status every second
    (and is the status of the lines a log gets while nothing finishes); ``status`` is the status until
    the first row.
    """

    def __init__(self, label: str, describe: Callable[[RowT], str], *, transient: bool,
                 skipped: Callable[[int], str] | None = None, tick: Callable[[], str] | None = None,
                 status: str = ""):
        self.label = label
        self.describe = describe
        self.skipped = skipped
        self.tick = tick
        self.live = console.is_interactive
        self.progress = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 TimeRemainingColumn(), TextColumn("{task.fields[status]}"), console=console,
                                 transient=transient)
        self.task: TaskID | None = None
        self.todo = self.done = 0
        self.status = status
        self._lock = threading.Lock()
        self._started: float | None = None
        self._first_done: float | None = None  # the time left is estimated from the rate after the first row
        self._last_line = 0.0
        self._ticker: Ticker | None = None

    def on_start(self, todo: int, skipped: int) -> None:
        self.todo = todo
        self._started = self._last_line = time.monotonic()
        if skipped and self.skipped is not None:
            console.print(self.skipped(skipped), highlight=False)
        if self.live:
            self.task = self.progress.add_task("", total=todo, status=self.status)
            self.progress.start()
        else:
            self._line()
        if todo == 0:
            self.close()
        elif self.tick is not None or not self.live:
            self._ticker = Ticker(1.0, self._beat)

    def on_done(self, row: RowT) -> None:
        status = self.describe(row)
        with self._lock:
            self.done += 1
            self.status = status
            if self.done == 1:
                self._first_done = time.monotonic()
            finished = self.done >= self.todo
            if self.live:
                assert self.task is not None
                self.progress.update(self.task, advance=1, status=status)
            elif finished or time.monotonic() - self._last_line >= MIN_GAP_S:
                self._line()
        if finished:
            self.close()

    def close(self) -> None:
        if self._ticker is not None:
            self._ticker.stop()
            self._ticker = None
        if self.live:
            self.progress.stop()
        elif self._started is not None and self.done < self.todo:
            log_line(f"{self.label} ended at {self.done}/{self.todo} after {elapsed(self._elapsed())}")
            self._started = None

    def _beat(self) -> None:
        with self._lock:
            if self.tick is not None:
                self.status = self.tick()
            if self.live:
                if self.task is not None:
                    self.progress.update(self.task, status=self.status)
            elif time.monotonic() - self._last_line >= LOG_INTERVAL_S:
                self._line()

    def _elapsed(self) -> float:
        return time.monotonic() - self._started if self._started is not None else 0.0

    def _time_left(self, spent: float) -> float:
        if self.done >= 2 and self._first_done is not None:  # the rate after the first row: no start-up time
            return (time.monotonic() - self._first_done) / (self.done - 1) * (self.todo - self.done)
        return spent / self.done * (self.todo - self.done)

    def _line(self) -> None:
        """The stage as one log line (caller holds the lock, or no other thread runs yet)."""
        self._last_line = time.monotonic()
        spent = self._elapsed()
        parts = [f"{self.label} {self.done}/{self.todo}", elapsed(spent)]
        if 0 < self.done < self.todo:
            parts.append(f"eta {elapsed(self._time_left(spent))}")
        if self.status:
            parts.append(self.status)
        log_line(" · ".join(parts))

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
