"""One grading container: what goes in (the task's testbed as a tar, the grading script and its
files on stdin) and what comes out, read back through the script's event lines into a :class:`Run`.

The script and its event protocol are in :mod:`.script`; what a run means for the grade is the
grader's (:mod:`.grader`).
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
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from legorl.core.errors import LegorlError
from legorl.core.schemas import TaskRow
from legorl.grading.logparse import TestStatuses
from legorl.grading.options import GradeOptions
from legorl.grading.patches import split_patch, touched_paths
from legorl.grading.script import (
    APPLY_METHODS,
    APPLY_TIMEOUT_S,
    MAX_REPORT_BYTES,
    SANDBOXED_DIGEST,
    bundle,
    grade_files,
    parse_pytest_command,
    read_events,
)
from legorl.sandbox.base import ExecResult, Sandbox, SandboxSpec

GRADER_VERSION = "4"  # bump when the verdict for the same inputs may change (it keys cached gold runs)

DEFAULT_PYTEST = "python3 -m pytest --no-header -rA --tb=no -p no:cacheprovider {test_files}"
INFRA_SLACK_S = 300.0  # what the grading script may take beyond the test timeout before it is infra
# Parsed, a report costs ~100 bytes a JSON value: within MAX_REPORT_BYTES, 8 MB of "{}," cost `legorl grade`
# 400 MB (a red team's); an honest report of 10,000 tests, its failures' frames included, holds well under this
MAX_REPORT_VALUES = 500_000
_UNPACK = "tar -x -i --no-same-owner -C / -f - && exec bash /tmp/.legorl-grade/script.sh"


class GradingInfraError(LegorlError):
    """Grading itself failed (not the patch): the grade is infra_error and is retried on rerun."""


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
    canaries: dict[str, object] | None = None  # what the canary writer said (:mod:`.sandboxed.canary`)

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
        if "canary_failed" in ev:
            return f"the hidden tests could not be written: {ev['canary_failed']}"
        if "tests_end" not in ev:
            return (f"the grading script stopped during the tests (exit {self.result.exit_code}"
                    f"{', timed out' if self.result.timed_out else ''})")
        code = self.tests_exit_code
        if code in (124, 137):
            return None  # a timeout is judged on its own
        if self.mode == "shell":
            return None if "test session starts" in self.test_output else f"no pytest session (exit {code})"
        if "report_too_large" in ev:
            size = ev["report_too_large"]
            over = f"{size} bytes, over {MAX_REPORT_BYTES}" if size.isdigit() else size
            return f"the test report is {over} (the tests wrote into it)"
        if self.report is None:
            return f"the test runner wrote no report (exit {code})"
        if self.report.get("nonce") != report_nonce:
            return "the test report does not carry this grade's nonce"
        if self.report.get("exitstatus") != code:
            return f"the test process exited {code} but pytest's session ended with {self.report.get('exitstatus')}"
        if code not in (0, 1, 2):  # 2: collection errors; 3 internal error, 4 usage error, 5 no tests
            return f"pytest could not run the tests (exit {code})"
        return None

    @property
    def runner_findings(self) -> list[str]:
        """What the runner's in-process tripwires saw (evidence for the row, never a verdict: the code
        under test shares that process and can blind them)."""
        found = (self.report or {}).get("tampered") or []
        return [f"runner: {str(f)[:300]}" for f in found][:20] if isinstance(found, list) else []

    @property
    def mutated(self) -> dict[str, str]:
        """The tests this run mutated (test name -> file:line)."""
        found = (self.canaries or {}).get("mutated")
        return {str(k): str(v) for k, v in found.items()} if isinstance(found, dict) else {}

    @property
    def negated(self) -> list[str]:
        """Which of ``mutated`` negate the assertion at their site (no expected value there to change)."""
        found = (self.canaries or {}).get("negated")
        return [str(k) for k in found] if isinstance(found, list) else []

    @property
    def where(self) -> dict[str, object]:
        """Where in the tree each failing test failed, as the runner saw it (trust it only on gold and
        empty runs: a candidate's code shares the runner's process)."""
        found = (self.report or {}).get("where")
        return dict(found) if isinstance(found, dict) else {}

    @property
    def tests_exit_code(self) -> int | None:
        """The test command's exit code (None before the tests ended, or unreadable)."""
        return _int(self.events["tests_end"]) if "tests_end" in self.events else None

    def before_patch_error(self) -> str:
        """Why a grading container failed before the patch went in (infrastructure by construction)."""
        if "infra" in self.events:
            return self.events["infra"] or "the grading container could not be prepared"
        res = self.result
        if res.timed_out:
            return f"the grading container did not get to the patch in {res.duration_s:.0f} s"
        last = res.output.strip().splitlines()[-1:] or [""]
        return f"the grading container failed before the patch was applied (exit {res.exit_code}): {last[0][:300]}"

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


class GradingContainers:
    """Runs grading containers, one fresh container per run, from ``create`` (a sandbox per spec)
    or, where the backend has one, its ``run_once`` (podman's ``podman run --rm -i``). Each task's
    testbed tar and file list are made once and kept."""

    def __init__(self, options: GradeOptions, create: Callable[[SandboxSpec], Sandbox]):
        self.options = options
        self._create = create
        self._run_once: Callable[..., ExecResult] | None = getattr(getattr(create, "__self__", None), "run_once", None)
        self._lock = threading.Lock()
        self._tars: dict[tuple[str, str], bytes] = {}
        self._heads: dict[tuple[str, str], frozenset[str]] = {}

    @property
    def run_once(self) -> Callable[..., ExecResult] | None:
        """The backend's one-call ``podman run --rm -i``, where it has one."""
        return self._run_once

    def image_for(self, task: TaskRow) -> str:
        """The image a task grades in: its own, else the default, else the sandbox base image."""
        if task.image:
            return task.image
        if self.options.default_image:
            return self.options.default_image
        from legorl.sandbox.host import base_image

        return base_image()

    def command_for(self, task: TaskRow) -> str:
        """The command that runs the task's hidden tests (``{test_files}`` filled in)."""
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

    def run(self, task: TaskRow, patch: str, canary_seed: str | None = None,
            canary_tests: Mapping[str, object] | None = None, deadline_s: float | None = None) -> tuple[Run, str]:
        """Grade ``patch`` in a fresh container; the run and the nonce its test report must carry.

        ``canary_seed``: a canary run (the expected values of ``canary_tests`` mutated, each at its site:
        :mod:`.sandboxed.canary`). ``deadline_s``: the
        host stops the container after this long (a second run's bound, from its first run: the
        script inside keeps the ordinary timeout, so nothing the test user can see differs)."""
        command = self.command_for(task)
        files, nonce, report_nonce = grade_files(patch=patch, test_patch=task.test_patch or "",
                                                 hidden=touched_paths(task.test_patch), command=command,
                                                 timeout=self.options.test_timeout, gold=touched_paths(task.patch),
                                                 tests=canary_tests, candidates=task.FAIL_TO_PASS,
                                                 canary_seed=canary_seed)
        own_testbed = bool(task.repo_source)
        spec = SandboxSpec(
            image=self.image_for(task), labels={"role": "grade", **self.options.labels},
            network=False, memory=self.options.memory, cpus=self.options.cpus,
            deadline_s=self.options.test_timeout + 2 * INFRA_SLACK_S + len(APPLY_METHODS) * (APPLY_TIMEOUT_S + 5),
            read_only=own_testbed, cache_isolation=True,  # what one grade's code marks, the next cannot read
            tmpfs=((("/testbed", "size=2g,mode=755"),) if own_testbed else ()) + (("/tmp", "size=2g,mode=1777"),),
        )
        stdin = (self._testbed_tar(task) if own_testbed else b"") + bundle(files)
        timeout = self.options.test_timeout + INFRA_SLACK_S + len(APPLY_METHODS) * (APPLY_TIMEOUT_S + 5)
        if deadline_s is not None:
            timeout = min(timeout, deadline_s)
        res = self.run_container(spec, ["sh", "-c", _UNPACK], stdin, timeout)
        events = read_events(res.output, nonce)
        mode = events.data("tests_start") or ("runner" if parse_pytest_command(command) else "shell")
        if "judge_failed" in events:  # the judge's own last words (stderr), for the row
            last = events.decoded("judge_failed").strip().splitlines()
            events.seen["judge_failed"] = last[-1][:300] if last else "the judge crashed"
        if "canary_failed" in events:
            events.seen["canary_failed"] = events.decoded("canary_failed").strip()[-300:]
        report_text = events.decoded("report")
        values = sum(report_text.count(c) for c in "{[,")  # an upper bound of its JSON values, before parsing
        if values > MAX_REPORT_VALUES:
            events.seen["report_too_large"] = f"{values} JSON values, over {MAX_REPORT_VALUES}"
            report_text = ""
        run = Run(res, events.seen, events.test_output, _json(report_text), _json(events.decoded("judged")),
                  mode, _json(events.decoded("canaries")))
        return run, report_nonce

    def run_container(self, spec: SandboxSpec, argv: list[str], stdin: bytes, timeout: float) -> ExecResult:
        """``argv`` in one fresh container of ``spec``, fed ``stdin``: podman's ``run_once`` where the
        backend has it, else create, exec and remove."""
        if self._run_once is not None:
            return self._run_once(spec, argv, stdin=stdin, timeout=timeout)
        box = self._create(spec)
        try:
            return box.exec(argv, timeout=timeout, stdin=stdin)  # type: ignore[call-arg]
        finally:
            box.remove()

    def clean_run(self, task: TaskRow, patch: str, what: str, canary_seed: str | None = None,
                  canary_tests: Mapping[str, object] | None = None, *, timed_out_ok: bool = False) -> Run:
        """One run of a patch of the task's own (gold, empty); GradingInfraError unless it is clean
        (``timed_out_ok``: a run whose tests timed out is clean, as for the task builder, which judges
        hanging tests itself)."""
        run, nonce = self.run(task, patch, canary_seed=canary_seed, canary_tests=canary_tests)
        if "applied" not in run.events:
            if "apply_failed" in run.events:
                raise GradingInfraError(f"task {task.instance_id}: its {what} does not apply")
            raise GradingInfraError(run.before_patch_error())
        failure = run.failure(nonce)
        if failure is None and not timed_out_ok and run.tests_exit_code in (124, 137):
            # a reference or canary discovery from a run cut short would be kept (cached on disk) as
            # the task's: a load spike then lost the task's canaries on this host for good
            failure = f"its tests timed out (exit {run.tests_exit_code})"
        if failure is not None:
            raise GradingInfraError(f"task {task.instance_id}: its {what} does not grade cleanly: {failure}")
        return run

    def task_key(self, task: TaskRow) -> str:
        """A digest of everything that shapes a task's runs (what the cached gold runs and canaries are kept by)."""
        parts = [GRADER_VERSION, SANDBOXED_DIGEST, task.instance_id, task.repo_source or "", task.repo_ref or "",
                 task.base_commit or "", task.patch or "", task.test_patch or "", task.test_command or "",
                 self.image_for(task)]
        return hashlib.sha256("\0".join(parts).encode("utf-8", "surrogateescape")).hexdigest()

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
