"""SIGKILL `legorl shards compact` at seeded random points, check what readers see, compact again.

A run directory of many small parts (rollouts and grades, some keys rewritten later: reruns of
infrastructure failures), compacted by the real command in its own process group and killed
``KILLS`` times at points drawn from ``random.Random(f"compaction:{seed}")``; after each kill and
at the end: every row exactly once, each key's last write, nothing a reader could trip on
(`legorl inspect --json`: no errors, no temp files).
"""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path

from chaos_support import Figures, assert_clean, inspect, kill_at, legorl, rng, start

from legorl.core import shards
from legorl.core.paths import RunDir
from legorl.core.schemas import GradeRow, GradeStatus, Kind, Segment, TrialRow

KILLS = 3
ROWS = 240


def _trial(i: int, outcome: str = "submitted", infra: bool = False) -> TrialRow:
    n = 4000
    return TrialRow.new(f"task__{i // 4}", "simple", i % 3, i % 4, outcome=outcome, infra_failure=infra,
                        segments=[Segment(list(range(n)), [i % 2] * n, [-0.25 * (i % 2)] * n)])


def _write_run(run: Path) -> dict[str, dict[str, object]]:
    """ROWS trials and grades, one part per row (as before batching) and a few parts of many rows."""
    rd = RunDir.at(run)
    for i in range(ROWS):
        rerun = i % 17 == 0
        first = _trial(i, "infra_error", infra=True) if rerun else _trial(i)
        shards.write(rd.rollouts, Kind.ROLLOUTS, [first])
        shards.write(rd.grades, Kind.GRADES, [GradeRow(first.trial_id, first.task_id, GradeStatus.GRADED,
                                                       step=first.step, reward=0.0)])
        if rerun:  # the rerun supersedes it, a few parts later
            shards.write(rd.rollouts, Kind.ROLLOUTS, [_trial(i, "timeout")])
            shards.write(rd.grades, Kind.GRADES, [GradeRow(first.trial_id, first.task_id, GradeStatus.GRADED,
                                                           step=first.step, reward=1.0)])
    return {"rollouts": _last(rd.rollouts, Kind.ROLLOUTS, "outcome"), "grades": _last(rd.grades, Kind.GRADES, "reward")}


def _last(folder: Path, kind: Kind, column: str) -> dict[str, object]:
    table = shards.read(folder, kind, columns=[column]).table
    return dict(zip(table.column("trial_id").to_pylist(), table.column(column).to_pylist(), strict=True))


def _raw(folder: Path, kind: Kind) -> Counter[str]:
    return Counter(k for f in shards.part_files(folder)
                   for k in shards.read_file(f, kind, ["trial_id"]).column("trial_id").to_pylist())


def test_compaction_sigkill_then_rerun(tmp_path: Path, chaos_seed: int, figures: Figures) -> None:
    run = tmp_path / f"chaos-compaction-{uuid.uuid4().hex[:10]}"
    expected = _write_run(run)
    raw_before = {name: _raw(run / name, kind) for name, kind in (("rollouts", Kind.ROLLOUTS), ("grades", Kind.GRADES))}
    draw = rng("compaction", chaos_seed)
    with figures.stage("compaction", chaos_seed) as fig:
        fig.rows_expected += sum(len(v) for v in expected.values())
        for _ in range(KILLS):
            proc = start("shards", "compact", str(run), "--target-mb", "1")
            landed = kill_at(proc, lambda: True, draw.uniform(0.0, 4.0))
            fig.faults_injected += landed
            fig.resumes += landed
            for name, kind in (("rollouts", Kind.ROLLOUTS), ("grades", Kind.GRADES)):
                raw = _raw(run / name, kind)
                fig.rows_lost += len(set(raw_before[name]) - set(raw))
                fig.duplicates += sum(max(0, n - raw_before[name][k]) for k, n in raw.items())
                column = "outcome" if kind == Kind.ROLLOUTS else "reward"
                assert _last(run / name, kind, column) == expected[name]
        legorl("shards", "compact", str(run), "--target-mb", "1")
    assert fig.rows_lost == 0 and fig.duplicates == 0
    for name, kind in (("rollouts", Kind.ROLLOUTS), ("grades", Kind.GRADES)):
        column = "outcome" if kind == Kind.ROLLOUTS else "reward"
        assert _last(run / name, kind, column) == expected[name]
        assert len(shards.part_files(run / name)) < 20
    report = inspect(run)
    # the reruns' superseded rows are there by design (no row twice is checked above, key by key)
    assert_clean(report, known_duplicates=("rollouts", "grades"))
    reruns = len([i for i in range(ROWS) if i % 17 == 0])
    assert all(d["duplicate_keys"] <= reruns for d in report["datasets"])
    assert not [p for p in (run / "rollouts").iterdir() if p.name.startswith(".compact-")]
