"""Batched writers: rows reach disk in parts of many rows (per N rows, per T seconds, on close), and a
SIGKILL loses only the rows still buffered; reads pushed down by key or step read only those rows."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.compute as pc
import pytest
from test_shards import make_trial

from legorl.core import shards
from legorl.core.errors import ShardError
from legorl.core.schemas import Kind, MetricRow


def test_rows_per_file_and_close_commit(tmp_path: Path) -> None:
    with shards.ShardWriter(tmp_path, Kind.METRICS, rows_per_file=4, max_seconds=float("inf")) as writer:
        for step in range(10):
            writer.add(MetricRow(step=step, key="loss", value=float(step)))
        assert [shards.file_info(f).rows for f in shards.part_files(tmp_path)] == [4, 4]
    assert [shards.file_info(f).rows for f in shards.part_files(tmp_path)] == [4, 4, 2]


def test_a_buffered_row_is_committed_after_max_seconds(tmp_path: Path) -> None:
    with shards.ShardWriter(tmp_path, Kind.METRICS, rows_per_file=100, max_seconds=0.2) as writer:
        writer.add(MetricRow(step=0, key="loss", value=1.0))
        writer.add(MetricRow(step=1, key="loss", value=1.0))
        assert shards.part_files(tmp_path) == []
        deadline = time.monotonic() + 10
        while not shards.part_files(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [shards.file_info(f).rows for f in shards.part_files(tmp_path)] == [2]  # one part, both rows
        writer.add(MetricRow(step=2, key="loss", value=1.0))
    assert shards.read(tmp_path, Kind.METRICS).table.num_rows == 3


def test_the_environment_sets_the_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LEGORL_SHARD_ROWS", "3")
    monkeypatch.setenv("LEGORL_SHARD_SECONDS", "7.5")
    writer = shards.ShardWriter(tmp_path, Kind.METRICS)
    assert (writer.rows_per_file, writer.max_seconds) == (3, 7.5)
    monkeypatch.setenv("LEGORL_SHARD_ROWS", "many")
    with pytest.raises(ShardError, match="LEGORL_SHARD_ROWS: not a number"):
        shards.ShardWriter(tmp_path, Kind.METRICS)


def test_a_timed_flush_that_fails_is_raised_by_the_next_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    import pyarrow.parquet as pq

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pq, "write_table", full)
    writer = shards.ShardWriter(tmp_path, Kind.METRICS, rows_per_file=100, max_seconds=0.05)
    writer.add(MetricRow(step=0, key="loss", value=1.0))
    time.sleep(0.5)
    with pytest.raises(ShardError, match="No space left on device"):
        writer.add(MetricRow(step=1, key="loss", value=1.0))
    assert list(tmp_path.iterdir()) == []  # no temp file left


_KILLED_BATCH_WRITER = r"""
import sys
from legorl.core import shards
from legorl.core.schemas import Kind, Segment, TrialRow
out = sys.argv[1]
with shards.ShardWriter(out, Kind.ROLLOUTS, rows_per_file=8, max_seconds=float("inf")) as writer:
    i = 0
    while True:
        writer.add(TrialRow.new(f"task{i}", "h", 0, 0, outcome="submitted",
                                segments=[Segment(list(range(20000)), [1] * 20000, [-0.1] * 20000)]))
        print(i, flush=True)  # handed to the writer: committed once its part is
        i += 1
"""


@pytest.mark.parametrize("seed", range(3))
def test_sigkill_loses_only_the_buffered_rows(tmp_path: Path, seed: int) -> None:
    import random

    out = tmp_path / "rollouts"
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_BATCH_WRITER, str(out)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    handed = random.Random(seed).randint(10, 40)  # rows handed over before the kill
    last = -1
    while last < handed:
        last = int(proc.stdout.readline())
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    keys = [k for f in shards.part_files(out) for k in shards.read_file(f, Kind.ROLLOUTS, ["trial_id"]).column("trial_id").to_pylist()]
    assert len(keys) == len(set(keys))  # nothing twice
    tasks = sorted(int(k.split("/")[0].removeprefix("task")) for k in keys)
    assert tasks == list(range(len(tasks)))  # a prefix: what a part committed, whole
    assert len(tasks) % 8 == 0 and last + 1 - len(tasks) <= 8 + 1  # lost: at most the buffer (and the row in hand)
    # a rerun resumes from what was committed
    assert shards.already_done(out, Kind.ROLLOUTS) == set(keys)


def test_where_reads_only_matching_rows_and_keeps_last_write_wins(tmp_path: Path) -> None:
    first = make_trial(sample=0, outcome="infra_error", infra_failure=True)
    shards.write(tmp_path, Kind.ROLLOUTS, [first, make_trial(sample=1), make_trial(sample=2)])
    shards.write(tmp_path, Kind.ROLLOUTS, [make_trial(sample=0, outcome="timeout")])
    dataset = shards.read(tmp_path, Kind.ROLLOUTS, where=pc.field("trial_id") == first.trial_id)
    assert [r.outcome for r in dataset.rows()] == ["timeout"] and dataset.duplicates == 1
    assert shards.read(tmp_path, Kind.ROLLOUTS, where=pc.field("step") == 99).table.num_rows == 0
    only = shards.read(tmp_path, Kind.ROLLOUTS, columns=["outcome"], where=pc.field("step") == 3).table
    assert only.column_names == ["trial_id", "outcome"] and only.num_rows == 3
    done = shards.already_done(tmp_path, Kind.ROLLOUTS, where=pc.field("trial_id") != make_trial(sample=2).trial_id)
    assert done == {first.trial_id, make_trial(sample=1).trial_id}
