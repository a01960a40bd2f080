"""Reading and writing shards: folders of ``part-*.parquet`` files.

The contract:

- a writer writes ``.part-*.parquet.<host>.tmp``, fsyncs it and renames it into place, so a reader
  never sees half a file and a killed stage loses at most what was in flight (the next writer in
  the folder removes the temp files of this host's dead writers); a write that fails (a full disk)
  is a :class:`~legorl.core.errors.ShardError` and leaves no temp file;
- part names sort in write order, and when a key appears twice the row from the later file wins
  (a rerun that supersedes an infrastructure failure, say); :func:`read` reports how many;
- every file carries its kind, schema version and the command that wrote it in its metadata, and
  is validated on read with an error naming file, row and field;
- writers batch (:class:`ShardWriter`: a part per N rows or T seconds), and :func:`compact` merges
  runs of small parts into large ones, keeping each key's last row, named so that they sort where
  the parts they replace were; a reader never sees a row twice or zero times, killed or not;
- :func:`read` takes ``where``, a filter pushed down to each file's row groups: a lookup by
  ``trial_id`` or ``step`` reads the row groups that can hold it, not the whole folder;
- a part with a ``step`` column has its step range beside it (``.steps-<part>.json``:
  :mod:`legorl.core.shards.step_ranges`), written with it; a read ``where`` the step rules out never
  opens it, and one that is missing, stale or corrupt is ignored (the part is opened);
- a rollout part may have a summary beside it, in the folder's hidden ``.summaries/``
  (:mod:`legorl.core.shards.summaries`; what it holds: :mod:`legorl.monitor.summaries`): derived data that
  no shard reader sees, checked against its part before use, written by the dashboard's reader and
  by compaction's ``on_merge``.

The work is done by :mod:`legorl.core.shards.files` (the folder's files), :mod:`legorl.core.shards.writing`,
:mod:`legorl.core.shards.reading`, :mod:`legorl.core.shards.compaction`, :mod:`legorl.core.shards.checks` and
:mod:`legorl.core.shards.step_ranges`; this
module is their public face (``docs/shards.md`` has the layout and the costs).
"""

from __future__ import annotations

from legorl.core.shards.compaction import Compacted, compact, compact_run
from legorl.core.shards.files import HOST as _HOST
from legorl.core.shards.files import (
    META_COMMAND,
    META_CREATED,
    META_KIND,
    META_VERSION,
    META_WRITER,
    PART_GLOB,
    part_files,
)
from legorl.core.shards.reading import (
    Dataset,
    FileInfo,
    Vanished,
    already_done,
    file_info,
    iter_files,
    read,
    read_file,
    read_rows,
)
from legorl.core.shards.writing import (
    ROWS_PER_PART,
    SECONDS_PER_PART,
    ShardWriter,
    to_table,
    write,
    write_table,
)

__all__ = [
    "META_COMMAND",
    "META_CREATED",
    "META_KIND",
    "META_VERSION",
    "META_WRITER",
    "PART_GLOB",
    "ROWS_PER_PART",
    "SECONDS_PER_PART",
    "_HOST",
    "Compacted",
    "Dataset",
    "FileInfo",
    "ShardWriter",
    "Vanished",
    "already_done",
    "compact",
    "compact_run",
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
