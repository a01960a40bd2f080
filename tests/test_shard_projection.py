"""Reading parts of a part file: one field of a nested column (``segments.token_ids``), with and
without ``where``, the same values as a whole read; the latest step from the statistics; a part
rewritten under its name read afresh (parsed footers are kept per process)."""

from __future__ import annotations

import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from legorl.core import shards
from legorl.core.errors import ShardError
from legorl.core.schemas import Kind
from legorl.core.shards.reading import latest_step, read_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import run_size


def _fields(column: pa.ChunkedArray, names: list[str]) -> list[object]:
    """A list-of-structs column's values as nested lists of the given fields only."""
    return [[{n: seg[n] for n in names} for seg in row] if row is not None else None for row in column.to_pylist()]


@pytest.fixture
def run(tmp_path: Path) -> Path:
    run_size.write_run(tmp_path / "run", 96, rows_per_part=40)
    return tmp_path / "run"


@pytest.mark.parametrize("where", [None, pc.field("step") == 1])
def test_one_field_of_a_nested_column_reads_what_a_whole_read_holds(run: Path, where: pc.Expression | None) -> None:
    for part in shards.part_files(run / "rollouts"):
        whole = read_file(part, Kind.ROLLOUTS, where=where)
        some = read_file(part, Kind.ROLLOUTS, ["step", "segments.loss_mask", "segments.token_ids", "fingerprint.harness",
                                                "calls.policy_version"], where=where)
        assert some.column_names == ["step", "segments", "fingerprint", "calls"]
        assert [f.name for f in some.schema.field("segments").type.value_type] == ["loss_mask", "token_ids"]
        assert _fields(some.column("segments"), ["loss_mask", "token_ids"]) == _fields(whole.column("segments"), ["loss_mask", "token_ids"])
        assert _fields(some.column("calls"), ["policy_version"]) == _fields(whole.column("calls"), ["policy_version"])
        assert some.column("step").to_pylist() == whole.column("step").to_pylist()
        assert some.num_rows == whole.num_rows
    dataset = shards.read(run / "rollouts", Kind.ROLLOUTS, columns=["segments.token_ids"])
    assert dataset.table.column_names == ["trial_id", "segments"] and dataset.table.num_rows == 96


def test_a_bad_loss_mask_read_alone_is_refused(run: Path) -> None:
    good = shards.part_files(run / "rollouts")[0]
    table = pq.read_table(good)  # with the legorl metadata
    segments = table.column("segments").to_pylist()
    segments[0][0]["loss_mask"] = [2] * len(segments[0][0]["loss_mask"])
    index = table.schema.get_field_index("segments")
    bad = table.set_column(index, table.schema.field(index), pa.array(segments, table.schema.field(index).type))
    part = good.with_name("part-99999999999999999999-bad.parquet")
    pq.write_table(bad, part)  # past the writer, which would refuse it
    with pytest.raises(ShardError, match="loss_mask"):
        read_file(part, Kind.ROLLOUTS, ["segments.loss_mask"])
    with pytest.raises(ShardError, match="loss_mask"):
        read_file(part, Kind.ROLLOUTS, ["segments.token_ids", "segments.loss_mask"], where=pc.field("step") == 0)


def test_the_latest_step_comes_from_the_statistics(run: Path) -> None:
    assert latest_step(run / "rollouts", Kind.ROLLOUTS) == 2
    assert latest_step(run / "nothing", Kind.ROLLOUTS) is None


def test_a_part_rewritten_under_its_name_is_read_afresh(run: Path) -> None:
    part = shards.part_files(run / "rollouts")[0]
    at = pc.field("step") == 0
    before = read_file(part, Kind.ROLLOUTS, ["step"], where=at).num_rows
    assert before > 0
    kept = read_file(part, Kind.ROLLOUTS)
    shards.write_table(part.parent, Kind.ROLLOUTS, kept.slice(0, 3)).replace(part)
    assert read_file(part, Kind.ROLLOUTS, ["step"], where=at).num_rows == min(3, before)


def test_an_unknown_column_is_named() -> None:
    with pytest.raises(ValueError, match="no column 'nope'"):
        shards.read("/nonexistent", Kind.ROLLOUTS, columns=["nope.field"])
