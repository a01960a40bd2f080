"""Validating shard tables: casting a file's table to the current schema, and the row-level
checks (keys, enums, segment arrays) that every write and every read runs (on the columns read)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from legorl.core.errors import ShardError
from legorl.core.schemas import ENUM_COLUMNS, KEY_COLUMNS, SCHEMAS, Kind


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type when it has none), for a one-line error."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def conform(path: Path, kind: Kind, table: pa.Table, schema: pa.Schema | None = None) -> pa.Table:
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
                    path, f"has type {column.type}, expected {fld.type} ({first_line(exc)})", field=fld.name
                ) from exc
        columns.append(column)
    return pa.Table.from_arrays(columns, schema=schema)


def _first_true(mask: pa.ChunkedArray | pa.Array) -> int | None:
    mask = pc.fill_null(mask, False)
    if not pc.any(mask).as_py():
        return None
    return int(pc.index(mask, True).as_py())


def check_rows(path: Path, kind: Kind, table: pa.Table) -> None:
    """Row-level checks, vectorised: keys present, enums known, segment arrays aligned (of the
    columns ``table`` holds: a read of some columns checks those)."""
    schema = SCHEMAS[kind]
    present = set(table.column_names)
    for name in schema.names:
        if name in present and not schema.field(name).nullable and table.column(name).null_count:
            raise ShardError(path, "must not be null", row=_first_true(pc.is_null(table.column(name))), field=name)
    for name in KEY_COLUMNS[kind]:
        if name not in present:
            continue
        column = table.column(name)
        if pa.types.is_string(column.type):
            row = _first_true(pc.equal(pc.utf8_length(column), 0))
            if row is not None:
                raise ShardError(path, "key must not be empty", row=row, field=name)
    for name, allowed in ENUM_COLUMNS.get(kind, {}).items():
        if name not in present:
            continue
        column = table.column(name)
        bad = pc.invert(pc.is_in(column, value_set=pa.array(sorted(allowed))))
        row = _first_true(pc.and_(bad, pc.is_valid(column)))
        if row is not None:
            raise ShardError(
                path, f"unknown value {column[row].as_py()!r} (allowed: {', '.join(sorted(allowed))})",
                row=row, field=name,
            )
    if kind == Kind.ROLLOUTS and "segments" in present:
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
