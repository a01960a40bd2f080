"""A family of tiny repair tasks, generated deterministically from a seed, in SWE-bench's schema.

Each task is a one-file repository holding one function with the wrong operator and one correct
neighbour; the fix is one ``sed`` substitution. The hidden tests (``test_patch``) check the fixed
function (FAIL_TO_PASS) and the neighbour (PASS_TO_PASS), so a substitution that hits the
neighbour, or breaks the file, fails. Two kinds, two phrasings of the statement each:

- ``flip`` (``calc.py``): "`merge` in calc.py should add, not subtract."
  → ``sed -i 's/a [-+] b/a + b/' calc.py``;
- ``compare`` (``checks.py``): "`fold` in checks.py should check that a is less than b."
  → ``sed -i 's/a [<>] b/a < b/' checks.py``.

The pattern is a bracket of both operators, so the command holds exactly one decision, the operator
it writes; writing the one already there (``reversed_command``) changes nothing: empty patch, reward 0.

What varies: the function and its neighbour (names, order), the direction of the bug, the
phrasing, the test values. The family is small on purpose — what a ~5 M-parameter
model can read out of a statement after a short warm-up is a word-to-operator lookup, not
arbitrary copying (measured: names and numbers copied at chance after 200 warm-up steps).
"""

from __future__ import annotations

import json
import random
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from legorl.core.errors import LegorlError

KINDS = ("flip", "compare")
# The (kind, wanted operator) cells a task set cycles through.
CELLS = (("flip", "+"), ("flip", "-"), ("compare", "<"), ("compare", ">"))
_MODULES = {"flip": "calc", "compare": "checks"}
_FUNCS = ("total", "combine", "merge", "join", "mix", "blend", "pair", "fold")
_WORDS = {"+": "add", "-": "subtract", "<": "less than", ">": "greater than"}
_DATE = "946684800 +0000"  # 2000-01-01: commit ids depend only on the seed


@dataclass(frozen=True)
class DemoTask:
    """One generated task: the repository's file, the one-line fix, and the hidden tests."""

    instance_id: str
    kind: str
    module: str  # file name without .py
    source: str  # the buggy file
    fixed_source: str
    wrong: str  # the operator the bug put there
    right: str  # the operator the tests want
    tests: str  # the hidden test file
    statement: str

    @property
    def filename(self) -> str:
        return f"{self.module}.py"

    @property
    def test_filename(self) -> str:
        return f"test_{self.module}.py"

    @property
    def operators(self) -> str:
        """Both operators of the kind as a sed bracket (``[-+]``, ``[<>]``): the pattern names no choice."""
        return "[-+]" if self.kind == "flip" else "[<>]"

    def edit_command(self, operator: str) -> str:
        """The one-line edit that writes ``operator`` into the function: ``sed -i 's/a [-+] b/a + b/' calc.py``."""
        return f"sed -i 's/a {self.operators} b/a {operator} b/' {self.filename}"

    @property
    def fix_command(self) -> str:
        """The fix as a bash command (what the warm-up demonstrates)."""
        return self.edit_command(self.right)

    @property
    def reversed_command(self) -> str:
        """The edit that writes the operator already there: changes nothing, so the patch is empty."""
        return self.edit_command(self.wrong)


def make_task(rng: random.Random, index: int, kind: str, right_first: bool = True, seed: int = 0) -> DemoTask:
    if kind not in KINDS:
        raise LegorlError(f"unknown demo task kind {kind!r} (known: {', '.join(KINDS)})")
    module = _MODULES[kind]
    func, other = rng.sample(_FUNCS, 2)
    ops = ("+", "-") if kind == "flip" else ("<", ">")
    right, wrong = ops if right_first else ops[::-1]
    neighbour = "a * b" if kind == "flip" else "a == b"
    funcs = [f"def {func}(a, b):\n    return a {wrong} b\n", f"def {other}(a, b):\n    return {neighbour}\n"]
    rng.shuffle(funcs)
    source = "\n\n".join(funcs)
    fixed = source.replace(f"a {wrong} b", f"a {right} b")
    if kind == "flip":
        statement = rng.choice((f"`{func}` in {module}.py should {_WORDS[right]}, not {_WORDS[wrong]}.",
                                f"In {module}.py, `{func}` must {_WORDS[right]} its arguments."))
        a, b = rng.randint(10, 99), rng.randint(2, 9)
        cases = [(a, b)]
    else:
        statement = rng.choice((f"`{func}` in {module}.py should check that a is {_WORDS[right]} b.",
                                f"In {module}.py, `{func}` must return whether a is {_WORDS[right]} b."))
        a, b = rng.randint(2, 49), rng.randint(50, 99)
        cases = [(a, b), (b, a)]

    def value(op: str, x: int, y: int) -> object:
        return {"+": x + y, "-": x - y, "*": x * y, "<": x < y, ">": x > y, "==": x == y}[op]

    n_op = neighbour.split()[1]
    tests = (f"from {module} import {func}, {other}\n\n\n"
             f"def test_{func}():\n"
             + "".join(f"    assert {func}({x}, {y}) == {value(right, x, y)}\n" for x, y in cases)
             + f"\n\ndef test_{other}():\n"
             + "".join(f"    assert {other}({x}, {y}) == {value(n_op, x, y)}\n" for x, y in cases))
    # The seed is part of the id: task sets made from different seeds (training, held-out) never share one.
    return DemoTask(f"demo__{kind}-s{seed}-{index:04d}", kind, module, source, fixed, wrong, right, tests,
                    statement)


def generate(n: int, seed: int = 0, kinds: tuple[str, ...] = KINDS) -> list[DemoTask]:
    """``n`` tasks cycling through every (kind, direction) pair, so even a small set asks for each
    operator; the same ``(n, seed)`` always gives the same tasks."""
    if n < 1:
        raise LegorlError(f"the number of demo tasks must be >= 1, got {n}")
    rng = random.Random(seed)
    cells = [(kind, right_first) for right_first in (True, False) for kind in kinds]
    offset = rng.randrange(len(cells))
    return [make_task(rng, i, *cells[(i + offset) % len(cells)], seed=seed) for i in range(n)]


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
