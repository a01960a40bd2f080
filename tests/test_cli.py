"""The CLI frame: every stage is a command, inspect's JSON is stable, bad input is one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from legorl.core import shards
from legorl.core.schemas import GradeRow, Kind, MetricRow, Segment, TrialRow

pytestmark = pytest.mark.heavy  # every test runs the CLI in a subprocess

COMMANDS = ["serve-proxy", "rollout", "grade", "train", "eval", "tasks", "model", "harness", "setup", "inspect", "dashboard"]


def legorl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "legorl.cli", *args], capture_output=True, text=True, timeout=120)


def test_help_lists_every_command() -> None:
    result = legorl("--help")
    assert result.returncode == 0, result.stderr
    for command in COMMANDS:
        assert command in result.stdout


def make_run(root: Path) -> None:
    trials = [
        TrialRow.new(f"t{i}", "mini-swe-agent", 0, k, outcome="submitted" if k else "timeout",
                     segments=[Segment([1, 2, 3, 4], [0, 0, 1, 1], [0.0, 0.0, -0.5, -0.25])])
        for i in range(2) for k in range(2)
    ]
    shards.write(root / "rollouts", Kind.ROLLOUTS, trials)
    shards.write(root / "rollouts", Kind.ROLLOUTS, trials[:1])  # a rerun: one duplicate key
    grades = [GradeRow(trial_id=t.trial_id, task_id=t.task_id, status="graded", reward=float(t.sample_index),
                       resolved=bool(t.sample_index)) for t in trials]
    shards.write(root / "grades", Kind.GRADES, grades)
    shards.write(root / "train" / "metrics", Kind.METRICS, [MetricRow(0, "loss", 0.5), MetricRow(1, "loss", 0.25)])


def test_inspect_json_has_documented_keys(tmp_path: Path) -> None:
    make_run(tmp_path)
    result = legorl("inspect", "--json", str(tmp_path))
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert set(summary) == {"path", "datasets", "errors", "health"}
    by_name = {d["name"]: d for d in summary["datasets"]}
    assert set(by_name) == {"rollouts", "grades", "train/metrics"}
    keys = {"name", "kind", "path", "files", "rows", "schema_versions", "commands", "duplicate_keys", "temp_files", "breakdown"}
    assert all(set(d) == keys for d in summary["datasets"])
    rollouts = by_name["rollouts"]
    assert (rollouts["rows"], rollouts["files"], rollouts["duplicate_keys"]) == (4, 2, 1)
    assert rollouts["breakdown"]["outcomes"] == {"submitted": 2, "timeout": 2}
    assert rollouts["breakdown"]["sampled_tokens"] == 8
    assert by_name["grades"]["breakdown"]["reward_mean"] == 0.5
    assert by_name["train/metrics"]["breakdown"]["last"] == {"loss": 0.25}


def test_inspect_names_a_corrupt_file_in_one_line(tmp_path: Path) -> None:
    make_run(tmp_path)
    bad = tmp_path / "grades" / "part-99999999999999999999-1-bad.parquet"
    bad.write_bytes(b"garbage")
    result = legorl("inspect", str(tmp_path))
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and bad.name in errors[0]
    # The other datasets are still summarised.
    assert "rollouts" in result.stderr


def test_inspect_of_a_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    result = legorl("inspect", str(tmp_path / "nope"))
    assert result.returncode == 1
    assert "no such run directory" in result.stderr and "Traceback" not in result.stderr
