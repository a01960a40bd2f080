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

The work is done by :mod:`legorl.shard_files` (the folder's files), :mod:`legorl.shard_writing`,
:mod:`legorl.shard_reading` and :mod:`legorl.shard_checks`; this module is their public face.
"""

from __future__ import annotations

from legorl.shard_files import HOST as _HOST
from legorl.shard_files import (
    META_COMMAND,
    META_CREATED,
    META_KIND,
    META_VERSION,
    META_WRITER,
    PART_GLOB,
    part_files,
)
from legorl.shard_reading import (
    Dataset,
    FileInfo,
    already_done,
    file_info,
    iter_files,
    read,
    read_file,
    read_rows,
)
from legorl.shard_writing import ShardWriter, to_table, write, write_table

__all__ = [
    "META_COMMAND",
    "META_CREATED",
    "META_KIND",
    "META_VERSION",
    "META_WRITER",
    "PART_GLOB",
    "_HOST",
    "Dataset",
    "FileInfo",
    "ShardWriter",
    "already_done",
    "file_info",
    "iter_files",
    "part_files",
    "read",
    "read_file",
    "read_rows",
    "to_table",
    "write",
    "write_table",
]
