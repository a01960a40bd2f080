"""Content digests: of bytes, and of a file (cached while its size and mtime stay the same)."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

_CHUNK = 1 << 20


def digest(data: bytes) -> str:
    """``sha256:`` and the first 16 hex digits of the bytes' sha256."""
    return "sha256:" + hashlib.sha256(data).hexdigest()[:16]


@functools.cache
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes, cached while its size and mtime stay the same."""
    st = path.stat()
    return _file_digest(str(path.resolve()), st.st_size, st.st_mtime_ns)
