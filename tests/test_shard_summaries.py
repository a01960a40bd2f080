"""Per-part summaries (legorl.monitor.summaries): written beside rollout parts by the first reader and
by compaction, used by the next reader, and never trusted over the part: a missing, torn, stale or
older summary is recomputed, with the same overview."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from monitor_runs import make_run

from legorl.core import shards
from legorl.core.schemas import Kind
from legorl.monitor import summaries
from legorl.monitor.behaviour import trial_behaviour
from legorl.monitor.dashboard.data import overview
from legorl.monitor.loading import RunReader
from legorl.trials import costs, provenance


def _overview(run: Path) -> str:
    data = overview(RunReader(run).snapshot())
    data.pop("run")
    return json.dumps(data, sort_keys=True, default=str)


def _summaries(run: Path) -> dict[str, Path]:
    folder = run / "rollouts" / ".summaries"
    return {p.name: p for p in folder.iterdir()} if folder.exists() else {}


@pytest.fixture
def run(tmp_path: Path) -> Path:
    return make_run(tmp_path / "run", steps=2)


def _no_build(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*_: object) -> None:
        raise AssertionError("summarised a part that has a valid summary")

    monkeypatch.setattr(summaries, "build", fail)


def test_the_first_reader_writes_summaries_and_the_next_uses_them(run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parts = shards.part_files(run / "rollouts")
    assert len(parts) > 1 and not _summaries(run)
    snap = RunReader(run).snapshot()
    assert set(_summaries(run)) == {p.name + ".summary" for p in parts}
    # what the summary holds is what the full rows say (the reader before summaries computed this)
    for row in shards.read_rows(run / "rollouts", Kind.ROLLOUTS):
        info = snap.trials[row.trial_id]
        assert info.behaviour == replace(trial_behaviour(row), events=[])  # the detail classifies them from the row
        assert info.token_lags == dict(provenance.token_lags(row))
        assert (info.patch, info.outcome, info.group_id, info.model) == (row.patch, row.outcome, row.group_id, row.model)
        assert info.cost == costs.cost_of(row)
    assert costs.cost_table(snap.trials.values()) == costs.run_costs(run)  # the overview's cost table, from summaries
    expected = _overview(run)
    _no_build(monkeypatch)
    assert _overview(run) == expected
    # the shard readers never see a summary
    assert shards.read(run / "rollouts", Kind.ROLLOUTS).files == parts
    assert pq.ParquetDataset(run / "rollouts").files == [str(p) for p in parts]


@pytest.mark.parametrize("damage", ["missing", "torn", "garbage", "other part", "older version", "part rewritten",
                                    "nonsense inside"])
def test_a_bad_summary_is_recomputed_with_the_same_overview(run: Path, damage: str) -> None:
    expected = _overview(run)
    parts = shards.part_files(run / "rollouts")
    target, other = parts[0], parts[1]
    summary = summaries.path_of(target)
    if damage == "missing":
        summary.unlink()
    elif damage == "torn":
        summary.write_bytes(summary.read_bytes()[: summary.stat().st_size // 2])
    elif damage == "garbage":
        summary.write_bytes(b"PAR1 not a summary")
    elif damage == "other part":  # a summary copied from another part: wrong rows for this one
        shutil.copy(summaries.path_of(other), summary)
    elif damage == "older version":
        table = pq.read_table(summary)
        meta = dict(table.schema.metadata)
        meta[b"legorl.summary_version"] = str(summaries.VERSION - 1).encode()
        pq.write_table(table.replace_schema_metadata(meta), summary)
    elif damage == "nonsense inside":  # whole, keyed right, but its token lags are not JSON: rebuilt on use
        table = pq.read_table(summary)
        lags = table.schema.get_field_index("token_lags")
        table = table.set_column(lags, table.schema.field(lags), pa.array(["{"] * table.num_rows))
        pq.write_table(table, summary)
    else:  # the part replaced under its own name by different rows: the summary's key no longer matches
        kept = shards.read_file(target, Kind.ROLLOUTS)
        shards.write_table(target.parent, Kind.ROLLOUTS, kept.slice(0, kept.num_rows - 1)).replace(target)
    if damage != "nonsense inside":
        assert summaries.load(target) is None
    if damage == "part rewritten":
        assert _overview(run) != expected  # one trial fewer: the part, not the summary, is what counts
    else:
        assert _overview(run) == expected
    assert summaries.load(target) is not None  # and stored again


def test_a_read_only_run_is_summarised_without_storing(run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(summaries, "store", lambda *_, **__: False)
    expected = _overview(run)
    assert not _summaries(run)
    monkeypatch.undo()
    assert _overview(run) == expected


def test_compaction_replaces_the_summaries_of_the_parts_it_merges(run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    expected = _overview(run)  # the reader summarises every part
    before = set(_summaries(run))
    [done] = [c for c in shards.compact_run(run, on_merge=summaries.merge) if c.folder == run / "rollouts"]
    assert done.replaced == len(before) and len(done.merged) == 1
    assert set(_summaries(run)) == {done.merged[0].name + ".summary"}
    _no_build(monkeypatch)  # the merged part's summary came from the replaced parts' summaries
    assert _overview(run) == expected


def test_compaction_summarises_the_parts_that_have_none(run: Path) -> None:
    expected = _overview(run)
    for summary in _summaries(run).values():
        summary.unlink()
    [done] = [c for c in shards.compact_run(run, on_merge=summaries.merge) if c.folder == run / "rollouts"]
    [merged] = done.merged
    summary = summaries.load(merged)
    assert summary is not None
    assert summary == summaries.build(shards.read_file(merged, Kind.ROLLOUTS))  # row for row
    assert _overview(run) == expected


def test_compaction_removes_orphan_summaries(run: Path) -> None:
    RunReader(run).snapshot()
    folder = run / "rollouts" / ".summaries"
    (folder / "part-00000000000000000001-1-deadbeef.parquet.summary").write_bytes(b"orphan")
    (folder / f".x.summary.{shards._HOST}.999999999.tmp").write_bytes(b"dead writer")
    shards.compact(run / "rollouts", Kind.ROLLOUTS, on_merge=summaries.merge)
    assert {p.name for p in folder.iterdir()} == {p.name + ".summary" for p in shards.part_files(run / "rollouts")}
