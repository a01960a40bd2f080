"""Reading the JSON and JSON-lines files users hand legorl (task sets, predictions) with one-line errors."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from legorl.core.errors import LegorlError

# JSON can spell a lone UTF-16 surrogate (\ud800); no Arrow string (so no shard) can hold one.
LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def read_utf8(path: Path) -> str:
    """The file's text; bytes that are not UTF-8 are an error naming the first one."""
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LegorlError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None


def loads(text: str) -> Any:
    """``json.loads``, with what it raises besides JSONDecodeError (nesting past the recursion
    limit, integers over Python's digit limit) made one: ``ValueError``."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def json_lines(path: Path, text: str, error: str) -> list[Any]:
    """One value per non-blank line; a bad line is ``error`` (formatted with ``line`` and ``message``)."""
    values = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            values.append(loads(line))
        except ValueError as exc:
            message = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc).splitlines()[0]
            raise LegorlError(f"{path}: " + error.format(line=number, message=message)) from None
    return values
