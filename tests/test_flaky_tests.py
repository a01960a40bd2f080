"""Flaky-test control on the shipped flaky task (examples/flaky-task): the task check runs each patch
several times and leaves out a test whose status varies, with a record on the task; ``--confirm``
re-runs a grade of 1 in a fresh container, so a pass that does not reproduce scores 0 and a real fix
stays 1."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from legorl.core import shards
from legorl.core.schemas import GradeRow, Kind, TaskRow
from legorl.grading.grader import GradeOptions, Grader
from legorl.tasks.builder import flaky_tests, validate

ROOT = Path(__file__).resolve().parents[1]
FLAKY_TASK = ROOT / "examples" / "flaky-task"
LEGORL = str(Path(sys.executable).parent / "legorl")
TESTS = "tests/test_coin.py"
FLAKY = f"{TESTS}::test_flip_lands_heads"
F2P = [f"{TESTS}::test_clamp_above", f"{TESTS}::test_clamp_at_high"]
P2P = sorted(f"{TESTS}::{name}" for name in ("test_clamp_inside", "test_clamp_below", "test_mean",
                                             "test_mean_of_nothing"))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run holding the shipped flaky task, imported the ordinary way (repo_source made absolute)."""
    run = tmp_path_factory.mktemp("flaky") / "run"
    proc = subprocess.run([LEGORL, "tasks", "import", str(FLAKY_TASK / "tasks.parquet"), "--run", str(run)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return run


@pytest.fixture(scope="module")
def task(run_dir: Path) -> TaskRow:
    (row,) = shards.read_rows(run_dir / "tasks", Kind.TASKS)
    return row


def test_flaky_tests_are_those_whose_status_varies_under_one_patch() -> None:
    runs = {"gold": [{"a": "PASSED", "b": "PASSED", "c": "PASSED"}, {"a": "PASSED", "b": "FAILED", "c": "PASSED"}],
            "empty": [{"a": "FAILED", "c": "FAILED"}, {"a": "FAILED", "c": "ERROR"}]}
    # b flips under gold; c is stable under gold but not under the empty patch; a is stable under both
    assert flaky_tests(runs) == {"b": {"gold": ["PASSED", "FAILED"], "empty": ["MISSING", "MISSING"]},
                                 "c": {"gold": ["PASSED", "PASSED"], "empty": ["FAILED", "ERROR"]}}
    assert flaky_tests({"gold": [{"a": "PASSED"}, {}], "empty": [{}, {}]}) == {
        "a": {"gold": ["PASSED", "MISSING"], "empty": ["MISSING", "MISSING"]}}


@pytest.mark.heavy
def test_the_shipped_row_records_its_flaky_test(task: TaskRow) -> None:
    assert (task.FAIL_TO_PASS, task.PASS_TO_PASS) == (F2P, P2P)
    recorded = json.loads(task.flaky_tests or "{}")
    assert list(recorded) == [FLAKY]
    assert any({"PASSED", "FAILED"} <= set(statuses) for statuses in recorded[FLAKY].values()), recorded


@pytest.mark.podman
@pytest.mark.slow
def test_the_check_leaves_the_flaky_test_out_and_keeps_the_stable_ones(task: TaskRow, run_dir: Path) -> None:
    draft = replace(task, FAIL_TO_PASS=[*F2P, FLAKY], PASS_TO_PASS=[], gold_statuses=None, flaky_tests=None)
    grader = Grader(GradeOptions(test_timeout=120, run_empty=True))
    # 6 runs of each patch: a 50% test stays constant under both patches once in ~1000 checks
    start = time.monotonic()
    checked = validate(draft, grader, runs=6)
    took = time.monotonic() - start
    assert isinstance(checked, TaskRow), checked
    assert (checked.FAIL_TO_PASS, checked.PASS_TO_PASS) == (F2P, P2P)
    assert checked.gold_status_map() == {t: "PASSED" for t in F2P + P2P}
    recorded = json.loads(checked.flaky_tests or "{}")
    assert list(recorded) == [FLAKY]
    assert all(len(statuses) == 6 for statuses in recorded[FLAKY].values())
    assert any(len(set(statuses)) > 1 for statuses in recorded[FLAKY].values())
    print(f"check, 6 runs of each patch + 1 fresh gold grade: {took:.1f} s")

    # legorl inspect names it in the tasks breakdown, and --json carries it
    out = subprocess.run([LEGORL, "inspect", str(run_dir), "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    (tasks,) = [d for d in json.loads(out.stdout)["datasets"] if d["name"] == "tasks"]
    assert tasks["breakdown"]["flaky_tests"] == {task.instance_id: {"count": 1, "names": [FLAKY]}}


@pytest.mark.podman
def test_a_task_whose_only_fail_to_pass_is_flaky_is_rejected(task: TaskRow) -> None:
    # the bug's two tests stay hidden: only the coin flip could tell gold from empty (it looks like a
    # FAIL_TO_PASS on all 4 runs of each once in 256 checks, and the fresh gold grade then fails half the time)
    draft = replace(task, test_patch=_touch_only(), FAIL_TO_PASS=[], PASS_TO_PASS=[], gold_statuses=None)
    why = validate(draft, Grader(GradeOptions(test_timeout=120, run_empty=True)), runs=4)
    assert isinstance(why, str) and why.startswith("no test fails before and passes after the gold patch"), why


def _touch_only() -> str:
    """A test_patch that adds a comment to the visible test file: it runs, without the bug's two tests."""
    return (f"diff --git a/{TESTS} b/{TESTS}\n--- a/{TESTS}\n+++ b/{TESTS}\n@@ -1,3 +1,4 @@\n"
            "+# hidden tests: none\n import pytest\n \n import coin\n")


@pytest.mark.podman
@pytest.mark.slow
def test_confirm_scores_a_pass_that_does_not_reproduce_0(task: TaskRow) -> None:
    half_fix = (FLAKY_TASK / "half-fix.diff").read_text()
    grader = Grader(GradeOptions(test_timeout=120, confirm=True))
    rows: list[GradeRow] = []
    # the half fix passes a grade w.p. 1/2, and its rerun disagrees w.p. 1/2: 1/4 per grade (24 grades: miss 1e-3)
    for _ in range(24):
        rows.append(grader.grade(task, half_fix))
        if rows[-1].confirmed is False:
            break
    caught = rows[-1]
    assert caught.confirmed is False, [(r.reward, r.confirmed) for r in rows]
    assert (caught.status, caught.reward, caught.resolved, caught.infra_failure) == ("graded", 0.0, False, False)
    assert "did not reproduce" in (caught.error or "")
    assert any(t.name in F2P and not t.passed for t in caught.tests), caught.tests
    for r in rows:  # no grade of 1 went unconfirmed; a first-run failure needed no rerun
        assert r.reward in (0.0, 1.0) and (r.reward == 0.0 or r.confirmed is True), r
        assert r.confirmed is not None or r.reward == 0.0


@pytest.mark.podman
def test_confirm_keeps_a_real_fix_and_threads_through_legorl_grade(run_dir: Path) -> None:
    out = run_dir / "gold-grades"
    proc = subprocess.run([LEGORL, "grade", "--run", str(run_dir), "--gold", "--confirm", "--out", str(out), "--json",
                           "--timeout", "120"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["unconfirmed"] == 0
    (grade,) = summary["grades"]
    assert (grade["reward"], grade["confirmed"]) == (1.0, True)
    (row,) = shards.read_rows(out, Kind.GRADES)
    assert (row.reward, row.confirmed) == (1.0, True)


@pytest.mark.podman
def test_an_infra_failure_in_the_confirming_rerun_is_infra_not_0(task: TaskRow) -> None:
    class ImageGoneOnRerun(Grader):
        """The rerun's image is missing (a real podman failure before the patch goes in)."""

        verdicts = 0

        def _verdict(self, task: TaskRow, patch: str | None, out: GradeRow) -> None:
            self.verdicts += 1
            if self.verdicts == 2:
                task = replace(task, image="localhost/legorl-test-no-such-image:gone")
            super()._verdict(task, patch, out)

    row = ImageGoneOnRerun(GradeOptions(test_timeout=120, confirm=True)).grade(task, task.patch)
    assert (row.status, row.infra_failure, row.reward, row.confirmed) == ("infra_error", True, None, None), row.error
    assert (row.error or "").startswith("the confirming rerun failed as infrastructure")


@pytest.mark.heavy
def test_inspect_shows_flaky_test_ids_as_text_at_80_columns(tmp_path: Path) -> None:
    """Parametrized ids hold brackets: the breakdown prints them as they are (not as rich markup)."""
    import os

    names = ["tests/t.py::test_x[a]", "tests/t.py::test_y[/x]", "tests/t.py::test_" + "long" * 20]
    record = {n: {"gold": ["PASSED", "FAILED"], "empty": ["FAILED", "FAILED"]} for n in names}
    with shards.ShardWriter(tmp_path / "tasks", Kind.TASKS) as writer:
        writer.add(TaskRow(instance_id="t-1", repo="r", FAIL_TO_PASS=["tests/t.py::test_z"],
                           flaky_tests=json.dumps(record)))
        writer.add(TaskRow(instance_id="t-2", repo="r", FAIL_TO_PASS=["tests/t.py::test_z"]))
    env = {**os.environ, "COLUMNS": "80", "TERM": "dumb"}
    out = subprocess.run([LEGORL, "inspect", str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = (out.stdout + out.stderr).splitlines()
    # wrapped between words: only a line holding the one id longer than the width passes 80 columns
    assert all(len(line.rstrip()) <= 80 or names[2] in line for line in lines), max(lines, key=len)
    text = "".join(line.strip() for line in lines)
    assert "flaky tests: t-1 count 3, names" in " ".join(line.strip() for line in lines)
    assert all(any(name in line for line in lines) for name in names), lines  # each id whole on a line
    assert "t-2" not in text.replace(str(tmp_path), "")  # (pytest's own folder may be pytest-2N)


@pytest.mark.parametrize(("recorded", "message"), [
    ("{not json", "not JSON"),
    (json.dumps({FLAKY: ["PASSED", "FAILED"]}), "expected a JSON object of test id -> {patch: [status per run]}"),
])
def test_import_refuses_a_malformed_flaky_tests_record(tmp_path: Path, recorded: str, message: str) -> None:
    from legorl.tasks.importer import TaskImportError, import_tasks

    row = {"instance_id": "x-1", "repo": "x", "test_patch": "", "test_command": "pytest",
           "FAIL_TO_PASS": ["t::a"], "flaky_tests": recorded}
    (tmp_path / "tasks.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(TaskImportError, match=re.escape(f"row 0 (x-1): field 'flaky_tests': {message}")):
        import_tasks(str(tmp_path / "tasks.jsonl"), tmp_path / "run" / "tasks")
