"""A run's fingerprint mixes, compared column by column (``fingerprints.run_mixes``, the dashboard's)
and taken from what ``legorl inspect`` has read (``inspect.run_mixes``): the same lines as
``fingerprints.mixes`` of the rows, the definition."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from legorl.core import shards
from legorl.core.schemas import GradeFingerprint, Kind, TrialFingerprint
from legorl.monitor import inspect
from legorl.monitor.health import health_summary
from legorl.trials import fingerprints

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import run_size


def _write(folder: Path, step0: int, rng: np.random.Generator) -> None:
    trials = [run_size.make_trial(f"org__repo-{i % 3}", run_size.HARNESSES[i % 2], step0 + i // 4, i, rng)
              for i in range(12)]
    for i, t in enumerate(trials):
        t.fingerprint = TrialFingerprint(
            harness=t.harness, harness_version="1.0" if i != 5 else "2.0",  # one harness, two versions
            harness_config=None if i % 3 else f"sha256:{i % 2}",  # unknown values never mix
            legorl_version="0.1.0", model_revision=f"rev{i // 6}",  # step step0 + 1 holds trials 4..7: two revisions
        )
    grades = [run_size.make_grade(t, resolved=bool(i % 2)) for i, t in enumerate(trials)]
    for i, g in enumerate(grades):
        g.fingerprint = GradeFingerprint(image="img", image_digest=f"sha256:{i % 2}" if g.task_id.endswith("1") else "sha256:a",
                                         test_command="pytest", grader_version=None)
    shards.write(folder / "rollouts", Kind.ROLLOUTS, trials[:6])
    shards.write(folder / "rollouts", Kind.ROLLOUTS, trials[6:])
    shards.write(folder / "grades", Kind.GRADES, grades)


def test_run_mixes_column_wise_equal_the_row_wise_definition(tmp_path: Path) -> None:
    run = tmp_path / "run"
    rng = np.random.default_rng(0)
    run_size.write_run(run, 64, rows_per_part=20)
    _write(run, 2, rng)  # the same steps again, with other fingerprints (the later rows win)
    _write(run / "eval", 0, rng)
    expected = []
    for prefix in ("", "eval/"):
        rows = shards.read(run / f"{prefix}rollouts", Kind.ROLLOUTS).table.to_pylist()
        grades = shards.read(run / f"{prefix}grades", Kind.GRADES).table.to_pylist()
        expected += [prefix + line for line in fingerprints.mixes(rows, grades)]
    assert any(line.startswith("harness ") for line in expected)
    assert any(line.startswith("task ") for line in expected)
    assert any(line.startswith("eval/") for line in expected)
    assert fingerprints.run_mixes(run) == expected
    summary = inspect.inspect_path(run)
    assert inspect.run_mixes(summary) == expected
    assert health_summary(run, mixes=inspect.run_mixes(summary)) == health_summary(run)


def test_a_run_without_fingerprints_mixes_nothing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run_size.write_run(run, 32, rows_per_part=10)
    assert fingerprints.run_mixes(run) == []
    assert inspect.run_mixes(inspect.inspect_path(run)) == []
