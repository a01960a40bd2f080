"""Compaction: small parts merged into large ones with "the later file wins" intact, and a reader
that never sees a row twice or zero times — while it runs, and when it is SIGKILLed at any point."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest
from test_shards import make_trial

from legorl.core import shards
from legorl.core.schemas import Kind, MetricRow
from legorl.core.shards import step_ranges
from legorl.core.shards.compaction import merged_name
from legorl.monitor import summaries


def _outcomes(folder: Path) -> dict[str, str]:
    return {r.trial_id: r.outcome for r in shards.read_rows(folder, Kind.ROLLOUTS)}


def _raw_keys(folder: Path) -> Counter[str]:
    """Every visible row's key, duplicates included (what a reader is handed before de-duplication)."""
    for _ in range(5):
        try:
            return Counter(k for f in shards.part_files(folder)
                           for k in shards.read_file(f, Kind.ROLLOUTS, ["trial_id"]).column("trial_id").to_pylist())
        except shards.Vanished:
            continue
    raise AssertionError("the folder kept changing")


def _leftovers(folder: Path) -> list[str]:
    """Hidden files that should not outlive a compaction: its journals, temp files, and summaries and
    step ranges that are torn, stale or of a part that is gone. The lock and the valid summaries and
    step ranges of live parts stay."""
    left = sorted(p.name for p in folder.iterdir() if p.name.startswith(".") and p.name not in (".compact.lock", ".summaries")
                  and not p.name.startswith(step_ranges.PREFIX))
    live = {p.name for p in shards.part_files(folder)}
    for path in sorted(folder.glob(f"{step_ranges.PREFIX}*")):
        part = folder / path.name.removeprefix(step_ranges.PREFIX).removesuffix(step_ranges.SUFFIX)
        if part.name not in live or step_ranges.load(part) is None:
            left.append(path.name)
        else:  # what the part holds
            steps = shards.read_file(part, Kind.ROLLOUTS, ["step"]).column("step")
            assert step_ranges.load(part) == step_ranges.StepRange.of(steps), part
    left += [f"no step range for {name}" for name in sorted(live) if step_ranges.load(folder / name) is None]
    for summary in sorted((folder / ".summaries").glob("*")) if (folder / ".summaries").exists() else []:
        part = folder / summary.name.removesuffix(".summary")
        if part.name not in live or summaries.load(part) is None:
            left.append(f".summaries/{summary.name}")
        else:  # what a reader would build from the part itself
            assert summaries.load(part) == summaries.build(shards.read_file(part, Kind.ROLLOUTS)), part
    return left


def _layout(folder: Path) -> int:
    """Small parts, a large one, small parts again; some keys rewritten later (an infra failure rerun,
    across the large part too). Returns a target size that keeps the large part as it is."""
    shards.write(folder, Kind.ROLLOUTS, [make_trial(sample=0, outcome="infra_error", infra_failure=True)])
    shards.write(folder, Kind.ROLLOUTS, [make_trial(sample=1), make_trial(sample=2, outcome="timeout")])
    shards.write(folder, Kind.ROLLOUTS, [make_trial(sample=2)])  # supersedes the timeout
    big = shards.write(folder, Kind.ROLLOUTS, [make_trial(task="big__1", sample=i, n_tokens=4000) for i in range(20)]
                       + [make_trial(sample=1, outcome="max_turns")])
    shards.write(folder, Kind.ROLLOUTS, [make_trial(sample=3)])
    shards.write(folder, Kind.ROLLOUTS, [make_trial(sample=0)])  # the rerun of the infra failure
    shards.write(folder, Kind.ROLLOUTS, [make_trial(task="big__1", sample=5, outcome="timeout")])
    assert big is not None
    return 4 * big.stat().st_size


def test_merged_names_sort_where_the_replaced_parts_were() -> None:
    last = "part-00000000000000000005-12-abcdef01.parquet"
    before, after = "part-00000000000000000004-99-ffffffff.parquet", "part-00000000000000000005-13-00000000.parquet"
    merged = merged_name(last)
    assert sorted([after, last, merged, before]) == [before, merged, last, after]
    again = merged_name(merged)
    assert again == "part-00000000000000000005-12-abcdef01-c0002.parquet"
    assert sorted([after, again, before]) == [before, again, after]


def test_compaction_keeps_the_last_write_of_each_key(tmp_path: Path) -> None:
    target = _layout(tmp_path)
    before = _outcomes(tmp_path)
    done_before = shards.already_done(tmp_path, Kind.ROLLOUTS)
    result = shards.compact(tmp_path, Kind.ROLLOUTS, target_bytes=target, on_merge=summaries.merge)
    assert (result.replaced, len(result.merged)) == (6, 2)  # 3 small, the large one kept, 3 small
    assert len(shards.part_files(tmp_path)) == 3
    assert _outcomes(tmp_path) == before
    assert before[make_trial(sample=0).trial_id] == "submitted"  # the rerun, not the infra failure
    assert before[make_trial(sample=1).trial_id] == "max_turns"  # the large part's, later than the first run's
    assert shards.already_done(tmp_path, Kind.ROLLOUTS) == done_before
    assert shards.compact(tmp_path, Kind.ROLLOUTS, target_bytes=target, on_merge=summaries.merge).replaced == 0  # nothing left to merge
    assert _leftovers(tmp_path) == []
    merged = {p.name + ".summary" for p in result.merged}
    assert {p.name for p in (tmp_path / ".summaries").iterdir()} == merged  # written by the merge, for its part


def test_merged_parts_are_sorted_and_read_by_row_group(tmp_path: Path) -> None:
    for step in range(6):
        shards.write(tmp_path, Kind.METRICS, [MetricRow(step=5 - step, key=f"k{i}", value=float(i)) for i in range(3)])
    shards.compact(tmp_path, Kind.METRICS)
    [part] = shards.part_files(tmp_path)
    steps = shards.read(tmp_path, Kind.METRICS).table.column("step").to_pylist()
    assert steps == sorted(steps)
    assert shards.file_info(part).command  # the command of the newest replaced part


_KILLED_COMPACTION = r"""
import os, signal, sys
import pyarrow.parquet as pq
from legorl.core.shards import compaction as shard_compaction
from legorl.core import shards
from legorl.monitor import summaries
from legorl.core.schemas import Kind
folder, target, kill_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
events = 0
def counted(fn):
    def call(*args, **kwargs):
        global events
        events += 1
        if events == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return fn(*args, **kwargs)
    return call
# Every step a crash can fall between: each file write, fsync, rename and removal.
os.replace, os.fsync, os.unlink = counted(os.replace), counted(os.fsync), counted(os.unlink)
pq.write_table = counted(pq.write_table)
shards.compact(folder, Kind.ROLLOUTS, target_bytes=target, on_merge=summaries.merge)
print(events)
"""


def _compact_killed(folder: Path, target: int, kill_at: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _KILLED_COMPACTION, str(folder), str(target), str(kill_at)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.heavy
def test_sigkill_at_every_point_of_a_compaction(tmp_path: Path) -> None:
    """Killed before each of its writes, fsyncs, renames and removals in turn: a reader sees what it
    saw before (no row twice, none missing), and the next compaction finishes the job."""
    template = tmp_path / "template"
    target = _layout(template)
    expected, raw_before = _outcomes(template), _raw_keys(template)
    probe = tmp_path / "probe"
    subprocess.run(["cp", "-a", str(template), str(probe)], check=True)
    events = int(_compact_killed(probe, target, 0).stdout)
    assert events > 10
    for kill_at in range(1, events + 1):
        folder = tmp_path / f"kill-{kill_at}"
        subprocess.run(["cp", "-a", str(template), str(folder)], check=True)
        proc = _compact_killed(folder, target, kill_at)
        assert proc.returncode == -9, (kill_at, proc.stderr[-2000:])
        raw = _raw_keys(folder)
        assert set(raw) == set(raw_before) and not raw - raw_before, kill_at  # none lost, none added twice
        assert _outcomes(folder) == expected, kill_at
        assert shards.compact(folder, Kind.ROLLOUTS, target_bytes=target, on_merge=summaries.merge) is not None
        assert _outcomes(folder) == expected, kill_at
        assert len(shards.part_files(folder)) == 3, kill_at
        assert _leftovers(folder) == [], kill_at


@pytest.mark.heavy
def test_readers_during_compactions_see_every_row_once(tmp_path: Path) -> None:
    """A writer adds parts and compacts them, over and over, while a reader reads."""
    written: list[str] = []
    stop = threading.Event()
    errors: list[BaseException] = []

    def write_and_compact() -> None:
        try:
            for cycle in range(15):
                for k in range(3):
                    trial = make_trial(task=f"t{cycle}__{k}", n_tokens=200)
                    shards.write(tmp_path, Kind.ROLLOUTS, [trial])
                    written.append(trial.trial_id)
                shards.compact(tmp_path, Kind.ROLLOUTS, on_merge=summaries.merge)
        except BaseException as exc:
            errors.append(exc)
        finally:
            stop.set()

    thread = threading.Thread(target=write_and_compact)
    thread.start()
    reads = 0
    seen: set[str] = set()
    while not stop.is_set():
        committed = set(written)  # before the read: each of these must be in it
        raw = _raw_keys(tmp_path)
        assert max(raw.values(), default=1) == 1, raw.most_common(1)
        assert committed <= set(raw) and seen <= set(raw)
        seen = set(raw)
        dataset = shards.read(tmp_path, Kind.ROLLOUTS, columns=[])
        assert dataset.duplicates == 0
        reads += 1
    thread.join()
    assert not errors, errors
    assert reads > 3
    assert set(_raw_keys(tmp_path)) == set(written)


def test_compact_command_on_a_run(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from legorl.cli.app import app

    run = tmp_path / "run"
    for sample in range(4):
        shards.write(run / "rollouts", Kind.ROLLOUTS, [make_trial(sample=sample)])
    result = CliRunner().invoke(app, ["shards", "compact", str(run), "--json"])
    assert result.exit_code == 0, result.output
    [entry] = json.loads(result.stdout)["compacted"]
    assert entry["replaced"] == 4 and entry["rows"] == 4
    assert len(shards.part_files(run / "rollouts")) == 1


@pytest.mark.parametrize("kind", [Kind.GRADES, Kind.TASKS])
def test_every_kind_compacts(tmp_path: Path, kind: Kind) -> None:
    from test_shards import sample_rows

    for _ in range(3):
        shards.write(tmp_path, kind, sample_rows()[kind])
    rows = shards.read_rows(tmp_path, kind)
    shards.compact(tmp_path, kind)
    assert shards.read_rows(tmp_path, kind) == rows and len(shards.part_files(tmp_path)) == 1
