"""Grading in real podman containers on shipped tasks: gold 1, empty 0, adversarial patches never 1,
SWE-bench agrees on the very logs, and a SIGKILLed `legorl grade` resumes cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from grading_support import REPORT_PATCH, SHIPPED, new_file, shipped_tasks, task_repo

from legorl.core import shards
from legorl.core.schemas import GradeRow, Kind, TaskRow
from legorl.grading.grader import GradeOptions, Grader
from legorl.grading.patches import touched_paths

pytestmark = pytest.mark.podman

LEGORL = str(Path(sys.executable).parent / "legorl")


@pytest.fixture(scope="module")
def shipped() -> dict[str, TaskRow]:
    """The shipped tasks, repo_source made absolute (as the importer stores it)."""
    return shipped_tasks()


@pytest.fixture(scope="module")
def sample_ids(shipped: dict[str, TaskRow]) -> list[str]:
    """One task per library (three at most): enough variety, few containers."""
    by_repo: dict[str, str] = {}
    for iid, task in sorted(shipped.items()):
        by_repo.setdefault(task.repo or "", iid)
    return sorted(by_repo.values())[:3]


def _swebench_resolution(task: TaskRow, log: str, tmp_path: Path) -> str:
    from swebench.harness.grading import get_eval_tests_report, get_logs_eval, get_resolution_status
    from swebench.types import TestSpec

    path = tmp_path / f"{task.instance_id}.log"
    path.write_text(log)
    spec = TestSpec(instance_id=task.instance_id, image="x", eval_script_list=[], repo=task.repo or "", version="1",
                    FAIL_TO_PASS=task.FAIL_TO_PASS, PASS_TO_PASS=task.PASS_TO_PASS, log_parser="parse_log_pytest",
                    eval_type="pass_and_fail")
    status_map, found = get_logs_eval(spec, str(path))
    if not found:
        return "NO"
    report = get_eval_tests_report(status_map, {"FAIL_TO_PASS": task.FAIL_TO_PASS, "PASS_TO_PASS": task.PASS_TO_PASS})
    return str(get_resolution_status(report)).removeprefix("RESOLVED_")


def _legorl(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([LEGORL, *args], capture_output=True, text=True, timeout=timeout)


def _noop_patch(task: TaskRow) -> str:
    """A patch that changes nothing that matters: a comment appended to the buggy file."""
    path = touched_paths(task.patch)[0]
    return (f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n@@ -1,0 +1,1 @@\n+# a harmless comment\n")


def test_gold_one_empty_zero_through_the_cli(base_image: str, shipped: dict[str, TaskRow], sample_ids: list[str],
                                             tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = [a for iid in sample_ids for a in ("--id", iid)]
    assert _legorl("tasks", "import", str(SHIPPED), "--run", str(run), *args).returncode == 0

    gold = _legorl("grade", "--run", str(run), "--gold", "--concurrency", "2", "--json")
    assert gold.returncode == 0, gold.stderr
    result = json.loads(gold.stdout)
    assert {g["task_id"]: g["reward"] for g in result["grades"]} == dict.fromkeys(sample_ids, 1.0)
    assert all(g["status"] == "graded" and g["apply_method"] == "git apply" for g in result["grades"])

    predictions = tmp_path / "preds.jsonl"
    lines = [{"instance_id": iid, "model_patch": "", "model_name_or_path": "empty"} for iid in sample_ids]
    lines += [{"instance_id": iid, "model_patch": _noop_patch(shipped[iid]), "model_name_or_path": "noop"}
              for iid in sample_ids]
    lines += [{"instance_id": iid, "model_patch": shipped[iid].patch or "", "model_name_or_path": "gold-copy"}
              for iid in sample_ids]
    predictions.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    # canaries off here: the rows' logs are then whole unmutated runs, which SWE-bench judges below
    preds = _legorl("grade", "--run", str(run), "--predictions", str(predictions), "--concurrency", "2",
                    "--no-canaries", "--json")
    assert preds.returncode == 0, preds.stderr
    by_model: dict[str, dict[str, float]] = {}
    for g in json.loads(preds.stdout)["grades"]:
        by_model.setdefault(g["trial_id"].split("/")[1], {})[g["task_id"]] = g["reward"]
    assert by_model == {"empty": dict.fromkeys(sample_ids, 0.0), "noop": dict.fromkeys(sample_ids, 0.0),
                        "gold-copy": dict.fromkeys(sample_ids, 1.0)}

    rows: list[GradeRow] = shards.read_rows(run / "grades", Kind.GRADES)
    assert len(rows) == 4 * len(sample_ids)
    for row in rows:
        task = shipped[row.task_id]
        if row.status == "empty_patch":
            assert row.reward == 0.0 and not row.infra_failure
            continue
        assert row.status == "graded" and row.log
        if row.reward == 0.0:  # the no-op: every FAIL_TO_PASS test really ran and failed
            assert all(t.status in ("FAILED", "ERROR") for t in row.tests if t.kind == "FAIL_TO_PASS")
        if row.canaries:  # the --gold grade's: its log is the first run, whose canaries are mutated by design
            continue
        # SWE-bench's own parser and report logic reach the same verdict on the same log
        assert _swebench_resolution(task, row.log, tmp_path) == row.resolution
    times = sorted(r.duration_s or 0 for r in rows if r.status == "graded")
    print(f"\nper-task grading time: median {times[len(times) // 2]:.2f} s, max {times[-1]:.2f} s")


ATTACK_PLUGIN = """import pytest

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.outcome = "passed"
"""


def _attacks(task: TaskRow) -> dict[str, tuple[str, str]]:
    """name -> (patch, the path the grade row must name as dropped)."""
    test_file = touched_paths(task.test_patch)[0]
    sitecustomize = ("import os\nos.environ['PYTEST_ADDOPTS'] = '-p attack_plugin'\n")
    return {
        "conftest": (new_file("conftest.py", ATTACK_PLUGIN), "conftest.py"),
        "nested conftest": (new_file("tests/conftest.py", ATTACK_PLUGIN), "tests/conftest.py"),
        "hidden test edit": (new_file(test_file, "def test_nothing():\n    pass\n").replace(
            "new file mode 100644\n--- /dev/null", f"--- a/{test_file}").replace("@@ -0,0", "@@ -1,0"), test_file),
        "sitecustomize": (new_file("src/attack_plugin.py", ATTACK_PLUGIN)
                          + new_file("src/sitecustomize.py", sitecustomize), "src/sitecustomize.py"),
        "pth hook": (new_file("src/attack_plugin.py", ATTACK_PLUGIN)
                     + new_file("src/attack.pth", "import os; os.environ['PYTEST_ADDOPTS'] = '-p attack_plugin'\n"),
                     "src/attack.pth"),
        "pytest.ini": (new_file("src/attack_plugin.py", ATTACK_PLUGIN)
                       + new_file("pytest.ini", "[pytest]\naddopts = -p attack_plugin\n"), "pytest.ini"),
        "tox.ini pytest section": (new_file("src/attack_plugin.py", ATTACK_PLUGIN) + (
            "diff --git a/tox.ini b/tox.ini\n--- a/tox.ini\n+++ b/tox.ini\n@@ -1,2 +1,5 @@\n"
            "+[pytest]\n+addopts = -p attack_plugin\n+\n [tox]\n envlist = py,docs,doctest,pyright,ruff,ruff-format\n"),
            "tox.ini"),
    }


def test_adversarial_patches_never_score(base_image: str, shipped: dict[str, TaskRow], tmp_path: Path) -> None:
    """Each attack on a src-layout task (cachetools) is undone on the tree and scores 0, never infra.
    (tests/test_grading_attacks.py is the red team's wider suite.)"""
    from legorl.sandbox.podman import PodmanBackend

    (iid,) = [i for i in sorted(shipped) if i.startswith("cachetools__")][:1]
    task = shipped[iid]
    # addopts neutralised by the task's own `-o addopts=` would hide the config attacks; grade a
    # variant that runs plain pytest so they would work if they got through
    task.test_command = (task.test_command or "").replace("-o addopts= ", "")
    grader = Grader(GradeOptions(test_timeout=120), PodmanBackend().create)
    for name, (patch, dropped) in _attacks(task).items():
        row = grader.grade(task, patch, f"attack/{name}")
        assert row.reward == 0.0, f"{name}: {row.status} {row.error}"
        assert dropped in row.dropped_paths, f"{name}: dropped {row.dropped_paths}"
        assert not row.infra_failure
        if row.log and row.status == "graded":
            assert _swebench_resolution(task, row.log, tmp_path) == row.resolution
    # the gold patch with an attack riding along still scores 1, and names what was dropped
    row = grader.grade(task, (task.patch or "") + _attacks(task)["conftest"][0])
    assert row.reward == 1.0 and row.dropped_paths == ["conftest.py"]


def _owned_containers(pid: int) -> list[str]:
    from legorl.sandbox.host import run_podman

    proc = run_podman(["ps", "-a", "--filter", f"label=legorl.owner_pid={pid}", "--format", "{{.Names}}"], timeout=60)
    return proc.stdout.decode().split()


@pytest.mark.slow
def test_sigkill_mid_run_then_rerun(base_image: str, shipped: dict[str, TaskRow], tmp_path: Path) -> None:
    run = tmp_path / "run"
    ids = sorted(shipped)[:10]  # enough that the first batch of rows (2 s) is committed well before the last
    assert _legorl("tasks", "import", str(SHIPPED), "--run", str(run), *[a for i in ids for a in ("--id", i)]
                   ).returncode == 0
    proc = subprocess.Popen([LEGORL, "grade", "--run", str(run), "--gold", "--concurrency", "2"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ.copy())
    deadline = time.monotonic() + 300
    while not shards.part_files(run / "grades") and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    first = shards.read(run / "grades", Kind.GRADES).table.num_rows  # a part holds every row committed together
    assert 1 <= first < len(ids), "the kill should land mid-run"
    rerun = _legorl("grade", "--run", str(run), "--gold", "--concurrency", "2", "--json")
    assert rerun.returncode == 0, rerun.stderr
    assert json.loads(rerun.stdout)["skipped"] == first
    assert _owned_containers(proc.pid) == []  # the rerun's reaper removed what the killed run left
    dataset = shards.read(run / "grades", Kind.GRADES)
    assert dataset.duplicates == 0
    assert sorted(dataset.table.column("task_id").to_pylist()) == ids
    assert set(dataset.table.column("reward").to_pylist()) == {1.0}


def test_unseen_task_in_the_documented_format(base_image: str, tmp_path: Path) -> None:
    """A task the builder never made: a directory repo_source (relative to the JSONL), src layout,
    no test_command (the default applies), test lists as JSON strings — gold 1, no-op 0."""
    repo = tmp_path / "data" / "minilib"
    clamp = "from minilib import clamp\n\ndef test_low():\n    assert clamp(-1, 0, 5) == 0\n"
    base, gold, test_patch = task_repo(
        repo, {"src/minilib/__init__.py": "def clamp(x, lo, hi):\n    return max(lo, min(x, lo))\n",
               "tests/test_clamp.py": clamp},
        fixed={"src/minilib/__init__.py": "def clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n"},
        hidden_tests={"tests/test_clamp.py": clamp + "\ndef test_mid():\n    assert clamp(3, 0, 5) == 3\n"})
    row = {"instance_id": "acme__minilib-1", "repo": "acme/minilib", "base_commit": base, "patch": gold,
           "test_patch": test_patch, "problem_statement": "clamp ignores hi", "version": "0.1",
           "FAIL_TO_PASS": json.dumps(["tests/test_clamp.py::test_mid"]),
           "PASS_TO_PASS": json.dumps(["tests/test_clamp.py::test_low"]), "repo_source": "minilib"}
    (tmp_path / "data" / "tasks.jsonl").write_text(json.dumps(row) + "\n")
    run = tmp_path / "run"
    assert _legorl("tasks", "import", str(tmp_path / "data" / "tasks.jsonl"), "--run", str(run)).returncode == 0
    (task,) = shards.read_rows(run / "tasks", Kind.TASKS)
    grader = Grader(GradeOptions(test_timeout=120))
    good = grader.grade(task, gold)
    assert (good.reward, good.resolution) == (1.0, "FULL"), good.log
    noop = grader.grade(task, _noop_patch(task))
    assert noop.reward == 0.0 and noop.status == "graded"
    assert {t.name: t.status for t in noop.tests} == {"tests/test_clamp.py::test_mid": "FAILED",
                                                      "tests/test_clamp.py::test_low": "PASSED"}
    # the task check (the builder's validate) derives the test lists and the gold statuses from fresh runs
    from legorl.tasks.builder import validate

    draft = TaskRow.from_dict({**task.to_dict(), "FAIL_TO_PASS": [], "PASS_TO_PASS": [], "gold_statuses": None})
    checked = validate(draft, Grader(GradeOptions(test_timeout=120, run_empty=True)))
    assert isinstance(checked, TaskRow), checked
    assert (checked.FAIL_TO_PASS, checked.PASS_TO_PASS) == (["tests/test_clamp.py::test_mid"],
                                                            ["tests/test_clamp.py::test_low"])
    assert checked.gold_status_map() == {"tests/test_clamp.py::test_mid": "PASSED",
                                         "tests/test_clamp.py::test_low": "PASSED"}


WRAP_CALL_AND_REPORT = """import _pytest.runner as _r
_orig = _r.call_and_report
def _fake(item, when, log=True, **kw):
    rep = _orig(item, when, log=False, **kw)
    rep.outcome = 'passed'
    item.ihook.pytest_runtest_logreport(report=rep)
    return rep
_r.call_and_report = _fake
"""
PLUGIN_THROUGH_GC = """import gc
for _o in gc.get_objects():
    if type(_o).__name__ == 'Config' and hasattr(_o, 'pluginmanager'):
        import pytest as _pt
        class _P:
            @_pt.hookimpl(hookwrapper=True)
            def pytest_runtest_makereport(self, item, call):
                out = yield
                out.get_result().outcome = 'passed'
        _o.pluginmanager.register(_P(), 'evil')
        break
"""
REWRITE_LATER_TESTS = """import os
_body = 'import unittest\\n\\nclass TTLCacheTest(unittest.TestCase):\\n' + ''.join(
    '    def %s(self):\\n        pass\\n' % n for n in NAMES)
for _p in ('tests/test_ttl.py', 'tests/__pycache__/test_ttl.cpython-311-pytest-7.2.1.pyc', 'src/zoneinfo.py'):
    try:
        os.makedirs(os.path.dirname(_p), exist_ok=True)
        with open(_p, 'w') as _f:
            _f.write(_body)
    except OSError:
        pass
"""


def _append(task: TaskRow, path: str, code: str) -> str:
    """A diff that appends ``code`` to ``path`` of the task's testbed."""
    from legorl.sandbox.testbed import prepare_repo

    repo, _ = prepare_repo(task.repo_source or "", task.repo_ref or task.base_commit or "")
    lines = (repo / path).read_text().splitlines()
    body = "".join(f"+{line}\n" for line in code.splitlines())
    return (f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n"
            f"@@ -{len(lines)},1 +{len(lines)},{1 + len(code.splitlines())} @@\n {lines[-1]}\n{body}")


def test_in_process_attacks_fail_without_the_screen(base_image: str, shipped: dict[str, TaskRow]) -> None:
    """Code under test that rewires pytest in its own process, or rewrites a test module pytest has not
    read yet, gets 0 even with the suspicious-code screen's zeroing off: the canary run (a forged
    pass forges the canaries' too) — or, on a task without canaries, the runner's tripwire — and the
    read-only tree stop them, not the screen; the runner's in-process checks see the rewiring."""
    task = TaskRow.from_dict(shipped["cachetools__compare-0bc4b363"].to_dict())
    # a variant whose failing tests all live in the second file, so that the package (imported while
    # the first is collected) could rewrite them before pytest reads them, were the tree writable
    gold = task.gold_status_map() or {}
    task.FAIL_TO_PASS = [t for t in task.FAIL_TO_PASS if t.startswith("tests/test_ttl.py::")]
    task.PASS_TO_PASS = []
    task.test_command = (task.test_command or "").replace("tests/test_func.py", "tests/test_cache.py")
    task.gold_statuses = json.dumps({t: gold[t] for t in task.FAIL_TO_PASS})
    names = sorted({t.rsplit("::", 1)[1] for t in task.FAIL_TO_PASS})
    grader = Grader(GradeOptions(test_timeout=120, suspicious_scores_zero=False))
    assert grader.grade(task, task.patch).reward == 1.0
    # test_ttl.py negates into assertNotEqual, a form no other test of the file uses: no canary
    # there (tests/attacks/test_negation_spotter.py), so the runner's tripwire decides this variant
    canaried = bool(grader.canaries.of(task, grader.canaries.seed(task)))
    attacks = {"rewire TestReport": REPORT_PATCH, "wrap call_and_report": WRAP_CALL_AND_REPORT,
               "plugin through gc": PLUGIN_THROUGH_GC,
               "rewrite later tests": f"NAMES = {names!r}\n" + REWRITE_LATER_TESTS}
    for name, code in attacks.items():
        row = grader.grade(task, _append(task, "src/cachetools/__init__.py", code), f"attack/{name}")
        assert (row.reward, row.infra_failure) == (0.0, False), f"{name}: {row.status} {row.error}"
        assert row.suspicious, name  # the screen still saw it, it just did not decide
        if name == "rewrite later tests":  # the real tests ran and failed
            assert row.status == "graded" and {t.status for t in row.tests} == {"FAILED"}, row.tests
        elif canaried:
            assert row.status == "tampered" and row.canaries, f"{name}: {row.status} {row.error}"
        else:
            assert row.status == "tests_errored" and "rewired the test runner" in (row.error or ""), \
                f"{name}: {row.status} {row.error}"
        if name != "rewrite later tests":
            assert any(s.startswith("runner: ") for s in row.suspicious), row.suspicious


def test_task_image_with_its_own_testbed(base_image: str, tmp_path: Path) -> None:
    """A SWE-bench-style task: no repo_source, the image holds /testbed (with history) — gold 1,
    no-op 0, a conftest attack 0, and the image's .git is back for the tests but out of the patch's reach."""
    from legorl.sandbox.host import run_podman

    ctx = tmp_path / "ctx"
    zero = "from calc import double\n\ndef test_zero():\n    assert double(0) in (0, 1)\n"
    _base, gold, test_patch = task_repo(
        ctx / "testbed", {"calc.py": "def double(x):\n    return x + x + 1\n", "tests/test_calc.py": zero},
        fixed={"calc.py": "def double(x):\n    return x + x\n"},
        hidden_tests={"tests/test_calc.py": (
            "import subprocess\n" + zero + "\ndef test_two():\n    assert double(2) == 4\n\ndef test_git_is_there():\n"
            "    assert subprocess.run(['git', 'log', '-1'], capture_output=True).returncode == 0\n")})
    (ctx / "Containerfile").write_text(f"FROM {base_image}\nCOPY testbed /testbed\n")
    image = f"localhost/legorl-test-own-testbed:{os.getpid()}"
    run_podman(["build", "-q", "-t", image, str(ctx)], timeout=300)
    try:
        task = TaskRow(instance_id="acme__calc-1", repo="acme/calc", patch=gold, test_patch=test_patch,
                       FAIL_TO_PASS=["tests/test_calc.py::test_two"],
                       PASS_TO_PASS=["tests/test_calc.py::test_zero", "tests/test_calc.py::test_git_is_there"],
                       image=image, test_command="python3 -m pytest -rA -p no:cacheprovider tests/test_calc.py")
        grader = Grader(GradeOptions(test_timeout=120))
        good = grader.grade(task, gold)
        assert (good.reward, good.status) == (1.0, "graded"), (good.error, good.log)
        assert grader.grade(task, _noop_patch(task)).reward == 0.0
        attack = new_file("conftest.py", ATTACK_PLUGIN)
        row = grader.grade(task, attack)
        assert (row.reward, row.infra_failure, row.dropped_paths) == (0.0, False, ["conftest.py"])
    finally:
        run_podman(["rmi", "-f", image], timeout=120, check=False)


FORGE_REPORT_AT_EXIT = """import json as _json, os as _os, weakref as _weakref
def _forge(fd=_os.dup(3)):
    doc = {"nonce": "?", "exitstatus": 0, "statuses": {n: "PASSED" for n in NAMES}, "tampered": []}
    _os.write(fd, _json.dumps(doc).encode())
    for path in ("/tmp/.legorl-report/report.json", "/tmp/.legorl-grade/report.json"):
        try:
            with open(path, "w") as f:
                f.write(_json.dumps(doc))
        except OSError:
            pass
_keep = type("_K", (), {})()
_weakref.finalize(_keep, _forge)
"""
WRITE_REPORT_FD_EARLY = """import os as _os
_os.write(3, b'{"nonce": "x", "exitstatus": 0, "statuses": {}}')
"""


def test_the_report_cannot_be_forged_from_the_test_process(base_image: str, shipped: dict[str, TaskRow]) -> None:
    """The test user can neither read the report back (its nonce), nor reach it by name, nor replace
    it: the descriptor is append-only and root takes exactly one JSON document, so a copy of the
    descriptor written at exit, or a write before the recorder's, leaves no valid report (reward 0)."""
    task = shipped["cachetools__compare-0bc4b363"]
    names = sorted(task.FAIL_TO_PASS + task.PASS_TO_PASS)
    grader = Grader(GradeOptions(test_timeout=120, suspicious_scores_zero=False))
    for name, code in (("forge at exit", f"NAMES = {names!r}\n" + FORGE_REPORT_AT_EXIT),
                       ("write early", WRITE_REPORT_FD_EARLY)):
        row = grader.grade(task, (task.patch or "") + _append(task, "src/cachetools/__init__.py", code), name)
        assert (row.reward, row.infra_failure, row.status) == (0.0, False, "tests_errored"), (name, row.error)
    assert grader.grade(task, task.patch).reward == 1.0
