"""Writing shards: rows to Arrow tables, and each table committed atomically as one part file
(see :mod:`legorl.core.shards` for the contract)."""

from __future__ import annotations

import math
import os
import shlex
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from legorl import __version__
from legorl.core.errors import ShardError
from legorl.core.schemas import SCHEMA_VERSION, SCHEMAS, SEGMENT_TYPE, Kind, _Row
from legorl.core.shards import step_ranges
from legorl.core.shards.checks import check_rows
from legorl.core.shards.files import (
    HOST,
    META_COMMAND,
    META_CREATED,
    META_KIND,
    META_VERSION,
    META_WRITER,
    new_part_name,
    sweep_dead_writers,
)

# A batching writer's defaults: a part file per this many rows, or this many seconds after its first
# row, whichever comes first (the environment overrides them). A buffered row is a finished trial
# that a kill would lose, so the wait is short; compaction merges the parts that come out small.
ROWS_PER_PART = 256
SECONDS_PER_PART = 2.0
ROWS_ENV = "LEGORL_SHARD_ROWS"
SECONDS_ENV = "LEGORL_SHARD_SECONDS"


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
    table = prepare(folder, kind, table, command)
    sweep_dead_writers(folder)
    final = folder / new_part_name()
    tmp = write_temp(folder, table, name=final.name)
    step_ranges.store(final, tmp, table)  # before the part: a reader may use it from the rename on
    try:
        os.replace(tmp, final)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        step_ranges.remove(folder, [final.name])
        raise _commit_error(folder, exc) from None
    fsync_dir(folder)
    return final


def prepare(folder: Path, kind: Kind, table: pa.Table, command: str | None = None) -> pa.Table:
    """``table`` cast to the schema of ``kind``, checked row by row, with legorl's metadata."""
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
    return table.replace_schema_metadata(metadata)


def write_temp(folder: Path, table: pa.Table, name: str | None = None, row_group_size: int | None = None) -> Path:
    """Write ``table`` (:func:`prepare`-d) to a temp file in ``folder`` and fsync it; the caller
    renames it into place. A temp file named after a part name (a fresh one by default) is swept
    away should this process die before the rename."""
    tmp = folder / f".{name or new_part_name()}.{HOST}.tmp"
    try:
        with open(tmp, "wb") as handle:
            # Dictionary encoding and statistics buy nothing on token lists and cost most of the
            # write time; scalar columns keep statistics for predicate pushdown.
            pq.write_table(
                table, handle, compression="zstd", use_dictionary=False, row_group_size=row_group_size,
                write_statistics=[f.name for f in table.schema if not pa.types.is_nested(f.type)],
            )
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise _commit_error(folder, exc) from None
        raise
    return tmp


def _commit_error(folder: Path, exc: OSError) -> ShardError:
    # a full or failing disk: what was committed before stays whole
    return ShardError(folder, f"cannot commit a part file: {exc.strerror or exc}; the files committed "
                              "before it are intact (free space, then rerun: the stage resumes)")


def fsync_dir(folder: Path) -> None:
    """Make the renames and removals in ``folder`` durable."""
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


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


def _env_number(name: str, default: Any, kind: type) -> Any:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return kind(value)
    except ValueError:
        raise ShardError(f"${name}", f"not a number: {value!r}") from None


class ShardWriter:
    """Buffers rows and commits them as one part file every ``rows_per_file`` rows, ``max_seconds``
    after the oldest buffered row arrived, and on :meth:`flush` / close, whichever comes first
    (defaults: :data:`ROWS_PER_PART` and :data:`SECONDS_PER_PART`, or ``$LEGORL_SHARD_ROWS`` and
    ``$LEGORL_SHARD_SECONDS``).

    Use it as a context manager; rows still buffered when the process is killed are lost (a stage
    reruns them: ``already_done`` does not see them), rows already committed never are. The timed
    flush runs on a timer thread; its error (a full disk) is raised by the next ``add`` or close.
    """

    def __init__(
        self, path: str | os.PathLike[str], kind: Kind, rows_per_file: int | None = None,
        command: str | None = None, max_seconds: float | None = None,
    ):
        self.path = Path(path)
        self.kind = kind
        rows = rows_per_file if rows_per_file is not None else _env_number(ROWS_ENV, ROWS_PER_PART, int)
        self.rows_per_file = max(1, rows)
        # math.inf: no timed flush (rows wait for rows_per_file or flush)
        self.max_seconds = max_seconds if max_seconds is not None else _env_number(SECONDS_ENV, SECONDS_PER_PART, float)
        self.command = command
        self._buffer: list[_Row | Mapping[str, Any]] = []
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._error: BaseException | None = None
        self.files: list[Path] = []

    def add(self, row: _Row | Mapping[str, Any]) -> None:
        with self._lock:
            self._raise_timer_error()
            self._buffer.append(row)
            if len(self._buffer) >= self.rows_per_file:
                self._flush()
            elif len(self._buffer) == 1 and math.isfinite(self.max_seconds):
                self._timer = threading.Timer(self.max_seconds, self._timed_flush)
                self._timer.daemon = True
                self._timer.start()

    def flush(self) -> None:
        with self._lock:
            self._raise_timer_error()
            self._flush()

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._buffer:
            rows, self._buffer = self._buffer, []
            written = write(self.path, self.kind, rows, self.command)
            if written is not None:
                self.files.append(written)

    def _timed_flush(self) -> None:
        with self._lock:
            try:
                self._flush()
            except BaseException as exc:  # handed to the writer's thread at its next call
                self._error = exc

    def _raise_timer_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.flush()
