"""Step ranges beside the parts: a reader of one step never opens a part that cannot hold it, and a
step range is a hint, never the truth: missing, torn, stale, foreign or corrupt, the part is opened
and read as before."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from test_shards import make_trial

from legorl.core import shards
from legorl.core.errors import ShardError
from legorl.core.schemas import GradeRow, Kind, TrialRow, group_key, trial_key
from legorl.core.shards import compaction, reading, step_ranges
from legorl.monitor import summaries


def trial(step: int, sample: int = 0, **kw: object) -> TrialRow:
    row = make_trial(sample=sample, **kw)
    return dataclasses.replace(row, step=step, trial_id=trial_key(row.task_id, row.harness, step, sample),
                               group_id=group_key(row.task_id, step))


def grade(trial_id: str, step: int | None) -> GradeRow:
    return GradeRow(trial_id=trial_id, task_id="repo__1", status="graded", reward=1.0, resolved=True, step=step)


def _opened(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The part files read from now on (the real reader, watched)."""
    opened: list[Path] = []
    real = reading.read_file

    def watched(path: Path, *args: object, **kwargs: object) -> object:
        opened.append(path)
        return real(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(reading, "read_file", watched)
    return opened


def _three_steps(folder: Path) -> list[Path]:
    parts = [shards.write(folder, Kind.ROLLOUTS, [trial(s, i) for i in range(3)]) for s in (0, 1, 2)]
    assert all(p is not None for p in parts)
    return [p for p in parts if p is not None]


def _ids(folder: Path, step: int) -> list[str]:
    return sorted(shards.read(folder, Kind.ROLLOUTS, ["step"], where=pc.field("step") == step).table.column("trial_id").to_pylist())


def test_a_step_read_opens_only_the_parts_that_hold_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parts = _three_steps(tmp_path)
    assert all(step_ranges.path_of(p).exists() for p in parts)  # written by the writer, beside each part
    assert step_ranges.load(parts[1]) == step_ranges.StepRange(((1, 1),), False)
    opened = _opened(monkeypatch)
    assert _ids(tmp_path, 1) == sorted(trial(1, i).trial_id for i in range(3))
    assert opened == [parts[1]]
    opened.clear()
    assert _ids(tmp_path, 7) == [] and opened == []
    assert reading.latest_step(tmp_path, Kind.ROLLOUTS) == 2
    # a filter on another column than the step: the step range cannot rule a part out
    one = trial(2, 1).trial_id
    assert shards.read(tmp_path, Kind.ROLLOUTS, where=pc.field("trial_id") == one).table.num_rows == 1
    assert opened == parts


def _damage(part: Path, how: str) -> None:
    path = step_ranges.path_of(part)
    body = json.loads(path.read_text())
    if how == "missing":
        path.unlink()
    elif how == "torn":
        path.write_text(path.read_text()[:20])
    elif how == "garbage":
        path.write_bytes(b"\xff\x00 not json")
    elif how == "edited":  # claims step 5 only, its digest left as it was
        path.write_text(json.dumps({**body, "ranges": [[5, 5]]}))
    elif how == "version":
        del body["digest"]
        body["version"] = 99
        path.write_text(json.dumps({**body, "digest": step_ranges._digest(body)}))
    elif how == "foreign":  # another part's, renamed and re-signed: the key is not this part's
        other = sorted(p for p in part.parent.glob("part-*.parquet") if p != part)[0]
        body = json.loads(step_ranges.path_of(other).read_text())
        del body["digest"]
        body["part"] = part.name
        path.write_text(json.dumps({**body, "digest": step_ranges._digest(body)}))
    elif how == "stale":  # the part rewritten under the same name (another write, same rows)
        table = pq.read_table(part)
        pq.write_table(table.replace_schema_metadata({**table.schema.metadata, b"legorl.created_at": b"1.0"}), part)
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("how", ["missing", "torn", "garbage", "edited", "version", "foreign", "stale"])
def test_a_bad_step_range_is_ignored_and_the_part_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    parts = _three_steps(tmp_path)
    _damage(parts[2], how)
    assert step_ranges.load(parts[2]) is None
    opened = _opened(monkeypatch)
    assert _ids(tmp_path, 2) == sorted(trial(2, i).trial_id for i in range(3))
    assert opened == [parts[2]]  # the others still ruled out by their own
    assert reading.latest_step(tmp_path, Kind.ROLLOUTS) == 2


def test_a_run_written_before_step_ranges_loads_the_same(tmp_path: Path) -> None:
    _three_steps(tmp_path)
    with_ranges = {s: _ids(tmp_path, s) for s in range(4)}
    for path in tmp_path.glob(".steps-*"):
        path.unlink()
    assert {s: _ids(tmp_path, s) for s in range(4)} == with_ranges
    assert reading.latest_step(tmp_path, Kind.ROLLOUTS) == 2


def test_grades_without_a_step_are_still_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``train`` reads a step's grades and those written without their trial's step."""
    shards.write(tmp_path, Kind.GRADES, [grade("a", 0)])
    unstepped = shards.write(tmp_path, Kind.GRADES, [grade("b", None)])
    mixed = shards.write(tmp_path, Kind.GRADES, [grade("c", 1), grade("d", None)])
    opened = _opened(monkeypatch)
    where = (pc.field("step") == 1) | pc.field("step").is_null()
    assert sorted(shards.read(tmp_path, Kind.GRADES, where=where).table.column("trial_id").to_pylist()) == ["b", "c", "d"]
    assert opened == [unstepped, mixed]


def test_a_corrupt_part_holding_the_step_is_an_error_naming_it(tmp_path: Path) -> None:
    parts = _three_steps(tmp_path)
    parts[1].write_bytes(b"PAR1 not a parquet file at all")
    with pytest.raises(ShardError, match=parts[1].name):
        _ids(tmp_path, 1)
    with pytest.raises(ShardError, match=parts[1].name):  # its step range is of other bytes: not trusted
        _ids(tmp_path, 0)


def test_compaction_keeps_the_step_ranges_true(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for step in range(6):
        shards.write(tmp_path, Kind.ROLLOUTS, [trial(step, i) for i in range(2)])
    shards.write(tmp_path, Kind.ROLLOUTS, [trial(9, 0)])
    replaced = [p.name for p in shards.part_files(tmp_path)]
    (tmp_path / f"{step_ranges.PREFIX}part-gone.parquet{step_ranges.SUFFIX}").write_text("{}")  # an orphan
    result = shards.compact(tmp_path, Kind.ROLLOUTS, on_merge=summaries.merge)
    [merged] = result.merged
    assert step_ranges.load(merged) == step_ranges.StepRange(((0, 5), (9, 9)), False)
    assert sorted(p.name for p in tmp_path.glob(".steps-*")) == [step_ranges.path_of(merged).name]
    assert not set(replaced) & {p.name for p in tmp_path.iterdir()}
    later = shards.write(tmp_path, Kind.ROLLOUTS, [trial(10, 0)])
    opened = _opened(monkeypatch)
    assert _ids(tmp_path, 10) == [trial(10, 0).trial_id] and opened == [later]
    opened.clear()
    assert _ids(tmp_path, 4) == sorted(trial(4, i).trial_id for i in range(2)) and opened == [merged]
    opened.clear()
    assert _ids(tmp_path, 7) == [] and opened == []  # between the merged part's ranges


def test_merged_row_groups_are_sized_by_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    small, large = tmp_path / "small", tmp_path / "large"
    for step in range(8):
        shards.write(small, Kind.ROLLOUTS, [trial(step, i, n_tokens=40) for i in range(8)])
        shards.write(large, Kind.ROLLOUTS, [trial(step, i, n_tokens=20_000) for i in range(8)])
    monkeypatch.setattr(compaction, "ROW_GROUP_BYTES", 2**20)
    for folder in (small, large):
        shards.compact(folder, Kind.ROLLOUTS)
    [small_part], [large_part] = shards.part_files(small), shards.part_files(large)
    assert pq.ParquetFile(small_part).metadata.num_row_groups == 1  # 64 short rows: well under 1 MiB
    groups = pq.ParquetFile(large_part).metadata
    rows = {groups.row_group(g).num_rows for g in range(groups.num_row_groups - 1)}
    assert groups.num_row_groups > 4 and rows == {compaction.row_group_rows(pq.read_table(large_part))}
    assert 1 <= max(rows) <= 8  # a row of 20k tokens is ~180 KB in memory


def test_compaction_gives_a_part_without_a_step_range_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run compacted before step ranges: its large parts are never merged again, so compaction
    stores their step ranges from their step column."""
    parts = _three_steps(tmp_path)
    for part in parts:
        step_ranges.path_of(part).unlink()
    assert shards.compact(tmp_path, Kind.ROLLOUTS, target_bytes=1).replaced == 0  # every part "large"
    assert [step_ranges.load(p) for p in parts] == [step_ranges.StepRange(((s, s),), False) for s in range(3)]
    opened = _opened(monkeypatch)
    assert _ids(tmp_path, 1) == sorted(trial(1, i).trial_id for i in range(3)) and opened == [parts[1]]


def test_compaction_names_a_torn_part(tmp_path: Path) -> None:
    parts = _three_steps(tmp_path)
    parts[1].write_bytes(b"PAR1 torn")
    with pytest.raises(ShardError, match=parts[1].name):
        shards.compact(tmp_path, Kind.ROLLOUTS)
