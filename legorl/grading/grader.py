"""Grade one (task, patch): a fresh container, the filtered patch, the hidden tests, SWE-bench's rules.

The steps, in one container that is removed on every exit path:

1. drop the patch's edits to hidden test files and test infrastructure (:mod:`.patches`);
2. start a container from the task's image (network off) and build ``/testbed`` at the task's
   commit (from ``repo_source``), or use the image's own ``/testbed`` with its history stripped;
3. apply the patch with ``git apply -v``, then ``--3way``, then ``--reject``, then
   ``patch --batch --forward --fuzz=5 -p1`` (the tree is reset between tries; all failing is
   ``patch_apply_failed``, reward 0);
4. restore tox.ini / setup.cfg / pyproject.toml whose pytest section the patch changed;
5. reset the files ``test_patch`` touches and apply it; run the test command between SWE-bench's
   markers with a timeout; parse; judge every FAIL_TO_PASS / PASS_TO_PASS test.

Grading throughput is what RL waits on, so the common case — a task with a ``repo_source`` and a
patch that leaves the shared config files alone — is one podman call
(:meth:`~legorl.sandbox.podman.PodmanBackend.run_once`): ``podman run --rm -i`` whose stdin holds
the task's testbed as a tar (built once per task and kept next to the host's testbed), the patch,
test_patch and the script of steps 3 and 5; the container is created, runs and is removed by that
one call. The hidden files the testbed's commit holds are known on the host, so their reset is one
``git checkout``. Otherwise (an image's own ``/testbed``, step 4 needed, another sandbox backend)
the container is created, the script runs in one ``exec`` (two when step 4 has files to judge),
and it is removed.

Grading's own failures — image missing, container gone, a task whose test_patch does not apply,
no test runner in the image — are ``infra_error`` with a null reward, never reward 0: a rerun
grades them again.
"""

from __future__ import annotations

import base64
import io
import os
import shlex
import subprocess
import tarfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from legorl.errors import LegorlError
from legorl.grading.logparse import (
    END_MARKER,
    EXIT_CODE_MARKER,
    START_MARKER,
    TestStatuses,
    contradicts_exit_code,
    get_parser,
    split_log,
)
from legorl.grading.patches import filter_patch, pytest_section, shared_configs, touched_paths
from legorl.grading.report import evaluate, failed_report
from legorl.sandbox.base import ExecResult, Sandbox, SandboxSpec
from legorl.schemas import GradeRow, GradeStatus, Resolution, TaskRow

# SWE-bench's pytest command; a src/ layout is importable without installing the package.
DEFAULT_TEST_COMMAND = (
    'if [ -d src ]; then export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"; fi; '
    "python3 -m pytest --no-header -rA --tb=no -p no:cacheprovider {test_files}"
)
APPLY_FAILED = ">>>>> Patch Apply Failed"
APPLIED = ">>>>> Applied Patch"
TEST_PATCH_FAILED = ">>>>> Reset Failed"  # SWE-bench's marker: the hidden tests could not be put in place
TIMED_OUT = ">>>>> Tests Timed Out"
APPLY_METHODS = (
    ("git apply", "git apply -v {f}"),
    ("git apply --3way", "git apply -v --3way {f}"),
    ("git apply --reject", "git apply -v --reject {f}"),
    ("patch --fuzz=5", "patch --batch --forward --fuzz=5 -p1 -i {f}"),
)
WORK = "/tmp/.legorl-grade"
MAX_LOG_CHARS = 200_000
INFRA_SLACK_S = 300.0  # what the grading script may take beyond the test timeout before it is infra
# stdin holds two tars back to back (the testbed, then the script): -i reads past the first's end
_UNPACK = (f"rm -rf /testbed && mkdir -p /testbed && tar -x -i --no-same-owner -C / -f - "
           f"&& exec bash {WORK}-script.sh")
_UNPACK_FRESH = _UNPACK.replace(f"{WORK}-script.sh", f"{WORK}/script.sh")


class GradingInfraError(LegorlError):
    """Grading itself failed (not the patch): the grade is infra_error and is retried on rerun."""


@dataclass
class GradeOptions:
    test_timeout: float = 600.0
    default_image: str | None = None  # for tasks without an image (the base image of `legorl setup`)
    labels: dict[str, str] = field(default_factory=dict)
    memory: str = "4g"
    cpus: float | None = None
    run_empty: bool = False  # also run the tests for an empty patch (task validation)


def hidden_test_files(test_patch: str | None) -> list[str]:
    """The test files the default command runs: the Python files ``test_patch`` leaves in place."""
    from legorl.grading.patches import split_patch

    return [fp.new_path for fp in split_patch(test_patch or "") if fp.new_path and fp.new_path.endswith(".py")]


def command_for(task: TaskRow) -> str:
    files = hidden_test_files(task.test_patch)
    command = task.test_command or DEFAULT_TEST_COMMAND
    if "{test_files}" in command:
        if not files:
            raise GradingInfraError(f"task {task.instance_id}: test_patch touches no Python test file to run")
        command = command.replace("{test_files}", " ".join(shlex.quote(f) for f in files))
    return command


def _b64_file(path: str, text: str) -> str:
    data = base64.b64encode(text.encode()).decode()
    return f"base64 -d > {shlex.quote(path)} <<'LEGORL_EOF'\n{data}\nLEGORL_EOF\n"


def apply_script(patch: str, inline: bool = True) -> str:
    """Shell: apply ``patch`` to /testbed by the first method that works, else print the failure marker.

    ``inline=False``: the patch is not embedded; the caller has put it at ``WORK/patch.diff``.
    """
    lines = ["cd /testbed"]
    if inline:
        lines += [f"mkdir -p {WORK}", _b64_file(f"{WORK}/patch.diff", patch)]
    lines.append("applied=")
    for name, cmd in APPLY_METHODS:
        lines += [
            'if [ -z "$applied" ]; then',
            f"  echo '>>>>> legorl: trying {name}'",
            f"  if {cmd.format(f=f'{WORK}/patch.diff')} 2>&1; then applied={shlex.quote(name)}; "
            "else git reset -q --hard HEAD; git clean -fdq; fi",
            "fi",
        ]
    lines += [
        f'if [ -z "$applied" ]; then echo "{APPLY_FAILED}"; exit 3; fi',
        f'echo "{APPLIED} ($applied)"',
        # only the fallbacks leave reject files behind (a clean `git apply` writes none)
        'case "$applied" in "git apply"|"git apply --3way") ;; *) '
        f"find . -name '*.rej' -newer {WORK}/patch.diff -not -path './.git/*' -delete 2>/dev/null;; esac",
    ]
    return "\n".join(lines) + "\n"


def eval_script_for(task: TaskRow, hidden: list[str], command: str, timeout: float,
                    in_head: set[str] | None = None, inline: bool = True) -> str:
    """Shell: put the hidden tests in place (reset, then apply test_patch) and run the tests.

    ``in_head``: which of ``hidden`` the testbed's commit holds, when the caller knows (one
    ``git checkout`` for all of them instead of a check and a checkout per path);
    ``inline=False``: the caller has put test_patch at ``WORK/test.diff``.
    """
    lines = ["cd /testbed"]
    if in_head is None:
        lines.append(f"mkdir -p {WORK}")
        for path in hidden:
            q = shlex.quote(path)
            lines.append(f"if git cat-file -e HEAD:{q} 2>/dev/null; then git checkout -q HEAD -- {q}; "
                         f"else rm -rf -- {q}; fi")
    elif hidden:
        # rm first, so whatever the patch left at a path (a directory, a link) goes; then HEAD's version
        lines.append(f"rm -rf -- {' '.join(shlex.quote(p) for p in hidden)}")
        kept = [p for p in hidden if p in in_head]
        if kept:
            lines.append(f"git --literal-pathspecs checkout -q HEAD -- {' '.join(shlex.quote(p) for p in kept)}")
    if (task.test_patch or "").strip():
        if inline:
            lines.append(_b64_file(f"{WORK}/test.diff", task.test_patch or ""))
        lines.append(f'git apply -v {WORK}/test.diff 2>&1 || {{ echo "{TEST_PATCH_FAILED}"; exit 4; }}')
    lines += [
        f"rm -rf {WORK}",
        f"echo '{START_MARKER}'",
        f"timeout -k 5 {timeout:g} bash -c {shlex.quote(command)} 2>&1 </dev/null",
        "code=$?",
        f"echo '{END_MARKER}'",
        f'if [ "$code" = 124 ] || [ "$code" = 137 ]; then echo "{TIMED_OUT}"; fi',
        f'echo "{EXIT_CODE_MARKER}: $code"',
    ]
    return "\n".join(lines) + "\n"


def _trim(log: str) -> str:
    if len(log) <= MAX_LOG_CHARS:
        return log
    half = MAX_LOG_CHARS // 2
    return log[:half] + f"\n... [{len(log) - MAX_LOG_CHARS} characters cut] ...\n" + log[-half:]


class Grader:
    """Grades patches against tasks, one fresh sandbox per grade.

    ``create`` makes a sandbox from a spec (``PodmanBackend().create`` by default).
    """

    def __init__(self, options: GradeOptions | None = None, create: Callable[[SandboxSpec], Sandbox] | None = None):
        self.options = options or GradeOptions()
        if create is None:
            from legorl.sandbox.podman import PodmanBackend

            create = PodmanBackend().create
        self._create = create
        # A backend that can run a whole grade as one container command (PodmanBackend.run_once)
        # is used for it; any other ``create`` gets the create / exec / remove path.
        self._run_once: Callable[..., ExecResult] | None = getattr(getattr(create, "__self__", None), "run_once", None)
        self._tars: dict[tuple[str, str], bytes] = {}
        self._heads: dict[tuple[str, str], frozenset[str]] = {}
        self._tar_lock = threading.Lock()

    def image_for(self, task: TaskRow) -> str:
        if task.image:
            return task.image
        if self.options.default_image:
            return self.options.default_image
        from legorl.sandbox.host import base_image

        return base_image()

    def grade(self, task: TaskRow, patch: str | None, trial_id: str | None = None, **row: object) -> GradeRow:
        """Grade ``patch`` on ``task``; extra keyword arguments (``harness``, ``step``) go on the row."""
        start = time.monotonic()
        out = GradeRow(trial_id=trial_id or task.instance_id, task_id=task.instance_id,
                       status=GradeStatus.GRADED, **row)  # type: ignore[arg-type]
        try:
            self._grade(task, patch, out)
        except LegorlError as exc:  # SandboxError, TestbedError, GradingInfraError, missing image
            self._infra(out, str(exc))
        except (OSError, TimeoutError) as exc:
            self._infra(out, f"{type(exc).__name__}: {exc}")
        out.duration_s = round(time.monotonic() - start, 3)
        if out.log is not None:
            out.log = _trim(out.log)
        return out

    @staticmethod
    def _infra(out: GradeRow, error: str) -> None:
        out.status = GradeStatus.INFRA_ERROR
        out.infra_failure = True
        out.reward = None
        out.resolved = None
        out.resolution = None
        out.error = error.splitlines()[0] if error else "infrastructure error"

    @staticmethod
    def _zero(out: GradeRow, status: GradeStatus, error: str, task: TaskRow, test_status: str = "MISSING") -> None:
        report = failed_report(task.FAIL_TO_PASS, task.PASS_TO_PASS, test_status)
        out.status, out.error, out.tests = status, error, report.tests
        out.reward, out.resolved, out.resolution = 0.0, False, Resolution.NO

    def _grade(self, task: TaskRow, patch: str | None, out: GradeRow) -> None:
        hidden = touched_paths(task.test_patch)
        filtered = filter_patch(patch, hidden)
        out.dropped_paths = sorted(filtered.dropped)
        log: list[str] = [f"{'>>>>> legorl: dropped ' + p + ' (' + why + ')'}" for p, why in filtered.dropped.items()]
        if not (patch or "").strip() and not self.options.run_empty:
            self._zero(out, GradeStatus.EMPTY_PATCH, "empty patch: nothing to grade", task)
            return
        command = command_for(task)
        parse = get_parser(task.log_parser)
        spec = SandboxSpec(
            image=self.image_for(task), labels={"role": "grade", "trial": out.trial_id, **self.options.labels},
            network=False, memory=self.options.memory, cpus=self.options.cpus,
            deadline_s=self.options.test_timeout + 2 * INFRA_SLACK_S,
        )
        configs = shared_configs(filtered.kept)
        if not configs and task.repo_source and self._run_once is not None:
            # The fast path: one `podman run --rm -i` creates, runs and removes the container;
            # the testbed, the patches and the script arrive on its stdin.
            script = (apply_script(filtered.patch, inline=False) if filtered.patch.strip() else "") + eval_script_for(
                task, hidden, command, self.options.test_timeout, in_head=self._in_head(task, hidden), inline=False)
            files = {"patch.diff": filtered.patch, "test.diff": task.test_patch or "", "script.sh": script}
            fresh = self._run_fresh(task, spec, files, self.options.test_timeout + INFRA_SLACK_S)
            self._finish(out, task, filtered.patch, log, fresh, parse, alive=None)
            return
        script = apply_script(filtered.patch) if filtered.patch.strip() else "cd /testbed\n"
        box = self._create(spec)
        try:
            res: ExecResult | None
            if not configs and self._streams(box, task):
                # One exec does it all: the testbed and the script arrive as a tar on stdin.
                script += eval_script_for(task, hidden, command, self.options.test_timeout)
                res = self._run_streamed(box, task, script, self.options.test_timeout + INFRA_SLACK_S)
                configs = []
            else:
                self._prepare(box, task)
                res = None
            if configs:
                applied = self._run(box, script, INFRA_SLACK_S)
                log.append(applied.output)
                if APPLIED not in applied.output and filtered.patch.strip():
                    self._applied(out, applied.output, task, log)
                    return
                for path in self._changed_configs(box, configs):
                    out.dropped_paths = sorted({*out.dropped_paths, path})
                    log.append(f">>>>> legorl: restored {path} (pytest section changed)")
                script = ""
            if res is None:
                script += eval_script_for(task, hidden, command, self.options.test_timeout)
                res = self._run(box, script, self.options.test_timeout + INFRA_SLACK_S)
            self._finish(out, task, filtered.patch, log, res, parse, alive=box.alive)
        finally:
            box.remove()

    def _finish(self, out: GradeRow, task: TaskRow, patch: str, log: list[str], res: ExecResult,
                parse: Callable[[str], TestStatuses], alive: Callable[[], bool] | None) -> None:
        """Judge the grading script's output; ``alive`` asks whether its container still runs
        (None: the container was the script's own and is gone)."""
        log.append(res.output)
        text = "\n".join(log)
        out.log = text
        if patch.strip() and not self._applied(out, text, task, log):
            return
        if TEST_PATCH_FAILED in res.output:
            raise GradingInfraError(f"task {task.instance_id}: its test_patch does not apply to the testbed")
        if res.timed_out or END_MARKER not in res.output:
            if alive is None:
                if res.timed_out:
                    raise GradingInfraError(f"the grading script did not finish in {res.duration_s:.0f} s")
                raise GradingInfraError(f"the grading container died during the test run (exit {res.exit_code})")
            if not alive():
                raise GradingInfraError("the grading container died during the test run")
            raise GradingInfraError(f"the grading script did not finish (exit {res.exit_code})")
        self._judge(out, text, parse, task)

    @staticmethod
    def _streams(box: Sandbox, task: TaskRow) -> bool:
        """Whether the fast path applies: a repo_source to build from and an exec that takes stdin."""
        import inspect

        return bool(task.repo_source) and "stdin" in inspect.signature(box.exec).parameters

    def _testbed_tar(self, task: TaskRow) -> bytes:
        """``testbed/...`` as an uncompressed tar of the one-commit repository (cached per task)."""
        from legorl.sandbox.testbed import prepare_repo

        ref = task.repo_ref or task.base_commit or ""
        key = (task.repo_source or "", ref)
        with self._tar_lock:
            cached = self._tars.get(key)
        if cached is not None:
            return cached
        repo, _commit = prepare_repo(task.repo_source or "", ref)
        # the tar is kept next to the (immutable) testbed, so a new grading process reads it
        # instead of walking the tree again
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
        with self._tar_lock:
            self._tars[key] = data
            while len(self._tars) > 64:
                self._tars.pop(next(iter(self._tars)))
        return data

    def _in_head(self, task: TaskRow, paths: list[str]) -> set[str]:
        """Which of ``paths`` the task's testbed commit holds (from the host's copy, listed once per task)."""
        from legorl.sandbox.testbed import prepare_repo

        key = (task.repo_source or "", task.repo_ref or task.base_commit or "")
        with self._tar_lock:
            files = self._heads.get(key)
        if files is None:
            repo, _commit = prepare_repo(key[0], key[1])
            proc = subprocess.run(["git", "ls-tree", "-r", "-z", "--name-only", "HEAD"], cwd=repo, capture_output=True)
            if proc.returncode != 0:
                raise GradingInfraError(f"cannot list the testbed of {task.instance_id}: "
                                        f"{proc.stderr.decode(errors='replace').strip()[-200:]}")
            files = frozenset(p for p in proc.stdout.decode(errors="surrogateescape").split("\0") if p)
            with self._tar_lock:
                self._heads[key] = files
                while len(self._heads) > 64:
                    self._heads.pop(next(iter(self._heads)))
        return {p for p in paths if p in files}

    @staticmethod
    def _script_tar(script: str) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo(f"{WORK.lstrip('/')}-script.sh")
            info.size, info.mode = len(script.encode()), 0o700
            tar.addfile(info, io.BytesIO(script.encode()))
        return buf.getvalue()

    def _run_streamed(self, box: Sandbox, task: TaskRow, script: str, timeout: float) -> ExecResult:
        stdin = self._testbed_tar(task) + self._script_tar(script)
        res = box.exec(["sh", "-c", _UNPACK], timeout=timeout, stdin=stdin)  # type: ignore[call-arg]
        if res.exit_code in (125, 126, 127) and not box.alive():
            raise GradingInfraError(f"the grading container is gone (exit {res.exit_code})")
        return res

    def _run_fresh(self, task: TaskRow, spec: SandboxSpec, files: dict[str, str], timeout: float) -> ExecResult:
        """The whole grade in one fresh container: testbed + ``WORK/<name>`` files (``script.sh``
        among them) on stdin; the container is removed when it is done."""
        assert self._run_once is not None
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for name, text in files.items():
                data = text.encode()
                info = tarfile.TarInfo(f"{WORK.lstrip('/')}/{name}")
                info.size, info.mode, info.mtime = len(data), 0o600, int(time.time())
                tar.addfile(info, io.BytesIO(data))
        stdin = self._testbed_tar(task) + buf.getvalue()
        res = self._run_once(spec, ["sh", "-c", _UNPACK_FRESH], stdin=stdin, timeout=timeout)
        if res.exit_code == 125 and END_MARKER not in res.output:  # podman's own failure
            last = res.output.strip().splitlines()[-1:] or [""]
            raise GradingInfraError(f"podman could not run the grading container: {last[0][:300]}")
        return res

    def _prepare(self, box: Sandbox, task: TaskRow) -> None:
        from legorl.sandbox.testbed import install_testbed, strip_history

        if task.repo_source:
            ref = task.repo_ref or task.base_commit
            assert ref is not None  # the importer requires one of them
            install_testbed(box, task.repo_source, ref)
        else:
            strip_history(box)

    @staticmethod
    def _run(box: Sandbox, script: str, timeout: float) -> ExecResult:
        box.put_file(f"{WORK}-script.sh", script.encode(), 0o700)
        res = box.exec(f"bash {WORK}-script.sh", timeout=timeout)
        if res.exit_code in (125, 126, 127) and not box.alive():
            raise GradingInfraError(f"the grading container is gone (exit {res.exit_code})")
        return res

    def _applied(self, out: GradeRow, text: str, task: TaskRow, log: list[str]) -> bool:
        """Record how the patch went in; False (and a zero grade) when it did not."""
        for line in text.splitlines():
            if line.startswith(APPLIED + " ("):
                out.apply_method = line[len(APPLIED) + 2 : -1]
                return True
        out.log = "\n".join(log)
        if APPLY_FAILED in text:
            self._zero(out, GradeStatus.PATCH_APPLY_FAILED, "the patch did not apply by any method", task)
            return False
        raise GradingInfraError("the grading script stopped before the patch was applied")

    def _changed_configs(self, box: Sandbox, paths: list[str]) -> list[str]:
        """Restore the shared config files whose pytest section differs from the original."""
        changed = []
        for path in dict.fromkeys(paths):
            q = shlex.quote(path)
            res = box.exec(f"cd /testbed && git show HEAD:{q} 2>/dev/null | base64 -w0; echo; "
                           f"test -f {q} && base64 -w0 {q}; echo", timeout=60)
            parts = [*res.output.split("\n"), "", ""][:2]
            old, new = (base64.b64decode(p).decode(errors="replace") if p.strip() else None for p in parts)
            name = PurePosixPath(path).name
            if pytest_section(name, old) != pytest_section(name, new):
                restore = (f"git checkout -q HEAD -- {q}" if old is not None else f"rm -f -- {q}")
                res = box.exec(f"cd /testbed && {restore}", timeout=60)
                if res.exit_code != 0:
                    raise GradingInfraError(f"cannot restore {path}: {res.output.strip()[-200:]}")
                changed.append(path)
        return changed

    def _judge(self, out: GradeRow, text: str, parse: Callable[[str], TestStatuses], task: TaskRow) -> None:
        parts = split_log(text)
        statuses = parse(parts.output)
        runner_missing = parts.exit_code in (126, 127) or (
            "No module named pytest" in parts.output and "test session starts" not in parts.output)
        if not statuses and runner_missing:
            raise GradingInfraError(f"the test command could not start in {self.image_for(task)} "
                                    f"(exit {parts.exit_code}): {parts.output.strip()[-200:]}")
        usage_error = parts.exit_code == 4 and "usage:" in parts.output and "error:" in parts.output
        if not statuses and usage_error and (task.log_parser or "pytest") == "pytest":
            # pytest's usage error: the command or the repository's own config asks for something
            # the image lacks (a plugin's option, say). The patch cannot cause it (config edits
            # are dropped), so it is the task's environment that is broken.
            last = parts.output.strip().splitlines()[-1:] or [""]
            raise GradingInfraError(f"pytest usage error (exit 4) for task {task.instance_id}: {last[0][:200]}; "
                                    "set the task's test_command")
        report = evaluate(statuses, task.FAIL_TO_PASS, task.PASS_TO_PASS)
        out.tests = report.tests
        if TIMED_OUT in text:
            self._zero(out, GradeStatus.TEST_TIMEOUT, f"the tests ran past {self.options.test_timeout:g} s", task)
            out.tests = report.tests
            return
        if contradicts_exit_code(statuses, parts.exit_code):
            out.reward, out.resolved, out.resolution = 0.0, False, Resolution.NO
            out.error = f"test command exited {parts.exit_code} but its log reports no failing test"
            return
        out.reward, out.resolved, out.resolution = report.reward, report.resolved, report.resolution
