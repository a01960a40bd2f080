"""The shard contract: round trips, atomic commits under SIGKILL, clear errors, resume."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from legorl.core import shards
from legorl.core.errors import ShardError
from legorl.core.schemas import (
    SCHEMAS,
    Call,
    GradeRow,
    Kind,
    MetricRow,
    Segment,
    TaskRow,
    TestResult,
    Timings,
    TrialRow,
)


def make_trial(task: str = "repo__1", sample: int = 0, n_tokens: int = 40, **kw: object) -> TrialRow:
    ids = list(range(n_tokens))
    mask = [i % 2 for i in ids]
    return TrialRow.new(
        task, "mini-swe-agent", 3, sample,
        outcome=kw.pop("outcome", "submitted"),
        model="tiny",
        patch="diff --git a/x.py b/x.py\n",
        segments=[
            Segment(ids, mask, [-0.5 * m for m in mask], reason="main"),
            Segment(
                ids[:4], [0, 0, 1, 1], [0.0, 0.0, -1.25, -0.25], reason="rewrite", parent=0,
                routed_experts=list(range(4 * 2 * 2)), routing_layers=2, routing_top_k=2,
            ),
        ],
        calls=[Call(index=0, api="openai", stream=True, segment=0, latency_s=0.25, ttft_s=0.01,
                    prompt_tokens=20, new_prompt_tokens=20, completion_tokens=20, finish_reason="tool_calls")],
        messages=json.dumps([{"role": "user", "content": "fix it"}]),
        timings=Timings(sandbox_s=0.5, agent_s=3.0, model_s=2.0, patch_s=0.1, total_s=3.7),
        started_at=1.0,
        finished_at=4.7,
        **kw,
    )


def sample_rows() -> dict[Kind, list]:
    return {
        Kind.TASKS: [
            TaskRow(instance_id="repo__1", repo="org/repo", base_commit="abc", patch="p", test_patch="tp",
                    problem_statement="bug", FAIL_TO_PASS=["t.py::test_a"], PASS_TO_PASS=["t.py::test_b"],
                    image="localhost/legorl-base:x", repo_source="/abs/repo.bundle", test_command="pytest")
        ],
        Kind.ROLLOUTS: [make_trial(), make_trial(sample=1, outcome="infra_error", infra_failure=True)],
        Kind.GRADES: [
            GradeRow(trial_id="a", task_id="repo__1", status="graded", reward=1.0, resolved=True, resolution="FULL",
                     tests=[TestResult("t.py::test_a", "FAIL_TO_PASS", "PASSED", True)],
                     dropped_paths=["conftest.py"], apply_method="git apply", duration_s=1.5, log="ok")
        ],
        Kind.METRICS: [MetricRow(step=0, key="loss", value=0.5), MetricRow(step=0, key="reward_mean", value=0.25, harness="opencode")],
    }


@pytest.mark.parametrize("kind", list(Kind))
def test_round_trip_every_schema(tmp_path: Path, kind: Kind) -> None:
    rows = sample_rows()[kind]
    written = shards.write(tmp_path / "ds", kind, rows, command="legorl test")
    assert written is not None and written.name.startswith("part-") and written.suffix == ".parquet"
    back = shards.read_rows(tmp_path / "ds", kind)
    assert back == rows
    info = shards.file_info(written)
    assert (info.kind, info.schema_version, info.command) == (str(kind), 1, "legorl test")
    # Anyone can open it: plain pyarrow sees the same schema.
    assert pq.read_schema(written).remove_metadata() == SCHEMAS[kind]


def test_duplicates_resolve_to_the_last_write_and_are_counted(tmp_path: Path) -> None:
    first = make_trial(outcome="infra_error", infra_failure=True)
    shards.write(tmp_path, Kind.ROLLOUTS, [first, make_trial(sample=1)])
    shards.write(tmp_path, Kind.ROLLOUTS, [make_trial(outcome="timeout")])
    dataset = shards.read(tmp_path, Kind.ROLLOUTS)
    assert dataset.duplicates == 1
    by_id = {r.trial_id: r for r in dataset.rows()}
    assert by_id[first.trial_id].outcome == "timeout"
    assert len(by_id) == 2


def test_already_done_skips_done_keys_but_not_infra_failures(tmp_path: Path) -> None:
    done, failed = make_trial(sample=0), make_trial(sample=1, outcome="infra_error", infra_failure=True)
    shards.write(tmp_path, Kind.ROLLOUTS, [done, failed])
    assert shards.already_done(tmp_path, Kind.ROLLOUTS) == {done.trial_id}
    assert shards.already_done(tmp_path / "missing", Kind.ROLLOUTS) == set()
    # A retried infra failure that now succeeded counts as done.
    shards.write(tmp_path, Kind.ROLLOUTS, [make_trial(sample=1)])
    assert shards.already_done(tmp_path, Kind.ROLLOUTS) == {done.trial_id, failed.trial_id}


_KILLED_WRITER = r"""
import sys
from legorl.core import shards
from legorl.core.schemas import Kind, Segment, TrialRow
out = sys.argv[1]
i = 0
while True:
    rows = [TrialRow.new(f"task{i}", "h", 0, k, outcome="submitted",
                         segments=[Segment(list(range(30000)), [1] * 30000, [-0.1] * 30000)]) for k in range(4)]
    shards.write(out, Kind.ROLLOUTS, rows)
    print(i, flush=True)
    i += 1
"""


def test_sigkill_mid_write_keeps_every_committed_row(tmp_path: Path) -> None:
    out = tmp_path / "rollouts"
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(out)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    committed = -1
    deadline = time.monotonic() + 60
    while committed < 2 and time.monotonic() < deadline:
        committed = int(proc.stdout.readline())
    time.sleep(0.05)  # land the kill inside a later write
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    dataset = shards.read(out, Kind.ROLLOUTS)
    tasks = set(dataset.table.column("task_id").to_pylist())
    assert {f"task{i}" for i in range(committed + 1)} <= tasks
    assert dataset.table.num_rows == 4 * len(tasks)  # no partial file was read
    assert all(f.name.startswith("part-") for f in dataset.files)


def test_corrupt_and_foreign_files_name_the_file(tmp_path: Path) -> None:
    shards.write(tmp_path, Kind.ROLLOUTS, [make_trial()])
    corrupt = tmp_path / "part-99999999999999999999-0-corrupt.parquet"
    corrupt.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(ShardError, match=r"part-99999999999999999999-0-corrupt\.parquet: not a readable Parquet"):
        shards.read(tmp_path, Kind.ROLLOUTS)
    corrupt.unlink()

    foreign = tmp_path / "part-99999999999999999999-0-foreign.parquet"
    pq.write_table(pa.table({"x": [1, 2]}), foreign)
    with pytest.raises(ShardError, match=r"foreign\.parquet: expected a legorl 'rollouts' shard, found not a legorl shard"):
        shards.read(tmp_path, Kind.ROLLOUTS)
    foreign.unlink()

    other = tmp_path / "grades"
    shards.write(other, Kind.GRADES, sample_rows()[Kind.GRADES])
    with pytest.raises(ShardError, match="expected a legorl 'rollouts' shard, found a legorl 'grades' shard"):
        shards.read(other, Kind.ROLLOUTS)


def test_a_truncated_file_is_reported_not_silently_skipped(tmp_path: Path) -> None:
    path = shards.write(tmp_path, Kind.ROLLOUTS, [make_trial(n_tokens=5000)])
    assert path is not None
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ShardError, match=str(path.name)):
        shards.read(tmp_path, Kind.ROLLOUTS)


def _write_raw(path: Path, kind: Kind, table: pa.Table) -> None:
    meta = {b"legorl.kind": str(kind).encode(), b"legorl.schema_version": b"1"}
    pq.write_table(table.replace_schema_metadata(meta), path)


def test_bad_rows_name_file_row_and_field(tmp_path: Path) -> None:
    good, bad = make_trial(sample=0).to_dict(), make_trial(sample=1).to_dict()
    bad["segments"][0]["loss_mask"] = bad["segments"][0]["loss_mask"][:-1]
    table = pa.Table.from_pylist([good, bad], schema=SCHEMAS[Kind.ROLLOUTS])
    _write_raw(tmp_path / "part-1.parquet", Kind.ROLLOUTS, table)
    with pytest.raises(ShardError, match=r"part-1\.parquet: row 1: field 'segments': segment 2: loss_mask has 39"):
        shards.read(tmp_path, Kind.ROLLOUTS)

    bad = make_trial(outcome="exploded").to_dict()
    _write_raw(tmp_path / "part-1.parquet", Kind.ROLLOUTS, pa.Table.from_pylist([good, bad], schema=SCHEMAS[Kind.ROLLOUTS]))
    with pytest.raises(ShardError, match=r"row 1: field 'outcome': unknown value 'exploded'"):
        shards.read(tmp_path, Kind.ROLLOUTS)

    # A column with an incompatible type.
    table = pa.table({"step": pa.array(["not-a-number"]), "key": ["loss"], "value": [1.0]})
    (tmp_path / "metrics").mkdir()
    _write_raw(tmp_path / "metrics" / "part-2.parquet", Kind.METRICS, table)
    with pytest.raises(ShardError, match=r"part-2\.parquet: field 'step': has type string"):
        shards.read(tmp_path / "metrics", Kind.METRICS)


def test_writing_bad_rows_fails_before_anything_is_written(tmp_path: Path) -> None:
    bad = make_trial()
    bad.segments[0].logprobs = bad.segments[0].logprobs[:3]
    with pytest.raises(ShardError, match="logprobs has 3 entries"):
        shards.write(tmp_path, Kind.ROLLOUTS, [make_trial(sample=5), bad])
    with pytest.raises(ShardError, match="do not fit the rollouts schema"):
        shards.write(tmp_path, Kind.ROLLOUTS, [{"trial_id": "x", "step": "three"}])
    assert list(tmp_path.iterdir()) == []


def test_temp_files_are_ignored_by_readers(tmp_path: Path) -> None:
    shards.write(tmp_path, Kind.ROLLOUTS, [make_trial()])
    (tmp_path / ".part-123.parquet.tmp").write_bytes(b"half a file")
    assert shards.read(tmp_path, Kind.ROLLOUTS).table.num_rows == 1


def test_a_writer_sweeps_the_temp_files_of_dead_writers_only(tmp_path: Path) -> None:
    import os
    import socket
    import subprocess

    probe = subprocess.Popen(["true"])
    probe.wait()
    dead_pid = probe.pid  # a writer that has exited
    host = shards._HOST
    assert host and socket.gethostname()
    torn = tmp_path / f".part-{1:020d}-{dead_pid}-deadbeef.parquet.{host}.tmp"
    legacy = tmp_path / f".part-{2:020d}-{dead_pid}-deadbeef.parquet.tmp"
    live = tmp_path / f".part-{3:020d}-{os.getppid()}-deadbeef.parquet.{host}.tmp"
    remote = tmp_path / f".part-{4:020d}-{dead_pid}-deadbeef.parquet.otherhost.tmp"
    for path in (torn, legacy, live, remote):
        path.write_bytes(b"PAR1 torn")
    shards.write(tmp_path, Kind.ROLLOUTS, [make_trial()])
    assert not torn.exists() and not legacy.exists()
    assert live.exists() and remote.exists()  # a live writer's, and another host's (pids mean nothing here)


def test_a_full_disk_is_one_shard_error_and_leaves_no_temp_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    shards.write(tmp_path, Kind.ROLLOUTS, [make_trial(sample=0)])
    before = sorted(p.name for p in tmp_path.iterdir())
    monkeypatch.setattr(pq, "write_table", full)
    with pytest.raises(ShardError, match="cannot commit a part file: No space left on device"):
        shards.write(tmp_path, Kind.ROLLOUTS, [make_trial(sample=1)])
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_shard_writer_commits_in_batches(tmp_path: Path) -> None:
    with shards.ShardWriter(tmp_path, Kind.METRICS, rows_per_file=2) as writer:
        for step in range(5):
            writer.add(MetricRow(step=step, key="loss", value=float(step)))
        assert len(shards.part_files(tmp_path)) == 2
    assert len(shards.part_files(tmp_path)) == 3
    assert shards.read(tmp_path, Kind.METRICS).table.num_rows == 5


def test_any_tool_can_open_a_dataset(tmp_path: Path) -> None:
    shards.write(tmp_path, Kind.ROLLOUTS, [make_trial(), make_trial(sample=1)])
    import pandas as pd

    frame = pd.read_parquet(tmp_path)
    assert sorted(frame["sample_index"]) == [0, 1]
    from datasets import load_dataset

    ds = load_dataset("parquet", data_files=str(tmp_path / "part-*.parquet"), split="train")
    assert len(ds[0]["segments"][0]["token_ids"]) == 40


def test_rows_written_before_fingerprints_and_costs_still_read(tmp_path: Path) -> None:
    """Shards without the fingerprint and cost columns (older legorl) read with them null, and a
    trial's cost is then derived from its calls (legorl.trials.costs)."""
    from legorl.grading.fingerprint import grade_fingerprint
    from legorl.trials.costs import cost_of, trial_cost
    from legorl.trials.fingerprints import trial_fingerprint

    new = make_trial(fingerprint=trial_fingerprint("mini-swe-agent"), cost=trial_cost(make_trial().calls, 2, 9.5))
    grade = sample_rows()[Kind.GRADES][0]
    grade.fingerprint = grade_fingerprint(TaskRow(instance_id="repo__1", test_command="pytest"))
    for kind, rows, dropped in ((Kind.ROLLOUTS, [new], ["fingerprint", "cost"]), (Kind.GRADES, [grade], ["fingerprint"])):
        folder = tmp_path / kind.value
        shards.write(folder, kind, rows)
        assert shards.read_rows(folder, kind)[0].to_dict() == rows[0].to_dict()  # the new fields round-trip
        [part] = shards.part_files(folder)
        table = pq.read_table(part)
        old = table.drop_columns(dropped).replace_schema_metadata(table.schema.metadata)
        pq.write_table(old, part)
        [back] = shards.read_rows(folder, kind)
        assert back.fingerprint is None and getattr(back, "cost", None) is None
    [old_trial] = shards.read_rows(tmp_path / "rollouts", Kind.ROLLOUTS)
    derived = cost_of(old_trial)
    assert derived.prompt_tokens == 20 and derived.sampled_tokens == 20 and derived.cached_tokens == 0
    assert derived.engine_s == 0.25 and derived.retries == 0 and derived.sandbox_s is None
    assert new.cost is not None and new.cost.retries == 1 and new.cost.sandbox_s == 9.5
