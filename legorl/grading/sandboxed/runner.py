"""Run pytest so that the repository under test cannot change how it runs or what it reports.

Runs inside the grading container as the unprivileged test user, with ``python3 -I`` (no
``PYTHONPATH``, no user site, the script's and the working folder not on ``sys.path``), from a
read-only folder outside the tree. In order:

1. it reads the per-grade report nonce from stdin (never in argv or the environment);
2. it imports pytest (and with it pytest's dependencies) and loads the plugins the *image* installs
   (``pytest11`` entry points) — all before the repository is importable, so no module in the tree
   can stand in for any of them;
3. it turns plugin autoload off (a ``*.dist-info`` in the tree cannot add one), then puts the
   working folder and ``PYTHONPATH``'s folders at the front of ``sys.path`` as ``python -m pytest``
   would;
4. it runs ``pytest.main`` with a recorder plugin that takes each test's status from pytest's own
   reports and writes them, with the nonce and pytest's exit status, through the report descriptor
   (:class:`ReportChannel`) when the session ends — and with the runner's functions and classes that the code under test swapped
   (compared by identity with a snapshot taken before the repository was importable). The grading script, not this process, then reads the file and checks the exit
   status it saw against the one reported.

The tripwires (:mod:`.guard`: an audit hook, the identity snapshot, hook implementations from the
tree) are installed before the repository is importable; what they find also goes in the report.

Usage (:func:`legorl.grading.script.launch`): ``runner REPORT_FD CHANGES_JSON [pytest args...] < nonce`` (CHANGES_JSON:
the judge's ``added`` map, path -> added line numbers or null for a whole file). Python 3.8+.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from .guard import (
    REPORT_HOOKS,
    Guard,
    RunnerSnapshot,
    changed_objects,
    foreign_plugins,
    runner_dirs,
    runner_objects,
    watch_should_stop,
)

SEVERITY = {"PASSED": 0, "XPASS": 1, "XFAIL": 1, "SKIPPED": 2, "FAILED": 3, "ERROR": 4}


def _preload() -> list[object]:
    """Import pytest and load the image's pytest plugins, before the tree is importable.

    pytest's own submodules are found through the ``_pytest`` package's path, never ``sys.path``, so
    importing the package is enough; a top-level module pytest imports late could only be shadowed
    by a module the tree already had (the judge removes new ones, and the tree is read-only).
    """
    import contextlib
    from importlib import metadata

    import pytest  # noqa: F401

    eps: Any = metadata.entry_points()
    group = eps.select(group="pytest11") if hasattr(eps, "select") else eps.get("pytest11", [])
    plugins: list[object] = []
    for ep in group:  # a broken plugin in the image is the image's business
        with contextlib.suppress(Exception):
            plugins.append(ep.load())
    return plugins


def status_of(report: object) -> str | None:
    """pytest's ``-rA`` word for one phase report (None: a passing setup/teardown says nothing)."""
    when = getattr(report, "when", "call")
    xfail = hasattr(report, "wasxfail")
    if getattr(report, "failed", False):
        return "FAILED" if when == "call" else "ERROR"
    if getattr(report, "skipped", False):
        return "XFAIL" if xfail else "SKIPPED"
    if when == "call":
        return "XPASS" if xfail else "PASSED"
    return None

class Recorder:
    def __init__(self, nonce: str, report: ReportChannel, pristine: RunnerSnapshot,
                 guard: Guard) -> None:
        self.nonce, self.report, self.pristine, self.guard = nonce, report, pristine, guard
        self.tree = os.getcwd()  # the tests may chdir into a folder and remove it: os.getcwd() then raises
        self.dirs = runner_dirs()
        self.statuses: dict[str, str] = {}
        self.collect_errors = 0
        self.collected = 0
        self.tampered: list[str] = []
        self.where: dict[str, list[list[object]]] = {}
        self.config: object = None

    # The hooks call the checks through default arguments, bound when this class was made: the class and the
    # module are the tree's to rewrite (``import __main__``), and a replaced ``_check`` would check nothing.
    # Replacing a default is an audited ``__defaults__`` write; replacing a method is in the identity snapshot.
    def _check(self, session: object, _changed: Any = changed_objects, _foreign: Any = foreign_plugins) -> None:
        if not self.tampered:
            found = (_changed(self.pristine, self.dirs)
                     + _foreign(getattr(session, "config", None), self.tree) + self.guard.check())
            if type(self.statuses) is not dict:
                found.append("the recorder's statuses were replaced")
            self.tampered = found[:20]

    def pytest_configure(self, config: object) -> None:
        self.config = config

    def pytest_collection_finish(self, session: object, _check: Any = _check) -> None:
        _check(self, session)  # the package under test has been imported by now

    def pytest_collectreport(self, report: object) -> None:
        if getattr(report, "failed", False):
            self.collect_errors += 1

    def pytest_collection_modifyitems(self, items: list[object]) -> None:
        self.collected = len(items)

    def pytest_exception_interact(self, node: object, call: object, report: object) -> None:
        """Where in the tree a test failed (its traceback's frames in the tree): the grader keeps a canary
        only where the buggy code fails it exactly where it fails the real test (checked on the gold and
        empty patches' runs, never on a candidate's, whose code shares this process)."""
        tree = self.tree + os.sep
        frames: list[list[object]] = []
        for entry in getattr(getattr(call, "excinfo", None), "traceback", None) or []:
            path = str(getattr(entry, "path", ""))
            if path.startswith(tree) and len(frames) < 50:
                frames.append([path[len(tree):], int(getattr(entry, "lineno", -1)) + 1])
        self.where[str(getattr(report, "nodeid", ""))] = frames

    def pytest_runtest_logreport(self, report: object, _foreign: Any = foreign_plugins) -> None:
        if not self.tampered:  # a hook added and removed again while the tests run is seen here
            # builtins only after a test's teardown, once its fixtures (monkeypatch) have been undone
            builtins = getattr(report, "when", "") == "teardown"
            self.tampered = (self.guard.check(builtins) + _foreign(self.config, self.tree, REPORT_HOOKS))[:20]
        status = status_of(report)
        if status is None:
            return
        nodeid = str(getattr(report, "nodeid", ""))
        old = self.statuses.get(nodeid)
        if old is None or SEVERITY[status] >= SEVERITY[old]:
            self.statuses[nodeid] = status

    def pytest_sessionfinish(self, session: object, exitstatus: object, _check: Any = _check) -> None:
        _check(self, session)
        data = {"nonce": self.nonce, "exitstatus": int(exitstatus),  # type: ignore[call-overload]
                "collected": self.collected, "collect_errors": self.collect_errors, "statuses": self.statuses,
                "tampered": self.tampered, "where": self.where}
        self.report.send(data)


def _encode(value: object) -> str:
    """JSON of the report's plain data, without the ``json`` module the code under test shares."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, int):
        return int.__repr__(int(value))
    if isinstance(value, str):
        return '"' + "".join(c if c.isprintable() and c not in '"\\' and ord(c) < 0x7f else f"\\u{ord(c):04x}"
                             if ord(c) < 0x10000 else c for c in str.__str__(value)) + '"'
    if isinstance(value, dict):
        return "{" + ",".join(_encode(str(k)) + ":" + _encode(v) for k, v in dict.items(value)) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_encode(v) for v in value) + "]"
    return _encode(str(value))


class ReportChannel:
    """The descriptor root opened for the report (append-only, on a file in a root-only folder).

    The test process can write to it but never read it back, never reach the file by name, and
    (``O_APPEND``) only ever add to it: root accepts exactly one JSON document, so anything written
    besides the recorder's makes the report invalid. The recorder writes once and closes it; a copy
    of the descriptor the code under test made beforehand is reported as tampering. The os functions
    used are bound before the repository is importable.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._write, self._close, self._fstat, self._listdir = os.write, os.close, os.fstat, os.listdir
        st = self._fstat(fd)  # fails now, before any test, when root passed no descriptor
        self._key = (st.st_dev, st.st_ino)

    def copies(self) -> list[int]:
        out = []
        for name in self._listdir("/proc/self/fd"):
            other = int(name)
            if other == self.fd:
                continue
            try:
                st = self._fstat(other)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == self._key:
                out.append(other)
        return out

    def send(self, data: dict[str, object]) -> None:
        copies = self.copies()
        if copies:
            data["tampered"] = [*list(data.get("tampered") or []), f"report descriptor copied to fd {copies}"]  # type: ignore[call-overload]
        payload = _encode(data).encode("utf-8", "backslashreplace")
        while payload:
            payload = payload[self._write(self.fd, payload):]
        self._close(self.fd)

def main() -> None:
    report_fd, changes_path, args = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    report = ReportChannel(report_fd)
    with open(changes_path) as f:
        added = json.load(f)
    nonce = sys.stdin.readline().strip()
    sys.stdin.close()
    sys.stdin = open(os.devnull)  # noqa: SIM115 - the test run's stdin, as `</dev/null` gives it
    plugins = _preload()
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    os.environ.pop("PYTEST_PLUGINS", None)
    os.environ.pop("PYTEST_ADDOPTS", None)
    guard = Guard(os.getcwd(), added)
    sys.addaudithook(guard)
    watch_should_stop(guard)
    recorder = Recorder(nonce, report, runner_objects(), guard)
    extra = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[0:0] = [os.getcwd(), *extra]
    import pytest

    code = pytest.main(args, plugins=[recorder, *plugins])
    sys.stdout.flush()
    sys.exit(int(code))


if __name__ == "__main__":
    main()
