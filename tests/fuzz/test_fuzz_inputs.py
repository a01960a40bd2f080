"""Fuzzing what a user hands legorl on disk (issue #12): task files for `legorl tasks import`,
predictions for `legorl grade --predictions`, shards, and the CLI's option values. Each bad input
is a :class:`LegorlError` (exit code 1 at the CLI) whose one line names the file (and row, field)
— never a traceback — and the shards already in the run directory stay byte-identical."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fuzz_values import JSON, SURROGATES
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from legorl.cli.app import app
from legorl.core import shards
from legorl.core.errors import LegorlError, ShardError
from legorl.core.schemas import Call, GradeRow, Kind, Segment, TaskRow, TrialRow
from legorl.stages.grade import prediction_jobs
from legorl.tasks.importer import import_tasks

TEST_PATCH = "diff --git a/t.py b/t.py\n--- a/t.py\n+++ b/t.py\n@@ -1 +1 @@\n-a\n+b\n"
GOOD_ROW: dict[str, Any] = {"instance_id": "org__repo-1", "repo": "org/repo", "base_commit": "abc",
                            "patch": "", "test_patch": TEST_PATCH, "problem_statement": "fix it",
                            "FAIL_TO_PASS": '["t.py::test_a"]', "PASS_TO_PASS": [], "version": "1.0"}
TASKS = {"org__repo-1": TaskRow(instance_id="org__repo-1", FAIL_TO_PASS=["t.py::test_a"])}


def sample_rows() -> dict[Kind, list[Any]]:
    ids = list(range(12))
    trial = TrialRow.new("org__repo-1", "mini-swe-agent", 0, 0, outcome="submitted", patch="diff",
                         segments=[Segment(ids, [i % 2 for i in ids], [-0.5 * (i % 2) for i in ids], reason="main")],
                         calls=[Call(index=0, api="openai", stream=False, segment=0, completion_tokens=6)])
    return {Kind.TASKS: [TASKS["org__repo-1"]], Kind.ROLLOUTS: [trial],
            Kind.GRADES: [GradeRow(trial_id=trial.trial_id, task_id="org__repo-1", status="graded", reward=1.0)]}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory holding one good shard of each kind (what must survive every bad input)."""
    run = tmp_path_factory.mktemp("run")
    for kind, rows in sample_rows().items():
        shards.write(run / str(kind), kind, rows)
    return run


def snapshot(run: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def assert_one_line_error(exc: BaseException, names: Path | str) -> None:
    assert isinstance(exc, LegorlError), f"{type(exc).__name__}: {exc}"
    text = str(exc)
    assert "\n" not in text and str(names) in text, text


def settle(run: Path, before: dict[Path, bytes]) -> None:
    """Files written earlier are byte-identical; part files a successful import added are removed
    (so the next example meets the same run directory)."""
    after = snapshot(run)
    for path, content in before.items():
        assert after.get(path) == content, f"{path} changed"
    for path in after.keys() - before.keys():
        path.unlink()


# ------------------------------------------------------------------ task files

def _task_rows(data: st.DataObject) -> list[Any]:
    rows: list[Any] = []
    for i in range(data.draw(st.integers(1, 3))):
        row: Any = {**GOOD_ROW, "instance_id": f"org__repo-{i + 1}"}
        for _ in range(data.draw(st.integers(0, 3))):
            name = data.draw(st.sampled_from([*GOOD_ROW, "image", "repo_source", "test_command", "log_parser",
                                              "gold_statuses", "image_name", "repo_ref"]))
            if data.draw(st.integers(0, 5)) == 0:
                row.pop(name, None)
            else:
                row[name] = data.draw(JSON | SURROGATES)
        rows.append(row if data.draw(st.integers(0, 9)) else data.draw(JSON))
    return rows


def _write_tasks(path: Path, rows: list[Any], data: st.DataObject) -> Path:
    fmt = data.draw(st.sampled_from(["jsonl", "json", "parquet", "bytes"]))
    if fmt == "parquet":
        try:
            pq.write_table(pa.Table.from_pylist(rows), path.with_suffix(".parquet"))
            return path.with_suffix(".parquet")
        except (pa.ArrowException, AttributeError, TypeError, ValueError, OverflowError):
            fmt = "jsonl"  # Arrow cannot hold these mixed types: the same rows as JSON lines
    text = "\n".join(json.dumps(r) for r in rows) if fmt != "json" else json.dumps(rows)
    raw = text.encode()
    if fmt == "bytes":  # a real file, cut short or with bytes flipped
        raw = raw[: data.draw(st.integers(0, len(raw)))]
        for at in data.draw(st.lists(st.integers(0, max(0, len(raw) - 1)), max_size=3)) if raw else []:
            raw = raw[:at] + bytes([raw[at] ^ data.draw(st.integers(1, 255))]) + raw[at + 1:]
    out = path.with_suffix(".json" if fmt == "json" else ".jsonl")
    out.write_bytes(raw)
    return out


def test_fuzzed_task_files(run_dir: Path, tmp_path: Path, fuzz_settings: Any, fuzzed: Counter[str]) -> None:
    @fuzz_settings(300)
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        before = snapshot(run_dir)
        source = _write_tasks(tmp_path / "tasks", _task_rows(data), data)
        fuzzed["task_files"] += 1
        try:
            import_tasks(str(source), run_dir / "tasks")
        except Exception as exc:
            assert_one_line_error(exc, source)
        settle(run_dir, before)
        source.unlink()

    run()


# ------------------------------------------------------------------ predictions

def test_fuzzed_predictions_files(run_dir: Path, tmp_path: Path, fuzz_settings: Any, fuzzed: Counter[str]) -> None:
    good = {"instance_id": "org__repo-1", "model_patch": "diff", "model_name_or_path": "m"}

    @fuzz_settings(300)
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        before = snapshot(run_dir)
        item: Any = dict(good)
        for _ in range(data.draw(st.integers(0, 2))):
            item[data.draw(st.sampled_from([*good, "x"]))] = data.draw(JSON | SURROGATES)
        shape = data.draw(st.sampled_from(["list", "keyed", "jsonl", "one", "any", "bytes"]))
        text = {"list": lambda: json.dumps([item]), "keyed": lambda: json.dumps({"org__repo-1": item}),
                "jsonl": lambda: json.dumps(item) + "\n" + json.dumps(item), "one": lambda: json.dumps(item),
                "any": lambda: json.dumps(data.draw(JSON)), "bytes": lambda: ""}[shape]()
        raw = data.draw(st.binary(max_size=40)) if shape == "bytes" else text.encode()
        path = tmp_path / "preds.jsonl"
        path.write_bytes(raw)
        fuzzed["predictions_files"] += 1
        try:
            jobs = prediction_jobs(path, TASKS)
            assert all(j.task_id in TASKS and isinstance(j.harness, str) for j in jobs)
        except Exception as exc:
            assert_one_line_error(exc, path)
        settle(run_dir, before)

    run()


# ------------------------------------------------------------------ shards

def _foreign_table(kind: Kind, table: pa.Table, data: st.DataObject) -> pa.Table:
    """``table`` with one column dropped, retyped or added, or its legorl metadata rewritten."""
    change = data.draw(st.sampled_from(["drop", "retype", "add", "meta"]))
    name = data.draw(st.sampled_from(table.column_names))
    meta = dict(table.schema.metadata or {})
    if change == "drop":
        return table.drop_columns([name])
    if change == "retype":
        value = data.draw(st.sampled_from([pa.array(["yes"] * table.num_rows), pa.array([1.5] * table.num_rows),
                                           pa.array([[1, 2]] * table.num_rows), pa.array([b"\xff"] * table.num_rows),
                                           pa.array([{"a": 1}] * table.num_rows)]))
        return table.set_column(table.column_names.index(name), name, value).replace_schema_metadata(meta)
    if change == "add":
        return table.append_column("extra", pa.array([None] * table.num_rows, pa.int8())).replace_schema_metadata(meta)
    key = data.draw(st.sampled_from([b"legorl.kind", b"legorl.schema_version"]))
    meta[key] = data.draw(st.sampled_from([b"", b"\xff\xfe", b"999", b"-1", "\u0663".encode(), b"grades", b"tasks"]))
    return table.replace_schema_metadata(meta)


def test_fuzzed_shards(run_dir: Path, tmp_path: Path, fuzz_settings: Any, fuzzed: Counter[str]) -> None:
    """A bad part file beside a good one: truncated, bytes flipped, foreign schema or column types."""

    @fuzz_settings(300)
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        kind = data.draw(st.sampled_from([Kind.TASKS, Kind.ROLLOUTS, Kind.GRADES]))
        folder = run_dir / str(kind)
        before = snapshot(run_dir)
        good = shards.part_files(folder)[0]
        raw = good.read_bytes()
        how = data.draw(st.sampled_from(["truncate", "flip", "foreign"]))
        if how == "truncate":
            raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
        elif how == "flip":
            for at in data.draw(st.lists(st.integers(0, len(raw) - 1), min_size=1, max_size=8)):
                raw = raw[:at] + bytes([raw[at] ^ data.draw(st.integers(1, 255))]) + raw[at + 1:]
        else:
            sink = pa.BufferOutputStream()
            pq.write_table(_foreign_table(kind, pq.read_table(good), data), sink)
            raw = sink.getvalue().to_pybytes()
        bad = folder / "part-99999999999999999999-fuzz.parquet"  # sorts after the good file
        bad.write_bytes(raw)
        fuzzed["shard_files"] += 1
        try:
            for reader in (shards.read_rows, shards.already_done, lambda p, k: list(shards.iter_files(p, k))):
                try:
                    reader(folder, kind)
                except Exception as exc:
                    assert isinstance(exc, ShardError), f"{type(exc).__name__}: {exc}"
                    assert_one_line_error(exc, bad)
        finally:
            bad.unlink()
        settle(run_dir, before)

    run()


# ------------------------------------------------------------------ the CLI

def _cli_cases(run: Path, bad_file: Path, good_file: Path) -> list[list[str]]:
    r = str(run)
    return [
        ["tasks", "import", str(good_file), "--run", r, "--limit", "-1"],
        ["tasks", "import", str(bad_file), "--run", r],
        ["tasks", "import", str(run / "missing.jsonl"), "--run", r],
        ["tasks", "import", str(run), "--run", r],
        ["tasks", "import", str(bad_file), "--run", r, "--limit", "x"],
        ["grade", "--run", r, "--predictions", str(bad_file)],
        ["grade", "--run", r, "--predictions", str(run / "missing.json")],
        ["grade", "--run", r, "--gold", "--predictions", str(bad_file)],
        ["grade", "--run", r, "--concurrency", "many"],
        ["grade", "--run", r, "--timeout", "soon"],
        ["inspect", str(run / "missing")],
        ["train", "--run", r, "--model", str(run / "no-model"), "--lr", "fast"],
        ["train", "--run", r, "--model", str(run / "no-model"), "--loss", "nope"],
        ["serve-proxy", "--model", str(run / "no-model"), "--port", "-5"],
        ["rollout", "--run", r, "--harness", "no-such-harness", "--model", str(run / "no-model")],
    ]


def test_cli_with_bad_inputs_and_option_values_exits_nonzero_in_one_line(
        run_dir: Path, tmp_path: Path, fuzzed: Counter[str]) -> None:
    bad_file = tmp_path / "bad.jsonl"
    bad_file.write_bytes(b'{"instance_id": "x", "FAIL_TO_PASS": "\\ud800"}\n\xff')
    good_file = tmp_path / "good.jsonl"
    good_file.write_text(json.dumps(GOOD_ROW) + "\n" + json.dumps({**GOOD_ROW, "instance_id": "org__repo-2"}) + "\n")
    before = snapshot(run_dir)
    runner = CliRunner()
    problems = []
    for args in _cli_cases(run_dir, bad_file, good_file):
        result = runner.invoke(app, args)
        fuzzed["cli_invocations"] += 1
        exc = result.exception
        if isinstance(exc, LegorlError):  # `legorl` (cli.app.main) prints it as one line, exit 1
            if "\n" in str(exc):
                problems.append((args, "multi-line", str(exc)))
            continue
        output = result.output
        if result.exit_code == 0 or "Traceback" in output or (exc is not None and not isinstance(exc, SystemExit)):
            problems.append((args, result.exit_code, repr(exc), output[-400:]))
    settle(run_dir, before)
    assert not problems, problems
