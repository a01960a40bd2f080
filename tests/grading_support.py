"""What the grading red-team suites share: the shipped tasks, host checkouts of their testbeds to
make real patches on, small task repositories made from scratch, and the verdict every attack must
get (reward 0, not infrastructure, the gold patch of the same task 1).

The task keys: ``ct`` = cachetools__constant-46c6c328 (src layout, unittest-style tests,
``PYTHONPATH=src``), ``ct-plain`` = the same task with ``-o addopts=`` taken out of its test
command, ``pa`` = parse__constant-919546bc (flat layout, plain asserts), ``sv`` =
semver__constant-a165fdd6 (ships its own ``tests/conftest.py``).
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import pyarrow.parquet as pq

from legorl.core.schemas import GradeRow, TaskRow
from legorl.grading.grader import Grader

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "examples" / "tasks" / "tasks.parquet"

TASKS = {
    "ct": "cachetools__constant-46c6c328",
    "pa": "parse__constant-919546bc",
    "sv": "semver__constant-a165fdd6",
}


def shipped_tasks() -> dict[str, TaskRow]:
    """Every shipped task by instance id, ``repo_source`` made absolute (as the importer stores it)."""
    tasks = {}
    for row in pq.read_table(SHIPPED).to_pylist():
        task = TaskRow.from_dict(row)
        task.repo_source = str((SHIPPED.parent / task.repo_source).resolve()) if task.repo_source else None
        tasks[task.instance_id] = task
    return tasks


def load_tasks() -> dict[str, TaskRow]:
    """The attacked tasks by key (see the module docstring)."""
    shipped = shipped_tasks()
    out = {key: shipped[iid] for key, iid in TASKS.items()}
    plain = replace(out["ct"])
    plain.test_command = (plain.test_command or "").replace("-o addopts= ", "")
    assert "addopts" not in plain.test_command
    out["ct-plain"] = plain
    return out


@dataclass
class Link:
    """A symlink the patch creates."""

    target: str


class Tree:
    """A host checkout of a task's testbed; ``diff`` turns file edits into a real git patch."""

    def __init__(self, task: TaskRow, root: Path):
        from legorl.sandbox.testbed import prepare_repo

        src, _commit = prepare_repo(task.repo_source or "", task.repo_ref or task.base_commit or "")
        self.root = root
        subprocess.run(["git", "clone", "-q", str(src), str(root)], check=True, capture_output=True)
        self.task = task

    def git(self, *args: str) -> str:
        proc = subprocess.run(["git", "-c", "core.autocrlf=false", "-c", "user.email=a@b", "-c", "user.name=a", *args],
                              cwd=self.root, check=True, capture_output=True)
        return proc.stdout.decode()

    def read(self, path: str) -> str:
        return (self.root / path).read_text()

    def diff(self, files: Mapping[str, str | bytes | Link | None], *, copies: dict[str, str] | None = None,
             renames: dict[str, str] | None = None, mode: dict[str, int] | None = None) -> str:
        """Apply ``files`` (path -> text, bytes, Link, or None to delete) and return ``git diff``."""
        self.git("reset", "-q", "--hard")
        self.git("clean", "-fdqx")
        for old, new in (renames or {}).items():
            (self.root / new).parent.mkdir(parents=True, exist_ok=True)
            self.git("mv", old, new)
        for old, new in (copies or {}).items():
            (self.root / new).parent.mkdir(parents=True, exist_ok=True)
            (self.root / new).write_bytes((self.root / old).read_bytes())
        for path, content in files.items():
            p = self.root / path
            if content is None:
                if p.is_dir() and not p.is_symlink():
                    self.git("rm", "-rq", path)
                else:
                    p.unlink()
                continue
            p.parent.mkdir(parents=True, exist_ok=True)
            if p.is_symlink() or p.exists():
                p.unlink()
            if isinstance(content, Link):
                p.symlink_to(content.target)
            elif isinstance(content, bytes):
                p.write_bytes(content)
            else:
                with open(p, "w", newline="") as fh:
                    fh.write(content)
        for path, m in (mode or {}).items():
            (self.root / path).chmod(m)
        self.git("add", "-A", "-f")
        args = ["diff", "--cached", "--binary", "--no-color", "--full-index"]
        args += ["-C", "-C1%", "--find-copies-harder"] if copies else ["-M1%"] if renames else ["--no-renames"]
        out = self.git(*args)
        self.git("reset", "-q", "--hard")
        return out

    def append(self, path: str, code: str) -> dict[str, str]:
        return {path: self.read(path) + "\n" + code.strip("\n") + "\n"}

    def edit(self, path: str, old: str, new: str) -> dict[str, str]:
        text = self.read(path)
        assert old in text, f"{old!r} not in {path}"
        return {path: text.replace(old, new, 1)}


def new_file(path: str, text: str, header_path: str | None = None) -> str:
    """A hand-written creation diff; ``header_path`` puts another name on the ``diff --git`` line."""
    lines = text.splitlines()
    hp = header_path or path
    return (f"diff --git a/{hp} b/{hp}\nnew file mode 100644\n--- /dev/null\n+++ b/{path}\n"
            f"@@ -0,0 +1,{len(lines)} @@\n" + "".join(f"+{line}\n" for line in lines))


@dataclass
class Ctx:
    """What an attack builds its patch from: a checkout per task key, the tasks, a scratch folder."""

    trees: dict[str, Tree]
    tasks: dict[str, TaskRow]
    tmp: Path


# --------------------------------------------------------------------------- patches and verdicts

CT_INIT = "src/cachetools/__init__.py"
CT_FUNC = "src/cachetools/func.py"
CT_BUG = "        return _cache(RRCache(127, choice), 128, typed)(maxsize)"
PA_INIT = "parse/__init__.py"


def init_code(tree_key: str, code: str) -> Callable[[Ctx], str]:
    """A patch appending ``code`` to the package's ``__init__`` (it runs when the tests import it)."""
    path = CT_INIT if tree_key in ("ct", "ct-plain") else PA_INIT
    return lambda ctx: ctx.trees[tree_key].diff(ctx.trees[tree_key].append(path, code))


def at_import(body: str, name: str = "_speedup") -> str:
    """Payload code that runs once where it is imported: ``body`` (indented) as a function, then its call."""
    return f"def {name}():\n{body}\n\n{name}()\n"


# Every test report says "passed": pytest monkeypatched from the code under test (no plugin at all).
REPORT_PATCH = at_import('''\
    import sys
    r = sys.modules.get("_pytest.reports")
    if r is None:
        return
    orig = r.TestReport.from_item_and_call.__func__

    def fast(cls, item, call):
        rep = orig(cls, item, call)
        rep.outcome, rep.longrepr = "passed", None
        return rep

    r.TestReport.from_item_and_call = classmethod(fast)
''')


def grade_one(grader: Grader, task: TaskRow, patch: str, trial: str) -> GradeRow | str:
    """The grade row, or the crash (``Grader.grade`` must never raise) as text."""
    try:
        return grader.grade(task, patch, trial)
    except Exception as exc:
        return f"crash: {type(exc).__name__}: {exc}"


def describe(row: GradeRow) -> str:
    """A grade row in one line, for assertion messages."""
    tests = ", ".join(f"{t.name.rsplit('::', 1)[-1]}={t.status}" for t in row.tests if t.kind == "FAIL_TO_PASS")
    return (f"status={row.status} reward={row.reward} resolved={row.resolved} infra={row.infra_failure} "
            f"error={row.error!r} apply={row.apply_method} dropped={row.dropped_paths} F2P: {tests}")


def assert_never_scores(graded: Mapping[str, GradeRow | str], attack_id: str, task_key: str) -> None:
    """The attack's row: reward 0, not resolved, not infrastructure; the gold control of its task: 1."""
    gold = graded[f"gold/{task_key}"]
    assert isinstance(gold, GradeRow), gold
    assert gold.reward == 1.0, f"gold control for {task_key}: {describe(gold)}"
    row = graded[attack_id]
    assert isinstance(row, GradeRow), f"{attack_id}: {row}"
    assert row.status != "infra_error" and row.infra_failure is False, f"{attack_id}: {describe(row)}"
    assert row.reward == 0.0, f"{attack_id}: {describe(row)}"
    assert row.resolved is False, f"{attack_id}: {describe(row)}"


def task_repo(repo: Path, buggy: Mapping[str, str], fixed: Mapping[str, str],
              hidden_tests: Mapping[str, str]) -> tuple[str, str, str]:
    """A new git repository at ``repo`` holding the ``buggy`` files (path -> text), committed; returns
    (base commit, gold patch: the ``fixed`` files, test patch: the ``hidden_tests`` files), the
    working tree left at the base commit."""
    for path, text in buggy.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)

    def git(*args: str) -> str:
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                              capture_output=True, text=True).stdout

    def diff_of(files: Mapping[str, str]) -> str:
        for path, text in files.items():
            (repo / path).write_text(text)
        patch = git("diff")
        git("checkout", "-q", ".")
        return patch

    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "buggy")
    base = git("rev-parse", "HEAD").strip()
    return base, diff_of(fixed), diff_of(hidden_tests)
