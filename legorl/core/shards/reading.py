"""Reading shards: one part file validated against its kind's schema, or a whole folder with
later files winning on duplicate keys (see :mod:`legorl.core.shards` for the contract)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from legorl.core.errors import ShardError
from legorl.core.schemas import KEY_COLUMNS, ROW_CLASSES, SCHEMA_VERSION, SCHEMAS, Kind
from legorl.core.shards.checks import check_rows, conform, first_line
from legorl.core.shards.files import META_COMMAND, META_KIND, META_VERSION, part_files


@dataclass
class FileInfo:
    path: Path
    kind: str | None
    schema_version: int | None
    command: str | None
    rows: int


class Vanished(ShardError):
    """A part file listed a moment ago is gone: a compaction replaced it (list the folder again)."""


def file_info(path: Path) -> FileInfo:
    """Metadata of one part file; raises :class:`ShardError` when it is not a readable Parquet file."""
    return _file_info(path)[0]


def _file_info(path: Path) -> tuple[FileInfo, list[str]]:
    """The file's metadata and its column names, from one read of its footer."""
    try:
        meta = pq.read_metadata(path)
        schema = meta.schema.to_arrow_schema()
    except FileNotFoundError as exc:
        raise Vanished(path, "part file vanished (replaced by a compaction)") from exc
    except (OSError, pa.ArrowInvalid, UnicodeDecodeError) as exc:  # a column name that is not UTF-8
        raise ShardError(path, f"not a readable Parquet file ({first_line(exc)})") from exc
    md = schema.metadata or {}
    version = md.get(META_VERSION)
    info = FileInfo(
        path=path,
        kind=md[META_KIND].decode(errors="replace") if META_KIND in md else None,
        schema_version=int(version) if version is not None and version.isdigit() else None,
        command=md[META_COMMAND].decode(errors="replace") if META_COMMAND in md else None,
        rows=meta.num_rows,
    )
    return info, schema.names


def read_file(
    path: Path, kind: Kind, columns: list[str] | None = None, where: pc.Expression | None = None
) -> pa.Table:
    """Read and validate one part file of ``kind``: ``columns`` only (all by default), the rows
    matching ``where`` only (all by default; row groups whose statistics rule it out are skipped)."""
    info, names = _file_info(path)
    if info.kind != str(kind):
        found = f"a legorl '{info.kind}' shard" if info.kind else "not a legorl shard (no legorl metadata)"
        raise ShardError(path, f"expected a legorl '{kind}' shard, found {found}")
    if info.schema_version is None:
        raise ShardError(path, "no readable legorl schema version in its metadata")
    if info.schema_version > SCHEMA_VERSION:
        raise ShardError(
            path, f"schema version {info.schema_version} is newer than this legorl reads ({SCHEMA_VERSION}); upgrade legorl"
        )
    present = None if columns is None else [c for c in columns if c in names]
    try:
        if where is None:
            table = pq.read_table(path, columns=present)
        else:
            table = pq.read_table(path, columns=present, filters=where)
            if present is not None:
                table = table.select(present)
        # Parquet readers do not check UTF-8: a flipped byte in a string would otherwise be a
        # UnicodeDecodeError at the first to_pylist().
        table.validate(full=True)
    except FileNotFoundError as exc:
        raise Vanished(path, "part file vanished (replaced by a compaction)") from exc
    except (OSError, pa.ArrowInvalid, UnicodeDecodeError) as exc:
        raise ShardError(path, f"corrupt Parquet data ({first_line(exc)})") from exc
    if columns is not None:
        schema = SCHEMAS[kind]
        missing = [c for c in columns if c not in table.column_names]
        for name in missing:
            if not schema.field(name).nullable:
                raise ShardError(path, "required column is missing", field=name)
            table = table.append_column(schema.field(name), pa.nulls(table.num_rows, schema.field(name).type))
        table = conform(path, kind, table.select(columns), pa.schema([schema.field(c) for c in columns]))
        check_rows(path, kind, table)
        return table
    table = conform(path, kind, table)
    check_rows(path, kind, table)
    return table


@dataclass
class Dataset:
    """A dataset read whole: the table after de-duplication, and what de-duplication dropped."""

    kind: Kind
    table: pa.Table
    files: list[Path]
    duplicates: int

    def rows(self) -> list[Any]:
        cls = ROW_CLASSES[self.kind]
        return [cls.from_dict(d) for d in self.table.to_pylist()]


def _key_array(kind: Kind, table: pa.Table) -> list[Any]:
    names = KEY_COLUMNS[kind]
    if len(names) == 1:
        return table.column(names[0]).to_pylist()
    return list(zip(*(table.column(n).to_pylist() for n in names), strict=True))


def dedupe(kind: Kind, table: pa.Table) -> tuple[pa.Table, int]:
    keys = _key_array(kind, table)
    last: dict[Any, int] = {}
    for i, key in enumerate(keys):
        last[key] = i
    if len(last) == len(keys):
        return table, 0
    keep = sorted(last.values())
    return table.take(pa.array(keep, pa.int64())), len(keys) - len(keep)


def read(
    path: str | os.PathLike[str], kind: Kind, columns: list[str] | None = None, where: pc.Expression | None = None
) -> Dataset:
    """Read every part file of a dataset folder; later files win on duplicate keys.

    ``columns`` reads only those columns (the key columns are always added). ``where`` reads only
    the rows it matches, pushed down to each file (row groups its statistics rule out are never
    read): it must test only what a key determines (``trial_id``, ``step``, ``task_id``,
    ``harness``), or a superseded row could match where the row that supersedes it does not. A
    missing folder is an empty dataset.
    """
    if columns is not None:
        columns = list(dict.fromkeys([*KEY_COLUMNS[kind], *columns]))
    files, tables = _read_listed(path, kind, columns, where)
    schema = SCHEMAS[kind] if columns is None else pa.schema([SCHEMAS[kind].field(c) for c in columns])
    if not tables:
        return Dataset(kind, schema.empty_table(), files, 0)
    table = pa.concat_tables(tables)
    table, duplicates = dedupe(kind, table)
    return Dataset(kind, table, files, duplicates)


def _read_listed(
    path: str | os.PathLike[str], kind: Kind, columns: list[str] | None, where: pc.Expression | None
) -> tuple[list[Path], list[pa.Table]]:
    """The folder's part files and their tables; listed again when a compaction replaces a part
    between the listing and its read (the merged part holds its rows)."""
    for attempt in range(_LIST_ATTEMPTS):
        files = part_files(path)
        try:
            return files, [read_file(f, kind, columns, where) for f in files]
        except Vanished:
            if attempt == _LIST_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


_LIST_ATTEMPTS = 5


def read_rows(path: str | os.PathLike[str], kind: Kind) -> list[Any]:
    """Typed rows (``TaskRow``, ``TrialRow``, ``GradeRow``, ``MetricRow``) of a dataset."""
    return read(path, kind).rows()


def iter_files(path: str | os.PathLike[str], kind: Kind) -> Iterator[tuple[Path, pa.Table]]:
    """Each part file with its validated table, for streaming over large datasets."""
    for f in part_files(path):
        yield f, read_file(f, kind)


def already_done(path: str | os.PathLike[str], kind: Kind, where: pc.Expression | None = None) -> set[Any]:
    """Keys already written (of the rows ``where`` matches, as in :func:`read`), for resuming. Rows
    marked as infrastructure failures don't count: a rerun tries them again, and the new row
    supersedes the old one."""
    extra = ["infra_failure"] if "infra_failure" in SCHEMAS[kind].names else []
    dataset = read(path, kind, columns=extra, where=where)
    table = dataset.table
    if extra:
        table = table.filter(pc.invert(pc.fill_null(table.column("infra_failure"), False)))
    return set(_key_array(kind, table))
