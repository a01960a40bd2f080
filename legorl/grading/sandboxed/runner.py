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

An audit hook (:class:`Guard`) installed before the repository is importable records what the
patch's own lines do to the interpreter while the tests run (trace functions, ``gc`` walks,
``ctypes``, ``exec``/``compile`` called directly, attributes set on the runner's or ``unittest``'s
classes), and ``builtins`` is compared by identity; any finding also goes in the report.

Usage: ``python3 -I runner.py REPORT_FD CHANGES_JSON [pytest args...] < nonce`` (CHANGES_JSON:
the judge's ``added`` map, path -> added line numbers or null for a whole file). Python 3.8+.
"""

from __future__ import annotations

import json
import os
import sys
import types
from typing import Any

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


# __main__ is this runner: the code under test reaches it with ``import __main__`` (a red team replaced
# Recorder._check and forged every status on tasks without canaries)
RUNNER_PACKAGES = ("_pytest", "pytest", "pluggy", "unittest", "__main__")
_MISSING = object()
# Audit events (PEP 578) the patch's own code has no business raising while its tests run. "exec" and
# "compile" count only when the patch's line calls them directly (the standard library execs on behalf
# of pristine code, e.g. dataclasses); the others when the nearest frame in the tree is the patch's.
CALL_EVENTS = frozenset({"exec", "compile", "marshal.loads", "code.__new__"})
STACK_EVENTS = frozenset({"sys.settrace", "sys.setprofile", "gc.get_objects", "gc.get_referrers", "gc.get_referents",
                          "sys._current_frames", "sys.addaudithook"})
SETATTR_EVENTS = frozenset({"object.__setattr__", "object.__delattr__"})
# Set by the patch's own line (the standard library sets them too: asyncio's import sets __code__), an
# object's __class__ by the patch's code however reached; a module's class only on the runner's modules (``sys.modules[__name__].__class__ = ...`` is a common
# deprecation pattern). __module__/__qualname__/__name__ are nobody's business: every check judges code by
# its file, and honest factories and decorators set them.
SPOOF_ATTRS = frozenset({"__code__", "__globals__", "__class__", "__defaults__", "__kwdefaults__"})
FRAME_ATTRS = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back", "f_locals", "f_globals"})
# a generator's, coroutine's or async generator's frame attribute -> (its "running" flag, its code)
SUSPENDABLE = {"gi_frame": ("gi_running", "gi_code"), "cr_frame": ("cr_running", "cr_code"),
               "ag_frame": ("ag_running", "ag_code")}
# stdlib helpers that hand frames to their caller; any other stdlib reader (asyncio's repr of a task, the
# warnings module) keeps them to itself, so only the patch's own line reading a frame counts there
FRAME_WALKERS = ("traceback.py", "inspect.py", "asyncio/base_tasks.py")
# What honest code calls to log or print an exception or a stack, or to ask a generator's state: the
# helper reads the frames, the caller gets text back (a red team's honest fix with ``log.exception`` scored
# 0 on a frame read; another's with ``inspect.getgeneratorstate``)
TEXT_FROM_FRAMES = frozenset({"format_exc", "print_exc", "format_exception", "print_exception", "format_tb",
                              "print_tb", "extract_tb", "format_stack", "print_stack", "extract_stack", "print_last",
                              "from_exception", "__init__"})  # TracebackException keeps summaries, no frames
STATE_FROM_FRAMES = frozenset({"getgeneratorstate", "getcoroutinestate", "getasyncgenstate"})
# ctypes loading a library (``import ctypes`` does, so does ``ctypes.util.find_library``) reads no memory
CTYPES_HARMLESS = frozenset({"ctypes.dlopen", "ctypes.dlsym"})
LOGGING_CALLS = frozenset({"exception", "error", "warning", "warn", "info", "debug", "critical", "fatal", "log",
                           "format", "formatException", "formatStack"})
WATCHED = (*RUNNER_PACKAGES, "builtins")


class Guard:
    """An audit hook, installed before the repository is importable (it cannot be removed), that
    records what the patch's own code does to the interpreter; plus a check of ``builtins``.

    The patch's code is what the judge says the patch added: lines it added to a file, and every line
    of a file it created (or code loaded from anything in the tree that is not a file, e.g. a zip).
    """

    def __init__(self, tree: str, added: dict[str, list[int] | None]) -> None:
        self.tree = tree.rstrip(os.sep) + os.sep
        self.added = {os.path.join(tree, rel): None if lines is None else frozenset(lines)
                      for rel, lines in added.items()}
        self.findings: list[str] = []
        self._getframe, self._isfile = sys._getframe, os.path.isfile
        import threading

        self._thread_id = threading.get_ident
        self._inside: set[int] = set()
        import inspect
        import logging
        import traceback

        # the modules' own files, taken before any code of the tree ran (a traceback.py it writes to
        # /tmp and imports is not this file)
        self._traceback, self._logging, self._inspect = traceback.__file__, logging.__file__, inspect.__file__
        # multiprocessing.Value/Array make their shared memory with ctypes, on memory they allocate
        self._sharedctypes = os.path.join(os.path.dirname(os.__file__), "multiprocessing", "sharedctypes.py")
        import builtins

        self._builtins = builtins
        self._builtins_before = dict(vars(builtins))

    def patch_code(self, frame: types.FrameType, whole_file: bool = False) -> bool:
        path = frame.f_code.co_filename
        if not path.startswith(self.tree):
            return False
        lines = self.added.get(path, _MISSING)
        if lines is _MISSING:
            return not self._isfile(path)
        return whole_file or lines is None or frame.f_lineno in lines  # type: ignore[operator]

    def _nearest_tree_frame(self, frame: types.FrameType | None) -> types.FrameType | None:
        while frame is not None and not frame.f_code.co_filename.startswith(self.tree):
            frame = frame.f_back
        return frame

    def __call__(self, event: str, args: tuple[object, ...]) -> None:
        # The hook's own frame reads raise events too (sys._getframe, f_code): without this each event
        # recursed until RecursionError, ~40% of a small task's test time
        me = self._thread_id()
        if me in self._inside:
            return
        self._inside.add(me)
        try:
            if event in CALL_EVENTS:
                self._direct(event, self._getframe(1))
            elif event == "sys._getframe":  # direct, or through traceback/inspect (logging's own use is not)
                caller = self._getframe(1)
                if caller is not None and caller.f_code.co_filename.endswith(FRAME_WALKERS):
                    if not self._only_text(caller):
                        self._stack(event, caller)
                else:
                    self._direct(event, caller)
            elif event == "object.__getattr__":
                if len(args) > 1 and args[1] in FRAME_ATTRS and not self._own_suspended(args[0], args[1]):
                    reader = self._getframe(1)
                    if reader is not None and reader.f_code.co_filename.endswith(FRAME_WALKERS):
                        if not self._only_text(reader):
                            self._stack(f"{event} {args[1]}", reader)
                    else:
                        self._direct(f"{event} {args[1]}", reader)
            elif event in SETATTR_EVENTS:
                target, name = args[0], str(args[1]) if len(args) > 1 else ""
                if name == "__class__" and not isinstance(target, types.ModuleType):
                    self._stack(f"{event} {name}", self._getframe(1))  # mock.patch.object would set it for the patch
                elif name in SPOOF_ATTRS and not (isinstance(target, types.ModuleType)
                                                  and str(target.__name__).split(".")[0] not in WATCHED):
                    self._direct(f"{event} {name}", self._getframe(1))
                elif isinstance(target, type) and str(getattr(target, "__module__", "")).split(".")[0] in WATCHED:
                    self._stack(f"{event} {getattr(target, '__name__', '')}.{name}", self._getframe(1))
            elif event in STACK_EVENTS or (event.startswith("ctypes.") and event not in CTYPES_HARMLESS):
                caller = self._getframe(1)
                if caller is None or caller.f_code.co_filename != self._sharedctypes:
                    self._stack(event, caller)
        except Exception:  # an audit hook must never raise into the code it watches
            pass
        finally:
            self._inside.discard(me)

    def _own_suspended(self, obj: object, attr: object) -> bool:
        """The frame of a generator (or coroutine) of the tree's own code that is not running: it has no
        caller (``f_back`` is None), so it reaches nothing of the runner (``gen.gi_frame is None``, an honest
        test of whether a generator finished, scored 0 on a task without canaries)."""
        running, code = SUSPENDABLE.get(str(attr), ("", ""))
        if not running or getattr(obj, running, True):
            return False
        path = getattr(getattr(obj, code, None), "co_filename", "")
        return isinstance(path, str) and path.startswith(self.tree)

    def _only_text(self, reader: types.FrameType | None) -> bool:
        """The frame is read by the standard ``traceback`` module for a call from the tree that gets
        text back: ``traceback.format_exc()`` and its kin, or a ``logging`` call formatting an exception."""
        if reader is None or reader.f_code.co_filename not in (self._traceback, self._inspect):
            return False
        entry = reader
        while entry.f_back is not None and not entry.f_back.f_code.co_filename.startswith(self.tree):
            entry = entry.f_back
        if entry.f_back is None:
            return False
        code = entry.f_code
        return ((code.co_filename == self._traceback and code.co_name in TEXT_FROM_FRAMES)
                or (code.co_filename == self._inspect and code.co_name in STATE_FROM_FRAMES)
                or (code.co_filename == self._logging and code.co_name in LOGGING_CALLS))

    def _direct(self, what: str, frame: types.FrameType | None) -> None:
        if frame is not None and self.patch_code(frame):
            self._found(what, frame)

    def _stack(self, what: str, frame: types.FrameType | None) -> None:
        """The nearest frame in the tree decides; a worker thread with none (driven by C code the patch
        set going) is the patch's too: pytest runs the tests on the main thread."""
        import threading

        near = self._nearest_tree_frame(frame)
        if near is not None:
            if self.patch_code(near):
                self._found(what, near)
        elif threading.current_thread() is not threading.main_thread() and len(self.findings) < 20:
            self.findings.append(f"{what} in a worker thread with no frame of the tree")

    def _found(self, what: str, frame: types.FrameType) -> None:
        if len(self.findings) < 20:
            self.findings.append(f"{what} at {frame.f_code.co_filename[len(self.tree):]}:{frame.f_lineno}")

    def check(self) -> list[str]:
        """Findings so far, plus builtins replaced and trace functions set by the patch's code."""
        out = list(self.findings)
        now = vars(self._builtins)
        out += [f"builtins.{name} replaced" for name, value in self._builtins_before.items()
                if now.get(name, _MISSING) is not value]
        for getter in (sys.gettrace, sys.getprofile):
            code = getattr(getter(), "__code__", None)
            if code is not None and code.co_filename.startswith(self.tree) and (
                    self.added.get(code.co_filename, _MISSING) is not _MISSING or not self._isfile(code.co_filename)):
                out.append(f"{getter.__name__.replace('get', 'set')} by {code.co_filename[len(self.tree):]}")
        return out


def runner_objects() -> dict[tuple[str, ...], object]:
    """Every function and class of the runner's modules, and the methods of those classes.

    Taken before the repository is importable and compared (by identity) after collection and at
    the end of the session: code under test that swaps any of them has rewired the runner.
    """
    out: dict[tuple[str, ...], object] = {}
    for name, mod in list(sys.modules.items()):
        if mod is None or name.split(".")[0] not in RUNNER_PACKAGES:
            continue
        for attr, value in list(vars(mod).items()):
            if isinstance(value, type) and getattr(value, "__module__", "").split(".")[0] in RUNNER_PACKAGES:
                out[(name, attr)] = value
                for key, member in list(vars(value).items()):
                    if callable(member) or isinstance(member, (staticmethod, classmethod, property)):
                        out[(name, attr, key)] = member
            elif callable(value):
                out[(name, attr)] = value
    return out


def runner_dirs() -> tuple[str, ...]:
    """Where the runner's packages live on disk."""
    out = []
    for name in RUNNER_PACKAGES:
        mod = sys.modules.get(name)
        path = getattr(mod, "__file__", None)
        if path:
            out.append(os.path.dirname(path) if os.path.basename(path) == "__init__.py" else path)
    return tuple(out)


def _runner_code(value: object, dirs: tuple[str, ...]) -> bool:
    """Whether ``value`` is a function whose code lives in the runner's own packages (pytest's plugins
    patch pytest too). Decided by the code's file, never by a ``__module__`` anyone can set."""
    for attr in ("fget", "__func__"):  # property, staticmethod, classmethod
        value = getattr(value, attr, None) or value
    code = getattr(value, "__code__", None)
    return isinstance(getattr(code, "co_filename", None), str) and code.co_filename.startswith(dirs)  # type: ignore[union-attr]


def changed_objects(before: dict[tuple[str, ...], object], dirs: tuple[str, ...]) -> list[str]:
    """The runner objects that were replaced by (or removed for) something not of the runner's own, and
    members added to the runner's classes that are not the runner's own (a new property can shadow an
    inherited one)."""
    out = []
    classes = {k[:2] for k in before if len(k) == 3}  # the runner's own classes, whose members were taken
    for key, value in before.items():
        holder: object = sys.modules.get(key[0], _MISSING)
        for part in key[1:]:
            holder = vars(holder).get(part, _MISSING) if holder is not _MISSING else _MISSING
        if holder is not value and (holder is _MISSING or not _runner_code(holder, dirs)):
            out.append(".".join(key))
        if len(key) == 2 and isinstance(value, type) and holder is value and key in classes:
            for member, new in list(vars(value).items()):
                if (key[0], key[1], member) not in before and (callable(new) or isinstance(
                        new, (staticmethod, classmethod, property))) and not _runner_code(new, dirs):
                    out.append(".".join((*key, member)))
    return out


# The hooks a test's report passes through: a hook implementation from the tree here can rewrite it
REPORT_HOOKS = ("pytest_runtest_protocol", "pytest_runtest_setup", "pytest_runtest_call", "pytest_runtest_teardown",
                "pytest_runtest_makereport", "pytest_runtest_logreport", "pytest_report_teststatus")


def _code_file(function: object) -> str:
    """The file of the code a hook implementation runs (a callable object's ``__call__``), never its
    ``__module__``, which a class body sets to anything (a red team's plugin said it was ``json``)."""
    code = getattr(function, "__code__", None)
    if code is None and callable(function):
        code = getattr(type(function).__call__, "__code__", None)
    filename = getattr(code, "co_filename", "")
    return filename if isinstance(filename, str) else ""


def foreign_plugins(config: object, tree: str, hooks: tuple[str, ...] | None = None) -> list[str]:
    """Hook implementations whose code lives in the tree, other than its conftest files (which the judge
    keeps pristine): registered plugins and implementations added to a hook by any other means. ``hooks``:
    only these hooks' implementations (all of them by default)."""
    out: list[str] = []
    relay = getattr(getattr(config, "pluginmanager", None), "hook", None)
    if hooks is None:
        hooks = tuple(n for n in list(vars(relay)) if n.startswith("pytest_")) if relay is not None else ()
    for name in hooks:
        impls: Any = getattr(getattr(relay, name, None), "get_hookimpls", list)
        for impl in list(impls()):
            path = _code_file(getattr(impl, "function", None))
            if path.startswith(tree + os.sep) and os.path.basename(path) != "conftest.py" and len(out) < 20:
                out.append(f"hook {name} from {path[len(tree) + 1:]}")
    return out


class Recorder:
    def __init__(self, nonce: str, report: ReportChannel, pristine: dict[tuple[str, ...], object],
                 guard: Guard) -> None:
        self.nonce, self.report, self.pristine, self.guard = nonce, report, pristine, guard
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
                     + _foreign(getattr(session, "config", None), os.getcwd()) + self.guard.check())
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
        tree = os.getcwd() + os.sep
        frames: list[list[object]] = []
        for entry in getattr(getattr(call, "excinfo", None), "traceback", None) or []:
            path = str(getattr(entry, "path", ""))
            if path.startswith(tree) and len(frames) < 50:
                frames.append([path[len(tree):], int(getattr(entry, "lineno", -1)) + 1])
        self.where[str(getattr(report, "nodeid", ""))] = frames

    def pytest_runtest_logreport(self, report: object, _foreign: Any = foreign_plugins) -> None:
        if not self.tampered:  # a hook added and removed again while the tests run is seen here
            self.tampered = (self.guard.check() + _foreign(self.config, os.getcwd(), REPORT_HOOKS))[:20]
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


def watch_should_stop(guard: Guard) -> None:
    """unittest swallows its ``_ShouldStop`` and reports the test a success (it is meant for failfast
    sub-tests): code that raises it passes any unittest-style test. unittest's name for it becomes a
    subclass whose making is a finding where the nearest frame in the tree is the patch's (rebinding
    the name back is one too: it is a runner object). A tripwire: made without its ``__init__`` it
    still passes (docs/threat-model.md)."""
    import unittest.case

    getframe = sys._getframe

    class ShouldStop(unittest.case._ShouldStop):  # type: ignore[name-defined]
        def __init__(self, *args: object) -> None:
            guard._stack("unittest.case._ShouldStop made", getframe(1))
            super().__init__(*args)

    unittest.case._ShouldStop = ShouldStop  # type: ignore[attr-defined]


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
