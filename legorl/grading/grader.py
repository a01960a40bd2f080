"""Grade one (task, patch) in a fresh container, on what actually happened there.

The threat model (docs/threat-model.md): the patch is hostile, and so is every byte the code it
changes prints. So the grader

- applies the patch as an unprivileged user in a fresh container from the task's image (network
  off, read-only image, size-capped tmpfs), then judges the **tree**, not the diff text: what a
  candidate patch may not change is put back (:mod:`.sandboxed.judge`);
- runs the hidden tests through a runner the repository cannot subvert (:mod:`.sandboxed.runner`)
  as that user, and takes each test's status from the runner's report, read by root after every
  process of that user is dead, never from the log;
- judges each test against the status the gold patch reaches (:mod:`.report`);
- trusts a pass only when **canaries** agree: tests whose expectation is mutated at the place the
  buggy code fails them (:mod:`.sandboxed.canary`), split by a host secret between the grade's two
  runs — each run mutates its half and checks the other half's real pass, so neither run is the
  ordinary one. The gold patch fails every canary; so does every honest patch that passes the
  canary's real version. A patch that passes both has forged a run (``tampered``, 0), however it did
  it — the code under test runs in the test process and can rewire anything there, so what it
  reports is a claim, and the canaries are what check the claim. The runner's in-process checks and the judge's screen are
  tripwires: evidence on the row (``suspicious``), deciding nothing where the task has canaries
  (where it has none, a pass the runner's own tripwires flag scores 0);
- labels a grade infrastructure only from signals outside the patch's reach: a failure before the
  patch went in (image, container, testbed), or a failure after it that a **control run** (the
  gold patch, else the empty one, in the same conditions) repeats. Any other failure after the
  patch went in — a crash, a usage error, a killed runner, no report — is the patch's doing:
  ``tests_errored``, reward 0.

Each kind of task is graded by its own :class:`TaskGrading`: :mod:`.hidden_tests` (SWE-bench style,
checked by :mod:`.canaries`) or :mod:`.harbor` (its test.sh); the rules every kind shares (the patch
text's checks, the control run, the verifier, ``--confirm``) are here. The container's script and
event protocol are in :mod:`.script`, its run in :mod:`.container`.
Whatever a patch holds, ``grade`` returns a row: one bad patch never stops a stage.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Protocol

from legorl.core.errors import ConfigError, LegorlError
from legorl.core.paths import cache_dir
from legorl.core.schemas import HARBOR, GradeRow, GradeStatus, Resolution, TaskRow, TestResult
from legorl.grading.canaries import Canaries
from legorl.grading.container import GRADER_VERSION as GRADER_VERSION
from legorl.grading.container import GradingContainers, GradingInfraError
from legorl.grading.fingerprint import grade_fingerprint
from legorl.grading.harbor import HarborTests
from legorl.grading.hidden_tests import HiddenTests
from legorl.grading.logparse import TestStatuses, get_parser
from legorl.grading.options import GRADE_FIELDS as GRADE_FIELDS
from legorl.grading.options import GradeOptions
from legorl.grading.report import F2P, P2P, infra, zero
from legorl.grading.verifier import Verifier, VerifierFailed, report_of
from legorl.sandbox.base import MAX_PATCH_BYTES, Sandbox, SandboxSpec

MAX_LOG_CHARS = 200_000
CONTROL_TTL_S = 600.0  # a control run that graded normally vouches for its task this long


class TaskGrading(Protocol):
    """How one kind of task is graded (:class:`.hidden_tests.HiddenTests`, :class:`.harbor.HarborTests`)."""

    def grade(self, task: TaskRow, patch: str, out: GradeRow) -> None:
        """``patch`` (its text already checked) graded into ``out``; GradingInfraError before the patch went in."""

    def control_problem(self, task: TaskRow) -> str | None:
        """The control run (the gold patch, else the empty one): None when it grades normally, else why not."""


def _trim(log: str) -> str:
    if len(log) <= MAX_LOG_CHARS:
        return log
    half = MAX_LOG_CHARS // 2
    return log[:half] + f"\n... [{len(log) - MAX_LOG_CHARS} characters cut] ...\n" + log[-half:]


class Grader:
    """Grades patches against tasks, one fresh container per grade.

    ``create`` makes a sandbox from a spec (``PodmanBackend().create`` by default); a backend with a
    ``run_once`` (podman's) runs each grade as one ``podman run --rm -i``.
    """

    def __init__(self, options: GradeOptions | None = None, create: Callable[[SandboxSpec], Sandbox] | None = None):
        self.options = options or GradeOptions()
        if create is None:
            from legorl.sandbox.podman import PodmanBackend

            create = PodmanBackend().create
        self.containers = GradingContainers(self.options, create)
        self._lock = threading.Lock()
        self._references: dict[str, TestStatuses] = {}
        self._controls: dict[str, tuple[float, str]] = {}
        self.canaries = Canaries(self.containers, self.reference)
        self.hidden_tests = HiddenTests(self.options, self.containers, self.canaries, self.reference,
                                        self._failed_after_patch)
        self.harbor = HarborTests(self.options, self.containers, self._failed_after_patch)
        self.verifier = self._make_verifier() if self.options.verifier else None
        self._verifier_controls: dict[str, float] = {}  # task key -> when the verifier last judged its gold patch

    # ------------------------------------------------------------------ the verdict

    def grade(self, task: TaskRow, patch: str | None, trial_id: str | None = None, **row: object) -> GradeRow:
        """Grade ``patch`` on ``task``; extra keyword arguments (``harness``, ``step``) go on the row."""
        start = time.monotonic()
        out = GradeRow(trial_id=trial_id or task.instance_id, task_id=task.instance_id,
                       status=GradeStatus.GRADED, **row)  # type: ignore[arg-type]
        self._verdict(task, patch, out)
        if self.options.confirm and out.reward == 1.0:
            self._confirm(task, patch, out)
        if self.verifier is not None and out.status == GradeStatus.GRADED and out.reward is not None:
            self._verify(task, patch or "", out)
        out.duration_s = round(time.monotonic() - start, 3)
        out.fingerprint = grade_fingerprint(task, self.containers)
        if out.log is not None:
            out.log = _trim(out.log)
        return out

    def _verdict(self, task: TaskRow, patch: str | None, out: GradeRow) -> None:
        """One grading run's verdict on ``out``, whatever happens in it."""
        try:
            self._grade(task, patch, out)
        except LegorlError as exc:  # SandboxError, TestbedError, GradingInfraError, missing image
            infra(out, str(exc))
        except (OSError, TimeoutError, subprocess.SubprocessError) as exc:
            infra(out, f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # whatever a patch does, its trial gets a row
            # A grader bug the patch triggered must not become its way out of a 0: the control
            # run decides, as for any failure after the patch went in.
            error = f"the grader could not judge this patch: {type(exc).__name__}: {exc}"
            control = self._control(task)
            if control is None:
                zero(out, GradeStatus.TESTS_ERRORED, error, task)
                out.control = "the task's control patch graded normally in the same conditions"
            else:
                infra(out, f"{error}; the control run failed too: {control}")
                out.control = control

    def _confirm(self, task: TaskRow, patch: str | None, out: GradeRow) -> None:
        """``--confirm``: grade the same patch again in a fresh container. A pass that does not
        reproduce is luck a policy would learn to chase: 0, ``confirmed`` false, the rerun's tests on
        the row. A rerun that fails as infrastructure proves nothing either way: infrastructure."""
        rerun = GradeRow(trial_id=out.trial_id, task_id=out.task_id, status=GradeStatus.GRADED)
        self._verdict(task, patch, rerun)
        if rerun.infra_failure:
            infra(out, f"the confirming rerun failed as infrastructure: {rerun.error}")
            return
        if rerun.reward == 1.0:
            out.confirmed = True
            return
        failing = [t.name for t in rerun.tests if not t.passed]
        zero(out, GradeStatus(out.status), f"the pass did not reproduce: a fresh rerun of the same patch scored "
                   f"{rerun.reward} ({rerun.status}{'; failing: ' + ', '.join(failing[:5]) if failing else ''})", task)
        out.tests, out.confirmed = rerun.tests, False
        out.log = (out.log or "") + "\n>>>>> legorl: the confirming rerun\n" + (rerun.log or "")

    # ------------------------------------------------------------------ the verifier

    def _make_verifier(self) -> Verifier:
        run_once = self.containers.run_once
        if run_once is None:
            raise ConfigError("--verifier runs in its own podman container: it needs the podman backend")
        from legorl.sandbox.host import base_image

        return Verifier(str(self.options.verifier), base_image(), run_once, self.options.verifier_timeout)

    def _verify(self, task: TaskRow, patch: str, out: GradeRow) -> None:
        """The verifier's reward in place of the tests' (:mod:`.verifier`); a failure on this patch is its 0,
        unless the verifier fails on the task's gold patch too."""
        assert self.verifier is not None
        out.verifier, out.tests_reward = self.verifier.spec, out.reward
        try:
            verdict = self.verifier(task.to_dict(), patch, report_of(out))
        except VerifierFailed as exc:
            broken = self._verifier_control(task)
            if broken:
                infra(out, f"{exc}; on the task's gold patch too: {broken}")
                return
            out.status, out.reward, out.error = GradeStatus.VERIFIER_FAILED, 0.0, str(exc)
            return
        except (LegorlError, OSError, subprocess.SubprocessError) as exc:  # its container did not run
            infra(out, f"the verifier's sandbox failed: {exc}")
            return
        out.reward, out.verifier_reasons = verdict.reward, verdict.reasons

    def _verifier_control(self, task: TaskRow) -> str | None:
        """The verifier on the task's gold patch, as if it passed every test: None when it gives a reward."""
        key = self.containers.task_key(task)
        with self._lock:
            seen = self._verifier_controls.get(key)
        if seen is not None and time.monotonic() - seen < CONTROL_TTL_S:
            return None
        gold = GradeRow(trial_id=task.instance_id, task_id=task.instance_id, status=GradeStatus.GRADED, reward=1.0,
                        resolved=True, resolution=Resolution.FULL,
                        tests=[TestResult(name=n, kind=kind, status="PASSED", passed=True)
                               for names, kind in ((task.FAIL_TO_PASS, F2P), (task.PASS_TO_PASS, P2P)) for n in names])
        assert self.verifier is not None
        try:
            self.verifier(task.to_dict(), task.patch or "", report_of(gold))
            problem = ""
        except (LegorlError, OSError, subprocess.SubprocessError) as exc:
            problem = str(exc) or type(exc).__name__
        if not problem:  # a failure is not kept: the next patch the verifier fails on asks again
            with self._lock:
                self._verifier_controls[key] = time.monotonic()
        return problem or None

    def _grade(self, task: TaskRow, patch: str | None, out: GradeRow) -> None:
        text = patch or ""
        problem = _patch_problem(text)
        if problem:
            zero(out, GradeStatus.PATCH_APPLY_FAILED, problem, task)
            return
        if not text.strip() and not self.options.run_empty:
            zero(out, GradeStatus.EMPTY_PATCH, "empty patch: nothing to grade", task)
            return
        self._kind(task).grade(task, text, out)

    def _kind(self, task: TaskRow) -> TaskGrading:
        """How a task of this kind is graded (``TaskRow.grader``): by its test.sh, else its hidden tests."""
        return self.harbor if task.grader == HARBOR else self.hidden_tests

    def _failed_after_patch(self, task: TaskRow, out: GradeRow, failure: str) -> None:
        """A run that broke after the patch went in: the patch's 0, unless the control run breaks too."""
        control = self._control(task)
        if control is not None:
            out.control = control
            raise GradingInfraError(f"{failure}; the control run failed too: {control}")
        out.control = "the task's control patch graded normally in the same conditions"
        zero(out, GradeStatus.TESTS_ERRORED, failure, task)

    # ------------------------------------------------------------------ reference and control runs

    def reference(self, task: TaskRow) -> TestStatuses | None:
        """The gold patch's per-test statuses: recorded on the task, else one gold run (cached)."""
        recorded = task.gold_status_map()
        if recorded is not None:
            return TestStatuses.from_map(recorded)
        if not (task.patch or "").strip():
            return None
        key = self.containers.task_key(task)
        with self._lock:
            if key in self._references:
                return self._references[key]
        # kept on disk by the hash of everything that shapes the gold run, so each grading process
        # (one per step of a loop) does not grade the gold patch again
        path = cache_dir() / "grading" / "gold" / f"{key}.json"
        try:
            statuses = {str(k): str(v) for k, v in json.loads(path.read_text()).items()}
        except (OSError, ValueError, AttributeError):
            statuses = self.gold_statuses(task)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_text(json.dumps(statuses, sort_keys=True))
            os.replace(tmp, path)
        ref = TestStatuses.from_map(statuses)
        with self._lock:
            self._references[key] = ref
        return ref

    def gold_statuses(self, task: TaskRow) -> dict[str, str]:
        """Grade the gold patch once and return every test's status."""
        statuses = self.statuses_for(task, task.patch or "", "gold patch")
        with self._lock:
            self._controls[self.containers.task_key(task)] = (time.monotonic(), "")
        return statuses

    def statuses_for(self, task: TaskRow, patch: str, what: str = "patch", *, timed_out_ok: bool = False) -> dict[str, str]:
        """Every test's status with ``patch`` applied; GradingInfraError unless the run is clean."""
        run = self.containers.clean_run(task, patch, what, timed_out_ok=timed_out_ok)
        return run.statuses(get_parser(task.log_parser)).full

    def _control(self, task: TaskRow) -> str | None:
        """Run the control patch (gold, else empty) now; None when it grades normally, else why not."""
        key = self.containers.task_key(task)
        with self._lock:
            seen = self._controls.get(key)
        if seen is not None and time.monotonic() - seen[0] < CONTROL_TTL_S and not seen[1]:
            return None
        try:
            problem = self._kind(task).control_problem(task)
        except Exception as exc:  # the control's failure, whatever it is, is the evidence
            problem = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        with self._lock:
            self._controls[key] = (time.monotonic(), problem or "")
        return problem


def _patch_problem(patch: str) -> str | None:
    """Why a patch cannot even be handed to the container (None: it can)."""
    try:
        data = patch.encode("utf-8")
    except UnicodeEncodeError:
        return "the patch is not valid UTF-8 text"
    if len(data) > MAX_PATCH_BYTES:
        return f"the patch is {len(data)} bytes (at most {MAX_PATCH_BYTES})"
    if "\0" in patch:
        return "the patch holds a NUL byte"
    return None


