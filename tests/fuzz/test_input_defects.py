"""The defects the fuzz suite found, each pinned by its failing case (before the fix: a traceback,
a message naming nothing, or bad input silently accepted)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from legorl.core import shards
from legorl.core.errors import ConfigError, LegorlError, ShardError
from legorl.core.schemas import Kind, TaskRow
from legorl.proxy.budgets import Budgets
from legorl.stages.grade import prediction_jobs
from legorl.tasks.importer import import_tasks

GOOD = {"instance_id": "org__repo-1", "FAIL_TO_PASS": ["t.py::a"], "test_command": "pytest"}
TASKS = {"org__repo-1": TaskRow(instance_id="org__repo-1", FAIL_TO_PASS=["t.py::a"])}
DEEP = "[" * 100_000 + "]" * 100_000
HUGE_INT = '{"instance_id": "org__repo-1", "version": ' + "1" * 5000 + "}"


@pytest.mark.parametrize(("name", "raw", "message"), [
    ("latin1.jsonl", b'{"instance_id": "caf\xe9"}\n', "not UTF-8 text (byte 20"),
    ("deep.json", DEEP.encode(), "line 1: not valid JSON (nested too deeply)"),
    ("deep.jsonl", (json.dumps(GOOD) + "\n" + DEEP).encode(), "line 2: not valid JSON (nested too deeply)"),
    ("int.jsonl", HUGE_INT.encode(), "line 1: not valid JSON (Exceeds the limit (4300 digits)"),
    ("id.jsonl", json.dumps({**GOOD, "instance_id": "x\ud800"}).encode(),
     "row 0: field 'instance_id': holds a lone UTF-16 surrogate"),
    ("ps.jsonl", json.dumps({**GOOD, "problem_statement": "\udc00"}).encode(),
     "row 0 (org__repo-1): field 'problem_statement': holds a lone UTF-16 surrogate"),
    ("f2p.jsonl", json.dumps({**GOOD, "FAIL_TO_PASS": ["t.py::\ud800"]}).encode(),
     "row 0 (org__repo-1): field 'FAIL_TO_PASS': holds a lone UTF-16 surrogate"),
])
def test_task_files_that_crashed_the_import_are_one_line_errors(tmp_path: Path, name: str, raw: bytes,
                                                                message: str) -> None:
    source = tmp_path / name
    source.write_bytes(raw)
    with pytest.raises(LegorlError) as info:
        import_tasks(str(source), tmp_path / "tasks")
    assert str(info.value).startswith(f"{source}: ") and message in str(info.value), str(info.value)
    assert "\n" not in str(info.value) and not (tmp_path / "tasks").exists()


def test_a_negative_import_limit_is_an_error_not_all_rows_but_the_last(tmp_path: Path) -> None:
    source = tmp_path / "two.jsonl"
    source.write_text(json.dumps(GOOD) + "\n" + json.dumps({**GOOD, "instance_id": "org__repo-2"}) + "\n")
    with pytest.raises(LegorlError, match="limit: must be >= 0, got -1"):
        import_tasks(str(source), tmp_path / "tasks", limit=-1)
    assert import_tasks(str(source), tmp_path / "tasks", limit=0).written == []


@pytest.mark.parametrize(("raw", "message"), [
    (b'[{"instance_id": "org__repo-1", "model_patch": "caf\xe9"}]', "not UTF-8 text (byte 51"),
    (DEEP.encode(), "neither JSON nor JSON lines (line 1: nested too deeply)"),
    (b'{"instance_id": "org__repo-1"}\n' + DEEP.encode(), "neither JSON nor JSON lines (line 2: nested too deeply)"),
    (HUGE_INT.encode(), "neither JSON nor JSON lines (line 1: Exceeds the limit (4300 digits)"),
    (json.dumps([{"instance_id": "org__repo-1", "model_patch": "d\ud800"}]).encode(),
     "prediction 0 (org__repo-1): field 'model_patch': holds a lone UTF-16 surrogate"),
    (json.dumps([{"instance_id": "org__repo-1", "model_name_or_path": "m\udfff"}]).encode(),
     "prediction 0 (org__repo-1): field 'model_name_or_path': holds a lone UTF-16 surrogate"),
    (json.dumps([{"instance_id": "org__repo-1", "model_name_or_path": {"name": "m"}}]).encode(),
     "prediction 0 (org__repo-1): field 'model_name_or_path': not a string"),
])
def test_predictions_that_crashed_or_slipped_through_are_one_line_errors(tmp_path: Path, raw: bytes,
                                                                         message: str) -> None:
    path = tmp_path / "preds.json"
    path.write_bytes(raw)
    with pytest.raises(LegorlError) as info:
        prediction_jobs(path, TASKS)
    assert str(info.value).startswith(f"{path}: ") and message in str(info.value), str(info.value)


def _parquet(table: pa.Table, metadata: dict[bytes, bytes]) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table.replace_schema_metadata(metadata), sink)
    return sink.getvalue()


@pytest.mark.parametrize(("table", "metadata", "message"), [
    (pa.table({"instance_id": ["a"]}), {b"legorl.kind": b"\xff\xfe", b"legorl.schema_version": b"1"},
     "expected a legorl 'tasks' shard, found a legorl"),
    (pa.table({"instance_id": ["a"]}), {b"legorl.kind": b"tasks", b"legorl.schema_version": "\u0663".encode()},
     "no readable legorl schema version"),
    (pa.table({"instance_id": [7], "FAIL_TO_PASS": [["t"]]}), {b"legorl.kind": b"tasks",
                                                               b"legorl.schema_version": b"1"}, None),
])
def test_foreign_shard_metadata_and_types_never_crash_a_reader(tmp_path: Path, table: pa.Table,
                                                               metadata: dict[bytes, bytes], message: str | None) -> None:
    """Undecodable kind metadata was a UnicodeDecodeError; a file without a version was said to be
    'newer'; a partial-column read (already_done) of an int64 key beside string keys crashed concat."""
    folder = tmp_path / "tasks"
    shards.write(folder, Kind.TASKS, [TaskRow(instance_id="ok", FAIL_TO_PASS=["t"])])
    good = shards.part_files(folder)[0]
    kept = good.read_bytes()
    (folder / "part-99999999999999999999-x.parquet").write_bytes(_parquet(table, metadata))
    for reader in (shards.read_rows, shards.already_done):
        if message is None:
            reader(folder, Kind.TASKS)
            continue
        with pytest.raises(ShardError, match=message):
            reader(folder, Kind.TASKS)
    assert good.read_bytes() == kept


def test_a_foreign_column_type_in_a_partial_read_is_a_shard_error_naming_the_field(tmp_path: Path) -> None:
    """``already_done`` on rollouts whose infra_failure column holds strings was an ArrowTypeError."""
    folder = tmp_path / "rollouts"
    folder.mkdir()
    row = {"trial_id": ["t"], "task_id": ["a"], "harness": ["h"], "step": [0], "sample_index": [0],
           "group_id": ["g"], "outcome": ["submitted"], "infra_failure": ["yes"]}
    (folder / "part-1.parquet").write_bytes(_parquet(pa.table(row), {b"legorl.kind": b"rollouts",
                                                                     b"legorl.schema_version": b"1"}))
    with pytest.raises(ShardError, match="field 'infra_failure': has type string, expected bool"):
        shards.already_done(folder, Kind.ROLLOUTS)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_wall_budget_is_refused(value: float) -> None:
    with pytest.raises(ConfigError, match=r"budgets\.max_wall_s: must be a positive number"):
        Budgets.from_dict({"max_wall_s": value})


def _tasks_folder(tmp_path: Path) -> tuple[Path, Path, bytes]:
    folder = tmp_path / "tasks"
    shards.write(folder, Kind.TASKS, [TaskRow(instance_id="ok", FAIL_TO_PASS=["t"])])
    good = shards.part_files(folder)[0]
    return folder, good, good.read_bytes()


def test_a_string_that_is_not_utf8_in_a_shard_is_a_shard_error(tmp_path: Path) -> None:
    """A flipped byte inside a string column was a UnicodeDecodeError from to_pylist()."""
    folder, good, kept = _tasks_folder(tmp_path)
    table = pq.read_table(good)
    broken = pa.array([b"\xffbad"], pa.binary()).view(pa.string())  # Arrow does not check on a view
    table = table.set_column(table.column_names.index("instance_id"), table.schema.field("instance_id"), broken)
    bad = folder / "part-99999999999999999999-x.parquet"
    bad.write_bytes(_parquet(table, dict(table.schema.metadata or {})))
    for reader in (shards.read_rows, shards.already_done):
        with pytest.raises(ShardError, match="corrupt Parquet data"):
            reader(folder, Kind.TASKS)
    assert good.read_bytes() == kept


def test_a_column_name_that_is_not_utf8_is_a_shard_error(tmp_path: Path) -> None:
    """A flipped byte in the footer's column names was a UnicodeDecodeError from read_metadata."""
    folder, good, kept = _tasks_folder(tmp_path)
    bad = folder / "part-99999999999999999999-x.parquet"
    bad.write_bytes(kept.replace(b"problem_statement", b"\xffroblem_statement"))
    with pytest.raises(ShardError, match="not a readable Parquet file"):
        shards.read_rows(folder, Kind.TASKS)
    assert good.read_bytes() == kept
