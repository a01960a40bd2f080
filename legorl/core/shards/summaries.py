"""Summaries of part files, kept beside them: derived data a reader would otherwise recompute from
every row (the dashboard's overview: :mod:`legorl.monitor.summaries` says what a rollout part's holds).

A part file never changes once renamed into place, so its summary is computed once and stored as
``.summaries/<part name>.summary`` (a Parquet file) inside the dataset folder; shard readers never see
it (it is not a ``part-*.parquet`` file, and Parquet tools skip hidden folders).

A summary is never trusted over its part. Its metadata names the part, the part's size, a digest of
the part's last bytes (its Parquet footer: row group offsets, statistics and the time it was written,
so a rewrite under the same name differs) and the summary's version. :func:`load` returns a summary
only when all four match the part now on disk and its schema is the one asked for, and None when it is
missing, torn, unreadable, of another version or of another part; the caller then summarises the
part again and may :func:`store` the result (atomically: temp file, rename). Compaction removes a
replaced part's summary after the part, and sweeps summaries whose part is gone: a reader never looks
one up, since it starts from the part listing.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from legorl.core.shards.files import HOST, dead_temp

FOLDER = ".summaries"
SUFFIX = ".summary"
_TAIL_BYTES = 64 * 1024
_META_VERSION = b"legorl.summary_version"
_META_PART = b"legorl.summary_of"
_META_SIZE = b"legorl.part_size"
_META_TAIL = b"legorl.part_tail"


def path_of(part: Path) -> Path:
    """Where the summary of ``part`` lives."""
    return part.parent / FOLDER / f"{part.name}{SUFFIX}"


def part_key(part: Path) -> tuple[int, str]:
    """(size, digest of the last bytes) of a part file; FileNotFoundError when it is gone."""
    with open(part, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        handle.seek(max(0, size - _TAIL_BYTES))
        return size, hashlib.sha1(handle.read()).hexdigest()


def load(part: Path, version: int, schema: pa.Schema, key: tuple[int, str] | None = None) -> pa.Table | None:
    """The stored summary of ``part`` when it is whole, of ``version`` and ``schema`` and of this very
    part; else None. Raises FileNotFoundError when the part itself is gone."""
    key = key or part_key(part)
    try:
        with pq.ParquetFile(path_of(part)) as file:
            meta = file.schema_arrow.metadata or {}
            if (meta.get(_META_VERSION) != str(version).encode() or meta.get(_META_PART) != part.name.encode()
                    or meta.get(_META_SIZE) != str(key[0]).encode() or meta.get(_META_TAIL) != key[1].encode()):
                return None
            table = file.read()
        table.validate(full=True)
    except (OSError, pa.ArrowInvalid, UnicodeDecodeError, ValueError):
        return None  # missing, torn or unreadable: summarise the part again
    return table.cast(schema) if table.schema.remove_metadata() == schema else None


def store(part: Path, summary: pa.Table, version: int, schema: pa.Schema, key: tuple[int, str] | None = None) -> bool:
    """Store ``summary`` as the summary of ``part`` (whose key is ``key``, or read from disk now),
    atomically. Returns False when it cannot be written (a read-only run): it is only a cache."""
    try:
        key = key or part_key(part)
        final = path_of(part)
        final.parent.mkdir(exist_ok=True)
        tmp = final.parent / f".{final.name}.{HOST}.{os.getpid()}.tmp"
        metadata = {_META_VERSION: str(version).encode(), _META_PART: part.name.encode(),
                    _META_SIZE: str(key[0]).encode(), _META_TAIL: key[1].encode()}
        try:
            # Not fsynced: a summary torn by a power cut is unreadable, hence recomputed.
            pq.write_table(summary.cast(schema).replace_schema_metadata(metadata), tmp, compression="zstd")
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
    except OSError:
        return False
    return True


def remove(folder: Path, part_names: list[str]) -> None:
    """Remove the summaries of the named parts (after the parts themselves)."""
    for name in part_names:
        with contextlib.suppress(FileNotFoundError):
            (folder / FOLDER / f"{name}{SUFFIX}").unlink()


def sweep(folder: Path) -> None:
    """Remove orphans: summaries whose part is gone, and temp files of this host's dead processes.
    Run under the folder's compaction lock (no merged part is then on its way in)."""
    try:
        entries = list(os.scandir(folder / FOLDER))
    except (FileNotFoundError, NotADirectoryError):
        return
    for entry in entries:
        name = entry.name
        if name.endswith(SUFFIX) and not name.startswith("."):
            orphan = not (folder / name.removesuffix(SUFFIX)).exists()
        elif name.startswith(".") and name.endswith(".tmp"):
            orphan = dead_temp(name)
        else:
            continue
        if orphan:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
