"""Grading by the task's hidden tests (SWE-bench style): the tests run through the runner in a fresh
container, each judged against the gold patch's status, and a pass checked by the task's canaries
across two runs (:mod:`.canaries`; why: docs/threat-model.md, "Grading")."""

from __future__ import annotations

import secrets
from collections.abc import Callable

from legorl.core.schemas import GradeRow, GradeStatus, TaskRow
from legorl.grading.canaries import FAILING, Canaries, halves, value_canaries
from legorl.grading.container import GradingContainers, GradingInfraError, Run
from legorl.grading.logparse import TestStatuses, contradicts_exit_code, get_parser
from legorl.grading.options import GradeOptions
from legorl.grading.report import evaluate, zero

# A pass's second run does the same work as its first: the host gives it this much of that run's time.
CANARY_TIME_FACTOR, CANARY_TIME_SLACK_S = 2.0, 60.0


class HiddenTests:
    """The grading of tasks whose hidden tests decide (every kind but Harbor's)."""

    def __init__(self, options: GradeOptions, containers: GradingContainers, canaries: Canaries,
                 reference: Callable[[TaskRow], TestStatuses | None],
                 after_patch: Callable[[TaskRow, GradeRow, str], None]):
        self.options = options
        self.containers = containers
        self.canaries = canaries
        self.reference = reference  # the gold patch's statuses
        self.after_patch = after_patch  # a run that broke after the patch went in: the control run decides

    def grade(self, task: TaskRow, patch: str, out: GradeRow) -> None:
        """Grade ``patch`` (its text already checked) into ``out``: a first run with half the task's
        canaries mutated, and after a pass a second with the other half."""
        reference = self.reference(task)
        seed = self.canaries.seed(task) if self.options.canaries else None
        first, second = halves(self.canaries.of(task, seed), seed) if seed is not None else ({}, {})
        if secrets.randbits(1):  # which half the first run mutates: a coin per grade, so telling the runs apart
            first, second = second, first  # (a red team did, by a kernel counter) says nothing of the canaries
        run, report_nonce = self.containers.run(task, patch, canary_seed=seed, canary_tests=first)
        out.log = run.result.output
        if "apply_failed" in run.events:
            zero(out, GradeStatus.PATCH_APPLY_FAILED, "the patch did not apply by any method", task)
            return
        if "ready" not in run.events:
            raise GradingInfraError(run.before_patch_error())
        out.apply_method = next((line[len(">>>>> Applied Patch ("):-1] for line in run.result.output.splitlines()
                                 if line.startswith(">>>>> Applied Patch (")), None)
        if run.judged is not None:
            reset = [r for r in run.judged.get("reset", []) if isinstance(r, list) and len(r) == 2]  # type: ignore[attr-defined]
            out.dropped_paths = sorted({str(path) for path, _why in reset})
            out.suspicious = [str(s) for s in run.judged.get("suspicious", [])][:50]  # type: ignore[attr-defined]
        out.suspicious += run.runner_findings
        failure = run.failure(report_nonce)
        if failure is not None:
            self.after_patch(task, out, failure)
            return
        statuses = run.statuses(get_parser(task.log_parser))
        report = evaluate(statuses, [n for n in task.FAIL_TO_PASS if n not in first],
                          [n for n in task.PASS_TO_PASS if n not in first], reference)
        out.tests = report.tests
        code = run.tests_exit_code
        if code in (124, 137):
            zero(out, GradeStatus.TEST_TIMEOUT, f"the tests ran past {self.options.test_timeout:g} s", task)
            out.tests = report.tests
            return
        if run.mode == "shell" and contradicts_exit_code(statuses, code):
            zero(out, GradeStatus.TESTS_ERRORED, f"the test command exited {code} but its log reports no "
                       "failing test", task)
            return
        out.reward, out.resolved, out.resolution = report.reward, report.resolved, report.resolution
        first_seen = {n: statuses.status(n) or "MISSING" for n in first}  # judged once their real runs are in
        out.canaries += [f"{n}: {st}" for n, st in first_seen.items()]
        if not report.resolved:
            if out.dropped_paths and not out.error:
                out.error = f"the tests did not pass; put back: {', '.join(out.dropped_paths[:5])}"
            return
        if first or second:
            self._second_run(task, patch, out, run.result.duration_s, first_seen, second, run)
            return
        # No canary: the runner's behavioural tripwires decide (the screen's findings stay evidence: it
        # reads names, and honest code imports inspect or base64)
        if run.runner_findings:
            zero(out, GradeStatus.TESTS_ERRORED, "the code under test rewired the test runner ("
                       + ", ".join(run.runner_findings)[:300] + ")", task)
            return


    def _second_run(self, task: TaskRow, patch: str, out: GradeRow, spent_s: float,
                    first_seen: dict[str, str], second: dict[str, dict[str, object]], first_run: Run) -> None:
        """Check a first run's pass with the second run: this patch again in a fresh container, the
        canaries the first run left alone mutated (:func:`halves`). Every listed test it leaves alone —
        the first run's canaries among them — must reach what the gold patch reaches (else 0). A canary
        whose real version passes (in the run that left it alone) must fail where it is mutated, else
        the run was forged (``tampered``). A canary whose real version fails proves nothing either way:
        a patch that does not fix the bug passes a negated canary as the buggy code does. A second run
        that breaks is judged as any run after the patch went in: the patch's doing unless the
        control run fails too.

        Where every canary mutated was a negation, the canaries cannot catch code that inverts each new
        test's outcome (the real test fails on buggy code and its negation passes), so the runner's
        tripwires decide as on a task without canaries."""
        run, nonce = self.containers.run(task, patch, canary_seed=self.canaries.seed(task), canary_tests=second,
                                         deadline_s=CANARY_TIME_FACTOR * spent_s + CANARY_TIME_SLACK_S)
        if "ready" not in run.events:
            raise GradingInfraError(run.before_patch_error())
        failure = run.failure(nonce)
        if failure is None and run.tests_exit_code in (124, 137):
            failure = "the second run's tests timed out"
        if failure is not None:
            self.after_patch(task, out, f"the second run: {failure}")
            return
        out.suspicious += [f"second run {f}" for f in run.runner_findings]
        statuses = run.statuses(get_parser(task.log_parser))
        second_seen = {n: statuses.status(n) or "MISSING" for n in second}
        out.canaries += [f"{n}: {st}" for n, st in second_seen.items()]
        report = evaluate(statuses, [n for n in task.FAIL_TO_PASS if n not in second],
                          [n for n in task.PASS_TO_PASS if n not in second], self.reference(task))
        checked = {t.name: t for t in report.tests}
        # a test that passed the first run but fails here shows this run's failure
        tests = [checked[t.name] if t.name in checked and not checked[t.name].passed else t for t in out.tests]
        tests += [checked[n] for n in first_seen if n in checked]
        # the second half's real versions passed in the first run (it was resolved); the first half's, here
        forged = [n for n, st in second_seen.items() if st not in FAILING]
        forged += [n for n, st in first_seen.items() if st not in FAILING and n in checked and checked[n].passed]
        if forged:
            zero(out, GradeStatus.TAMPERED, f"{len(forged)} of {len(first_seen) + len(second)} canaries did "
                       f"not fail (tests every honest patch that passes them unmutated fails; their expectation was "
                       f"mutated): {', '.join(forged[:3])}", task)
        else:
            differ = [t for t in report.tests if not t.passed]
            if differ:
                zero(out, GradeStatus(out.status), "in the second run: "
                           + ", ".join(f"{t.name} {t.status}" for t in differ[:3]), task)
            elif not value_canaries(first_run) and not value_canaries(run):
                findings = first_run.runner_findings + run.runner_findings
                if findings:
                    zero(out, GradeStatus.TESTS_ERRORED, "the code under test rewired the test runner "
                               "(the task's canaries are negations only) (" + ", ".join(findings)[:300] + ")", task)
        out.tests = tests

    def control_problem(self, task: TaskRow) -> str | None:
        """The control run (the gold patch, else the empty one): None when it grades normally, else why not."""
        run, nonce = self.containers.run(task, task.patch or "")
        return run.failure(nonce) if "ready" in run.events else run.before_patch_error()
