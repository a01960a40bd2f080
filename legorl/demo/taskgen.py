"""A family of tiny repair tasks, generated deterministically from a seed, in SWE-bench's schema.

Each task is a one-file repository (``<module>.py``) holding one small bug and one correct
neighbour; the fix is one ``sed`` substitution. The hidden tests (``test_patch``) check the fixed
value (FAIL_TO_PASS) and the neighbour (PASS_TO_PASS), so a substitution that also hits the
neighbour, or breaks the file, fails. Two kinds, each with two phrasings of the statement:

- ``set``: "Set `DEPTH` to 7 in limits.py." — the model must copy the name, the value and the
  file name out of the statement (``sed -i 's/DEPTH = .*/DEPTH = 7/' limits.py``);
- ``flip``: "`merge` in config.py should add, not subtract." — it must turn the words into the
  operators and copy the file name (``sed -i 's/a - b/a + b/' config.py``).

The pools (6 files, 8 names, values 2–9, 6 functions) are small on purpose: a ~5 M-parameter
model learns the format in a few dozen supervised steps but the copying only partly, so it
starts with some successes and has something left to learn from rewards.

All repositories go into one git bundle (one parentless commit per task, written with
``git fast-import``); ``repo_source`` names the bundle and ``base_commit`` the task's commit, so
``legorl tasks import`` and the testbed code take it as any other task set.
"""

from __future__ import annotations

import json
import random
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from legorl.errors import LegorlError

KINDS = ("set", "flip")
_FILES = ("config", "settings", "limits", "params", "defaults", "options")
_NAMES = ("LIMIT", "SIZE", "DEPTH", "WIDTH", "COUNT", "RETRIES", "TIMEOUT", "LEVEL")
_FUNCS = ("total", "combine", "merge", "join", "mix", "blend")
_DATE = "946684800 +0000"  # 2000-01-01: commit ids depend only on the seed


@dataclass(frozen=True)
class DemoTask:
    """One generated task: the repository's file, the one-line fix, and the hidden tests."""

    instance_id: str
    kind: str
    module: str  # file name without .py
    source: str  # the buggy file
    fixed_source: str
    fix_command: str  # the canonical fix as the driver's bash command (what the warm-up teaches)
    tests: str  # the hidden test file
    statement: str

    @property
    def filename(self) -> str:
        return f"{self.module}.py"

    @property
    def test_filename(self) -> str:
        return f"test_{self.module}.py"


def make_task(rng: random.Random, index: int, kind: str) -> DemoTask:
    module = rng.choice(_FILES)
    if kind == "set":
        name, other = rng.sample(_NAMES, 2)
        old_v, new_v, other_v = rng.sample(range(2, 10), 3)
        lines = [f"{name} = {old_v}", f"{other} = {other_v}"]
        rng.shuffle(lines)
        source = "\n".join(lines) + "\n"
        fixed = source.replace(f"{name} = {old_v}", f"{name} = {new_v}")
        command = f"sed -i 's/{name} = .*/{name} = {new_v}/' {module}.py"
        statement = rng.choice((f"Set `{name}` to {new_v} in {module}.py.",
                                f"In {module}.py, `{name}` should be {new_v}."))
        tests = (f"from {module} import {name}, {other}\n\n\n"
                 f"def test_{name.lower()}():\n    assert {name} == {new_v}\n\n\n"
                 f"def test_{other.lower()}():\n    assert {other} == {other_v}\n")
    elif kind == "flip":
        func, other = rng.sample(_FUNCS, 2)
        want, wrong = rng.choice((("+", "-"), ("-", "+")))
        words = {"+": "add", "-": "subtract"}
        funcs = [f"def {func}(a, b):\n    return a {wrong} b\n", f"def {other}(a, b):\n    return a * b\n"]
        rng.shuffle(funcs)
        source = "\n\n".join(funcs)
        fixed = source.replace(f"a {wrong} b", f"a {want} b")
        command = f"sed -i 's/a {wrong} b/a {want} b/' {module}.py"
        statement = rng.choice((f"`{func}` in {module}.py should {words[want]}, not {words[wrong]}.",
                                f"In {module}.py, `{func}` must {words[want]} its arguments."))
        a, b = rng.randint(10, 99), rng.randint(2, 9)
        tests = (f"from {module} import {func}, {other}\n\n\n"
                 f"def test_{func}():\n    assert {func}({a}, {b}) == {a + b if want == '+' else a - b}\n\n\n"
                 f"def test_{other}():\n    assert {other}({a}, {b}) == {a * b}\n")
    else:
        raise LegorlError(f"unknown demo task kind {kind!r} (known: {', '.join(KINDS)})")
    assert fixed != source
    return DemoTask(f"demo__{kind}-{index:04d}", kind, module, source, fixed, command, tests, statement)


def generate(n: int, seed: int = 0, kinds: tuple[str, ...] = KINDS) -> list[DemoTask]:
    """``n`` tasks, cycling through ``kinds``; the same ``(n, seed)`` always gives the same tasks."""
    if n < 1:
        raise LegorlError(f"the number of demo tasks must be >= 1, got {n}")
    rng = random.Random(seed)
    return [make_task(rng, i, kinds[i % len(kinds)]) for i in range(n)]


# --------------------------------------------------------------------------- SWE-bench rows


def _new_file_diff(path: str, text: str) -> str:
    lines = text.splitlines()
    body = "".join(f"+{line}\n" for line in lines)
    return (f"diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n+++ b/{path}\n"
            f"@@ -0,0 +1,{len(lines)} @@\n{body}")


def _edit_diff(path: str, before: str, after: str) -> str:
    import difflib

    hunk = difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                f"a/{path}", f"b/{path}")
    return f"diff --git a/{path} b/{path}\n" + "".join(hunk)


def _fast_import_stream(tasks: list[DemoTask]) -> bytes:
    out: list[bytes] = []
    for i, task in enumerate(tasks, 1):
        data = task.source.encode()
        out += [f"commit refs/tasks/{task.instance_id}\nmark :{i}\n".encode(),
                f"author demo <demo@localhost> {_DATE}\ncommitter demo <demo@localhost> {_DATE}\n".encode(),
                b"data 0\n",
                f"M 100644 inline {task.filename}\ndata {len(data)}\n".encode(), data, b"\n\n"]
    return b"".join(out)


def write_bundle(tasks: list[DemoTask], bundle: Path) -> dict[str, str]:
    """Write every task's repository as one parentless commit into the git bundle ``bundle``;
    returns instance id -> commit id."""
    with tempfile.TemporaryDirectory(prefix="legorl-demo-") as tmp:
        env_git = ["git", "-c", "init.defaultBranch=main", "-C", tmp]
        subprocess.run([*env_git, "init", "-q", "--bare"], check=True)
        marks = Path(tmp) / "marks"
        proc = subprocess.run([*env_git, "fast-import", "--quiet", f"--export-marks={marks}"],
                              input=_fast_import_stream(tasks), capture_output=True)
        if proc.returncode != 0:
            raise LegorlError(f"git fast-import of the demo tasks failed: {proc.stderr.decode().strip()[-300:]}")
        by_mark = dict(line.split() for line in marks.read_text().splitlines())
        bundle.parent.mkdir(parents=True, exist_ok=True)
        tmp_bundle = bundle.with_suffix(".bundle.tmp")
        proc = subprocess.run([*env_git, "bundle", "create", "-q", str(tmp_bundle.resolve()), "--all"],
                              capture_output=True)
        if proc.returncode != 0:
            raise LegorlError(f"git bundle create {bundle} failed: {proc.stderr.decode().strip()[-300:]}")
        tmp_bundle.replace(bundle)
    return {t.instance_id: by_mark[f":{i}"] for i, t in enumerate(tasks, 1)}


def task_rows(tasks: list[DemoTask], commits: dict[str, str], bundle_name: str) -> list[dict[str, str]]:
    """SWE-bench-schema rows (``repo_source`` relative to the rows' file)."""
    rows = []
    for t in tasks:
        f2p = [f"{t.test_filename}::test_{t.tests.split('def test_')[1].split('(')[0]}"]
        p2p = [f"{t.test_filename}::test_{t.tests.split('def test_')[2].split('(')[0]}"]
        rows.append({
            "instance_id": t.instance_id,
            "repo": f"legorl-demo/{t.kind}",
            "base_commit": commits[t.instance_id],
            "patch": _edit_diff(t.filename, t.source, t.fixed_source),
            "test_patch": _new_file_diff(t.test_filename, t.tests),
            "problem_statement": t.statement,
            "hints_text": "",
            "created_at": "2000-01-01T00:00:00Z",
            "version": "1",
            "FAIL_TO_PASS": json.dumps(f2p),
            "PASS_TO_PASS": json.dumps(p2p),
            "environment_setup_commit": commits[t.instance_id],
            "repo_source": bundle_name,
        })
    return rows


def write_task_set(out_dir: Path, n: int, seed: int = 0, kinds: tuple[str, ...] = KINDS) -> Path:
    """Generate ``n`` tasks into ``out_dir`` (``tasks.jsonl`` + ``repos.bundle``); returns the JSONL path,
    ready for ``legorl tasks import``."""
    tasks = generate(n, seed, kinds)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    bundle = out_dir / "repos.bundle"
    commits = write_bundle(tasks, bundle)
    path = out_dir / "tasks.jsonl"
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in task_rows(tasks, commits, bundle.name)))
    tmp.replace(path)
    return path
