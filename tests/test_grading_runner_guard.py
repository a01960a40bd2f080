"""The runner's audit hook, alone in a child interpreter (no container): what the patch's own code
does to frames is a finding, and the honest reads that reach nothing of the runner are not.

The hook cannot be removed once installed, so each case runs in a fresh ``python3``; the grading
container runs the same file (``legorl/grading/sandboxed/guard.py``, imported by the runner).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from legorl.grading.sandboxed import guard
from legorl.grading.script import launch

DRIVER = """
import json, sys
sys.path.insert(0, {package_parent!r})
from sandboxed.guard import Guard
guard = Guard({tree!r}, {{"mod.py": None}})
sys.addaudithook(guard)
sys.path.insert(0, {tree!r})
import mod
print(json.dumps(guard.check()))
"""


def findings(tmp_path: Path, code: str) -> list[str]:
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "mod.py").write_text(textwrap.dedent(code))
    driver = DRIVER.format(package_parent=str(Path(guard.__file__).parent.parent), tree=str(tree))
    out = subprocess.run([sys.executable, "-I", "-c", driver], capture_output=True, text=True, timeout=60, check=True)
    return list(json.loads(out.stdout.strip().splitlines()[-1]))


HONEST = {
    "a suspended generator's frame": """
        def numbers():
            yield 1
        gen = numbers()
        next(gen)
        suspended = gen.gi_frame is not None
        """,
    "a finished generator's frame": """
        def numbers():
            yield 1
        gen = numbers()
        list(gen)
        finished = gen.gi_frame is None
        """,
    "an unstarted coroutine's frame": """
        async def ready():
            return True
        coro = ready()
        unstarted = coro.cr_frame is not None
        coro.close()
        """,
    "a suspended async generator's frame": """
        async def ticks():
            yield 1
        agen = ticks()
        waiting = agen.ag_frame is not None
        """,
}


# Ordinary code a second red team (reading the code) found the tripwires took for rewiring
HONEST.update({
    "a traceback's frames cleared": """
        import traceback
        try:
            raise ValueError("x")
        except ValueError as exc:
            traceback.clear_frames(exc.__traceback__)
        """,
    "a stack summary of a traceback": """
        import traceback
        try:
            raise ValueError("x")
        except ValueError as exc:
            summary = traceback.StackSummary.extract(traceback.walk_tb(exc.__traceback__))
        """,
    "asyncio logging a task's unretrieved exception": """
        import asyncio
        import gc

        async def fail():
            raise ValueError("x")

        async def main():
            asyncio.ensure_future(fail())
            await asyncio.sleep(0)

        asyncio.run(main())
        gc.collect()
        """,
    "a zip file read as a path": """
        import io
        import zipfile
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as zf:
            zf.writestr("a/b.txt", "x")
        names = [p.name for p in zipfile.Path(zipfile.ZipFile(buf)).iterdir()]
        """,
    "a dataclass of a script a test runs as __main__": """
        import dataclasses

        class Args:  # as runpy.run_module(..., run_name="__main__") makes it
            name: str = "x"

        Args.__module__ = "__main__"
        Args = dataclasses.dataclass(Args)  # no docstring: dataclasses sets __doc__
        """,
    "an object changing its class (a state pattern)": """
        class Closed:
            def open(self):
                self.__class__ = Open

        class Open(Closed):
            pass

        door = Closed()
        door.open()
        """,
    "a namedtuple's defaults set the old way": """
        import collections
        Point = collections.namedtuple("Point", "x y")
        Point.__new__.__defaults__ = (None, None)
        """,
})

# ... and what the same rules must still see
FOUND = {
    "a traceback's frame taken by hand": """
        import traceback
        try:
            raise ValueError("x")
        except ValueError as exc:
            frame, line = next(traceback.walk_tb(exc.__traceback__))
        """,
    "a test case given a class of the patch's": """
        import unittest

        class Passing(unittest.TestCase):
            def runTest(self):
                pass

        case = unittest.TestCase()
        case.__class__ = Passing
        """,
    "a standard-library function's defaults replaced": """
        import textwrap
        textwrap.indent.__defaults__ = (lambda line: True,)
        """,
}


@pytest.mark.parametrize("case", sorted(FOUND))
def test_a_frame_or_a_default_of_someone_else_is_a_finding(tmp_path: Path, case: str) -> None:
    assert findings(tmp_path, FOUND[case])


@pytest.mark.parametrize("case", sorted(HONEST))
def test_a_frame_without_a_caller_is_no_finding(tmp_path: Path, case: str) -> None:
    assert findings(tmp_path, HONEST[case]) == []


def test_a_running_generator_reading_its_own_frame_is_a_finding(tmp_path: Path) -> None:
    # running, the generator's frame has the runner's frames behind it (f_back, which no event audits)
    found = findings(tmp_path, """
        def walker():
            frame = walking.gi_frame
            yield frame.f_back is not None
        walking = walker()
        reached = next(walking)
        """)
    assert found == ["object.__getattr__ gi_frame at mod.py:3"]


def test_a_suspended_generator_of_code_outside_the_tree_is_a_finding(tmp_path: Path) -> None:
    # not the tree's own code: its frame's locals are another module's (a runner's hook wrapper, say)
    found = findings(tmp_path, """
        import os
        walk = os.walk(os.path.dirname(__file__))
        next(walk)
        frame = walk.gi_frame
        """)
    assert found == ["object.__getattr__ gi_frame at mod.py:5"]


SNAPSHOT_DRIVER = """
import importlib.util, json, sys, types
sys.path.insert(0, {package_parent!r})
import unittest.util
from sandboxed import guard
before, dirs = guard.runner_objects(), guard.runner_dirs()
{change}
print(json.dumps(guard.changed_objects(before, dirs)))
"""

# What code under test does to the runner's modules -> what the identity snapshot must report
SNAPSHOT_CASES = {
    # a stand-in in sys.modules, then the real module rewired: the snapshot's lookups went by name
    "a stand-in hides the real module": ("""
        real = sys.modules["unittest.util"]
        stand_in = types.ModuleType("unittest.util")
        stand_in.__dict__.update(vars(real))
        sys.modules["unittest.util"] = stand_in
        real.safe_repr = lambda obj, short=False: "forged"
        """, ["unittest.util.safe_repr"]),
    # the runner's own code, run on globals the code under test chose: a second copy of its module...
    "a second copy of a runner module": ("""
        spec = importlib.util.spec_from_file_location("copy_of_guard", guard.__file__)
        copy = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(copy)
        guard.foreign_plugins = copy.foreign_plugins
        """, ["sandboxed.guard.foreign_plugins"]),
    # ... or a function made from its code with other globals
    "a runner function with other globals": ("""
        guard.foreign_plugins = types.FunctionType(guard.foreign_plugins.__code__, dict(vars(guard)))
        """, ["sandboxed.guard.foreign_plugins"]),
    # the runner rebinding its own functions (pytest does: its assertion helpers per test) is no finding
    "the runner's own function in its own module": ("""
        unittest.util.safe_repr = unittest.util.strclass
        """, []),
    "nothing changed": ("", []),
}


@pytest.mark.parametrize("case", sorted(SNAPSHOT_CASES))
def test_the_identity_snapshot_sees_the_runner_rewired(case: str) -> None:
    change, expected = SNAPSHOT_CASES[case]
    driver = SNAPSHOT_DRIVER.format(package_parent=str(Path(guard.__file__).parent.parent),
                                    change=textwrap.dedent(change))
    out = subprocess.run([sys.executable, "-I", "-c", driver], capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == expected


def runner_report(tmp_path: Path, test_file: str) -> dict[str, object]:
    """The runner's report of one test file, the runner started as the grading container starts it (here
    on the host's interpreter and pytest, the whole file counted as the patch's)."""
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "test_it.py").write_text(textwrap.dedent(test_file))
    changes = tmp_path / "changes.json"
    changes.write_text(json.dumps({"test_it.py": None}))
    report = tmp_path / "report.json"
    code = launch(str(Path(guard.__file__).parent.parent), "runner", package="sandboxed")
    with open(report, "ab") as channel:
        fd = channel.fileno()
        subprocess.run([sys.executable, "-I", "-c", code, str(fd), str(changes), "-q", "-p", "no:cacheprovider"],
                       input="nonce\n", text=True, cwd=tree, pass_fds=(fd,), capture_output=True, timeout=120)
    return dict(json.loads(report.read_text()))


def test_a_test_that_patches_a_builtin_with_monkeypatch_is_no_finding(tmp_path: Path) -> None:
    report = runner_report(tmp_path, """
        import builtins

        def ask():
            return input("continue? ")

        def test_answer(monkeypatch):
            monkeypatch.setattr(builtins, "input", lambda *_: "y")
            assert ask() == "y"
        """)
    assert (report["statuses"], report["tampered"]) == ({"test_it.py::test_answer": "PASSED"}, [])


def test_a_builtin_left_replaced_is_a_finding(tmp_path: Path) -> None:
    report = runner_report(tmp_path, """
        import builtins

        def test_answer():
            builtins.input = lambda *_: "y"
            assert input() == "y"
        """)
    assert report["tampered"] == ["builtins.input replaced"]


def test_whose_defaults_are_the_tree_s_business(tmp_path: Path) -> None:
    """A function made from a string is the tree's only where its globals are not a runner module's (a
    dataclass's ``__init__`` is made on its module's globals; a namedtuple's ``__new__`` on its own)."""
    rule = guard.Guard(str(tmp_path), {})

    def made(module: str) -> object:
        namespace: dict[str, object] = {"__name__": module}
        exec(compile("def f(x=0):\n    return x\n", "<string>", "exec"), namespace)
        return namespace["f"]

    assert rule._own_function(made("namedtuple_Point"))
    assert not rule._own_function(made("unittest.case"))
    assert not rule._own_function(textwrap.indent)
