"""Compaction: merging a dataset folder's runs of small part files into large ones, crash-safely.

A run is a sequence of consecutive parts (in part-name order) small enough to merge. Its merged part
holds each key's last row among them (what :func:`legorl.core.shards.read` resolves them to), sorted by
step and key so that lookups skip row groups, and is named to sort where the run was: after every
part before it and before every part after it, so "the later file wins" resolves as before.

The steps, each durable before the next (``fsync``):

1. write the merged part to a temp file (swept away if this process dies), in row groups of about
   :data:`ROW_GROUP_BYTES`, store its step range (:mod:`legorl.core.shards.step_ranges`) and hand it to
   the caller's ``on_merge`` (the monitor stores the merged part's summary there:
   :mod:`legorl.monitor.summaries`), both keyed by its bytes;
2. write the journal ``.compact-<merged>.json``, naming the merged part and the parts it replaces;
3. rename the merged part into place: from here readers (:func:`legorl.core.shards.files.part_files`)
   hide the replaced parts, so none sees a row twice or zero times;
4. remove the replaced parts, their summaries and step ranges, then the journal.

Killed anywhere, the next compaction finishes step 4 for a journal whose merged part exists and
drops a journal whose merged part does not (the replaced parts then still hold the rows), and
removes summaries and step ranges whose part is gone. Neither is what decides which rows a reader
sees (the part listing is, and a step range is checked against its part's bytes), so a crash that
leaves one behind costs disk, not correctness. One compaction runs per folder at a time (a lock
file); writers may add parts meanwhile.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from legorl.core.errors import ShardError
from legorl.core.paths import RUN_DATASETS, RunDir, file_lock
from legorl.core.schemas import KEY_COLUMNS, SCHEMAS, Kind
from legorl.core.shards import step_ranges
from legorl.core.shards import summaries as shard_summaries
from legorl.core.shards.files import JOURNAL_PREFIX, part_files, read_journal, sweep_dead_writers
from legorl.core.shards.reading import dedupe, file_info, read_file
from legorl.core.shards.writing import fsync_dir, prepare, write_temp

# A merged part's bounds (the sum of its inputs' sizes on disk, and rows); a part at a quarter of
# either is large enough to stay as it is, which bounds how often a row is rewritten.
TARGET_BYTES = 128 * 2**20
TARGET_ROWS = 200_000
# A row group, the unit a lookup reads, holds about this many bytes of rows (in memory, Arrow's size;
# zstd makes it a third to a half of that on disk), and at most ROW_GROUP_MAX_ROWS rows. By bytes, not
# rows: a synthetic rollout row is 8.8 KB, a real one with a 30k-token segment some 300 KB. Each
# row group costs about 8.5 KB of footer (57 leaf columns), which every reader of the part parses.
ROW_GROUP_BYTES = 4 * 2**20
ROW_GROUP_MAX_ROWS = 65536
LOCK_NAME = ".compact.lock"
# (kind, merged part's final path, its temp file, the parts it replaces, their rows as read): a layer
# above keeps derived data of the merged part (the monitor's summaries) before it is renamed into place
OnMerge = Callable[[Kind, Path, Path, list[Path], list[pa.Table]], None]
_MERGED_SUFFIX = re.compile(r"^(?P<base>.*)-c(?P<gen>\d+)$")


@dataclass
class Compacted:
    """What one folder's compaction did."""

    folder: Path
    merged: list[Path] = field(default_factory=list)
    replaced: int = 0  # parts replaced by the merged ones
    rows: int = 0  # rows in the merged parts
    dropped: int = 0  # superseded rows (an earlier version of a key) left out of them


@dataclass(frozen=True)
class _Part:
    path: Path
    size: int
    rows: int


def merged_name(last: str) -> str:
    """The merged part's name for a run ending with part ``last``: ``<last stem>-c<generation>``,
    which sorts just before ``last`` and after every part before it."""
    stem = last.removesuffix(".parquet")
    match = _MERGED_SUFFIX.match(stem)
    base, gen = (match["base"], int(match["gen"])) if match else (stem, 0)
    return f"{base}-c{gen + 1:04d}.parquet"


def plan(parts: list[_Part], target_bytes: int, target_rows: int) -> list[list[_Part]]:
    """Runs of at least two consecutive small parts, each at most ``target_bytes`` and ``target_rows``."""
    runs: list[list[_Part]] = []
    current: list[_Part] = []
    for part in parts:
        small = part.size < target_bytes // 4 and part.rows < target_rows // 4
        full = current and (sum(p.size for p in current) + part.size > target_bytes
                            or sum(p.rows for p in current) + part.rows > target_rows)
        if not small or full:
            runs.append(current)
            current = []
        if small:
            current.append(part)
    runs.append(current)
    return [r for r in runs if len(r) >= 2]


def compact(
    folder: str | os.PathLike[str], kind: Kind, *, target_bytes: int = TARGET_BYTES,
    target_rows: int = TARGET_ROWS, command: str | None = None, on_merge: OnMerge | None = None,
) -> Compacted:
    """Merge the runs of small parts of the dataset ``folder`` (of ``kind``) into large ones;
    ``on_merge`` sees each merged part before it is renamed into place (see the module's steps)."""
    path = Path(folder)
    done = Compacted(path)
    if not path.is_dir():
        return done
    with file_lock(path / LOCK_NAME):
        recover(path)
        sweep_dead_writers(path)
        parts = [_Part(p, p.stat().st_size, file_info(p).rows) for p in part_files(path)]  # bad: names it
        for run in plan(parts, target_bytes, target_rows):
            merged, rows, dropped = _merge(path, kind, [p.path for p in run], command, on_merge)
            done.merged.append(merged)
            done.replaced += len(run)
            done.rows += rows
            done.dropped += dropped
        store_missing_step_ranges(path, kind)
    return done


def store_missing_step_ranges(folder: Path, kind: Kind) -> None:
    """Give each part without a valid step range one, from its step column: the large parts of a run
    compacted before step ranges existed are never merged again. A part that cannot be read is left
    as it is (its readers open it, and say what is wrong with it)."""
    if step_ranges.COLUMN not in SCHEMAS[kind].names:
        return
    for part in part_files(folder):
        if step_ranges.load(part) is None:
            try:
                table = read_file(part, kind, columns=[step_ranges.COLUMN])
            except ShardError:
                continue
            step_ranges.store(part, part, table)


def recover(folder: Path) -> None:
    """Finish or drop the journals a killed compaction left (see the module's steps)."""
    for entry in os.scandir(folder):
        if entry.name.startswith(JOURNAL_PREFIX) and entry.name.endswith(".tmp"):
            Path(entry.path).unlink(missing_ok=True)
            continue
        if not (entry.name.startswith(JOURNAL_PREFIX) and entry.name.endswith(".json")):
            continue
        journal = read_journal(Path(entry.path))
        if journal is not None and (folder / journal[0]).exists():
            _remove(folder, journal[1])
        Path(entry.path).unlink(missing_ok=True)
        fsync_dir(folder)
    shard_summaries.sweep(folder)
    step_ranges.sweep(folder)


def _merge(folder: Path, kind: Kind, run: list[Path], command: str | None,
           on_merge: OnMerge | None) -> tuple[Path, int, int]:
    tables = [read_file(p, kind) for p in run]
    table, dropped = dedupe(kind, pa.concat_tables(tables))
    table = table.sort_by([(c, "ascending") for c in sort_columns(kind)])
    final = folder / merged_name(run[-1].name)
    tmp = write_temp(folder, prepare(folder, kind, table, command or _command(run[-1])),
                     row_group_size=row_group_rows(table))
    journal = folder / f"{JOURNAL_PREFIX}{final.name}.json"
    try:
        step_ranges.store(final, tmp, table)
        if on_merge is not None:
            on_merge(kind, final, tmp, run, tables)
        _write_journal(journal, final.name, [p.name for p in run])
        os.replace(tmp, final)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        journal.unlink(missing_ok=True)
        step_ranges.remove(folder, [final.name])
        if isinstance(exc, OSError):
            raise ShardError(folder, f"cannot commit a merged part: {exc.strerror or exc}; the parts "
                                     "it would replace are intact") from None
        raise
    fsync_dir(folder)
    _remove(folder, [p.name for p in run])
    shard_summaries.remove(folder, [p.name for p in run])
    step_ranges.remove(folder, [p.name for p in run])
    journal.unlink()
    fsync_dir(folder)
    return final, table.num_rows, dropped


def row_group_rows(table: pa.Table) -> int:
    """Rows per row group of a merged part: :data:`ROW_GROUP_BYTES` of its rows, on average."""
    per_row = max(1, table.nbytes // max(1, table.num_rows))
    return max(1, min(ROW_GROUP_MAX_ROWS, ROW_GROUP_BYTES // per_row))


def sort_columns(kind: Kind) -> list[str]:
    """The merged part's row order: by step (where rows have one) and key, so that lookups skip row groups."""
    keys = list(KEY_COLUMNS[kind])
    return keys if "step" in keys or "step" not in SCHEMAS[kind].names else ["step", *keys]


def _command(part: Path) -> str:
    """The merged part's command: the one that wrote its newest rows (what ``inspect`` lists)."""
    meta = pq.read_schema(part).metadata or {}
    return meta.get(b"legorl.command", b"").decode(errors="replace")


def _write_journal(journal: Path, merged: str, replaces: list[str]) -> None:
    tmp = journal.with_name(journal.name + ".tmp")
    with open(tmp, "w") as handle:
        json.dump({"merged": merged, "replaces": replaces}, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, journal)
    fsync_dir(journal.parent)


def _remove(folder: Path, names: list[str]) -> None:
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            (folder / name).unlink()
    fsync_dir(folder)


def compact_run(
    root: str | os.PathLike[str], *, target_bytes: int = TARGET_BYTES, target_rows: int = TARGET_ROWS,
    on_merge: OnMerge | None = None,
) -> list[Compacted]:
    """Compact every dataset of a run directory (:data:`legorl.core.paths.RUN_DATASETS`)."""
    run = RunDir.at(root)
    return [compact(run.root / name, kind, target_bytes=target_bytes, target_rows=target_rows, on_merge=on_merge)
            for name, kind in RUN_DATASETS]
