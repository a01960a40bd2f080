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
- scores a pass whose code reaches into the runner or the interpreter as ``suspicious``, 0;
- labels a grade infrastructure only from signals outside the patch's reach: a failure before the
  patch went in (image, container, testbed), or a failure after it that a **control run** (the
  gold patch, else the empty one, in the same conditions) repeats. Any other failure after the
  patch went in — a crash, a usage error, a killed runner, no report — is the patch's doing:
  ``tests_errored``, reward 0.

The container's script and event protocol are in :mod:`.script`. Whatever a patch holds, ``grade``
returns a row: one bad patch never stops a stage.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shlex
import subprocess
import tarfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from legorl.errors import ConfigError, LegorlError
from legorl.grading.logparse import TestStatuses, contradicts_exit_code, get_parser
from legorl.grading.patches import split_patch, touched_paths
from legorl.grading.report import evaluate, failed_report
from legorl.grading.script import (
    APPLY_METHODS,
    APPLY_TIMEOUT_S,
    SANDBOXED_DIGEST,
    bundle,
    grade_files,
    parse_pytest_command,
    read_events,
)
from legorl.paths import cache_dir
from legorl.sandbox.base import MAX_PATCH_BYTES, ExecResult, Sandbox, SandboxSpec
from legorl.schemas import GradeRow, GradeStatus, Resolution, TaskRow

GRADER_VERSION = "2"  # bump when the verdict for the same inputs may change (it keys cached gold runs)
DEFAULT_PYTEST = "python3 -m pytest --no-header -rA --tb=no -p no:cacheprovider {test_files}"
MAX_LOG_CHARS = 200_000
INFRA_SLACK_S = 300.0  # what the grading script may take beyond the test timeout before it is infra
CONTROL_TTL_S = 600.0  # a control run that graded normally vouches for its task this long
_UNPACK = "tar -x -i --no-same-owner -C / -f - && exec bash /tmp/.legorl-grade/script.sh"


class GradingInfraError(LegorlError):
    """Grading itself failed (not the patch): the grade is infra_error and is retried on rerun."""


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
    labels: dict[str, str] = field(default_factory=dict)
    run_empty: bool = False  # also run the tests for an empty patch (task validation)
    suspicious_scores_zero: bool = True  # False: a suspicious pass keeps its reward (findings still recorded)

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ConfigError(f"--concurrency must be at least 1, got {self.concurrency}")
        if not self.test_timeout > 0:
            raise ConfigError(f"--timeout must be positive, got {self.test_timeout}")


def hidden_test_files(test_patch: str | None) -> list[str]:
    """The test files the default command runs: the Python files ``test_patch`` leaves in place."""
    return [fp.new_path for fp in split_patch(test_patch or "") if fp.new_path and fp.new_path.endswith(".py")]


@dataclass
class Run:
    """One grading container's run, read back through its event lines."""

    result: ExecResult
    events: dict[str, str]
    test_output: str
    report: dict[str, object] | None
    judged: dict[str, object] | None
    mode: str  # "runner" (the report counts) or "shell" (a custom command: its pytest log counts)

    def failure(self, report_nonce: str) -> str | None:
        """Why the test run did not produce trustworthy results (None: it did)."""
        ev = self.events
        if "applied" not in ev:  # the container died while the patch was being applied
            return (f"the grading script stopped while applying the patch (exit {self.result.exit_code}"
                    f"{', timed out' if self.result.timed_out else ''})")
        if "judge_failed" in ev:
            return f"the patched tree could not be judged: {ev['judge_failed']}"
        if "test_patch_failed" in ev:
            return "the hidden tests could not be put in place on the patched tree"
        if "tests_end" not in ev:
            return (f"the grading script stopped during the tests (exit {self.result.exit_code}"
                    f"{', timed out' if self.result.timed_out else ''})")
        code = _int(ev["tests_end"])
        if code in (124, 137):
            return None  # a timeout is judged on its own
        if self.mode == "shell":
            return None if "test session starts" in self.test_output else f"no pytest session (exit {code})"
        if self.report is None:
            return f"the test runner wrote no report (exit {code})"
        if self.report.get("nonce") != report_nonce:
            return "the test report does not carry this grade's nonce"
        tampered = self.report.get("tampered")
        if tampered:
            return f"the code under test rewired the test runner ({', '.join(map(str, tampered))[:300]})"  # type: ignore[call-overload]
        if self.report.get("exitstatus") != code:
            return f"the test process exited {code} but pytest's session ended with {self.report.get('exitstatus')}"
        if code not in (0, 1, 2):  # 2: collection errors; 3 internal error, 4 usage error, 5 no tests
            return f"pytest could not run the tests (exit {code})"
        return None

    def statuses(self, parse: Callable[[str], TestStatuses]) -> TestStatuses:
        if self.mode == "shell":
            return parse(self.test_output)
        raw = (self.report or {}).get("statuses") or {}
        return TestStatuses.from_map({str(k): str(v) for k, v in dict(raw).items()})  # type: ignore[call-overload]


def _int(text: str) -> int | None:
    try:
        return int(text.split()[0])
    except (ValueError, IndexError):
        return None


def _trim(log: str) -> str:
    if len(log) <= MAX_LOG_CHARS:
        return log
    half = MAX_LOG_CHARS // 2
    return log[:half] + f"\n... [{len(log) - MAX_LOG_CHARS} characters cut] ...\n" + log[-half:]


def _json(text: str) -> dict[str, object] | None:
    """A JSON object from the container, every string made writable (a lone surrogate — a file name
    that is not UTF-8, say — becomes a backslash escape)."""
    try:
        data = json.loads(text) if text else None
    except (json.JSONDecodeError, RecursionError):
        return None
    clean = _writable(data) if isinstance(data, dict) else None
    return clean if isinstance(clean, dict) else None


def _writable(value: object) -> object:
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, dict):
        return {_writable(k): _writable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_writable(v) for v in value]
    return value


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
        self._create = create
        self._run_once: Callable[..., ExecResult] | None = getattr(getattr(create, "__self__", None), "run_once", None)
        self._lock = threading.Lock()
        self._tars: dict[tuple[str, str], bytes] = {}
        self._heads: dict[tuple[str, str], frozenset[str]] = {}
        self._references: dict[str, TestStatuses] = {}
        self._controls: dict[str, tuple[float, str]] = {}

    def image_for(self, task: TaskRow) -> str:
        if task.image:
            return task.image
        if self.options.default_image:
            return self.options.default_image
        from legorl.sandbox.host import base_image

        return base_image()

    # ------------------------------------------------------------------ the verdict

    def grade(self, task: TaskRow, patch: str | None, trial_id: str | None = None, **row: object) -> GradeRow:
        """Grade ``patch`` on ``task``; extra keyword arguments (``harness``, ``step``) go on the row."""
        start = time.monotonic()
        out = GradeRow(trial_id=trial_id or task.instance_id, task_id=task.instance_id,
                       status=GradeStatus.GRADED, **row)  # type: ignore[arg-type]
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
        out.duration_s = round(time.monotonic() - start, 3)
        if out.log is not None:
            out.log = _trim(out.log)
        return out

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
        reference = self.reference(task)
        run, report_nonce = self._execute(task, text)
        out.log = run.result.output
        if "apply_failed" in run.events:
            self._zero(out, GradeStatus.PATCH_APPLY_FAILED, "the patch did not apply by any method", task)
            return
        if "ready" not in run.events:
            raise GradingInfraError(_before_patch_error(run))
        out.apply_method = next((line[len(">>>>> Applied Patch ("):-1] for line in run.result.output.splitlines()
                                 if line.startswith(">>>>> Applied Patch (")), None)
        if run.judged is not None:
            reset = [r for r in run.judged.get("reset", []) if isinstance(r, list) and len(r) == 2]  # type: ignore[attr-defined]
            out.dropped_paths = sorted({str(path) for path, _why in reset})
            out.suspicious = [str(s) for s in run.judged.get("suspicious", [])][:50]  # type: ignore[attr-defined]
        failure = run.failure(report_nonce)
        if failure is not None:
            control = self._control(task)
            if control is not None:
                out.control = control
                raise GradingInfraError(f"{failure}; the control run failed too: {control}")
            out.control = "the task's control patch graded normally in the same conditions"
            self._zero(out, GradeStatus.TESTS_ERRORED, failure, task)
            return
        statuses = run.statuses(get_parser(task.log_parser))
        report = evaluate(statuses, task.FAIL_TO_PASS, task.PASS_TO_PASS, reference)
        out.tests = report.tests
        code = _int(run.events["tests_end"])
        if code in (124, 137):
            self._zero(out, GradeStatus.TEST_TIMEOUT, f"the tests ran past {self.options.test_timeout:g} s", task)
            out.tests = report.tests
            return
        if run.mode == "shell" and contradicts_exit_code(statuses, code):
            self._zero(out, GradeStatus.TESTS_ERRORED, f"the test command exited {code} but its log reports no "
                       "failing test", task)
            return
        out.reward, out.resolved, out.resolution = report.reward, report.resolved, report.resolution
        if report.resolved and out.suspicious and self.options.suspicious_scores_zero:
            out.status, out.reward, out.resolved, out.resolution = GradeStatus.SUSPICIOUS, 0.0, False, Resolution.NO
            out.error = f"the tests passed, but the patch's code reaches into the test runner ({out.suspicious[0]})"

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
        run, nonce = self._execute(task, patch)
        if "applied" not in run.events:
            if "apply_failed" in run.events:
                raise GradingInfraError(f"task {task.instance_id}: its {what} does not apply")
            raise GradingInfraError(_before_patch_error(run))
        failure = run.failure(nonce)
        if failure is not None:
            raise GradingInfraError(f"task {task.instance_id}: its {what} does not grade cleanly: {failure}")
        return run.statuses(get_parser(task.log_parser)).full

    def _control(self, task: TaskRow) -> str | None:
        """Run the control patch (gold, else empty) now; None when it grades normally, else why not."""
        key = self._task_key(task)
        with self._lock:
            seen = self._controls.get(key)
        if seen is not None and time.monotonic() - seen[0] < CONTROL_TTL_S and not seen[1]:
            return None
        try:
            run, nonce = self._execute(task, task.patch or "")
            problem = run.failure(nonce) if "ready" in run.events else _before_patch_error(run)
        except Exception as exc:  # the control's failure, whatever it is, is the evidence
            problem = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        with self._lock:
            self._controls[key] = (time.monotonic(), problem or "")
        return problem

    def _task_key(self, task: TaskRow) -> str:
        parts = [GRADER_VERSION, SANDBOXED_DIGEST, task.instance_id, task.repo_source or "", task.repo_ref or "", task.base_commit or "",
                 task.patch or "", task.test_patch or "", task.test_command or "", self.image_for(task)]
        return hashlib.sha256("\0".join(parts).encode("utf-8", "surrogateescape")).hexdigest()

    # ------------------------------------------------------------------ one container

    def command_for(self, task: TaskRow) -> str:
        files = hidden_test_files(task.test_patch)
        command = task.test_command or DEFAULT_PYTEST
        if not task.test_command and task.repo_source and "src" in {p.split("/", 1)[0] for p in self._head(task)
                                                                    if "/" in p}:
            command = "PYTHONPATH=src " + command  # a src layout is importable without installing it
        if "{test_files}" in command:
            if not files:
                raise GradingInfraError(f"task {task.instance_id}: test_patch touches no Python test file to run")
            command = command.replace("{test_files}", " ".join(shlex.quote(f) for f in files))
        return command

    def _execute(self, task: TaskRow, patch: str) -> tuple[Run, str]:
        command = self.command_for(task)
        files, nonce, report_nonce = grade_files(patch=patch, test_patch=task.test_patch or "",
                                                 hidden=touched_paths(task.test_patch), command=command,
                                                 timeout=self.options.test_timeout, gold=touched_paths(task.patch))
        own_testbed = bool(task.repo_source)
        spec = SandboxSpec(
            image=self.image_for(task), labels={"role": "grade", **self.options.labels},
            network=False, memory=self.options.memory, cpus=self.options.cpus,
            deadline_s=self.options.test_timeout + 2 * INFRA_SLACK_S + len(APPLY_METHODS) * (APPLY_TIMEOUT_S + 5),
            read_only=own_testbed,
            tmpfs=((("/testbed", "size=2g,mode=755"),) if own_testbed else ()) + (("/tmp", "size=2g,mode=1777"),),
        )
        stdin = (self._testbed_tar(task) if own_testbed else b"") + bundle(files)
        timeout = self.options.test_timeout + INFRA_SLACK_S + len(APPLY_METHODS) * (APPLY_TIMEOUT_S + 5)
        if self._run_once is not None:
            res = self._run_once(spec, ["sh", "-c", _UNPACK], stdin=stdin, timeout=timeout)
        else:
            box = self._create(spec)
            try:
                res = box.exec(["sh", "-c", _UNPACK], timeout=timeout, stdin=stdin)  # type: ignore[call-arg]
            finally:
                box.remove()
        events = read_events(res.output, nonce)
        mode = events.data("tests_start") or ("runner" if parse_pytest_command(command) else "shell")
        if "judge_failed" in events:  # the judge's own last words (stderr), for the row
            last = events.decoded("judge_failed").strip().splitlines()
            events.seen["judge_failed"] = last[-1][:300] if last else "the judge crashed"
        run = Run(res, events.seen, events.test_output, _json(events.decoded("report")), _json(events.decoded("judged")),
                  mode)
        return run, report_nonce

    def _head(self, task: TaskRow) -> frozenset[str]:
        """The files of the task's testbed commit (listed once per task from the host's copy)."""
        from legorl.sandbox.testbed import prepare_repo

        key = (task.repo_source or "", task.repo_ref or task.base_commit or "")
        with self._lock:
            files = self._heads.get(key)
        if files is None:
            repo, _commit = prepare_repo(key[0], key[1])
            proc = subprocess.run(["git", "ls-tree", "-r", "-z", "--name-only", "HEAD"], cwd=repo, capture_output=True)
            if proc.returncode != 0:
                raise GradingInfraError(f"cannot list the testbed of {task.instance_id}: "
                                        f"{proc.stderr.decode(errors='replace').strip()[-200:]}")
            files = frozenset(p for p in proc.stdout.decode(errors="surrogateescape").split("\0") if p)
            with self._lock:
                self._heads[key] = files
        return files

    def _testbed_tar(self, task: TaskRow) -> bytes:
        """``testbed/...`` as an uncompressed tar of the one-commit repository (cached per task)."""
        from legorl.sandbox.testbed import prepare_repo

        key = (task.repo_source or "", task.repo_ref or task.base_commit or "")
        with self._lock:
            cached = self._tars.get(key)
        if cached is not None:
            return cached
        repo, _commit = prepare_repo(*key)
        # kept next to the (immutable) testbed, so a new grading process reads it instead of walking the tree
        path = repo.with_name(repo.name + ".grade-v1.tar")
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
                tar.add(repo, arcname="testbed", filter=lambda info: None if info.name.endswith(
                    "/.git/legorl-testbed") else info)
            data = buf.getvalue()
            tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        with self._lock:
            self._tars[key] = data
            while len(self._tars) > 64:
                self._tars.pop(next(iter(self._tars)))
        return data


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


def _before_patch_error(run: Run) -> str:
    """Why a grading container failed before the patch went in (infrastructure by construction)."""
    if "infra" in run.events:
        return run.events["infra"] or "the grading container could not be prepared"
    res = run.result
    if res.timed_out:
        return f"the grading container did not get to the patch in {res.duration_s:.0f} s"
    last = res.output.strip().splitlines()[-1:] or [""]
    return f"the grading container failed before the patch was applied (exit {res.exit_code}): {last[0][:300]}"
