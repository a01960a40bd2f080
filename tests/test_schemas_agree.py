"""Row classes and Arrow schemas say the same thing: a field one has and the other lacks would be
dropped on write (or read back as null) without a word.

Checked for every Kind, down into the nested structs (segments, calls, timings, tests): the same
field names; each field's Python type matches its Arrow type (str/string, int/any integer,
float/any float, bool, list[T]/list<T>, a row class/its struct); and a field that may be None has a
nullable column. The converse is not asked: a nullable column under a field that is never None is
how a column is added compatibly (older files read it as null).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass

import pyarrow as pa
import pytest

from legorl.core.schemas import ENUM_COLUMNS, KEY_COLUMNS, ROW_CLASSES, SCHEMAS, Kind, Segment, _Row


def _disagreements(row_cls: type, fields: list[pa.Field], where: str) -> list[str]:
    """How ``row_cls`` and the Arrow ``fields`` disagree ([] when they agree)."""
    hints = typing.get_type_hints(row_cls)
    py_names = [f.name for f in dataclasses.fields(row_cls)]
    arrow = {f.name: f for f in fields}
    problems = [f"{where}.{n}: in the row class, not in the schema" for n in py_names if n not in arrow]
    problems += [f"{where}.{n}: in the schema, not in the row class" for n in arrow if n not in py_names]
    for name in py_names:
        if name in arrow:
            problems += _type_disagreements(hints[name], arrow[name].type, arrow[name].nullable, f"{where}.{name}")
    return problems


def _type_disagreements(py_type: object, arrow_type: pa.DataType, nullable: bool, where: str) -> list[str]:
    args = typing.get_args(py_type)
    if isinstance(py_type, types.UnionType) or typing.get_origin(py_type) is typing.Union:
        if type(None) not in args or len(args) != 2:
            return [f"{where}: {py_type} is not 'T | None'"]
        inner = next(a for a in args if a is not type(None))
        if not nullable:
            return [f"{where}: may be None, but its column is not nullable"]
        return _type_disagreements(inner, arrow_type, True, where)
    if typing.get_origin(py_type) is list:
        if not pa.types.is_list(arrow_type):
            return [f"{where}: a list in the row class, {arrow_type} in the schema"]
        item = arrow_type.value_field
        return _type_disagreements(args[0], item.type, item.nullable, f"{where}[]")
    if isinstance(py_type, type) and issubclass(py_type, _Row):
        if not pa.types.is_struct(arrow_type):
            return [f"{where}: a {py_type.__name__} in the row class, {arrow_type} in the schema"]
        return _disagreements(py_type, list(arrow_type), where)
    matches = {
        str: pa.types.is_string,
        bool: pa.types.is_boolean,
        int: pa.types.is_integer,
        float: pa.types.is_floating,
    }
    check = matches.get(py_type) if isinstance(py_type, type) else None
    if check is None:
        return [f"{where}: no Arrow counterpart known for {py_type}"]
    return [] if check(arrow_type) else [f"{where}: {py_type.__name__} in the row class, {arrow_type} in the schema"]


@pytest.mark.parametrize("kind", list(Kind))
def test_row_class_and_schema_agree(kind: Kind) -> None:
    assert _disagreements(ROW_CLASSES[kind], list(SCHEMAS[kind]), kind.value) == []


@pytest.mark.parametrize("kind", list(Kind))
def test_keys_and_enum_columns_are_columns(kind: Kind) -> None:
    names = set(SCHEMAS[kind].names)
    assert set(KEY_COLUMNS[kind]) <= names
    assert set(ENUM_COLUMNS.get(kind, {})) <= names


def test_the_check_sees_each_kind_of_disagreement() -> None:
    @dataclass
    class Drifted(_Row):
        __slots__ = ()
        kept: str
        added: int  # a field someone forgot in the schema
        wrong_type: float
        optional: str | None = None
        segments: list[Segment] = dataclasses.field(default_factory=list)

    schema = [
        pa.field("kept", pa.string(), nullable=False),
        pa.field("wrong_type", pa.string()),
        pa.field("optional", pa.string(), nullable=False),
        pa.field("segments", pa.list_(pa.struct([pa.field("token_ids", pa.list_(pa.int32()))]))),
        pa.field("dropped", pa.int32()),
    ]
    problems = _disagreements(Drifted, schema, "t")
    for expected in ("t.added: in the row class", "t.dropped: in the schema", "t.wrong_type: float",
                     "t.optional: may be None", "t.segments[].loss_mask: in the row class"):
        assert any(p.startswith(expected) for p in problems), (expected, problems)
    assert not any(p.startswith("t.kept") for p in problems)
