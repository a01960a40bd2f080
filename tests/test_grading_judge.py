"""The in-container judge's rules, run on real folders on the host (it is plain Python, no container needed).

The judge compares a patched tree with its pristine copy and puts back what a candidate patch may
not change; each case here is one rule of docs/threat-model.md, with an honest edit beside it that
must survive untouched.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from legorl.grading.sandboxed import judge as judge_mod

PRISTINE = {
    "src/pkg/__init__.py": "from .core import add\n",
    "src/pkg/core.py": "import re\n\ndef add(a, b):\n    return a - b\n",
    "tests/__init__.py": "",
    "tests/helpers.py": "def check(x):\n    assert x\n",
    "tests/test_core.py": "from pkg import add\n\ndef test_add():\n    assert add(1, 2) == 3\n",
    "tox.ini": "[tox]\nenvlist = py3\n",
    "pyproject.toml": "[project]\nname = 'pkg'\n",
    "README.md": "pkg\n",
}
HIDDEN = ["tests/test_core.py", "tests/test_new.py"]


@pytest.fixture()
def trees(tmp_path: Path) -> tuple[Path, Path]:
    pristine, tree = tmp_path / "pristine", tmp_path / "testbed"
    for rel, text in PRISTINE.items():
        (pristine / rel).parent.mkdir(parents=True, exist_ok=True)
        (pristine / rel).write_text(text)
    shutil.copytree(pristine, tree, symlinks=True)
    return pristine, tree


def _write(tree: Path, rel: str, text: str) -> None:
    (tree / rel).parent.mkdir(parents=True, exist_ok=True)
    (tree / rel).write_text(text)


def _judge(pristine: Path, tree: Path) -> dict[str, object]:
    return judge_mod.judge(str(tree), str(pristine), HIDDEN)


def _same(pristine: Path, tree: Path) -> None:
    """Everything but the honest fix is as it was (an emptied new folder may stay)."""
    now = judge_mod.scan(str(tree))
    changed = judge_mod.changed_paths(str(tree), str(pristine), now, judge_mod.scan(str(pristine)))
    assert [p for p in changed if now.get(p, ("",))[0] != "d"] == ["src/pkg/core.py"]


FIX = "import re\n\ndef add(a, b):\n    return a + b\n"
CASES = {
    # rel -> (content, or a callable that makes the change; the reason the judge must give)
    "tests/test_core.py": ("def test_add():\n    pass\n", "hidden test file"),
    "tests/test_new.py": ("def test_x():\n    pass\n", "hidden test file"),
    "tests/helpers.py": ("def check(x):\n    pass\n", "hidden test file"),
    "conftest.py": ("import pytest\n", "test runner config"),
    "src/pkg/conftest.py": ("import pytest\n", "test runner config"),
    "tox.ini": ("[tox]\r[pytest]\raddopts = -p evil\r", "test runner config"),
    "tests/sub/setup.cfg": ("[tool:pytest]\naddopts = -p evil\n", "hidden test file"),
    "docs/setup.cfg": ("[tool:pytest]\naddopts = -p evil\n", "test runner config"),
    "pyproject.toml": ("[tool.pytest.ini_options]\naddopts = '-p evil'\n", "test runner config"),
    "src/sitecustomize.py": ("import os\n", "interpreter hook"),
    "src/pkg/evil.pth": ("import os\n", "interpreter hook"),
    "src/pkg/__pycache__/core.cpython-311.pyc": ("junk", "compiled bytecode"),
    "src/evil-1.0.dist-info/entry_points.txt": ("[pytest11]\nevil = evil\n", "package metadata"),
    "src/pluggy/__init__.py": ("", "shadows the module 'pluggy'"),
    "src/json.py": ("", "shadows the module 'json'"),
    "pytest.py": ("", "shadows the module 'pytest'"),
    "helper_mod.py": ("import pytest\n", "new module outside any package"),
    "src/pkg/test_util.py": ("import pytest\n", "test file"),
    ".git/hooks/post-checkout": ("#!/bin/sh\n", "git metadata"),
    "src/pkg/_speedups.abi3.so": ("\x7fELF fake", "native code"),
    "src/pkg/helper.bin": ("\x7fELF\x02\x01", "native code"),
    "src/pkg/.git/config": ("[core]\n", "git metadata"),
}


@pytest.mark.parametrize("rel", sorted(CASES))
def test_forbidden_change_is_put_back_and_the_fix_kept(trees: tuple[Path, Path], rel: str) -> None:
    pristine, tree = trees
    text, why = CASES[rel]
    _write(tree, "src/pkg/core.py", FIX)
    _write(tree, rel, text)
    result = _judge(pristine, tree)
    reset = dict(map(tuple, result["reset"]))  # type: ignore[call-overload]
    assert any(rel == p or rel.startswith(p + "/") for p in reset), result
    assert why in reset.values(), result
    _same(pristine, tree)
    assert (tree / "src/pkg/core.py").read_text() == FIX


def test_symlinks_and_type_changes(trees: tuple[Path, Path], tmp_path: Path) -> None:
    pristine, tree = trees
    secret = tmp_path / "host-secret"
    secret.write_text("secret")
    os.symlink(str(secret), tree / "src/pkg/data.txt")  # new link out of the tree
    os.unlink(tree / "README.md")
    os.symlink("/proc/self/clear_refs", tree / "README.md")  # a file turned into a link
    shutil.rmtree(tree / "tests")
    os.symlink("/etc", tree / "tests")  # a hidden test's folder turned into a link
    os.mkfifo(tree / "src/pkg/pipe")
    _write(tree, "src/pkg/core.py", FIX)
    result = _judge(pristine, tree)
    reasons = dict(map(tuple, result["reset"]))  # type: ignore[call-overload]
    assert reasons == {"README.md": "symbolic link", "src/pkg/data.txt": "symbolic link",
                       "src/pkg/pipe": "special file", "tests": "hidden test file"}
    _same(pristine, tree)
    assert secret.read_text() == "secret"  # nothing was written through a link


def test_honest_patch_is_left_alone(trees: tuple[Path, Path]) -> None:
    pristine, tree = trees
    _write(tree, "src/pkg/core.py", FIX + "\nPATTERN = re.compile(r'x')\n")
    _write(tree, "src/pkg/extra.py", "def helper():\n    return 1\n")
    _write(tree, "README.md", "pkg, fixed\n")
    os.unlink(tree / "src/pkg/__init__.py")
    _write(tree, "src/pkg/__init__.py", "from .core import add\nfrom .extra import helper\n")
    result = _judge(pristine, tree)
    assert result["reset"] == [] and result["suspicious"] == []
    assert sorted(result["changed"]) == ["README.md", "src/pkg/__init__.py", "src/pkg/core.py",  # type: ignore[arg-type]
                                         "src/pkg/extra.py"]


@pytest.mark.parametrize("line", [
    "import pytest", "import _pytest.reports", "__import__('py' + 'test')", "import importlib",
    "sys.modules['x'] = y", "os._exit(0)", "os.write(1, b'PASSED')", "sys.settrace(f)", "import builtins",
    "exec(code)", "eval(s)", "atexit.register(f)", "os.kill(os.getppid(), 9)", "x = sys._getframe(1).f_globals",
    "().__class__.__subclasses__()", "if os.environ.get('PYTEST_CURRENT_TEST'):", "import ctypes",
    "gc.get_objects()", "open('/proc/self/status')", "import subprocess",
])
def test_screen_flags_code_that_reaches_into_the_runner(trees: tuple[Path, Path], line: str) -> None:
    pristine, tree = trees
    _write(tree, "src/pkg/core.py", FIX + line + "\n")
    result = _judge(pristine, tree)
    assert result["reset"] == []
    (finding,) = result["suspicious"]  # type: ignore[misc]
    assert str(finding).startswith("src/pkg/core.py:5: ")


def test_screen_sees_only_added_lines(trees: tuple[Path, Path]) -> None:
    pristine, tree = trees
    _write(pristine, "src/pkg/core.py", "import subprocess\n" + PRISTINE["src/pkg/core.py"])
    _write(tree, "src/pkg/core.py", "import subprocess\n" + FIX + "# pytest is mentioned in a comment\n")
    assert _judge(pristine, tree)["suspicious"] == []


def test_past_the_findings_cap_a_file_s_own_lines_stay_its_own(trees: tuple[Path, Path]) -> None:
    """The screen stops at its cap of findings, but which lines the patch added is still read for every
    file: with every line of the next file counted as the patch's, its untouched code that reads frames
    (semver's own deprecation helper does) became a finding of the patch's (a red team, reading the code)."""
    pristine, tree = trees
    flagged = "".join(f"PATTERN_{i} = compile(r'{i}')\n" for i in range(judge_mod.MAX_FINDINGS + 1))
    _write(tree, "src/pkg/core.py", FIX + flagged)
    _write(pristine, "src/pkg/zlast.py", "import inspect\n\nCALLER = inspect.currentframe()\n")
    _write(tree, "src/pkg/zlast.py", "import inspect\n\nCALLER = inspect.currentframe()\nFIXED = True\n")
    result = _judge(pristine, tree)
    assert len(result["suspicious"]) == judge_mod.MAX_FINDINGS + 1  # type: ignore[arg-type]  # the cap, and a count
    assert result["added"]["src/pkg/zlast.py"] == [4]  # type: ignore[index]


@pytest.mark.parametrize("gold", ["mod.py", "src/nspkg/mod.py"])
def test_a_helper_beside_a_fix_outside_any_package_is_kept(tmp_path: Path, gold: str) -> None:
    """A single-module library's fix, or a namespace package's, with a helper module beside it: the fix
    lives at the top, so a new module there is ordinary (reset, the fix's import failed and every test
    with it: a red team, reading the code). One that shadows a module still goes back."""
    pristine, tree = tmp_path / "pristine", tmp_path / "testbed"
    folder = gold.rpartition("/")[0]
    helper, shadow = (f"{folder}/_mod_helpers.py", f"{folder}/json.py") if folder else ("_mod_helpers.py", "json.py")
    for root in (pristine, tree):
        _write(root, gold, "def add(a, b):\n    return a - b\n")
        _write(root, "tests/test_mod.py", "from mod import add\n")
    _write(tree, gold, "from _mod_helpers import plus\n\ndef add(a, b):\n    return plus(a, b)\n")
    _write(tree, helper, "def plus(a, b):\n    return a + b\n")
    _write(tree, shadow, "")
    result = judge_mod.judge(str(tree), str(pristine), ["tests/test_mod.py"], gold=[gold])
    assert result["reset"] == [[shadow, "shadows the module 'json'"]]
    assert sorted(result["changed"]) == sorted([gold, helper])  # type: ignore[arg-type]


def test_old_code_wrapped_in_a_new_block_stays_the_old_code(trees: tuple[Path, Path]) -> None:
    """Lines re-indented (wrapped in a ``try:``) are the old lines: counted as added, the file's own frame
    read became the patch's (a red team, reading the code)."""
    pristine, tree = trees
    _write(pristine, "src/pkg/where.py", "import inspect\nCALLER = inspect.currentframe()\n")
    _write(tree, "src/pkg/where.py", "import inspect\ntry:\n    CALLER = inspect.currentframe()\n"
                                     "except AttributeError:\n    CALLER = None\n")
    result = _judge(pristine, tree)
    assert result["added"]["src/pkg/where.py"] == [2, 4, 5]  # type: ignore[index]
    assert result["suspicious"] == []


def test_a_data_file_that_starts_like_a_windows_executable_is_data(trees: tuple[Path, Path]) -> None:
    pristine, tree = trees
    _write(tree, "src/pkg/core.py", FIX)
    _write(tree, "src/pkg/countries.csv", "MZ,Mozambique\nNA,Namibia\n")
    pe = bytearray(b"MZ" + b"\0" * 126)
    pe[0x3C:0x40] = (0x40).to_bytes(4, "little")
    pe[0x40:0x44] = b"PE\0\0"
    (tree / "src/pkg/helper.exe").write_bytes(bytes(pe))
    result = _judge(pristine, tree)
    assert result["reset"] == [["src/pkg/helper.exe", "native code"]]
    assert "src/pkg/countries.csv" in result["changed"]  # type: ignore[operator]


@pytest.mark.parametrize("move", ["delete", "rename"])
def test_a_put_back_file_whose_folder_the_patch_removed_gets_its_folder_again(trees: tuple[Path, Path],
                                                                             move: str) -> None:
    """Deleting a subpackage (or renaming a folder) that holds a file the judge puts back: ``git apply``
    removes the emptied folder, and the judge failed (the patch's 0) for want of it (a red team, reading
    the code)."""
    pristine, tree = trees
    for root in (pristine, tree):
        _write(root, "src/pkg/legacy/__init__.py", "")
        _write(root, "src/pkg/legacy/test_legacy.py", "def test_old():\n    pass\n")
        _write(root, "examples/conftest.py", "import pytest\n")
    os.chmod(pristine / "src/pkg/legacy", 0o750)
    if move == "delete":
        shutil.rmtree(tree / "src/pkg/legacy")
        shutil.rmtree(tree / "examples")
    else:
        os.rename(tree / "src/pkg/legacy", tree / "src/pkg/old")
        os.rename(tree / "examples", tree / "docs_examples")
    result = _judge(pristine, tree)
    reset = dict(map(tuple, result["reset"]))  # type: ignore[call-overload]
    assert reset["src/pkg/legacy/test_legacy.py"] == "test file"
    assert reset["examples/conftest.py"] == "test runner config"
    assert (tree / "src/pkg/legacy/test_legacy.py").read_text() == "def test_old():\n    pass\n"
    assert (tree / "examples/conftest.py").read_text() == "import pytest\n"
    assert not (tree / "src/pkg/legacy/__init__.py").exists()  # the deletion itself stays
    assert os.stat(tree / "src/pkg/legacy").st_mode & 0o777 == 0o750  # the folder as it was


def test_a_put_back_file_whose_folder_is_now_a_file_or_a_link_fails(tmp_path: Path) -> None:
    pristine, tree, outside = tmp_path / "pristine", tmp_path / "testbed", tmp_path / "outside"
    _write(pristine, "a/b/test_x.py", "")
    outside.mkdir()
    tree.mkdir()
    os.symlink(str(outside), tree / "a")
    with pytest.raises(SystemExit, match="not a directory"):
        judge_mod.restore(str(tree), str(pristine), "a/b/test_x.py")
    assert list(outside.iterdir()) == []  # nothing made through the link
    os.unlink(tree / "a")
    _write(tree, "a", "")
    with pytest.raises(SystemExit, match="not a directory"):
        judge_mod.restore(str(tree), str(pristine), "a/b/test_x.py")


@pytest.mark.parametrize("importer", ["from pkg.util import helper", "import pkg.util", "from .util import helper",
                                      "from . import util", "from pkg import util"])
def test_a_module_the_library_imports_beside_a_hidden_test_is_library_code(tmp_path: Path, importer: str) -> None:
    """Beside a hidden test in a package folder, ``pkg/util.py`` imported by ``pkg/core.py`` (which the
    package imports) is the library's: it was put back as test support, since only the first part of a
    dotted import counted and a module beside the test was never read for its imports (a red team,
    reading the code). A helper only tests (or other such helpers) import still goes back."""
    pristine, tree = tmp_path / "pristine", tmp_path / "testbed"
    for root in (pristine, tree):
        _write(root, "pkg/__init__.py", "from .core import run\n")
        _write(root, "pkg/core.py", f"{importer}\n\ndef run():\n    return 1\n")
        _write(root, "pkg/util.py", "def helper():\n    return 1\n")
        _write(root, "pkg/helpers.py", "def check(x):\n    assert x\n")
        _write(root, "pkg/fixtures.py", "from pkg.helpers import check\n")
        _write(root, "other/util.py", "import json\n")
        _write(root, "pkg/core_test.py", "from pkg.fixtures import check\n")
    _write(tree, "pkg/util.py", "def helper():\n    return 2\n")
    _write(tree, "pkg/helpers.py", "def check(x):\n    pass\n")
    result = judge_mod.judge(str(tree), str(pristine), ["pkg/core_test.py"])
    assert result["reset"] == [["pkg/helpers.py", "test support file"]]
    assert result["changed"] == ["pkg/util.py"]


@pytest.mark.parametrize("folder", ["new", "old"])
def test_a_new_module_in_a_namespace_folder_inside_a_package_is_kept(trees: tuple[Path, Path], folder: str) -> None:
    """``src/pkg/plugins/`` (no ``__init__.py``) inside the package ``src/pkg`` is a namespace subpackage, no
    sys.path entry: a new module there was put back as outside any package (a red team, reading the code)."""
    pristine, tree = trees
    if folder == "old":
        for root in (pristine, tree):
            _write(root, "src/pkg/plugins/base.py", "class Plugin:\n    pass\n")
    _write(tree, "src/pkg/core.py", FIX)
    _write(tree, "src/pkg/plugins/extra.py", "from .base import Plugin\n")
    _write(tree, "src/json.py", "")  # a folder outside any package stays a way onto sys.path
    result = _judge(pristine, tree)
    assert result["reset"] == [["src/json.py", "shadows the module 'json'"]]
    assert "src/pkg/plugins/extra.py" in result["changed"]  # type: ignore[operator]


def test_a_library_module_named_like_a_test_is_library_code(trees: tuple[Path, Path]) -> None:
    """``chi2_test.py`` that the library imports is the library's (it was put back as a test file: a red
    team, reading the code); one only a test or ``conftest.py`` imports, or a new one, still goes back."""
    pristine, tree = trees
    for root in (pristine, tree):
        _write(root, "src/pkg/stats/__init__.py", "from .chi2_test import chi2\n")
        _write(root, "src/pkg/stats/chi2_test.py", "def chi2():\n    return 0\n")
        _write(root, "src/pkg/stats/ab_test.py", "def check():\n    assert 1\n")
        _write(root, "src/pkg/stats/t_test.py", "def check():\n    assert 1\n")
        _write(root, "src/conftest.py", "from pkg.stats.t_test import check\n")
        _write(root, "tests/test_ab.py", "from pkg.stats.ab_test import check\n")
    for rel in ("src/pkg/stats/chi2_test.py", "src/pkg/stats/ab_test.py", "src/pkg/stats/t_test.py"):
        _write(tree, rel, "def check():\n    pass\n")
    _write(tree, "src/pkg/stats/z_test.py", "def check():\n    pass\n")
    result = _judge(pristine, tree)
    assert result["reset"] == [["src/pkg/stats/ab_test.py", "test file"], ["src/pkg/stats/t_test.py", "test file"],
                               ["src/pkg/stats/z_test.py", "test file"]]
    assert result["changed"] == ["src/pkg/stats/chi2_test.py"]


@pytest.mark.parametrize("folder", ["pkg/sub", "pkg/other"])
def test_a_folder_inside_a_package_that_pytest_puts_on_sys_path_is_top_level(tmp_path: Path, folder: str) -> None:
    """pytest (its default import mode) puts a hidden test's or a ``conftest.py``'s folder on sys.path when
    it has no ``__init__.py``, inside a package or not: a new module there may still shadow one."""
    pristine, tree = tmp_path / "pristine", tmp_path / "testbed"
    for root in (pristine, tree):
        _write(root, "pkg/__init__.py", "")
        _write(root, "pkg/sub/test_x.py", "def test_x():\n    pass\n")
        _write(root, "pkg/other/conftest.py", "")
    _write(tree, f"{folder}/pdb.py", "")
    _write(tree, f"{folder}/helper.py", "")
    result = judge_mod.judge(str(tree), str(pristine), ["pkg/sub/test_x.py"])
    assert result["reset"] == [[f"{folder}/helper.py", "new module outside any package"],
                               [f"{folder}/pdb.py", "shadows the module 'pdb'"]]
