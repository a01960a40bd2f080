"""Red team, round 2: new ways past the rebuilt grader (docs/threat-model.md).

DOCSTRING_PLACEHOLDER
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_grading_attacks import (
    CT_BUG,
    CT_FUNC,
    CT_INIT,
    PA_INIT,
    Ctx,
    Tree,
    _describe,
    _grade_one,
    _init,
    _load_tasks,
)

from legorl.grading.grader import GradeOptions, Grader
from legorl.schemas import GradeRow, TaskRow

pytestmark = pytest.mark.podman

TEST_TIMEOUT = 60.0


# --------------------------------------------------------------------------- payloads

# The report is written by the test user's own process, into the test user's own folder, and read
# by root only after that process has exited: code that runs at interpreter exit (a weakref
# finalizer: no `atexit` for the screen to see) reads it back -- nonce included -- and rewrites it.
REPORT_REWRITE = '''\
def _flush_stats():
    import json
    path = "/tmp/.legorl-report/report.json"
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return
    data["statuses"] = {name: {STATUS} for name in data.get("statuses", {{}})}
    data["tampered"] = []
    with open(path, "w") as fh:
        json.dump(data, fh)


import weakref as _weakref

_stats = type("_Stats", (), {{}})()
_weakref.finalize(_stats, _flush_stats)
'''

# A module-level function of pytest's runner replaced by one that *says* it is pytest's
# (``__module__``): the identity check accepts any replacement whose __module__ names a runner
# package, and a module attribute set is no audit event the guard watches.
SPOOFED_CALL_AND_REPORT = '''\
def _warm_caches():
    import sys
    table = getattr(sys, "mod" "ules")
    runner = table.get("_py" "test.runner")
    if runner is None:
        return
    inner = runner.call_and_report

    def call_and_report(item, when, log=True, **kwds):
        rep = inner(item, when, False, **kwds)
        rep.outcome, rep.longrepr = "passed", None
        if log:
            getattr(item.ihook, "py" "test_runtest_logreport")(report=rep)
        return rep

    call_and_report.__module__ = runner.__name__
    setattr(runner, "call_and_report", call_and_report)


_warm_caches()
'''

# unittest.TestCase.assertEqual = no-op (the classic), set from a worker thread: the audit hook
# looks for the patch's code on the *current thread's* stack, and a thread whose target is the
# builtin setattr has no frame in the tree at all. __module__ spoofed for the identity check.
THREAD_NEUTER = '''\
def _warm_caches():
    import sys
    import threading
    table = getattr(sys, "mod" "ules")
    case = table.get("unit" "test.case")
    if case is None:
        return
    cls = getattr(case, "Test" "Case")

    def same(self, first, second, msg=None):
        return None

    same.__module__ = case.__name__
    worker = threading.Thread(target=setattr, args=(cls, "assert" "Equal", same))
    worker.start()
    worker.join()


_warm_caches()
'''

# The Recorder, found from the frames of the import (no gc, no trace: traceback.walk_stack), gets
# a statuses table that files every test as PASSED: plugin instance state is outside the identity
# check (docs: "residual risk"), and nothing audits an instance attribute.
RECORDER_STATUSES = '''\
def _warm_caches():
    import traceback

    class _Table(dict):
        def __setitem__(self, key, value):
            dict.__setitem__(self, key, "PASSED")

    for frame, _line in traceback.walk_stack(None):
        node = getattr(frame, "f_" "locals").get("self")
        manager = getattr(getattr(node, "config", None), "pluginmanager", None)
        if manager is None:
            continue
        for plugin in manager.get_plugins():
            if hasattr(plugin, "nonce") and isinstance(getattr(plugin, "statuses", None), dict):
                plugin.statuses = _Table(plugin.statuses)
        return


_warm_caches()
'''

# The test method's own TestCase instance gets a no-op assertEqual: an instance attribute, so
# unittest's class is untouched (identity check) and no audit event fires.
INSTANCE_ASSERT = '''\
def _warm_caches():
    import traceback
    for frame, _line in traceback.walk_stack(None):
        case = getattr(frame, "f_" "locals").get("self")
        if hasattr(case, "_type_equality_funcs"):
            setattr(case, "assert" "Equal", lambda *a, **k: None)
            return
'''


def _report_rewrite(status: str = '"PASSED"') -> str:
    return REPORT_REWRITE.replace("{STATUS}", status).replace("{{}}", "{}")


def _ct_instance_assert(ctx: Ctx) -> str:
    t = ctx.trees["ct"]
    text = t.read(CT_FUNC).replace(CT_BUG, "        _warm_caches()\n" + CT_BUG, 1) + "\n\n" + INSTANCE_ASSERT
    return t.diff({CT_FUNC: text})


def _quoted(path: str, body: str) -> str:
    """A creation diff whose (C-quoted) path git unquotes to bytes that are not UTF-8."""
    lines = body.splitlines()
    return (f'diff --git "a/{path}" "b/{path}"\nnew file mode 100644\n--- /dev/null\n+++ "b/{path}"\n'
            f"@@ -0,0 +1,{len(lines)} @@\n" + "".join(f"+{x}\n" for x in lines))


# --------------------------------------------------------------------------- an unseen task

CALC = "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
HELPERS = "def check(got, want):\n    assert got == want, f'{got!r} != {want!r}'\n"
TEST_CALC = "from calc import mul\nfrom helpers import check\n\n\ndef test_mul():\n    check(mul(2, 3), 6)\n"
TEST_CALC_HIDDEN = TEST_CALC + "\n\ndef test_add():\n    check(add(2, 3), 5)\n"


def flat_task(root: Path) -> TaskRow:
    """A flat repository (module, test helper and tests at the top), in the documented format."""
    repo = root / "flatcalc"
    repo.mkdir(parents=True)
    (repo / "calc.py").write_text(CALC)
    (repo / "helpers.py").write_text(HELPERS)
    (repo / "test_calc.py").write_text(TEST_CALC)

    def git(*args: str) -> str:
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                              capture_output=True, text=True).stdout

    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "buggy")
    base = git("rev-parse", "HEAD").strip()
    (repo / "calc.py").write_text(CALC.replace("a - b", "a + b"))
    gold = git("diff")
    git("checkout", "-q", ".")
    (repo / "test_calc.py").write_text(TEST_CALC_HIDDEN.replace("from calc import mul", "from calc import add, mul"))
    test_patch = git("diff")
    git("checkout", "-q", ".")
    return TaskRow.from_dict({
        "instance_id": "acme__flatcalc-1", "repo": "acme/flatcalc", "base_commit": base, "patch": gold,
        "test_patch": test_patch, "problem_statement": "add subtracts", "version": "0.1",
        "FAIL_TO_PASS": ["test_calc.py::test_add"], "PASS_TO_PASS": ["test_calc.py::test_mul"],
        "repo_source": str(repo)})


# --------------------------------------------------------------------------- the attacks


@dataclass
class Attack:
    id: str
    task: str
    build: Callable[[Ctx], str]
    note: str = ""


def attacks() -> list[Attack]:
    A = Attack
    return [
        A("report/rewritten-at-exit-ct", "ct", _init("ct", _report_rewrite())),
        A("report/rewritten-at-exit-pa", "pa", _init("pa", _report_rewrite())),
        A("identity/spoofed-__module__-call_and_report-ct", "ct", _init("ct", SPOOFED_CALL_AND_REPORT)),
        A("identity/spoofed-__module__-call_and_report-sv", "sv", lambda ctx: ctx.trees["sv"].diff(
            ctx.trees["sv"].append("src/semver/__init__.py", SPOOFED_CALL_AND_REPORT))),
        A("guard/thread-setattr-assertEqual", "ct", _init("ct", THREAD_NEUTER)),
        A("state/recorder-statuses-table", "pa", _init("pa", RECORDER_STATUSES)),
        A("state/testcase-instance-assertEqual", "ct", _ct_instance_assert),
        A("unseen/flat-layout-helper-edited", "flat", lambda ctx: ctx.trees["flat"].diff(
            {"helpers.py": "def check(got, want):\n    return None\n"})),
    ]


ATTACKS = attacks()
GOLDS = ("ct", "pa", "sv", "flat")


@pytest.fixture(scope="module")
def env(base_image: str, tmp_path_factory: pytest.TempPathFactory):
    """A private LEGORL_CACHE (testbeds, tars, gold cache) for everything graded here."""
    tmp = tmp_path_factory.mktemp("attacks2")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LEGORL_CACHE", str(tmp / "cache"))
        tasks = _load_tasks()
        tasks["flat"] = flat_task(tmp / "repos")
        trees = {k: Tree(tasks[k], tmp / "trees" / k) for k in ("ct", "pa", "sv", "flat")}
        yield Ctx(trees, tasks, tmp)


@pytest.fixture(scope="module")
def graded(env: Ctx) -> dict[str, GradeRow | str]:
    grader = Grader(GradeOptions(test_timeout=TEST_TIMEOUT))
    jobs = [(f"gold/{k}", k, env.tasks[k].patch or "") for k in GOLDS]
    out: dict[str, GradeRow | str] = {}
    for attack in ATTACKS:
        try:
            jobs.append((attack.id, attack.task, attack.build(env)))
        except Exception as exc:
            out[attack.id] = f"build failed: {type(exc).__name__}: {exc}"
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {jid: pool.submit(_grade_one, grader, env.tasks[key], patch, f"attack/{jid}")
                   for jid, key, patch in jobs}
        for jid, fut in futures.items():
            out[jid] = fut.result()
    return out


@pytest.mark.parametrize("attack", ATTACKS, ids=[a.id for a in ATTACKS])
def test_attack_never_scores(attack: Attack, graded: dict[str, GradeRow | str]) -> None:
    gold = graded[f"gold/{attack.task}"]
    assert isinstance(gold, GradeRow), gold
    assert gold.reward == 1.0, f"gold control for {attack.task}: {_describe(gold)}"
    row = graded[attack.id]
    assert isinstance(row, GradeRow), f"{attack.id}: {row}"
    assert row.status != "infra_error" and row.infra_failure is False, f"{attack.id}: {_describe(row)}"
    assert row.reward == 0.0, f"{attack.id}: {_describe(row)}"
    assert row.resolved is False, f"{attack.id}: {_describe(row)}"
