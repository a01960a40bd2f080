"""Reading and writing shards: folders of ``part-*.parquet`` files.

The contract:

- a writer writes ``.part-*.parquet.<host>.tmp``, fsyncs it and renames it into place, so a reader
  never sees half a file and a killed stage loses at most what was in flight (the next writer in
  the folder removes the temp files of this host's dead writers); a write that fails (a full disk)
  is a :class:`~legorl.errors.ShardError` and leaves no temp file;
- part names sort in write order, and when a key appears twice the row from the later file wins
  (a rerun that supersedes an infrastructure failure, say); :func:`read` reports how many;
- every file carries its kind, schema version and the command that wrote it in its metadata, and
  is validated on read with an error naming file, row and field.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import socket
import sys
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from legorl import __version__
from legorl.errors import ShardError
from legorl.schemas import (
    ENUM_COLUMNS,
    KEY_COLUMNS,
    ROW_CLASSES,
    SCHEMA_VERSION,
    SCHEMAS,
    SEGMENT_TYPE,
    Kind,
    _Row,
)

PART_GLOB = "part-*.parquet"
META_KIND = b"legorl.kind"
META_VERSION = b"legorl.schema_version"
META_COMMAND = b"legorl.command"
META_WRITER = b"legorl.writer"
META_CREATED = b"legorl.created_at"


def part_files(path: str | os.PathLike[str]) -> list[Path]:
    """The committed part files of a dataset folder, in write order (temp files are ignored)."""
    folder = Path(path)
    if not folder.is_dir():
        return []
    return sorted(folder.glob(PART_GLOB))


def _new_part_name() -> str:
    # Sortable by write time; pid + random suffix keep concurrent writers apart.
    return f"part-{time.time_ns():020d}-{os.getpid()}-{uuid.uuid4().hex[:8]}.parquet"


_HOST = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname()) or "host"
# .part-<ns>-<pid>-<hex>.parquet.<host>.tmp (or, from earlier versions, without the host)
_TEMP_NAME = re.compile(r"^\.part-\d+-(\d+)-[0-9a-f]+\.parquet(?:\.([A-Za-z0-9_-]+))?\.tmp$")
_swept: set[Path] = set()


def _sweep_dead_writers(folder: Path) -> None:
    """Remove the temp files of writers on this host that died mid-write (once per folder and process).

    Readers never see a temp file; this only keeps ``inspect`` from counting it for ever. A temp
    file of another host (a shared filesystem) is left alone: its writer's pid means nothing here.
    """
    if folder in _swept:
        return
    _swept.add(folder)
    for entry in os.scandir(folder):
        match = _TEMP_NAME.match(entry.name)
        if match is None or (match.group(2) or _HOST) != _HOST:
            continue
        pid = int(match.group(1))
        if pid == os.getpid() or _alive(pid):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(entry.path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _current_command() -> str:
    return shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv else ""


def _list_array(values: list[Any], dtype: Any, arrow_type: pa.DataType) -> pa.Array:
    """A list<arrow_type> array from per-item sequences (lists or numpy arrays), built via numpy:
    an order of magnitude faster than converting Python lists element by element."""
    parts = [np.asarray(v, dtype=dtype) for v in values]
    offsets = np.zeros(len(parts) + 1, dtype=np.int32)
    np.cumsum([p.size for p in parts], out=offsets[1:])
    flat = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type=arrow_type))


def _segments_column(rows_segments: list[Any]) -> pa.Array:
    """The ``segments`` column (list<segment struct>) built column-wise from segment dicts."""
    per_row = [list(segs) if segs is not None else [] for segs in rows_segments]
    segs = [s.to_dict() if isinstance(s, _Row) else s for row in per_row for s in row]
    routed = [s.get("routed_experts") for s in segs]
    routed_array = _list_array([r if r is not None else () for r in routed], np.int16, pa.int16())
    if any(r is None for r in routed):
        validity = pa.array([r is not None for r in routed])
        routed_array = pa.ListArray.from_arrays(
            routed_array.offsets, routed_array.values, mask=pc.invert(validity)
        )
    fields = {
        "token_ids": _list_array([s["token_ids"] for s in segs], np.int32, pa.int32()),
        "loss_mask": _list_array([s["loss_mask"] for s in segs], np.int8, pa.int8()),
        "logprobs": _list_array([s["logprobs"] for s in segs], np.float32, pa.float32()),
        "routed_experts": routed_array,
        "routing_layers": pa.array([s.get("routing_layers") for s in segs], pa.int32()),
        "routing_top_k": pa.array([s.get("routing_top_k") for s in segs], pa.int32()),
        "reason": pa.array([s.get("reason") for s in segs], pa.string()),
        "parent": pa.array([s.get("parent") for s in segs], pa.int32()),
    }
    struct = pa.StructArray.from_arrays(list(fields.values()), fields=list(SEGMENT_TYPE))
    offsets = np.zeros(len(per_row) + 1, dtype=np.int32)
    np.cumsum([len(r) for r in per_row], out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), struct)


def to_table(kind: Kind, rows: Iterable[_Row | Mapping[str, Any]]) -> pa.Table:
    """Build an Arrow table of ``kind`` from row objects or plain dicts (missing fields are null)."""
    dicts = [r.to_dict() if isinstance(r, _Row) else dict(r) for r in rows]
    schema = SCHEMAS[kind]
    try:
        if kind != Kind.ROLLOUTS:
            return pa.Table.from_pylist(dicts, schema=schema)
        # Token segments dominate a trial row's size: build them column-wise.
        segments = _segments_column([d.pop("segments", None) for d in dicts])
        rest = pa.Table.from_pylist(dicts, schema=schema.remove(schema.get_field_index("segments")))
        return rest.add_column(schema.get_field_index("segments"), schema.field("segments"), segments)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, KeyError) as exc:
        raise ShardError(f"<{kind} rows>", f"rows do not fit the {kind} schema: {exc}") from exc


def write_table(
    path: str | os.PathLike[str], kind: Kind, table: pa.Table, command: str | None = None
) -> Path:
    """Atomically add one part file holding ``table`` to the dataset folder ``path``."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    schema = SCHEMAS[kind]
    if table.schema != schema:
        try:
            table = table.select(schema.names).cast(schema)
        except (KeyError, pa.ArrowInvalid, pa.ArrowTypeError, ValueError) as exc:
            raise ShardError(folder, f"table does not fit the {kind} schema: {exc}") from exc
    _check_rows(folder, kind, table)
    metadata = {
        META_KIND: str(kind).encode(),
        META_VERSION: str(SCHEMA_VERSION).encode(),
        META_COMMAND: (command if command is not None else _current_command()).encode(),
        META_WRITER: f"legorl {__version__}".encode(),
        META_CREATED: f"{time.time():.3f}".encode(),
    }
    table = table.replace_schema_metadata(metadata)
    _sweep_dead_writers(folder)
    final = folder / _new_part_name()
    tmp = folder / f".{final.name}.{_HOST}.tmp"
    try:
        with open(tmp, "wb") as handle:
            # Dictionary encoding and statistics buy nothing on token lists and cost most of the
            # write time; scalar columns keep statistics for predicate pushdown.
            pq.write_table(
                table, handle, compression="zstd", use_dictionary=False,
                write_statistics=[f.name for f in table.schema if not pa.types.is_nested(f.type)],
            )
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, final)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):  # a full or failing disk: what was committed before stays whole
            raise ShardError(folder, f"cannot commit a part file: {exc.strerror or exc}; the files committed "
                                     "before it are intact (free space, then rerun: the stage resumes)") from None
        raise
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return final


def write(
    path: str | os.PathLike[str],
    kind: Kind,
    rows: Iterable[_Row | Mapping[str, Any]],
    command: str | None = None,
) -> Path | None:
    """Atomically add ``rows`` to the dataset at ``path`` as one new part file."""
    table = to_table(kind, rows)
    if table.num_rows == 0:
        return None
    return write_table(path, kind, table, command)


class ShardWriter:
    """Buffers rows and commits a part file every ``rows_per_file`` rows (and on close).

    Use it as a context manager; rows still buffered when the process is killed are lost, rows
    already committed never are.
    """

    def __init__(
        self, path: str | os.PathLike[str], kind: Kind, rows_per_file: int = 1, command: str | None = None
    ):
        self.path = Path(path)
        self.kind = kind
        self.rows_per_file = max(1, rows_per_file)
        self.command = command
        self._buffer: list[_Row | Mapping[str, Any]] = []
        self.files: list[Path] = []

    def add(self, row: _Row | Mapping[str, Any]) -> None:
        self._buffer.append(row)
        if len(self._buffer) >= self.rows_per_file:
            self.flush()

    def flush(self) -> None:
        if self._buffer:
            rows, self._buffer = self._buffer, []
            written = write(self.path, self.kind, rows, self.command)
            if written is not None:
                self.files.append(written)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.flush()


# --------------------------------------------------------------------------- reading


@dataclass
class FileInfo:
    path: Path
    kind: str | None
    schema_version: int | None
    command: str | None
    rows: int


def file_info(path: Path) -> FileInfo:
    """Metadata of one part file; raises :class:`ShardError` when it is not a readable Parquet file."""
    try:
        meta = pq.read_metadata(path)
        schema = pq.read_schema(path)
    except (OSError, pa.ArrowInvalid, UnicodeDecodeError) as exc:  # a column name that is not UTF-8
        raise ShardError(path, f"not a readable Parquet file ({_first_line(exc)})") from exc
    md = schema.metadata or {}
    version = md.get(META_VERSION)
    return FileInfo(
        path=path,
        kind=md[META_KIND].decode(errors="replace") if META_KIND in md else None,
        schema_version=int(version) if version is not None and version.isdigit() else None,
        command=md[META_COMMAND].decode(errors="replace") if META_COMMAND in md else None,
        rows=meta.num_rows,
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _conform(path: Path, kind: Kind, table: pa.Table, schema: pa.Schema | None = None) -> pa.Table:
    """Cast a file's table to the current schema (or the part of it in ``schema``): missing
    nullable columns become null."""
    schema = SCHEMAS[kind] if schema is None else schema
    columns = []
    for fld in schema:
        if fld.name not in table.column_names:
            if not fld.nullable:
                raise ShardError(path, "required column is missing", field=fld.name)
            columns.append(pa.nulls(table.num_rows, type=fld.type))
            continue
        column = table.column(fld.name)
        if column.type != fld.type:
            try:
                column = column.cast(fld.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
                raise ShardError(
                    path, f"has type {column.type}, expected {fld.type} ({_first_line(exc)})", field=fld.name
                ) from exc
        columns.append(column)
    return pa.Table.from_arrays(columns, schema=schema)


def _first_true(mask: pa.ChunkedArray | pa.Array) -> int | None:
    mask = pc.fill_null(mask, False)
    if not pc.any(mask).as_py():
        return None
    return int(pc.index(mask, True).as_py())


def _check_rows(path: Path, kind: Kind, table: pa.Table) -> None:
    """Row-level checks, vectorised: keys present, enums known, segment arrays aligned."""
    schema = SCHEMAS[kind]
    for name in schema.names:
        if not schema.field(name).nullable and table.column(name).null_count:
            raise ShardError(path, "must not be null", row=_first_true(pc.is_null(table.column(name))), field=name)
    for name in KEY_COLUMNS[kind]:
        column = table.column(name)
        if pa.types.is_string(column.type):
            row = _first_true(pc.equal(pc.utf8_length(column), 0))
            if row is not None:
                raise ShardError(path, "key must not be empty", row=row, field=name)
    for name, allowed in ENUM_COLUMNS.get(kind, {}).items():
        column = table.column(name)
        bad = pc.invert(pc.is_in(column, value_set=pa.array(sorted(allowed))))
        row = _first_true(pc.and_(bad, pc.is_valid(column)))
        if row is not None:
            raise ShardError(
                path, f"unknown value {column[row].as_py()!r} (allowed: {', '.join(sorted(allowed))})",
                row=row, field=name,
            )
    if kind == Kind.ROLLOUTS:
        _check_segments(path, table)


def _check_segments(path: Path, table: pa.Table) -> None:
    segments = table.column("segments").combine_chunks()
    if len(segments) == 0:
        return
    # One entry per segment, with the row it belongs to.
    row_of_segment = pc.list_parent_indices(segments)
    flat = pc.list_flatten(segments)
    if len(flat) == 0:
        return
    n_tokens = pc.list_value_length(flat.field("token_ids"))
    for name in ("loss_mask", "logprobs"):
        differs = pc.not_equal(pc.list_value_length(flat.field(name)), n_tokens)
        seg = _first_true(differs)
        if seg is not None:
            raise ShardError(
                path, f"segment {seg}: {name} has {pc.list_value_length(flat.field(name))[seg]} entries "
                f"but token_ids has {n_tokens[seg]}", row=int(row_of_segment[seg].as_py()), field="segments",
            )
    mask_values = pc.list_flatten(flat.field("loss_mask"))
    if len(mask_values):
        bad = pc.and_(pc.not_equal(mask_values, 0), pc.not_equal(mask_values, 1))
        if pc.any(bad).as_py():
            raise ShardError(path, "loss_mask holds values other than 0 and 1", field="segments")
    routed = flat.field("routed_experts")
    has_routing = pc.is_valid(routed)
    if pc.any(has_routing).as_py():
        expected = pc.multiply(
            n_tokens, pc.multiply(pc.fill_null(flat.field("routing_layers"), 0), pc.fill_null(flat.field("routing_top_k"), 0))
        )
        wrong = pc.and_(has_routing, pc.not_equal(pc.list_value_length(routed), pc.cast(expected, pa.int32())))
        seg = _first_true(pc.fill_null(wrong, False))
        if seg is not None:
            raise ShardError(
                path, f"segment {seg}: routed_experts length does not equal tokens x routing_layers x routing_top_k",
                row=int(row_of_segment[seg].as_py()), field="segments",
            )


def read_file(path: Path, kind: Kind, columns: list[str] | None = None) -> pa.Table:
    """Read and validate one part file of ``kind``."""
    info = file_info(path)
    if info.kind != str(kind):
        found = f"a legorl '{info.kind}' shard" if info.kind else "not a legorl shard (no legorl metadata)"
        raise ShardError(path, f"expected a legorl '{kind}' shard, found {found}")
    if info.schema_version is None:
        raise ShardError(path, "no readable legorl schema version in its metadata")
    if info.schema_version > SCHEMA_VERSION:
        raise ShardError(
            path, f"schema version {info.schema_version} is newer than this legorl reads ({SCHEMA_VERSION}); upgrade legorl"
        )
    try:
        table = pq.read_table(path, columns=None if columns is None else _existing(path, columns))
        # Parquet readers do not check UTF-8: a flipped byte in a string would otherwise be a
        # UnicodeDecodeError at the first to_pylist().
        table.validate(full=True)
    except (OSError, pa.ArrowInvalid, UnicodeDecodeError) as exc:
        raise ShardError(path, f"corrupt Parquet data ({_first_line(exc)})") from exc
    if columns is not None:
        schema = SCHEMAS[kind]
        missing = [c for c in columns if c not in table.column_names]
        for name in missing:
            if not schema.field(name).nullable:
                raise ShardError(path, "required column is missing", field=name)
            table = table.append_column(schema.field(name), pa.nulls(table.num_rows, schema.field(name).type))
        return _conform(path, kind, table.select(columns), pa.schema([schema.field(c) for c in columns]))
    table = _conform(path, kind, table)
    _check_rows(path, kind, table)
    return table


def _existing(path: Path, columns: list[str]) -> list[str]:
    names = set(pq.read_schema(path).names)
    return [c for c in columns if c in names]


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


def _dedupe(kind: Kind, table: pa.Table) -> tuple[pa.Table, int]:
    keys = _key_array(kind, table)
    last: dict[Any, int] = {}
    for i, key in enumerate(keys):
        last[key] = i
    if len(last) == len(keys):
        return table, 0
    keep = sorted(last.values())
    return table.take(pa.array(keep, pa.int64())), len(keys) - len(keep)


def read(path: str | os.PathLike[str], kind: Kind, columns: list[str] | None = None) -> Dataset:
    """Read every part file of a dataset folder; later files win on duplicate keys.

    ``columns`` reads only those columns (the key columns are always added). A missing folder is
    an empty dataset.
    """
    files = part_files(path)
    if columns is not None:
        columns = list(dict.fromkeys([*KEY_COLUMNS[kind], *columns]))
    tables = [read_file(f, kind, columns) for f in files]
    schema = SCHEMAS[kind] if columns is None else pa.schema([SCHEMAS[kind].field(c) for c in columns])
    if not tables:
        return Dataset(kind, schema.empty_table(), files, 0)
    table = pa.concat_tables(tables)
    table, duplicates = _dedupe(kind, table)
    return Dataset(kind, table, files, duplicates)


def read_rows(path: str | os.PathLike[str], kind: Kind) -> list[Any]:
    """Typed rows (``TaskRow``, ``TrialRow``, ``GradeRow``, ``MetricRow``) of a dataset."""
    return read(path, kind).rows()


def iter_files(path: str | os.PathLike[str], kind: Kind) -> Iterator[tuple[Path, pa.Table]]:
    """Each part file with its validated table, for streaming over large datasets."""
    for f in part_files(path):
        yield f, read_file(f, kind)


def already_done(path: str | os.PathLike[str], kind: Kind) -> set[Any]:
    """Keys already written, for resuming. Rows marked as infrastructure failures don't count:
    a rerun tries them again, and the new row supersedes the old one."""
    extra = ["infra_failure"] if "infra_failure" in SCHEMAS[kind].names else []
    dataset = read(path, kind, columns=extra)
    table = dataset.table
    if extra:
        table = table.filter(pc.invert(pc.fill_null(table.column("infra_failure"), False)))
    return set(_key_array(kind, table))
