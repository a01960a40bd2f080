"""Per-test verdicts and the FULL / PARTIAL / NO resolution: SWE-bench's rules, judged against the gold run.

SWE-bench counts XFAIL as a pass and SKIPPED as a maintained PASS_TO_PASS test, so a patch that
makes the code under test call ``pytest.xfail()`` or ``pytest.skip()`` would resolve a task. legorl
judges each test against the status the task's **gold patch** reaches in the same grader (the
task's ``gold_statuses``, or a gold run the grader makes once):

- a FAIL_TO_PASS test passes when it reaches the gold status: PASSED where gold PASSED (the usual
  case), XFAIL only where gold gives XFAIL;
- a PASS_TO_PASS test is maintained when it reaches the gold status (SKIPPED where gold skips it,
  PASSED also counts there);
- without a reference both must be PASSED — stricter than SWE-bench, never looser.

FULL iff every F2P test passes and every P2P test is maintained (an empty list counts as all);
PARTIAL iff some but not all F2P tests pass and every P2P test is maintained; NO otherwise. Only
FULL is "resolved", and the reward is 1.0 for FULL, 0.0 otherwise. A grade that never reached a
verdict is :func:`zero` (the patch's outcome) or :func:`infra` (no reward either way).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from legorl.core.schemas import GradeRow, GradeStatus, Resolution, TaskRow, TestResult
from legorl.grading.logparse import TestStatuses

F2P = "FAIL_TO_PASS"
P2P = "PASS_TO_PASS"
MISSING = "MISSING"



def reaches(status: str, gold: str | None, kind: str) -> bool:
    """Whether a test's ``status`` reaches the ``gold`` run's status for it."""
    if gold in (None, "PASSED", MISSING):
        return status == "PASSED"
    if gold == "SKIPPED" and kind == P2P:
        return status in ("SKIPPED", "PASSED")
    return status == gold


@dataclass
class TestReport:
    __test__ = False  # not a pytest test class

    tests: list[TestResult]
    resolution: Resolution

    @property
    def resolved(self) -> bool:
        return self.resolution == Resolution.FULL

    @property
    def reward(self) -> float:
        return 1.0 if self.resolved else 0.0

    def counts(self, kind: str) -> tuple[int, int]:
        """(passed, total) for ``kind`` (F2P or P2P)."""
        mine = [t for t in self.tests if t.kind == kind]
        return sum(t.passed for t in mine), len(mine)


def _fraction(passed: int, total: int) -> float:
    return 1.0 if total == 0 else passed / total


def resolution_of(f2p: tuple[int, int], p2p: tuple[int, int]) -> Resolution:
    f, p = _fraction(*f2p), _fraction(*p2p)
    if f == 1 and p == 1:
        return Resolution.FULL
    if 0 < f < 1 and p == 1:
        return Resolution.PARTIAL
    return Resolution.NO


def evaluate(statuses: TestStatuses, fail_to_pass: Sequence[str], pass_to_pass: Sequence[str],
             reference: TestStatuses | None = None) -> TestReport:
    """Judge every listed test against the statuses a run reported and the gold run's (``reference``)."""
    tests: list[TestResult] = []
    for kind, names in ((F2P, fail_to_pass), (P2P, pass_to_pass)):
        for name in names:
            status = statuses.status(name) or MISSING
            gold = reference.status(name) if reference is not None else None
            tests.append(TestResult(name=name, kind=kind, status=status, passed=reaches(status, gold, kind)))
    report = TestReport(tests, Resolution.NO)
    report.resolution = resolution_of(report.counts(F2P), report.counts(P2P))
    return report


def failed_report(fail_to_pass: Sequence[str], pass_to_pass: Sequence[str], status: str = MISSING) -> TestReport:
    """Every listed test failed with one status (the patch did not apply, the tests timed out)."""
    tests = [TestResult(name=n, kind=F2P, status=status, passed=False) for n in fail_to_pass]
    tests += [TestResult(name=n, kind=P2P, status=status, passed=False) for n in pass_to_pass]
    return TestReport(tests, Resolution.NO)


def zero(out: GradeRow, status: GradeStatus, error: str, task: TaskRow, test_status: str = MISSING) -> None:
    """``out`` scored 0 with ``status``: the patch's outcome, every listed test at ``test_status``."""
    report = failed_report(task.FAIL_TO_PASS, task.PASS_TO_PASS, test_status)
    out.status, out.error, out.tests = status, error, report.tests
    out.reward, out.resolved, out.resolution = 0.0, False, Resolution.NO


def infra(out: GradeRow, error: str) -> None:
    """``out`` an infrastructure failure: no reward either way (its first line says why)."""
    out.status = GradeStatus.INFRA_ERROR
    out.infra_failure = True
    out.reward = out.resolved = out.resolution = None
    out.error = error.splitlines()[0] if error.strip() else "infrastructure error"
