"""Which tasks' passes are checked from outside the test process: each task's canaries, by form.

A pass is checked from outside only where the grade mutates a canary's expected value (the threat
model's "Grading" section): a negated assertion is passed blind by code that inverts each new test's
outcome, and a task with no canary rests on the runner's tripwires, which code in the test process can
evade. On the checked tasks alone (`legorl tasks canaries RUN --into CHECKED`), code in the test
process that forges outcomes must know which test is which (code that makes them true at test time,
searching with the tests as its oracle, is a residual risk: docs/threat-model.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from legorl.core.schemas import HARBOR, TaskRow
from legorl.grading.container import GradingInfraError
from legorl.grading.grader import Grader

CHECKED, NEGATIONS_ONLY, TRIPWIRES_ONLY, TEST_SH, ERROR = (
    "canaries", "negations only", "tripwires only", "test.sh only", "error")


@dataclass(frozen=True)
class TaskCanaries:
    """One task's FAIL_TO_PASS tests and the canaries among them, by form."""

    instance_id: str
    tests: int
    values: tuple[str, ...] = ()  # canaries whose expected value is changed
    negations: tuple[str, ...] = ()  # canaries whose assertion is negated
    harbor: bool = False
    error: str | None = None  # the task's own patches did not grade cleanly

    @property
    def checked(self) -> bool:
        """Whether a pass of this task is checked by a changed expected value."""
        return bool(self.values) and self.error is None

    @property
    def verdict(self) -> str:
        if self.error is not None:
            return ERROR
        if self.harbor:
            return TEST_SH
        return CHECKED if self.values else NEGATIONS_ONLY if self.negations else TRIPWIRES_ONLY

    def as_dict(self) -> dict[str, object]:
        return {"instance_id": self.instance_id, "verdict": self.verdict, "FAIL_TO_PASS": self.tests,
                "values": list(self.values), "negations": list(self.negations), "error": self.error}


def task_canaries(grader: Grader, task: TaskRow) -> TaskCanaries:
    """``task``'s canaries under this host's key (found once per task and cached; one gold run tells
    their forms)."""
    tests = len(task.FAIL_TO_PASS)
    if task.grader == HARBOR:
        return TaskCanaries(task.instance_id, tests, harbor=True)
    try:
        values, negations = grader.canaries.forms(task)
    except GradingInfraError as e:
        return TaskCanaries(task.instance_id, tests, error=str(e)[:500])
    return TaskCanaries(task.instance_id, tests, tuple(values), tuple(negations))


def survey(grader: Grader, tasks: Iterable[TaskRow], concurrency: int = 2,
           on_done: Callable[[TaskCanaries], None] | None = None) -> list[TaskCanaries]:
    """Every task's canaries, ``concurrency`` tasks at once, in the order given."""

    def one(task: TaskRow) -> TaskCanaries:
        found = task_canaries(grader, task)
        if on_done is not None:
            on_done(found)
        return found

    with ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="canaries") as pool:
        return list(pool.map(one, list(tasks)))
