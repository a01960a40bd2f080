"""Shared by the harness and rollout tests: a task to run, scripted fixes, a proxy on a scripted engine."""

from __future__ import annotations

import json
import shlex
import subprocess
from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq

from legorl.core import shards
from legorl.core.schemas import Kind, TaskRow

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "examples" / "tasks" / "tasks.parquet"

_BUGGY = "def add(a, b):\n    return a - b\n\n\ndef sub(a, b):\n    return a - b\n"
_TESTS = "from calc import add, sub\n\n\ndef test_sub():\n    assert sub(3, 1) == 2\n"
_HIDDEN = "\n\ndef test_add():\n    assert add(2, 2) == 4\n"


def _git(repo: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin", "HOME": str(repo)}
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True).stdout


def _diff(repo: Path, path: str, new: str) -> str:
    (repo / path).write_text(new)
    _git(repo, "add", "-A")
    out = _git(repo, "diff", "--cached", "HEAD")
    _git(repo, "reset", "-q", "--hard", "HEAD")
    return out


def local_task(root: Path) -> TaskRow:
    """A one-file bug with one hidden failing test and one passing test, in a local git repo."""
    repo = root / "calc-repo"
    (repo / "tests").mkdir(parents=True)
    (repo / "calc.py").write_text(_BUGGY)
    (repo / "tests" / "test_calc.py").write_text(_TESTS)
    (repo / "conftest.py").write_text("")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "calc")
    commit = _git(repo, "rev-parse", "HEAD").strip()
    gold = _diff(repo, "calc.py", _BUGGY.replace("return a - b", "return a + b", 1))
    test_patch = _diff(repo, "tests/test_calc.py", _TESTS + _HIDDEN)
    return TaskRow(
        instance_id="local__calc-1", repo="local/calc", base_commit=commit, patch=gold, test_patch=test_patch,
        problem_statement="`calc.add(2, 2)` returns 0 instead of 4. Fix `add` in calc.py.",
        FAIL_TO_PASS=["tests/test_calc.py::test_add"], PASS_TO_PASS=["tests/test_calc.py::test_sub"],
        repo_source=str(repo), repo_ref=commit,
    )


def shipped_tasks() -> list[TaskRow]:
    if not SHIPPED.exists():
        return []
    tasks = []
    for row in pq.read_table(SHIPPED).to_pylist():
        task = TaskRow.from_dict(row)
        if task.repo_source:
            task.repo_source = str((SHIPPED.parent / task.repo_source).resolve())
        tasks.append(task)
    return sorted(tasks, key=lambda t: t.instance_id)


def a_task(root: Path) -> TaskRow:
    """The first task of the shipped set, or (until it lands) a local one of the same format."""
    tasks = shipped_tasks()
    return tasks[0] if tasks else local_task(root)


def write_tasks(run: Path, tasks: list[TaskRow]) -> None:
    shards.write(run / "tasks", Kind.TASKS, tasks)


def import_one(run: Path, root: Path) -> TaskRow:
    """Put one task in ``run/tasks`` the documented way (``legorl tasks import`` of the shipped set),
    or the local task until the shipped set exists; returns it as stored."""
    if SHIPPED.exists():
        from legorl.tasks.importer import import_tasks

        import_tasks(str(SHIPPED), run / "tasks", instance_ids=[shipped_tasks()[0].instance_id])
    else:
        write_tasks(run, [local_task(root)])
    return shards.read_rows(run / "tasks", Kind.TASKS)[0]


def fix_command(task: TaskRow) -> str:
    """A shell command applying the task's gold patch in /testbed."""
    return f"cd /testbed && printf %s {shlex.quote(task.patch or '')} | git apply -"


def tool_call(name: str, args: dict[str, object]) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def solving_script(harness: str, task: TaskRow) -> list[str]:
    """What a policy that knows the fix would sample, in each harness's own tool vocabulary."""
    cmd = fix_command(task)
    return {
        "mini-swe-agent": [tool_call("bash", {"command": cmd}),
                           tool_call("bash", {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"})],
        "openhands": [tool_call("terminal", {"command": cmd, "summary": "apply the fix", "security_risk": "LOW"}),
                      tool_call("finish", {"message": "Fixed."})],
        "opencode": [tool_call("bash", {"command": cmd, "description": "apply the fix"}), "Fixed."],
        "claude-code": [tool_call("Bash", {"command": cmd, "description": "apply the fix"}), "Fixed."],
    }[harness]


def scripted(turns: list[str], aux: str = "Fix the bug") -> Callable[[object], str]:
    """Completions for a ScriptedEngine, stateless so concurrent trials each get the whole script:
    the n-th assistant turn of a conversation with tools is ``turns[n]`` (then a plain final
    answer); tool-less auxiliary requests (title generation) get ``aux``."""

    def complete(call: object) -> str:
        text = str(getattr(call, "prompt_text", ""))
        if "# Tools" not in text:
            return aux
        n = text.count("<|im_start|>assistant") - 1
        return turns[n] if n < len(turns) else "Done."

    return complete
