"""Small, fast request validation shared by the OpenAI and Anthropic front ends.

Hand-written rather than pydantic models: the proxy accepts (and ignores) any extra field a
harness sends, only rejects wrong types of the fields it reads or knows, and must add well under a
millisecond per call. Every failure is a :class:`BadRequest` naming the offending parameter.
"""

from __future__ import annotations

import math
import re
from typing import Any

from legorl.core.jsonfiles import LONE_SURROGATE

# Integers the engines take as 64-bit (seeds, top_k): anything wider is the client's error, never
# an engine failure (which would mark the session's trial as infrastructure).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code


def obj(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BadRequest(f"{where}: expected an object", where)
    return value


def opt_str(body: dict[str, Any], key: str, where: str = "") -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise BadRequest(f"{where}{key}: expected a string", where + key)
    return value


def req_str(body: dict[str, Any], key: str, where: str = "") -> str:
    value = body.get(key)
    if not isinstance(value, str):
        raise BadRequest(f"{where}{key}: required string", where + key)
    return value


def opt_bool(body: dict[str, Any], key: str, default: bool = False, where: str = "") -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"{where}{key}: expected a boolean", where + key)
    return value


def opt_int(body: dict[str, Any], key: str, lo: int | None = None, hi: int | None = None,
            where: str = "") -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise BadRequest(f"{where}{key}: expected an integer", where + key)
    if lo is not None and value < lo:
        raise BadRequest(f"{where}{key}: must be >= {lo}", where + key)
    if hi is not None and value > hi:
        raise BadRequest(f"{where}{key}: must be <= {hi}", where + key)
    return value


def opt_num(body: dict[str, Any], key: str, lo: float | None = None, hi: float | None = None,
            where: str = "", lo_open: bool = False) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise BadRequest(f"{where}{key}: expected a number", where + key)
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise BadRequest(f"{where}{key}: must be {'>' if lo_open else '>='} {lo}", where + key)
    if hi is not None and value > hi:
        raise BadRequest(f"{where}{key}: must be <= {hi}", where + key)
    return float(value)


def opt_obj(body: dict[str, Any], key: str, where: str = "") -> dict[str, Any] | None:
    value = body.get(key)
    if value is not None and not isinstance(value, dict):
        raise BadRequest(f"{where}{key}: expected an object", where + key)
    return value


def opt_list(body: dict[str, Any], key: str, where: str = "") -> list[Any] | None:
    value = body.get(key)
    if value is not None and not isinstance(value, list):
        raise BadRequest(f"{where}{key}: expected an array", where + key)
    return value


def check_types(body: dict[str, Any], spec: dict[str, type | tuple[type, ...]], where: str = "") -> None:
    """Fields the proxy ignores but whose type is known: reject a wrong type, accept null."""
    for key, types in spec.items():
        value = body.get(key)
        if value is None:
            continue
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in _as_tuple(types)):
            raise BadRequest(f"{where}{key}: wrong type", where + key)


def _as_tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def json_schema(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {"type": "object", "properties": {}}
    if not isinstance(value, dict):
        raise BadRequest(f"{where}: expected a JSON schema object", where)
    return value


#: A JSON text holding this may spell a lone surrogate (then run :func:`without_lone_surrogates`).
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _fix(text: str) -> str:
    return LONE_SURROGATE.sub("\ufffd", text) if LONE_SURROGATE.search(text) else text


def without_lone_surrogates(root: Any) -> Any:
    """``root`` (parsed JSON) with every lone UTF-16 surrogate (JSON can spell one as ``\\ud800``) in
    its strings and keys replaced by U+FFFD, in place: nothing downstream (UTF-8 responses,
    captures, shards) can write one. Iterative: JSON may nest as deep as its parser allows."""
    if isinstance(root, str):
        return _fix(root)
    stack = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            items: Any = enumerate(node)
        else:
            if any(LONE_SURROGATE.search(k) for k in node):
                pairs = list(node.items())
                node.clear()
                node.update((_fix(k), v) for k, v in pairs)
            items = list(node.items())
        for key, value in items:
            if isinstance(value, str):
                node[key] = _fix(value)
            elif isinstance(value, list | dict):
                stack.append(value)
    return root
