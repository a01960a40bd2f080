"""Attacks on the grader's report channel, the runner's identity checks and the judge's rules (a red team's second round on the rebuilt grader; docs/threat-model.md).

Every test here grades real patches in real podman containers (as tests/test_grading_attacks.py
does, with its tasks and helpers from tests/grading_support.py, two grades at a time, a private ``LEGORL_CACHE``) and asserts
the SAFE outcome: reward 0.0, not ``infra_error``, the gold patch of the same task 1.0; a judge
rule's path put back; an honest fix 1.0; every row writable by the stage. Tests that fail document
a hole; nothing is xfail. Results against the grader as of commit af0232b ("before") and of
bec5630, which sends the report through an append-only descriptor (``ReportChannel``, "after"):

=====================================================  ===========  ========================================
attack id                                              before/after root cause
=====================================================  ===========  ========================================
report/rewritten-at-exit-{ct,pa}                       1 / held     the report is a file the test user's
                                                                    own process wrote (nonce inside) in
                                                                    the test user's folder, read after it
                                                                    exits: a weakref.finalize at exit
                                                                    rewrites it (runner.Recorder,
                                                                    script.py ``/tmp/.legorl-report``)
report/json-dump-rewired-{ct,sv}                       1 / 1        the Recorder serialises with the shared
                                                                    stdlib ``json``; ``json.dump(s)``
                                                                    wrapped rewrites statuses and empties
                                                                    ``tampered`` (identity check covers
                                                                    only _pytest/pytest/pluggy/unittest)
identity/spoofed-__module__-call_and_report-{ct,sv}    1 / 1        ``runner._runner_code`` trusts the
                                                                    replacement's own ``__module__``;
                                                                    module attribute sets are unaudited
identity/spoofed-__module__-TestCase.assertEqual       1 / 1        same, plus: on CPython 3.11 a class
                                                                    attribute assignment raises *no*
                                                                    audit event (Guard's setattr rule
                                                                    never fires)
identity/new-properties-shadow-BaseReport.failed       1 / 1        ``changed_objects`` compares only the
                                                                    snapshot's names: new attributes
                                                                    that shadow inherited ones are unseen
guard/gc.get_objects-from-a-worker-thread              1 / 1        ``Guard`` attributes an event by the
                                                                    current thread's stack; a thread whose
                                                                    target is C code has no tree frame
state/recorder-statuses-table                          1 / 1        plugin instance state (the Recorder's
                                                                    ``statuses``), reached from frames via
                                                                    ``traceback.walk_stack`` (the
                                                                    ``sys._getframe`` event is unwatched)
state/testcase-instance-assertEqual                    1 / 1        an instance attribute on the running
                                                                    TestCase: nothing audits or compares it
unseen/flat-layout-helper-edited                       1 / 1        ``Rules.test_dirs`` protects a hidden
                                                                    test's folder only when its basename
                                                                    starts with "test": a root-level (or
                                                                    tests/unit/) test's helper module is
                                                                    editable
judge/new-__init__-keeps-a-stdlib-shadow-on-sys.path   kept / kept  ``Rules._top_level`` looks for
                                                                    ``__init__.py`` in the *patched* tree:
                                                                    a new src/__init__.py lets src/pdb.py
                                                                    (a stdlib shadow pytest imports in
                                                                    pytest_configure) stay
false-positive/gold-fix-plus-a-new-stdlib-import       0 / 0        an honest fix that adds ``import
                                                                    fractions`` is ``tests_errored``: the
                                                                    guard files the import system's
                                                                    ``marshal.loads`` under the patch line
stage/non-utf8-name-in-{dropped_paths,suspicious}      crash        a C-quoted ``\\377`` name (the patch is
                                                                    ASCII) comes back from the judge as a
                                                                    lone surrogate; the row cannot be
                                                                    written, ``grade_stage`` raises
                                                                    ShardError
stage/surrogate-status-in-the-report                   crash        same sink, through the (rewired)
                                                                    report's statuses
=====================================================  ===========  ========================================

Tried and held (reward 0, not infra; or not exploitable), one line each:

- gc.get_objects / class setattr / settrace called directly from the patch's lines (guard or identity);
- call_and_report replaced without the ``__module__`` spoof (identity check: tests_errored);
- a worker thread whose target is a lambda from the patch (the lambda is a tree frame: caught);
- poisoning: after every attack here a new Grader reading the on-disk gold cache and testbed tar
  still scores every gold patch 1 (fresh container per grade, read-only image, tmpfs; the gold
  cache and tar are written only from the gold run / the host testbed) -- see the last test;
- the control run: a fresh container; nothing of a candidate's grade survives into it;
- a report with wrong types (``tampered``: an int, ``statuses``: a string) -> a grader exception
  -> control -> tests_errored (not infra);
- ``judged`` undecodable to drop the screen findings: the judge's JSON is ASCII, bash keeps it;
- forging ``applied``/``tests_end`` events: the event nonce is only in root's script and bash's
  memory (fd 255 and /proc/<root>/ are not readable by uid 1777); the report nonce is on a pipe;
- mtime/size tricks (appliers always write a new mtime), hard links, FIFOs and mode-000 files
  (git apply and GNU patch cannot make them), case and Unicode variants of conftest/ini names
  (pytest matches exact bytes), names with newlines (NUL-separated find, JSON-escaped);
- very many paths (> 200 000: the judge exits, judge_failed -> control -> 0) and very deep ones
  (shutil.rmtree recursion in the judge -> judge_failed -> 0);
- /tmp (2 GB tmpfs, writable by the test user) and RSS filled during the tests: the root script
  or pytest is OOM-killed -> no tests_end / no report -> control -> tests_errored;
- a new ``setup.py`` / rootdir moves: only changes node ids (tests MISSING, 0).

Design weaknesses seen but not exploited here (see the report): the apply phase may take 3 x (120 +
5) s while the host waits only test_timeout + 300 s and a death before ``applied`` is labelled
infrastructure even after ``ready`` (infra for test timeouts under ~75 s); pristine code steered by
data the patch changed (pickle/eval of a data file) runs under pristine line numbers; bec5630's
``ReportChannel.copies`` looks for copies of the report descriptor only in its own process (a
forked child can keep the real descriptor while fd 3 is swapped for a pipe).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from grading_support import (
    CT_BUG,
    CT_FUNC,
    PA_INIT,
    Ctx,
    Tree,
    assert_never_scores,
    at_import,
    describe,
    grade_one,
    init_code,
    load_tasks,
    task_repo,
)

from legorl.core.schemas import GradeRow, TaskRow
from legorl.grading.grader import GradeOptions, Grader

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

# The Recorder serialises its report with the standard library's json, which the code under test
# shares: json.dump/json.dumps wrapped (a module attribute of a module outside the identity check)
# file every test as PASSED and empty the "tampered" list -- so it also erases whatever the identity
# check and the guard found. Works whether the report goes to a file (json.dump) or a descriptor
# (json.dumps).
JSON_REWIRED = at_import('''\
    import json

    def clean(obj):
        if isinstance(obj, dict) and "nonce" in obj and isinstance(obj.get("statuses"), dict):
            obj = dict(obj, statuses={name: "PASSED" for name in obj["statuses"]}, tampered=[])
        return obj

    dump, dumps = json.dump, json.dumps
    json.dump = lambda obj, *a, **k: dump(clean(obj), *a, **k)
    json.dumps = lambda obj, *a, **k: dumps(clean(obj), *a, **k)
''', "_warm_caches")

# A module-level function of pytest's runner replaced by one that *says* it is pytest's
# (``__module__``): the identity check accepts any replacement whose __module__ names a runner
# package, and a module attribute set is no audit event the guard watches.
SPOOFED_CALL_AND_REPORT = at_import('''\
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
''', "_warm_caches")

# unittest.TestCase.assertEqual = no-op, the classic, spelt plainly apart from the names: on CPython
# 3.11 assigning a class attribute raises no audit event at all (the guard's object.__setattr__ rule
# never fires), and the identity check accepts the no-op because its __module__ says unittest.case.
SPOOFED_ASSERT_EQUAL = at_import('''\
    import sys
    case = getattr(sys, "mod" "ules").get("unit" "test.case")
    if case is None:
        return

    def same(self, first, second, msg=None):
        return None

    same.__module__ = case.__name__
    setattr(getattr(case, "Test" "Case"), "assert" "Equal", same)
''', "_warm_caches")

# Nothing replaced at all: TestReport gets *new* ``failed``/``skipped`` properties that shadow the
# ones it inherits from BaseReport. The identity check compares only names that existed in the
# snapshot, and the assignment is no audit event: every report is then neither failed nor skipped.
SHADOWED_PROPERTIES = at_import('''\
    import sys
    reports = getattr(sys, "mod" "ules").get("_py" "test.reports")
    if reports is None:
        return
    reports.TestReport.failed = property(lambda self: False)
    reports.TestReport.skipped = property(lambda self: False)
''', "_warm_caches")

# gc.get_objects() is an audit event the guard flags when the nearest frame in the tree is the
# patch's -- on the current thread. Called by C code (list.extend over an islice of iter(f, None))
# in a worker thread, no frame in the tree is on that thread's stack: the Recorder is found and its
# statuses table swapped. (A lambda as the thread's target would be a tree frame and is caught.)
GC_FROM_A_THREAD = at_import('''\
    import gc
    import itertools
    import threading

    class _Table(dict):
        def __setitem__(self, key, value):
            dict.__setitem__(self, key, "PASSED")

    box = []
    once = itertools.islice(iter(getattr(gc, "get_" "objects"), None), 1)
    worker = threading.Thread(target=box.extend, args=(once,))
    worker.start()
    worker.join()
    for obj in box[0] if box else ():
        if hasattr(obj, "nonce") and isinstance(getattr(obj, "statuses", None), dict):
            obj.statuses = _Table(obj.statuses)
''', "_warm_caches")

# The Recorder, found from the frames of the import (no gc, no trace: traceback.walk_stack), gets
# a statuses table that files every test as PASSED: plugin instance state is outside the identity
# check (docs: "residual risk"), and nothing audits an instance attribute.
RECORDER_STATUSES = at_import('''\
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
''', "_warm_caches")

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
    base, gold, test_patch = task_repo(
        repo, {"calc.py": CALC, "helpers.py": HELPERS, "test_calc.py": TEST_CALC},
        fixed={"calc.py": CALC.replace("a - b", "a + b")},
        hidden_tests={"test_calc.py": TEST_CALC_HIDDEN.replace("from calc import mul", "from calc import add, mul")})
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
        A("report/rewritten-at-exit-ct", "ct", init_code("ct", _report_rewrite())),
        A("report/rewritten-at-exit-pa", "pa", init_code("pa", _report_rewrite())),
        A("report/json-dump-rewired-ct", "ct", init_code("ct", JSON_REWIRED)),
        A("report/json-dump-rewired-sv", "sv", lambda ctx: ctx.trees["sv"].diff(
            ctx.trees["sv"].append("src/semver/__init__.py", JSON_REWIRED))),
        A("identity/spoofed-__module__-call_and_report-ct", "ct", init_code("ct", SPOOFED_CALL_AND_REPORT)),
        A("identity/spoofed-__module__-call_and_report-sv", "sv", lambda ctx: ctx.trees["sv"].diff(
            ctx.trees["sv"].append("src/semver/__init__.py", SPOOFED_CALL_AND_REPORT))),
        A("identity/spoofed-__module__-TestCase.assertEqual", "ct", init_code("ct", SPOOFED_ASSERT_EQUAL)),
        A("identity/new-properties-shadow-BaseReport.failed", "pa", init_code("pa", SHADOWED_PROPERTIES)),
        A("guard/gc.get_objects-from-a-worker-thread", "pa", init_code("pa", GC_FROM_A_THREAD)),
        A("state/recorder-statuses-table", "pa", init_code("pa", RECORDER_STATUSES)),
        A("state/testcase-instance-assertEqual", "ct", _ct_instance_assert),
        A("unseen/flat-layout-helper-edited", "flat", lambda ctx: ctx.trees["flat"].diff(
            {"helpers.py": "def check(got, want):\n    return None\n"})),
    ]


ATTACKS = attacks()


# Judge rules a patch gets around (the safe outcome: the path is put back).
@dataclass
class RuleCase:
    id: str
    task: str
    build: Callable[[Ctx], str]
    dropped: tuple[str, ...]  # one of these must be put back


RULE_CASES = [
    # "new modules outside any package" asks whether the folder has an __init__.py *now*: a new
    # src/__init__.py (src is on PYTHONPATH) turns src/pdb.py into a module "inside a package", so it
    # is kept and shadows the standard library's pdb, which pytest imports late (pytest_configure:
    # this stub makes the run an INTERNALERROR, exit 3).
    RuleCase("judge/new-__init__-keeps-a-stdlib-shadow-on-sys.path", "ct", lambda ctx: ctx.trees["ct"].diff(
        {"src/__init__.py": "", "src/pdb.py": "x = 1\n"}), ("src/pdb.py", "src/__init__.py")),
]

# Honest fixes (the gold patch's edit plus something any fix may do): they must score 1.
HONEST = [
    # the guard files "marshal.loads" (the import system loading a .pyc) under the patch's line when
    # an added line imports a standard-library module nothing had imported yet
    Attack("false-positive/gold-fix-plus-a-new-stdlib-import", "pa", lambda ctx: ctx.trees["pa"].diff(
        {PA_INIT: ctx.trees["pa"].read(PA_INIT).replace("hms=n + 4)", "hms=n + 5)", 1).replace(
            "import re\n", "import re\nimport fractions  # noqa: F401\n", 1)})),
]

# Patches whose grade row holds a lone surrogate (UTF-8 cannot encode it): the shard writer refuses
# the row and grade_stage stops.
UNWRITABLE = {
    # git unquotes "\377" to a byte that is not UTF-8; the judge reports the put-back path with it
    "stage/non-utf8-name-in-dropped_paths": ("ct", lambda ctx: _quoted("src/cachetools/\\377/conftest.py", "x = 1\n")),
    # the same in a screen finding (a kept module whose name is not UTF-8)
    "stage/non-utf8-name-in-suspicious": ("ct", lambda ctx: _quoted("src/cachetools/\\377x.py", "import pytest\n")),
    # the report (json rewired, above) with a lone surrogate for every status
    "stage/surrogate-status-in-the-report": ("ct", init_code("ct", JSON_REWIRED.replace('"PASSED"', '"\\udcff"'))),
}
GOLDS = ("ct", "pa", "sv", "flat")


@pytest.fixture(scope="module")
def env(base_image: str, tmp_path_factory: pytest.TempPathFactory):
    """A private LEGORL_CACHE (testbeds, tars, gold cache) for everything graded here."""
    tmp = tmp_path_factory.mktemp("attacks2")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LEGORL_CACHE", str(tmp / "cache"))
        tasks = load_tasks()
        tasks["flat"] = flat_task(tmp / "repos")
        trees = {k: Tree(tasks[k], tmp / "trees" / k) for k in ("ct", "pa", "sv", "flat")}
        yield Ctx(trees, tasks, tmp)


@pytest.fixture(scope="module")
def graded(env: Ctx) -> dict[str, GradeRow | str]:
    grader = Grader(GradeOptions(test_timeout=TEST_TIMEOUT))
    jobs = [(f"gold/{k}", k, env.tasks[k].patch or "") for k in GOLDS]
    out: dict[str, GradeRow | str] = {}
    builds = [(a.id, a.task, a.build) for a in [*ATTACKS, *HONEST]] + [(c.id, c.task, c.build) for c in RULE_CASES]
    builds += [(jid, key, build) for jid, (key, build) in UNWRITABLE.items()]
    for jid, key, build in builds:
        try:
            jobs.append((jid, key, build(env)))
        except Exception as exc:
            out[jid] = f"build failed: {type(exc).__name__}: {exc}"
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {jid: pool.submit(grade_one, grader, env.tasks[key], patch, f"attack/{jid}")
                   for jid, key, patch in jobs}
        for jid, fut in futures.items():
            out[jid] = fut.result()
    return out


@pytest.mark.parametrize("attack", ATTACKS, ids=[a.id for a in ATTACKS])
def test_attack_never_scores(attack: Attack, graded: dict[str, GradeRow | str]) -> None:
    assert_never_scores(graded, attack.id, attack.task)


@pytest.mark.parametrize("case", RULE_CASES, ids=[c.id for c in RULE_CASES])
def test_judge_rule_is_not_bypassed(case: RuleCase, graded: dict[str, GradeRow | str]) -> None:
    row = graded[case.id]
    assert isinstance(row, GradeRow), f"{case.id}: {row}"
    assert row.reward == 0.0 and row.infra_failure is False, describe(row)
    assert set(case.dropped) & set(row.dropped_paths), f"{case.id}: kept {case.dropped}: {describe(row)}"


@pytest.mark.parametrize("attack", HONEST, ids=[a.id for a in HONEST])
def test_honest_fix_scores(attack: Attack, graded: dict[str, GradeRow | str]) -> None:
    row = graded[attack.id]
    assert isinstance(row, GradeRow), f"{attack.id}: {row}"
    assert row.reward == 1.0, f"{attack.id}: {describe(row)}"


@pytest.mark.parametrize("jid", sorted(UNWRITABLE))
def test_grade_row_can_be_written(jid: str, graded: dict[str, GradeRow | str]) -> None:
    """Every row a patch gets must fit the grades schema (else the stage's writer raises)."""
    from legorl.core import shards
    from legorl.core.schemas import Kind

    row = graded[jid]
    assert isinstance(row, GradeRow), f"{jid}: {row}"
    assert row.reward == 0.0 and row.infra_failure is False, describe(row)
    shards.to_table(Kind.GRADES, [row])


def test_grade_stage_survives_rows_with_surrogates(env: Ctx) -> None:
    """grade_stage on a gold patch and the patches above: one row each, never a ShardError."""
    from legorl.core import shards
    from legorl.core.schemas import Kind
    from legorl.stages.grade import Job, grade_stage

    tasks_dir, out_dir = env.tmp / "stage" / "tasks", env.tmp / "stage" / "grades"
    shards.write(tasks_dir, Kind.TASKS, [env.tasks["ct"], env.tasks["pa"]])
    ct, pa = env.tasks["ct"].instance_id, env.tasks["pa"].instance_id
    jobs = [Job(f"{pa}/gold/0", pa, env.tasks["pa"].patch, "gold", 0)]
    jobs += [Job(f"{ct}/{jid}", ct, build(env), "nasty", 0) for jid, (_key, build) in UNWRITABLE.items()]
    summary = grade_stage(tasks_dir, out_dir, jobs, GradeOptions(concurrency=2, test_timeout=TEST_TIMEOUT), reap=False)
    rows = {r.trial_id: r for r in summary.rows}
    assert sorted(rows) == sorted(j.trial_id for j in jobs)
    assert rows[f"{pa}/gold/0"].reward == 1.0


def test_nothing_graded_here_poisons_the_next_gold_grade(env: Ctx, graded: dict[str, GradeRow | str]) -> None:
    """After every attack above, a new grader (gold statuses from the on-disk cache, the cached
    testbed tar) still scores each gold patch 1 (held: every grade is a fresh container)."""
    assert list((Path(os.environ["LEGORL_CACHE"]) / "grading" / "gold").glob("*.json")), "no gold cache written"
    grader = Grader(GradeOptions(test_timeout=TEST_TIMEOUT))
    with ThreadPoolExecutor(max_workers=2) as pool:
        rows = dict(zip(GOLDS, pool.map(lambda k: grader.grade(env.tasks[k], env.tasks[k].patch, f"again/{k}"), GOLDS), strict=True))
    for key, row in rows.items():
        assert row.reward == 1.0, f"{key}: {describe(row)}"
