"""Writing shards: rows to Arrow tables, and each table committed atomically as one part file
(see :mod:`legorl.shards` for the contract)."""

from __future__ import annotations

import os
import shlex
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from legorl import __version__
from legorl.errors import ShardError
from legorl.schemas import SCHEMA_VERSION, SCHEMAS, SEGMENT_TYPE, Kind, _Row
from legorl.shard_checks import check_rows
from legorl.shard_files import (
    HOST,
    META_COMMAND,
    META_CREATED,
    META_KIND,
    META_VERSION,
    META_WRITER,
    new_part_name,
    sweep_dead_writers,
)


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
    check_rows(folder, kind, table)
    metadata = {
        META_KIND: str(kind).encode(),
        META_VERSION: str(SCHEMA_VERSION).encode(),
        META_COMMAND: (command if command is not None else _current_command()).encode(),
        META_WRITER: f"legorl {__version__}".encode(),
        META_CREATED: f"{time.time():.3f}".encode(),
    }
    table = table.replace_schema_metadata(metadata)
    sweep_dead_writers(folder)
    final = folder / new_part_name()
    tmp = folder / f".{final.name}.{HOST}.tmp"
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
