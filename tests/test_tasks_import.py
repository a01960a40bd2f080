"""Importing SWE-bench-schema rows: local files in every format, clear errors, shards written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from legorl.core import shards
from legorl.core.errors import LegorlError
from legorl.core.schemas import Kind
from legorl.tasks.importer import import_tasks, read_source

TEST_PATCH = "diff --git a/tests/test_x.py b/tests/test_x.py\n--- a/tests/test_x.py\n+++ b/tests/test_x.py\n@@ -1 +1,2 @@\n a\n+b\n"


def _row(i: int, **over: object) -> dict[str, object]:
    row: dict[str, object] = {
        "instance_id": f"org__repo-{i}", "repo": "org/repo", "base_commit": "abc123", "patch": TEST_PATCH,
        "test_patch": TEST_PATCH, "problem_statement": "it breaks", "hints_text": "", "created_at": "2024-01-01",
        "version": "1.0", "FAIL_TO_PASS": json.dumps(["tests/test_x.py::test_a"]),
        "PASS_TO_PASS": json.dumps(["tests/test_x.py::test_b"]), "environment_setup_commit": "abc123",
    }
    row.update(over)
    return row


def test_swebench_verified_style_jsonl(tmp_path: Path) -> None:
    src = tmp_path / "verified.jsonl"
    src.write_text("\n".join(json.dumps(_row(i)) for i in range(3)) + "\n")
    result = import_tasks(str(src), tmp_path / "run" / "tasks")
    assert result.written == [f"org__repo-{i}" for i in range(3)]
    rows = shards.read_rows(tmp_path / "run" / "tasks", Kind.TASKS)
    assert rows[0].FAIL_TO_PASS == ["tests/test_x.py::test_a"] and rows[0].image is None
    # importing again writes nothing new; a changed row is written and wins on read
    assert import_tasks(str(src), tmp_path / "run" / "tasks").written == []
    src.write_text(json.dumps(_row(0, problem_statement="new text")) + "\n")
    assert import_tasks(str(src), tmp_path / "run" / "tasks").written == ["org__repo-0"]
    by_id = {r.instance_id: r for r in shards.read_rows(tmp_path / "run" / "tasks", Kind.TASKS)}
    assert by_id["org__repo-0"].problem_statement == "new text" and len(by_id) == 3


def test_parquet_with_real_lists_and_relative_repo_source(tmp_path: Path) -> None:
    (tmp_path / "bundles").mkdir()
    (tmp_path / "bundles" / "repo.bundle").write_bytes(b"x")
    rows = [_row(0, FAIL_TO_PASS=["t::a"], PASS_TO_PASS=[], repo_source="bundles/repo.bundle",
                 image="localhost/img:1", test_command="pytest {test_files}", log_parser="pytest")]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "set.parquet")
    raw, base = read_source(str(tmp_path / "set.parquet"))
    assert base == tmp_path.resolve() and raw[0]["FAIL_TO_PASS"] == ["t::a"]
    import_tasks(str(tmp_path / "set.parquet"), tmp_path / "tasks")
    (task,) = shards.read_rows(tmp_path / "tasks", Kind.TASKS)
    assert task.repo_source == str((tmp_path / "bundles" / "repo.bundle").resolve())
    assert task.image == "localhost/img:1" and task.test_command == "pytest {test_files}"


def test_json_array_and_swesmith_image_alias(tmp_path: Path) -> None:
    src = tmp_path / "rows.json"
    src.write_text(json.dumps([_row(1, image_name="swesmith/img")]))
    import_tasks(str(src), tmp_path / "tasks")
    assert shards.read_rows(tmp_path / "tasks", Kind.TASKS)[0].image == "swesmith/img"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"FAIL_TO_PASS": "not json"}, "row 1 (org__repo-1): field 'FAIL_TO_PASS': not a JSON list"),
        ({"FAIL_TO_PASS": "[]"}, "field 'FAIL_TO_PASS': empty"),
        ({"PASS_TO_PASS": [1, 2]}, "field 'PASS_TO_PASS': holds a non-string"),
        ({"instance_id": ""}, "row 1: field 'instance_id': missing or empty"),
        ({"repo_source": "nope.bundle"}, "field 'repo_source'"),
        ({"log_parser": "jest"}, "field 'log_parser': unknown parser 'jest'"),
        ({"test_patch": "", "test_command": None}, "field 'test_patch': empty, and no test_command"),
        ({"patch": "this is not a diff"}, "field 'patch': not a unified diff"),
        ({"version": {"a": 1}}, "field 'version': expected a string"),
    ],
)
def test_bad_rows_name_row_and_field(tmp_path: Path, override: dict[str, object], message: str) -> None:
    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps(_row(0)) + "\n" + json.dumps(_row(1, **override)) + "\n")
    with pytest.raises(LegorlError) as info:
        import_tasks(str(src), tmp_path / "tasks")
    assert message in str(info.value)
    assert str(src) in str(info.value)
    assert not (tmp_path / "tasks").exists()  # nothing half-written


def test_duplicate_ids_are_an_error(tmp_path: Path) -> None:
    src = tmp_path / "dup.jsonl"
    src.write_text(json.dumps(_row(0)) + "\n" + json.dumps(_row(0)) + "\n")
    with pytest.raises(LegorlError, match=r"row 1 .*duplicate of row 0"):
        import_tasks(str(src), tmp_path / "tasks")


def test_missing_local_file_and_unknown_suffix(tmp_path: Path) -> None:
    with pytest.raises(LegorlError, match="no such file"):
        read_source(str(tmp_path / "nope.parquet"))
    (tmp_path / "x.csv").write_text("a\n")
    with pytest.raises(LegorlError, match="unknown file type"):
        read_source(str(tmp_path / "x.csv"))


@pytest.mark.heavy
def test_hub_id_fails_fast_offline(tmp_path: Path) -> None:
    """Through the CLI, as a user sees it: one line, no traceback, quickly."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    start = time.monotonic()
    legorl = str(Path(sys.executable).parent / "legorl")
    proc = subprocess.run([legorl, "tasks", "import", "SWE-bench/SWE-bench_Verified",
                           "--run", str(tmp_path / "run")], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1
    assert "cannot load dataset 'SWE-bench/SWE-bench_Verified'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert time.monotonic() - start < 60
