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

The container's script and event protocol are in :mod:`.script`, its run in :mod:`.container`.
Whatever a patch holds, ``grade`` returns a row: one bad patch never stops a stage.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from legorl.errors import ConfigError, LegorlError
from legorl.fingerprints import grade_fingerprint
from legorl.grading import harbor
from legorl.grading.container import GradingContainers, GradingInfraError, Run
from legorl.grading.logparse import TestStatuses, contradicts_exit_code, get_parser
from legorl.grading.report import F2P, P2P, evaluate, failed_report
from legorl.grading.script import SANDBOXED_DIGEST
from legorl.grading.verifier import Verifier, VerifierFailed, check_spec, report_of
from legorl.paths import cache_dir
from legorl.sandbox.base import MAX_PATCH_BYTES, Sandbox, SandboxSpec
from legorl.schemas import GradeRow, GradeStatus, Resolution, TaskRow, TestResult

GRADER_VERSION = "4"  # bump when the verdict for the same inputs may change (it keys cached gold runs)
MAX_LOG_CHARS = 200_000
CONTROL_TTL_S = 600.0  # a control run that graded normally vouches for its task this long
FAILING = frozenset({"FAILED", "ERROR"})  # what a canary must be in every run that mutates it
# A pass's second run does the same work as its first: the host gives it this much of that run's time.
CANARY_TIME_FACTOR, CANARY_TIME_SLACK_S = 2.0, 60.0
CANARY_TRIES = 2  # mutations drawn per test when a task's canaries are found (each try: a gold and an empty run)


@dataclass
class GradeOptions:
    """How grades are run (``legorl grade``, ``eval`` and ``loop`` take the documented fields as options)."""

    concurrency: int = field(default=2, metadata={"help": "Grading containers at once (the grade stage's pool)."})
    test_timeout: float = field(default=600.0, metadata={"aliases": ["--timeout"], "help": (
        "Seconds the hidden tests may run (longer: tests_timeout, reward 0).")})
    default_image: str | None = field(default=None, metadata={"aliases": ["--image"], "help": (
        "Image for tasks without one (default: the sandbox base image of `legorl setup`).")})
    memory: str = field(default="4g", metadata={"help": "Memory limit of a grading container (podman's --memory)."})
    cpus: float | None = field(default=None, metadata={"help": "CPU limit of a grading container (podman's --cpus)."})
    confirm: bool = field(default=False, metadata={"help": (
        "Re-run a grade of 1 in a fresh container before trusting it: a pass the rerun does not reproduce "
        "scores 0 (confirmed false); a rerun that fails as infrastructure makes the grade infrastructure.")})
    canaries: bool = field(default=True, metadata={"help": (
        "Mutate the task's canaries (tests every honest patch fails once their expectation is changed), half "
        "in each of a pass's two runs: a patch that passes a canary forged the run (tampered, 0). Off: one run, "
        "and only the in-process tripwires stand.")})
    verifier: str | None = field(default=None, metadata={"help": (
        "A reward plug-in, package.module:function(task, patch, report) -> reward [, reasons]: run in its own "
        "sandbox on every grade the hidden tests judged; its reward replaces theirs (kept as tests_reward). "
        "See legorl.grading.verifier.")})
    verifier_timeout: float = field(default=60.0, metadata={"help": "Seconds the --verifier may take per grade."})
    labels: dict[str, str] = field(default_factory=dict)
    run_empty: bool = False  # also run the tests for an empty patch (task validation)
    # Harbor tasks (their test.sh decides; no runner, no canaries): False lets a pass the screen flags keep
    # its reward (findings still recorded)
    suspicious_scores_zero: bool = True

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ConfigError(f"--concurrency must be at least 1, got {self.concurrency}")
        if not self.test_timeout > 0:
            raise ConfigError(f"--timeout must be positive, got {self.test_timeout}")
        if not self.verifier_timeout > 0:
            raise ConfigError(f"--verifier-timeout must be positive, got {self.verifier_timeout}")
        if self.verifier:
            check_spec(self.verifier)


# The grading options the composed commands (`legorl eval`, `legorl loop`) take, as --grade-…: one list for both.
GRADE_FIELDS = ("concurrency", "test_timeout", "confirm", "verifier")


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
        self._canaries: dict[str, dict[str, dict[str, object]]] = {}
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
            self._infra(out, str(exc))
        except (OSError, TimeoutError, subprocess.SubprocessError) as exc:
            self._infra(out, f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # whatever a patch does, its trial gets a row
            # A grader bug the patch triggered must not become its way out of a 0: the control
            # run decides, as for any failure after the patch went in.
            error = f"the grader could not judge this patch: {type(exc).__name__}: {exc}"
            control = self._control(task)
            if control is None:
                self._zero(out, GradeStatus.TESTS_ERRORED, error, task)
                out.control = "the task's control patch graded normally in the same conditions"
            else:
                self._infra(out, f"{error}; the control run failed too: {control}")
                out.control = control

    def _confirm(self, task: TaskRow, patch: str | None, out: GradeRow) -> None:
        """``--confirm``: grade the same patch again in a fresh container. A pass that does not
        reproduce is luck a policy would learn to chase: 0, ``confirmed`` false, the rerun's tests on
        the row. A rerun that fails as infrastructure proves nothing either way: infrastructure."""
        rerun = GradeRow(trial_id=out.trial_id, task_id=out.task_id, status=GradeStatus.GRADED)
        self._verdict(task, patch, rerun)
        if rerun.infra_failure:
            self._infra(out, f"the confirming rerun failed as infrastructure: {rerun.error}")
            return
        if rerun.reward == 1.0:
            out.confirmed = True
            return
        failing = [t.name for t in rerun.tests if not t.passed]
        self._zero(out, GradeStatus(out.status), f"the pass did not reproduce: a fresh rerun of the same patch scored "
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
                self._infra(out, f"{exc}; on the task's gold patch too: {broken}")
                return
            out.status, out.reward, out.error = GradeStatus.VERIFIER_FAILED, 0.0, str(exc)
            return
        except (LegorlError, OSError, subprocess.SubprocessError) as exc:  # its container did not run
            self._infra(out, f"the verifier's sandbox failed: {exc}")
            return
        out.reward, out.verifier_reasons = verdict.reward, verdict.reasons

    def _verifier_control(self, task: TaskRow) -> str | None:
        """The verifier on the task's gold patch, as if it passed every test: None when it gives a reward."""
        key = self._task_key(task)
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

    @staticmethod
    def _infra(out: GradeRow, error: str) -> None:
        out.status = GradeStatus.INFRA_ERROR
        out.infra_failure = True
        out.reward = out.resolved = out.resolution = None
        out.error = error.splitlines()[0] if error.strip() else "infrastructure error"

    @staticmethod
    def _zero(out: GradeRow, status: GradeStatus, error: str, task: TaskRow, test_status: str = "MISSING") -> None:
        report = failed_report(task.FAIL_TO_PASS, task.PASS_TO_PASS, test_status)
        out.status, out.error, out.tests = status, error, report.tests
        out.reward, out.resolved, out.resolution = 0.0, False, Resolution.NO

    def _grade(self, task: TaskRow, patch: str | None, out: GradeRow) -> None:
        text = patch or ""
        problem = _patch_problem(text)
        if problem:
            self._zero(out, GradeStatus.PATCH_APPLY_FAILED, problem, task)
            return
        if not text.strip() and not self.options.run_empty:
            self._zero(out, GradeStatus.EMPTY_PATCH, "empty patch: nothing to grade", task)
            return
        if task.grader == harbor.HARBOR:  # its own tests/test.sh decides (legorl.grading.harbor)
            harbor.grade(self, task, text, out)
            return
        reference = self.reference(task)
        seed = self.canary_seed(task) if self.options.canaries else None
        first, second = halves(self.canaries(task, seed), seed) if seed is not None else ({}, {})
        if secrets.randbits(1):  # which half the first run mutates: a coin per grade, so telling the runs apart
            first, second = second, first  # (a red team did, by a kernel counter) says nothing of the canaries
        run, report_nonce = self.containers.run(task, text, canary_seed=seed, canary_tests=first)
        out.log = run.result.output
        if "apply_failed" in run.events:
            self._zero(out, GradeStatus.PATCH_APPLY_FAILED, "the patch did not apply by any method", task)
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
            self._failed_after_patch(task, out, failure)
            return
        statuses = run.statuses(get_parser(task.log_parser))
        report = evaluate(statuses, [n for n in task.FAIL_TO_PASS if n not in first],
                          [n for n in task.PASS_TO_PASS if n not in first], reference)
        out.tests = report.tests
        code = run.tests_exit_code
        if code in (124, 137):
            self._zero(out, GradeStatus.TEST_TIMEOUT, f"the tests ran past {self.options.test_timeout:g} s", task)
            out.tests = report.tests
            return
        if run.mode == "shell" and contradicts_exit_code(statuses, code):
            self._zero(out, GradeStatus.TESTS_ERRORED, f"the test command exited {code} but its log reports no "
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
            self._second_run(task, text, out, run.result.duration_s, first_seen, second, run)
            return
        # No canary: the runner's behavioural tripwires decide (the screen's findings stay evidence: it
        # reads names, and honest code imports inspect or base64)
        if run.runner_findings:
            self._zero(out, GradeStatus.TESTS_ERRORED, "the code under test rewired the test runner ("
                       + ", ".join(run.runner_findings)[:300] + ")", task)
            return

    def _failed_after_patch(self, task: TaskRow, out: GradeRow, failure: str) -> None:
        """A run that broke after the patch went in: the patch's 0, unless the control run breaks too."""
        control = self._control(task)
        if control is not None:
            out.control = control
            raise GradingInfraError(f"{failure}; the control run failed too: {control}")
        out.control = "the task's control patch graded normally in the same conditions"
        self._zero(out, GradeStatus.TESTS_ERRORED, failure, task)

    # ------------------------------------------------------------------ the canaries

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
        run, nonce = self.containers.run(task, patch, canary_seed=self.canary_seed(task), canary_tests=second,
                                         deadline_s=CANARY_TIME_FACTOR * spent_s + CANARY_TIME_SLACK_S)
        if "ready" not in run.events:
            raise GradingInfraError(run.before_patch_error())
        failure = run.failure(nonce)
        if failure is None and run.tests_exit_code in (124, 137):
            failure = "the second run's tests timed out"
        if failure is not None:
            self._failed_after_patch(task, out, f"the second run: {failure}")
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
            self._zero(out, GradeStatus.TAMPERED, f"{len(forged)} of {len(first_seen) + len(second)} canaries did "
                       f"not fail (tests every honest patch that passes them unmutated fails; their expectation was "
                       f"mutated): {', '.join(forged[:3])}", task)
        else:
            differ = [t for t in report.tests if not t.passed]
            if differ:
                self._zero(out, GradeStatus(out.status), "in the second run: "
                           + ", ".join(f"{t.name} {t.status}" for t in differ[:3]), task)
            elif not _value_canaries(first_run) and not _value_canaries(run):
                findings = first_run.runner_findings + run.runner_findings
                if findings:
                    self._zero(out, GradeStatus.TESTS_ERRORED, "the code under test rewired the test runner "
                               "(the task's canaries are negations only) (" + ", ".join(findings)[:300] + ")", task)
        out.tests = tests

    def canaries(self, task: TaskRow, seed: str) -> dict[str, dict[str, object]]:
        """The task's canaries under ``seed`` (found once per task and seed, cached): FAIL_TO_PASS test
        id -> ``{"site", "salt"}``, the line where the buggy code fails the test and the salt of the
        mutation kept. A canary is a test whose mutation the gold patch fails, and which the buggy code
        (the empty patch) fails exactly where it fails the real test. A mutation the buggy code meets
        anywhere else — a row it passes, an assertion before the bug, a mixin's method every subclass
        runs — would fail a test that never ran through the patched code, and code watching that would
        tell the canary run apart: such tests are left unmutated."""
        if not (task.patch or "").strip() or not task.FAIL_TO_PASS:
            return {}
        key = hashlib.sha256(f"{self._task_key(task)}\0{seed}".encode()).hexdigest()  # the task key covers the writer
        with self._lock:
            if key in self._canaries:
                return self._canaries[key]
        path = cache_dir() / "grading" / "canaries" / f"{key}.json"
        try:
            found = json.loads(path.read_text())
            live = {str(n): dict(spec) for n, spec in found.items()}
        except (OSError, ValueError, TypeError, AttributeError):
            try:
                live = self._find_canaries(task, seed)
            except GradingInfraError:  # the task's own patches do not run cleanly: no canaries, this process
                with self._lock:
                    self._canaries[key] = {}
                return {}
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_text(json.dumps(live, sort_keys=True))
            os.replace(tmp, path)
        with self._lock:
            self._canaries[key] = live
        return live

    def canary_forms(self, task: TaskRow) -> tuple[list[str], list[str]]:
        """The task's canaries under this host's seed, as ``(changed values, negations)``: one gold run
        with every canary mutated. Only a changed value checks a pass from outside the test process
        (code that inverts each new test's outcome passes a negation blind; see the threat model)."""
        seed = self.canary_seed(task)
        live = self.canaries(task, seed)
        if not live:
            return [], []
        run = self._clean_run(task, task.patch or "", "gold patch (canary forms)", seed, live)
        negated = set(run.negated)
        forms = {n: _mutation_of(n, run.mutated) for n in live}
        return ([n for n, key in forms.items() if key and key not in negated],
                [n for n, key in forms.items() if key in negated])

    def _find_canaries(self, task: TaskRow, seed: str) -> dict[str, dict[str, object]]:
        """Mutate every FAIL_TO_PASS test at its site, keep what passes the checks; retry the rest with
        another salt (a drawn value can be what the buggy code returns, or out of a constructor's range)."""
        gold = self.reference(task)
        parse = get_parser(task.log_parser)
        empty = self._clean_run(task, "", "empty patch")
        before, where_before = empty.statuses(parse).full, empty.where
        sites = {}
        for nodeid in task.FAIL_TO_PASS:
            frames = where_before.get(nodeid)
            real = gold.status(nodeid) if gold is not None else None
            if before.get(nodeid) in FAILING and (real or "MISSING") not in FAILING and isinstance(frames, list) \
                    and frames and isinstance(frames[0], list):
                sites[nodeid] = frames[0]

        live: dict[str, dict[str, object]] = {}
        for salt in range(CANARY_TRIES):
            tried: dict[str, dict[str, object]] = {
                **live, **{n: {"site": site, "salt": str(salt)} for n, site in sites.items() if n not in live}}
            if len(tried) == len(live):
                break
            gold_canary = self._clean_run(task, task.patch or "", "gold patch (canary run)", seed, tried)
            empty_canary = self._clean_run(task, "", "empty patch (canary run)", seed, tried)
            after, where_after = empty_canary.statuses(parse).full, empty_canary.where
            changed = [n for n in {*before, *after}
                       if before.get(n) != after.get(n) or where_before.get(n) != where_after.get(n)]
            statuses, mutated, negated = gold_canary.statuses(parse).full, gold_canary.mutated, gold_canary.negated
            live = {}
            for nodeid, spec in tried.items():
                key = _mutation_of(nodeid, mutated)
                # the buggy code passes a negated assertion: the canary itself may change, nothing else may
                own = {n for n in tried if _mutation_of(n, {key: ""})} if key in negated else set()
                if key and statuses.get(nodeid) in FAILING \
                        and not any(_mutation_of(n, {key: ""}) for n in changed if n not in own):
                    live[nodeid] = spec
            sites = {n: site for n, site in sites.items() if _mutation_of(n, mutated)}  # nothing to mutate: no retry
        return dict(sorted(live.items()))

    def canary_seed(self, task: TaskRow) -> str:
        """The task's canary seed: a keyed hash of the task under a secret kept on this host (0600), so
        nothing the patch can see or compute tells which test was mutated, or to what."""
        path = cache_dir() / "grading" / "canary.key"
        try:
            key = path.read_bytes()
        except FileNotFoundError:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(32))
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)  # the first writer wins; everyone reads what it wrote
            tmp.unlink()
            key = path.read_bytes()
        return hmac.new(key, self._task_key(task).encode(), hashlib.sha256).hexdigest()

    # ------------------------------------------------------------------ reference and control runs

    def reference(self, task: TaskRow) -> TestStatuses | None:
        """The gold patch's per-test statuses: recorded on the task, else one gold run (cached)."""
        recorded = task.gold_status_map()
        if recorded is not None:
            return TestStatuses.from_map(recorded)
        if not (task.patch or "").strip():
            return None
        key = self._task_key(task)
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
            self._controls[self._task_key(task)] = (time.monotonic(), "")
        return statuses

    def statuses_for(self, task: TaskRow, patch: str, what: str = "patch") -> dict[str, str]:
        """Every test's status with ``patch`` applied; GradingInfraError unless the run is clean."""
        return self._clean_run(task, patch, what).statuses(get_parser(task.log_parser)).full

    def _clean_run(self, task: TaskRow, patch: str, what: str, canary_seed: str | None = None,
                   canary_tests: dict[str, dict[str, object]] | None = None) -> Run:
        """One run of a patch of the task's own (gold, empty); GradingInfraError unless it is clean."""
        run, nonce = self.containers.run(task, patch, canary_seed=canary_seed, canary_tests=canary_tests)
        if "applied" not in run.events:
            if "apply_failed" in run.events:
                raise GradingInfraError(f"task {task.instance_id}: its {what} does not apply")
            raise GradingInfraError(run.before_patch_error())
        failure = run.failure(nonce)
        if failure is not None:
            raise GradingInfraError(f"task {task.instance_id}: its {what} does not grade cleanly: {failure}")
        return run

    def _control(self, task: TaskRow) -> str | None:
        """Run the control patch (gold, else empty) now; None when it grades normally, else why not."""
        key = self._task_key(task)
        with self._lock:
            seen = self._controls.get(key)
        if seen is not None and time.monotonic() - seen[0] < CONTROL_TTL_S and not seen[1]:
            return None
        try:
            if task.grader == harbor.HARBOR:
                problem = harbor.control_problem(self, task)
            else:
                run, nonce = self.containers.run(task, task.patch or "")
                problem = run.failure(nonce) if "ready" in run.events else run.before_patch_error()
        except Exception as exc:  # the control's failure, whatever it is, is the evidence
            problem = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        with self._lock:
            self._controls[key] = (time.monotonic(), problem or "")
        return problem

    def _task_key(self, task: TaskRow) -> str:
        parts = [GRADER_VERSION, SANDBOXED_DIGEST, task.instance_id, task.repo_source or "", task.repo_ref or "", task.base_commit or "",
                 task.patch or "", task.test_patch or "", task.test_command or "", self.containers.image_for(task)]
        return hashlib.sha256("\0".join(parts).encode("utf-8", "surrogateescape")).hexdigest()

    # ------------------------------------------------------------------ one container

def halves(canaries: dict[str, dict[str, object]], seed: str) -> tuple[dict[str, dict[str, object]], dict[str, dict[str, object]]]:
    """Split a task's canaries between a grade's two runs by the secret seed, a test function (every
    row and class of it, which may share one mutation) on one side. Each run mutates its half and
    checks the other's real pass, so neither run is "the ordinary one": code that carries a mark from
    one run to the next (a red team did, through the host's kernel keyring and page cache) still meets
    canaries in the first run, where no mark exists yet, and must guess which tests they are."""
    def side(nodeid: str) -> int:
        function = nodeid.split("::")[-1].partition("[")[0]
        return hmac.new(seed.encode(), function.encode(), hashlib.sha256).digest()[0] & 1

    first = {n: spec for n, spec in canaries.items() if side(n) == 0}
    return first, {n: spec for n, spec in canaries.items() if n not in first}


def _value_canaries(run: Run) -> bool:
    """Whether the run mutated a canary's expected value (not only negated assertions)."""
    return bool(set(run.mutated) - set(run.negated))


def _mutation_of(nodeid: str, mutated: dict[str, str]) -> str | None:
    """Which of a canary run's mutations (:mod:`.sandboxed.canary`'s keys) a test runs: its row's own
    value (``name[id]``), else its function's body (``name``: every row, and every class that has it)."""
    last = nodeid.split("::")[-1]
    for key in (last, last.partition("[")[0]):
        if key in mutated:
            return key
    return None


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


