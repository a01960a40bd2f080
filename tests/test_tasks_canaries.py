"""`legorl tasks canaries`: which tasks' passes canaries check from outside the test process, and
`--into` keeping only those, on shipped tasks of each kind, through the real grader and podman."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from grading_support import SHIPPED

from legorl.core import shards
from legorl.core.schemas import Kind

pytestmark = pytest.mark.podman

# one task of each verdict, as the shipped tasks' canaries fall on every host key (their sites decide)
VERDICTS = {
    "parse__constant-13d57205": "canaries",  # an expected value changed at the site
    "cachetools__constant-f0c6d29a": "negations only",  # its one canary is a negated assertion
    "webcolors__constant-ace7d9fa": "tripwires only",  # its expectation is computed from the same input
}


def legorl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "legorl.cli", *args], capture_output=True, text=True, timeout=900)


def test_verdicts_and_into_keeps_only_checked_tasks(tmp_path: Path, base_image: str) -> None:
    run, checked = tmp_path / "run", tmp_path / "checked"
    ids = [arg for task in VERDICTS for arg in ("--id", task)]
    assert legorl("tasks", "import", str(SHIPPED), "--run", str(run), *ids).returncode == 0
    result = legorl("tasks", "canaries", "--run", str(run), "--into", str(checked), "--timeout", "120", "--json")
    assert result.returncode == 0, result.stderr
    found = {row["instance_id"]: row for row in json.loads(result.stdout)}
    assert {task: row["verdict"] for task, row in found.items()} == VERDICTS
    assert found["parse__constant-13d57205"]["values"] and not found["parse__constant-13d57205"]["negations"]
    assert found["cachetools__constant-f0c6d29a"]["negations"] and not found["cachetools__constant-f0c6d29a"]["values"]
    assert [t.instance_id for t in shards.read_rows(checked / "tasks", Kind.TASKS)] == ["parse__constant-13d57205"]
    before = sorted(p.name for p in (checked / "tasks").iterdir())
    again = legorl("tasks", "canaries", "--run", str(run), "--into", str(checked), "--id", "parse__constant-13d57205")
    assert again.returncode == 0, again.stderr
    assert sorted(p.name for p in (checked / "tasks").iterdir()) == before  # unchanged rows are not written twice


def test_bad_arguments_name_what_is_wrong(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert legorl("tasks", "import", str(SHIPPED), "--run", str(run), "--id", "parse__constant-13d57205").returncode == 0
    unknown = legorl("tasks", "canaries", "--run", str(run), "--id", "no-such-task")
    assert unknown.returncode != 0 and "no task 'no-such-task'" in unknown.stderr
    itself = legorl("tasks", "canaries", "--run", str(run), "--into", str(run))
    assert itself.returncode != 0 and "the tasks' own folder" in itself.stderr
