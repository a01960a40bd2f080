"""Splitting diffs per file (the host's bookkeeping; what is kept is judged on the tree: test_grading_judge.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from legorl.grading.patches import split_patch, touched_paths


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
    assert [f.new_path for f in split_patch(diff)] == ["x.py", "conftest.py"]
    assert touched_paths(diff) == ["x.py", "conftest.py"]
