"""A reward plug-in in the loop: `legorl loop --grade-verifier` grades each step's trials with the hidden
tests, hands the verifier's reward (not theirs) to the trainer, and the step trains on it.

The trials come from a test harness plug-in (``tests/plugins/loop_fixer.py``) that asks the model once
and applies the task's gold patch, with a marker line in every trial but sample 0's: the hidden tests
score both 1, the verifier (``tests/plugins/loop_verifier.py``) 1 and 0.5. Equal rewards would skip the
step (no advantage); these train it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from legorl.core import metric_keys as mk
from legorl.core import shards
from legorl.core.schemas import Kind

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "examples" / "tasks" / "tasks.parquet"
PLUGINS = {**os.environ, "PYTHONPATH": str(ROOT / "tests" / "plugins")}


def legorl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "legorl.cli", *args], capture_output=True, text=True, timeout=900,
                          env=PLUGINS)


@pytest.mark.podman
@pytest.mark.slow
def test_the_verifier_reward_is_what_the_loop_trains_on(tiny_model: Path, base_image: str, tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert legorl("tasks", "import", str(TASKS), "--run", str(run), "--id", "parse__constant-919546bc").returncode == 0
    result = legorl("loop", "--run", str(run), "--model", str(tiny_model), "--harness", "loop_fixer:GoldFixer",
                    "--steps", "1", "--samples", "2", "--max-turns", "2", "--timeout", "300",
                    "--grade-verifier", "loop_verifier:verify", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    grades = sorted(shards.read_rows(run / "grades", Kind.GRADES), key=lambda g: g.trial_id)
    seen = [(g.status, g.tests_reward, g.reward, g.verifier, g.verifier_reasons) for g in grades]
    assert seen == [("graded", 1.0, 1.0, "loop_verifier:verify", ["clean"]),
                    ("graded", 1.0, 0.5, "loop_verifier:verify", ["marked"])], seen
    metrics = {m.key: m.value for m in shards.read_rows(run / "train" / "metrics", Kind.METRICS)
               if m.step == 0 and m.harness is None}
    assert metrics[mk.SKIPPED] == 0.0  # the verifier's rewards differ: the step trained on them
    assert json.loads(result.stdout)["steps"][0]["new_grades"] == 2
