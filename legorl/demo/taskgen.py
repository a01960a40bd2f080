"""A family of tiny repair tasks, generated deterministically from a seed, in SWE-bench's schema.

Each task is a one-file repository (``<module>.py``) holding one small bug and one correct
neighbour. The problem statement names the file and the wrong and right code, so the fix is one
``sed`` substitution a small model can learn to write; the hidden tests (``test_patch``) check the
fixed value (FAIL_TO_PASS) and the neighbour (PASS_TO_PASS), so a substitution that also hits the
neighbour, or breaks the file, fails. Three kinds of bug:

- ``op``: ``return x - y`` should be ``return x + y`` (or the other way round);
- ``const``: ``LIMIT = 17`` should be ``LIMIT = 42``;
- ``offset``: ``return n + 3`` should be ``return n + 8``.

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

KINDS = ("op", "const", "offset")
_WORDS = ["alpha", "amber", "apple", "arrow", "aspen", "basil", "birch", "blaze", "brick", "cedar", "chalk", "cider", "cliff", "clove", "cobalt", "coral", "crane", "daisy", "delta", "dune", "ember", "fable", "fern", "flint", "frost", "gale", "garnet", "ginger", "glade", "grain", "harbor", "hazel", "heron", "indigo", "iris", "ivory", "jade", "juniper", "kelp", "lark", "lemon", "lilac", "linen", "lotus", "maple", "marble", "meadow", "mint", "moss", "nectar", "noble", "oak", "olive", "onyx", "opal", "orchid", "pearl", "pebble", "pine", "plume", "poppy", "quartz", "raven", "reed", "ridge", "river", "robin", "sage", "sand", "shell", "sierra", "slate", "sorrel", "spruce", "stone", "storm", "sugar", "swift", "thyme", "tide", "timber", "topaz", "tulip", "velvet", "violet", "willow", "winter", "zephyr"]
_VARS = ("a", "b", "x", "y", "n", "m", "p", "q", "u", "v", "s", "t")
_DATE = "946684800 +0000"  # 2000-01-01: commit ids depend only on the seed


@dataclass(frozen=True)
class DemoTask:
    """One generated task: the repository's file, the one-line fix, and the hidden tests."""

    instance_id: str
    kind: str
    module: str  # file name without .py
    source: str  # the buggy file
    old: str  # the wrong line's code (unique in the file)
    new: str  # what it should be
    tests: str  # the hidden test file
    statement: str

    @property
    def filename(self) -> str:
        return f"{self.module}.py"

    @property
    def test_filename(self) -> str:
        return f"test_{self.module}.py"

    @property
    def fixed_source(self) -> str:
        return self.source.replace(self.old, self.new)

    @property
    def fix_command(self) -> str:
        """The canonical fix as the driver's bash command (what the warm-up teaches)."""
        return f"sed -i 's/{self.old}/{self.new}/' {self.filename}"


def _statement(rng: random.Random, func: str, module: str, old: str, new: str) -> str:
    forms = (
        "In {m}.py, `{f}` has a bug: replace `{o}` with `{n}`.",
        "`{f}` in {m}.py is wrong. Change `{o}` to `{n}`.",
    )
    return rng.choice(forms).format(m=module, f=func, o=old, n=new)


def make_task(rng: random.Random, index: int, kind: str) -> DemoTask:
    words = rng.sample(_WORDS, 3)
    module, f_bug, f_ok = words[0], f"get_{words[1]}", f"get_{words[2]}"
    if kind == "op":
        x, y, u, v = rng.sample(_VARS, 4)
        right, wrong = rng.choice((("+", "-"), ("-", "+")))
        ok_op = rng.choice("+-")
        old, new = f"{x} {wrong} {y}", f"{x} {right} {y}"
        source = (f"def {f_bug}({x}, {y}):\n    return {old}\n\n\n"
                  f"def {f_ok}({u}, {v}):\n    return {u} {ok_op} {v}\n")
        a, b = rng.randint(10, 99), rng.randint(1, 9)
        want = a + b if right == "+" else a - b
        ok_want = a + b if ok_op == "+" else a - b
        tests = (f"from {module} import {f_bug}, {f_ok}\n\n\n"
                 f"def test_{f_bug}():\n    assert {f_bug}({a}, {b}) == {want}\n\n\n"
                 f"def test_{f_ok}():\n    assert {f_ok}({a}, {b}) == {ok_want}\n")
        func = f_bug
    elif kind == "const":
        name, other = words[1].upper(), words[2].upper()
        old_v, new_v, other_v = rng.sample(range(2, 99), 3)
        old, new = f"{name} = {old_v}", f"{name} = {new_v}"
        source = f"{old}\n{other} = {other_v}\n"
        tests = (f"from {module} import {name}, {other}\n\n\n"
                 f"def test_{name.lower()}():\n    assert {name} == {new_v}\n\n\n"
                 f"def test_{other.lower()}():\n    assert {other} == {other_v}\n")
        func = name
    elif kind == "offset":
        x = rng.choice(_VARS)
        k_old, k_new, k_ok = rng.sample(range(2, 10), 3)
        old, new = f"{x} + {k_old}", f"{x} + {k_new}"
        source = (f"def {f_bug}({x}):\n    return {old}\n\n\n"
                  f"def {f_ok}({x}):\n    return {x} + {k_ok}\n")
        a = rng.randint(10, 99)
        tests = (f"from {module} import {f_bug}, {f_ok}\n\n\n"
                 f"def test_{f_bug}():\n    assert {f_bug}({a}) == {a + k_new}\n\n\n"
                 f"def test_{f_ok}():\n    assert {f_ok}({a}) == {a + k_ok}\n")
        func = f_bug
    else:
        raise LegorlError(f"unknown demo task kind {kind!r} (known: {', '.join(KINDS)})")
    assert source.count(old) == 1, (source, old)
    return DemoTask(f"demo__{kind}-{index:04d}", kind, module, source, old, new, tests,
                    _statement(rng, func, module, old, new))


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
