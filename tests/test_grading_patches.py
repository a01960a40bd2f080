"""Splitting diffs per file and dropping what a graded patch may not touch."""

from __future__ import annotations

import subprocess
from pathlib import Path

from legorl.grading.patches import filter_patch, pytest_section, split_patch, touched_paths


def _git_diff(tmp_path: Path, before: dict[str, str], after: dict[str, str | None]) -> str:
    """A real `git diff` between two trees (new, deleted, renamed files included)."""
    repo = tmp_path / "repo"
    repo.mkdir()

    def git(*args: str) -> str:
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo,
                              capture_output=True, text=True, check=True).stdout

    git("init", "-q")
    for path, text in before.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)
    git("add", "-A")
    git("commit", "-qm", "base")
    for path, new in after.items():
        if new is None:
            (repo / path).unlink()
        else:
            (repo / path).parent.mkdir(parents=True, exist_ok=True)
            (repo / path).write_text(new)
    git("add", "-A")
    return git("diff", "--cached", "-M")


def test_split_real_git_diff(tmp_path: Path) -> None:
    before = {"pkg/a.py": "x = 1\n-- not a header\n", "pkg/gone.py": "y = 2\n", "tests/test_a.py": "def test(): pass\n",
              "old/name.py": "z = 3\n" * 20}
    after: dict[str, str | None] = {
        "pkg/a.py": "x = 2\n--- looks like a header\n", "pkg/gone.py": None, "pkg/new.py": "n = 1\n",
        "old/name.py": None, "new/name.py": "z = 3\n" * 20,
    }
    diff = _git_diff(tmp_path, before, after)
    files = split_patch(diff)
    assert {(f.old_path, f.new_path) for f in files} == {
        ("pkg/a.py", "pkg/a.py"), ("pkg/gone.py", None), (None, "pkg/new.py"), ("old/name.py", "new/name.py"),
    }
    assert "".join(f.text for f in files) == diff  # nothing lost, nothing duplicated
    assert set(touched_paths(diff)) == {"pkg/a.py", "pkg/gone.py", "pkg/new.py", "old/name.py", "new/name.py"}


def test_plain_unified_diff_without_git_headers() -> None:
    diff = ("--- a/x.py\t2024-01-01\n+++ b/x.py\t2024-01-01\n@@ -1 +1 @@\n-a\n+b\n"
            "--- a/conftest.py\n+++ b/conftest.py\n@@ -1 +1,2 @@\n a\n+b\n")
    result = filter_patch(diff, [])
    assert [f.new_path for f in result.kept] == ["x.py"]
    assert result.dropped == {"conftest.py": "conftest.py"}


def test_filter_drops_hidden_tests_and_test_infrastructure(tmp_path: Path) -> None:
    before = {"lib/core.py": "a = 1\n", "tests/test_core.py": "def test(): pass\n", "tests/__init__.py": "",
              "lib/__init__.py": "", "tox.ini": "[tox]\n"}
    after: dict[str, str | None] = {
        "lib/core.py": "a = 2\n",
        "tests/test_core.py": "def test(): assert True\n",
        "tests/__init__.py": "import os\n",
        "lib/__init__.py": "import os\n",
        "conftest.py": "def pytest_collection_modifyitems(items): items.clear()\n",
        "lib/deep/conftest.py": "x = 1\n",
        "sitecustomize.py": "import os\n",
        "lib/usercustomize.py": "import os\n",
        "hook.pth": "import os\n",
        "pytest.ini": "[pytest]\naddopts = -p no:x\n",
        "tests/.pytest.ini": "[pytest]\n",
        "_pytest/fake.py": "x = 1\n",
        "pytest.py": "x = 1\n",
        "tox.ini": "[tox]\n[pytest]\naddopts = -x\n",
    }
    diff = _git_diff(tmp_path, before, after)
    result = filter_patch(diff, ["tests/test_core.py"])
    assert result.dropped == {
        "tests/test_core.py": "hidden test file",
        "tests/__init__.py": "test package __init__",
        "conftest.py": "conftest.py",
        "lib/deep/conftest.py": "conftest.py",
        "sitecustomize.py": "interpreter hook",
        "lib/usercustomize.py": "interpreter hook",
        "hook.pth": ".pth file",
        "pytest.ini": "pytest config",
        "tests/.pytest.ini": "pytest config",
        "_pytest/fake.py": "shadows the test runner",
        "pytest.py": "shadows the test runner",
    }
    # the library's own code, its package __init__ and tox.ini (judged after applying) are kept
    assert sorted(p for f in result.kept for p in f.paths) == ["lib/__init__.py", "lib/core.py", "tox.ini"]
    assert split_patch(result.patch) and "conftest" not in result.patch


def test_renaming_a_hidden_test_away_is_dropped(tmp_path: Path) -> None:
    body = "def test_something():\n    assert compute() == 3\n" * 5
    diff = _git_diff(tmp_path, {"tests/test_x.py": body}, {"tests/test_x.py": None, "tests/moved.py": body})
    result = filter_patch(diff, ["tests/test_x.py"])
    assert not result.kept
    assert set(result.dropped) == {"tests/test_x.py", "tests/moved.py"}


def test_unsafe_paths_are_dropped() -> None:
    diff = "--- a/../etc/x\n+++ b/../etc/x\n@@ -1 +1 @@\n-a\n+b\n--- a/.git/config\n+++ b/.git/config\n@@ -1 +1 @@\n-a\n+b\n"
    assert filter_patch(diff, []).dropped == {"../etc/x": "unsafe path", ".git/config": "unsafe path"}


def test_compiled_bytecode_is_dropped() -> None:
    def add(path: str) -> str:
        return f"diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n+++ b/{path}\n@@ -0,0 +1 @@\n+x\n"

    diff = add("tests/__pycache__/helpers.cpython-311.pyc") + add("lib/old.pyo") + add("lib/core.py")
    result = filter_patch(diff, ["tests/test_core.py"])
    assert result.dropped == {"tests/__pycache__/helpers.cpython-311.pyc": "compiled bytecode",
                              "lib/old.pyo": "compiled bytecode"}
    assert touched_paths(result.patch) == ["lib/core.py"]


def test_pytest_sections() -> None:
    assert pytest_section("tox.ini", "[tox]\nenvlist = py3\n") is None
    assert pytest_section("tox.ini", "[pytest]\naddopts = -x\n") == {"addopts": "-x"}
    assert pytest_section("setup.cfg", "[metadata]\nname = x\n[tool:pytest]\naddopts = -q\n") == {"addopts": "-q"}
    assert pytest_section("pyproject.toml", "[project]\nname='x'\n") is None
    assert pytest_section("pyproject.toml", "[tool.pytest.ini_options]\naddopts='-p x'\n") == {
        "ini_options": {"addopts": "-p x"}}
    # only the pytest part matters: other edits compare equal
    a = "[metadata]\nname = x\n[tool:pytest]\naddopts = -q\n"
    b = "[metadata]\nname = y\n[tool:pytest]\naddopts = -q\n"
    assert pytest_section("setup.cfg", a) == pytest_section("setup.cfg", b)
