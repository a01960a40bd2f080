"""Draft a task from a mined bug: the visible repository as one parentless commit with a fixed
date, the gold ``patch``, the ``test_patch`` and a problem statement written from the failures
(step 3 of :mod:`legorl.tasks.builder`; its test lists are still provisional)."""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

from legorl.core.schemas import TaskRow
from legorl.grading.container import hidden_test_files
from legorl.tasks.hiding import remove_tests
from legorl.tasks.library import BuildError, Library
from legorl.tasks.mining import Mined
from legorl.tasks.mutate import Mutation

FIXED_DATE = "2024-01-01T00:00:00+0000"
_GIT_ENV = {
    "GIT_AUTHOR_NAME": "legorl", "GIT_AUTHOR_EMAIL": "legorl@localhost", "GIT_AUTHOR_DATE": FIXED_DATE,
    "GIT_COMMITTER_NAME": "legorl", "GIT_COMMITTER_EMAIL": "legorl@localhost", "GIT_COMMITTER_DATE": FIXED_DATE,
    "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null",
}


def git(repo: Path, *args: str, input: bytes | None = None, env: dict[str, str] | None = None) -> str:
    """``git ARGS`` in ``repo`` as legorl at :data:`FIXED_DATE` (no user config); its stdout."""
    proc = subprocess.run(["git", *args], cwd=repo, capture_output=True, input=input,
                          env={**os.environ, **_GIT_ENV, **(env or {})})
    if proc.returncode != 0:
        raise BuildError(f"git {args[0]} in {repo}: {proc.stderr.decode(errors='replace').strip()[-300:]}")
    return proc.stdout.decode(errors="replace")


def _tree_of(repo: Path, tree_dir: Path) -> str:
    """Write ``tree_dir``'s files as a tree object in ``repo`` (a throwaway index, nothing staged)."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {"GIT_INDEX_FILE": f"{tmp}/index", "GIT_WORK_TREE": str(tree_dir)}
        git(repo, "add", "-A", "-f", ".", env=env)
        return git(repo, "write-tree", env=env).strip()


def _commit(repo: Path, tree: str, message: str) -> str:
    return git(repo, "commit-tree", tree, "-m", message).strip()


def problem_statement(lib: Library, broken: dict[str, str]) -> str:
    lines = [
        f"{lib.name}: {len(broken)} test{'s' if len(broken) != 1 else ''} of the maintainers' suite fail",
        "",
        f"Running the test suite of `{lib.name}` ({lib.version}) shows failures that should not happen:",
        "",
    ]
    for test_id, message in sorted(broken.items()):
        lines.append(f"- `{test_id}`" + (f" fails with: `{message}`" if message else " fails"))
    lines += [
        "",
        "The tests are right; the library's behaviour is wrong. Fix the library so these tests pass "
        "again, without breaking any other test.",
    ]
    return "\n".join(lines) + "\n"


def task_id(lib: Library, m: Mutation) -> str:
    digest = hashlib.sha256(m.describe().encode()).hexdigest()[:8]
    return f"{lib.name}__{m.kind}-{digest}"


def make_task(lib: Library, repo: Path, mined: Mined, work: Path) -> tuple[TaskRow, str]:
    """The task row (lists still provisional) and the ref of its visible commit in ``repo``."""
    m = mined.mutation
    iid = task_id(lib, m)
    visible = work / iid
    shutil.rmtree(visible, ignore_errors=True)
    shutil.copytree(lib.root, visible)
    original = (lib.root / m.path).read_text()
    (visible / m.path).write_text(m.apply(original))
    helpers = [p.relative_to(lib.root).as_posix() for p in lib.root.rglob("*.py")
               if p.relative_to(lib.root).as_posix().split("/")[0] in ("tests", "test")]
    changed_tests = remove_tests(visible, mined.broken, helpers)
    visible_tree = _tree_of(repo, visible)
    commit = _commit(repo, visible_tree, f"{lib.name} {lib.version}")
    # gold: the visible tree with the bug reverted; full: with the hidden tests restored
    (visible / m.path).write_text(original)
    fixed_tree = _tree_of(repo, visible)
    (visible / m.path).write_text(m.apply(original))
    for path in changed_tests:
        shutil.copy2(lib.root / path, visible / path)
    full_tree = _tree_of(repo, visible)
    shutil.rmtree(visible)
    gold = git(repo, "diff", "--no-color", "--no-ext-diff", visible_tree, fixed_tree)
    test_patch = git(repo, "diff", "--no-color", "--no-ext-diff", visible_tree, full_tree)
    ref = f"refs/tasks/{iid}"
    git(repo, "update-ref", ref, commit)
    # Run the files the failing tests live in (a test inherited from a mixin in tests/__init__.py
    # changes only that file), plus every test file the test_patch touches.
    files = dict.fromkeys([*(t.split("::", 1)[0] for t in sorted(mined.broken)), *hidden_test_files(test_patch)])
    run = [f for f in files if f in lib.test_files]
    task = TaskRow(
        instance_id=iid, repo=f"pypi/{lib.name}", base_commit=commit, patch=gold, test_patch=test_patch,
        problem_statement=problem_statement(lib, mined.broken), hints_text="", created_at=FIXED_DATE,
        version=lib.version, FAIL_TO_PASS=sorted(mined.broken), PASS_TO_PASS=[],
        test_command=lib.test_command.replace("{test_files}", " ".join(shlex.quote(f) for f in run)),
        log_parser="pytest",
    )
    return task, ref
