"""Reading shards: one part file validated against its kind's schema, or a whole folder with
later files winning on duplicate keys (see :mod:`legorl.core.shards` for the contract)."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from legorl.core.errors import ShardError
from legorl.core.schemas import KEY_COLUMNS, ROW_CLASSES, SCHEMA_VERSION, SCHEMAS, Kind
from legorl.core.shards import step_ranges
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
    return _info(path, schema, meta.num_rows), schema.names


def _info(path: Path, schema: pa.Schema, rows: int) -> FileInfo:
    md = schema.metadata or {}
    version = md.get(META_VERSION)
    return FileInfo(
        path=path,
        kind=md[META_KIND].decode(errors="replace") if META_KIND in md else None,
        schema_version=int(version) if version is not None and version.isdigit() else None,
        command=md[META_COMMAND].decode(errors="replace") if META_COMMAND in md else None,
        rows=rows,
    )


def _check_info(path: Path, kind: Kind, info: FileInfo) -> None:
    if info.kind != str(kind):
        found = f"a legorl '{info.kind}' shard" if info.kind else "not a legorl shard (no legorl metadata)"
        raise ShardError(path, f"expected a legorl '{kind}' shard, found {found}")
    if info.schema_version is None:
        raise ShardError(path, "no readable legorl schema version in its metadata")
    if info.schema_version > SCHEMA_VERSION:
        raise ShardError(
            path, f"schema version {info.schema_version} is newer than this legorl reads ({SCHEMA_VERSION}); upgrade legorl"
        )


_LOCAL = pafs.LocalFileSystem()
_FRAGMENTS: OrderedDict[tuple[str, int, int, int], ds.ParquetFileFragment] = OrderedDict()
_FRAGMENTS_KEPT = 4  # parsed footers kept: a reader going step by step through a part (the export) parses it once
_FRAGMENTS_LOCK = threading.Lock()


def _fragment(path: Path) -> ds.ParquetFileFragment:
    """The part file as a dataset fragment with its footer parsed, kept for the next read of the same
    file (by path, inode, size and mtime: a part is never rewritten in place, a new one is renamed over it)."""
    st = os.stat(path)
    key = (str(path), st.st_ino, st.st_size, st.st_mtime_ns)
    with _FRAGMENTS_LOCK:
        fragment = _FRAGMENTS.get(key)
        if fragment is not None:
            _FRAGMENTS.move_to_end(key)
            return fragment
    fragment = ds.ParquetFileFormat().make_fragment(str(path), filesystem=_LOCAL)
    fragment.ensure_complete_metadata()
    with _FRAGMENTS_LOCK:
        _FRAGMENTS[key] = fragment
        while len(_FRAGMENTS) > _FRAGMENTS_KEPT:
            _FRAGMENTS.popitem(last=False)
    return fragment


def read_file(
    path: Path, kind: Kind, columns: list[str] | None = None, where: pc.Expression | None = None
) -> pa.Table:
    """Read and validate one part file of ``kind``: ``columns`` only (all by default), the rows
    matching ``where`` only (all by default; row groups whose statistics rule it out are skipped).

    A column may name one field of a struct or list-of-structs column (``segments.token_ids``,
    ``fingerprint.harness``): only that field is read (not a segment's logprobs, say), and the
    column holds the fields named (:func:`projected_schema`). The file's footer is parsed once."""
    schema = None if columns is None else projected_schema(kind, columns)
    try:
        if where is None:
            parquet = pq.ParquetFile(path)
            arrow_schema, rows = parquet.schema_arrow, parquet.metadata.num_rows
        else:
            fragment = _fragment(path)
            arrow_schema, rows = fragment.physical_schema, -1
    except FileNotFoundError as exc:
        raise Vanished(path, "part file vanished (replaced by a compaction)") from exc
    except (OSError, pa.ArrowInvalid, UnicodeDecodeError) as exc:  # a column name that is not UTF-8
        raise ShardError(path, f"not a readable Parquet file ({first_line(exc)})") from exc
    try:
        _check_info(path, kind, _info(path, arrow_schema, rows))
    except ShardError:
        if where is None:
            parquet.close()
        raise
    present = None if schema is None else [f for f in schema if f.name in arrow_schema.names]
    try:
        if where is None:
            with parquet:
                table = parquet.read(columns=None if present is None else _leaves(kind, present))
        elif present is None or all(f.equals(SCHEMAS[kind].field(f.name)) for f in present):
            table = fragment.to_table(columns=None if present is None else [f.name for f in present], filter=where)
        else:  # a part of a column, of some row groups: those the statistics leave, read by their leaves
            groups = [g.id for g in fragment.subset(filter=where).row_groups]
            with pq.ParquetFile(path) as parquet:
                table = parquet.read_row_groups(groups, columns=_leaves(kind, present)).filter(where)
        # Parquet readers do not check UTF-8: a flipped byte in a string would otherwise be a
        # UnicodeDecodeError at the first to_pylist().
        table.validate(full=True)
    except FileNotFoundError as exc:
        raise Vanished(path, "part file vanished (replaced by a compaction)") from exc
    except (OSError, pa.ArrowInvalid, UnicodeDecodeError) as exc:
        raise ShardError(path, f"corrupt Parquet data ({first_line(exc)})") from exc
    if schema is None:
        table = conform(path, kind, table)
        check_rows(path, kind, table)
        return table
    for fld in schema:
        if fld.name not in table.column_names:
            if not fld.nullable:
                raise ShardError(path, "required column is missing", field=fld.name)
            table = table.append_column(fld, pa.nulls(table.num_rows, fld.type))
    table = conform(path, kind, table.select(schema.names), schema)
    whole = [f.name for f in schema if f.equals(SCHEMAS[kind].field(f.name))]
    check_rows(path, kind, table.select(whole))
    if "segments" in table.column_names and "segments" not in whole:
        _check_segment_part(path, table.column("segments"))
    return table


def projected_schema(kind: Kind, columns: list[str]) -> pa.Schema:
    """The schema of ``columns`` of a ``kind`` table: a ``name.field`` entry keeps that field of the
    struct (or list-of-structs) column ``name``, the fields of one column in the order named."""
    full = SCHEMAS[kind]
    wanted: dict[str, list[str]] = {}  # column -> its fields named ([]: the whole column)
    whole: set[str] = set()
    for column in columns:
        name, _, sub = column.partition(".")
        if full.get_field_index(name) < 0:
            raise ValueError(f"{kind} shards have no column {name!r}")
        wanted.setdefault(name, [])
        if sub:
            wanted[name].append(sub)
        else:
            whole.add(name)
    fields = []
    for name, subs in wanted.items():
        fld = full.field(name)
        if subs and name not in whole:
            is_list = pa.types.is_list(fld.type)
            struct = fld.type.value_type if is_list else fld.type
            if not pa.types.is_struct(struct):
                raise ValueError(f"{kind} column {name!r} has no fields to choose from")
            kept = pa.struct([struct.field(sub) for sub in dict.fromkeys(subs)])
            fld = fld.with_type(pa.list_(fld.type.value_field.with_type(kept)) if is_list else kept)
        fields.append(fld)
    return pa.schema(fields)


def _leaves(kind: Kind, fields: list[pa.Field]) -> list[str]:
    """The Parquet column paths that hold ``fields`` (a whole column: its name)."""
    out = []
    for fld in fields:
        if fld.equals(SCHEMAS[kind].field(fld.name)):
            out.append(fld.name)
            continue
        is_list = pa.types.is_list(fld.type)
        struct = fld.type.value_type if is_list else fld.type
        prefix = f"{fld.name}.list.element." if is_list else f"{fld.name}."
        out += [prefix + sub.name for sub in struct]
    return out


def _check_segment_part(path: Path, segments: pa.ChunkedArray) -> None:
    """The checks of :func:`legorl.core.shards.checks.check_rows` on the segment fields read: a loss
    mask as long as the token ids, of 0s and 1s."""
    flat = pc.list_flatten(segments.combine_chunks())
    names = {flat.type.field(i).name for i in range(flat.type.num_fields)}
    if "loss_mask" not in names:
        return
    masks = flat.field("loss_mask")
    if "token_ids" in names:
        differs = pc.not_equal(pc.list_value_length(masks), pc.list_value_length(flat.field("token_ids")))
        if pc.any(differs).as_py():
            raise ShardError(path, "a segment's loss_mask and token_ids differ in length", field="segments")
    values = pc.list_flatten(masks)
    if len(values) and pc.any(pc.and_(pc.not_equal(values, 0), pc.not_equal(values, 1))).as_py():
        raise ShardError(path, "loss_mask holds values other than 0 and 1", field="segments")


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

    ``columns`` reads only those columns (the key columns are always added; ``name.field``: one
    field of a struct column, as in :func:`read_file`). ``where`` reads only
    the rows it matches, pushed down to each file (row groups its statistics rule out are never
    read): it must test only what a key determines (``trial_id``, ``step``, ``task_id``,
    ``harness``), or a superseded row could match where the row that supersedes it does not. A
    missing folder is an empty dataset.
    """
    if columns is not None:
        columns = list(dict.fromkeys([*KEY_COLUMNS[kind], *columns]))
    files, tables = _read_listed(path, kind, columns, where)
    schema = SCHEMAS[kind] if columns is None else projected_schema(kind, columns)
    if not tables:
        return Dataset(kind, schema.empty_table(), files, 0)
    table = pa.concat_tables(tables)
    table, duplicates = dedupe(kind, table)
    return Dataset(kind, table, files, duplicates)


def _read_listed(
    path: str | os.PathLike[str], kind: Kind, columns: list[str] | None, where: pc.Expression | None
) -> tuple[list[Path], list[pa.Table]]:
    """The folder's part files and their tables (with ``where``: of the parts whose step range does
    not rule it out); listed again when a compaction replaces a part between the listing and its read
    (the merged part holds its rows)."""
    by_step = where is not None and step_ranges.COLUMN in SCHEMAS[kind].names and step_ranges.decides(
        where, SCHEMAS[kind].field(step_ranges.COLUMN).type)
    for attempt in range(_LIST_ATTEMPTS):
        files = part_files(path)
        try:
            return files, [read_file(f, kind, columns, where) for f in files if not by_step or _may_match(f, kind, where)]
        except Vanished:
            if attempt == _LIST_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


_LIST_ATTEMPTS = 5


def _may_match(path: Path, kind: Kind, where: pc.Expression) -> bool:
    """False when the part's stored step range (:mod:`legorl.core.shards.step_ranges`) says no row of
    it matches ``where`` (a test of the step alone), without opening it; True when one may, or when it
    has no valid step range."""
    steps = _step_range(path)
    return steps is None or steps.may_match(where, SCHEMAS[kind].field(step_ranges.COLUMN).type)


def _step_range(path: Path) -> step_ranges.StepRange | None:
    try:
        return step_ranges.load(path)
    except FileNotFoundError as exc:
        raise Vanished(path, "part file vanished (replaced by a compaction)") from exc
    except OSError:  # the part is unreadable: opening it says so, naming it
        return None


def latest_step(path: str | os.PathLike[str], kind: Kind, column: str = "step") -> int | None:
    """The largest value of the integer ``column`` in a dataset folder (None: no rows), from each part's
    stored step range, else its row-group statistics (a part written without them is read); a
    superseded row counts too."""
    for attempt in range(_LIST_ATTEMPTS):
        try:
            found = [_column_max(f, kind, column) for f in part_files(path)]
            return max((v for v in found if v is not None), default=None)
        except Vanished:
            if attempt == _LIST_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


def _column_max(path: Path, kind: Kind, column: str) -> int | None:
    steps = _step_range(path) if column == step_ranges.COLUMN else None
    if steps is not None:
        return steps.max
    try:
        meta = pq.read_metadata(path)
    except FileNotFoundError as exc:
        raise Vanished(path, "part file vanished (replaced by a compaction)") from exc
    except (OSError, pa.ArrowInvalid) as exc:
        raise ShardError(path, f"not a readable Parquet file ({first_line(exc)})") from exc
    names = [meta.schema.column(i).path for i in range(meta.num_columns)]
    if column not in names:
        return None
    index = names.index(column)
    best: int | None = None
    for g in range(meta.num_row_groups):
        chunk = meta.row_group(g).column(index)
        stats = chunk.statistics
        if stats is None or not stats.has_min_max:
            if chunk.num_values == 0:
                continue
            values = read_file(path, kind, columns=[column]).column(column)
            top = pc.max(values).as_py()
            return None if top is None else int(top)
        best = int(stats.max) if best is None else max(best, int(stats.max))
    return best


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
