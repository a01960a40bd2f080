"""The steps a part file holds, kept beside it, so that a reader of one step (``train``'s load, grading
a step, resume) skips the parts that cannot hold it without opening them.

Ruling a part out from its row-group statistics means parsing its footer, and a large compacted part's
footer is megabytes. ``.steps-<part name>.json`` in the dataset folder holds the part's distinct
``step`` values as inclusive ranges, and whether some of its rows have none.

It is a hint, never the truth. Its metadata names the part, the part's size and a digest of the part's
last 64 KiB (its footer: the key of a summary, :func:`legorl.core.shards.summaries.part_key`), and it
carries a digest of its own content. :func:`load` returns it only when all of them match; a step range
that is missing (a part written before them, or its writer killed between the two files), torn, stale,
of another version or corrupt is None, and the reader opens the part as before.

Who writes them: the part writer and compaction, each before renaming the part into place, from the
table being written, keyed by the temp file's bytes (valid from the rename on). Not fsynced: a torn one
is unreadable, hence ignored. Compaction removes a replaced part's after the part, and sweeps orphans
(a range whose part never arrived or is gone, and dead processes' temp files).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from legorl.core.shards.files import HOST, dead_temp
from legorl.core.shards.summaries import part_key

PREFIX = ".steps-"
SUFFIX = ".json"
VERSION = 1
COLUMN = "step"


@dataclass(frozen=True)
class StepRange:
    """The distinct steps of a part, as sorted inclusive ranges, and whether a row has no step."""

    ranges: tuple[tuple[int, int], ...]
    nulls: bool

    @classmethod
    def of(cls, column: pa.ChunkedArray | pa.Array) -> StepRange:
        values = np.unique(pc.drop_null(column).to_numpy(zero_copy_only=False).astype(np.int64))
        breaks = np.flatnonzero(np.diff(values) != 1) + 1
        ranges = tuple((int(run[0]), int(run[-1])) for run in np.split(values, breaks) if run.size)
        return cls(ranges, column.null_count > 0)

    @property
    def max(self) -> int | None:
        return self.ranges[-1][1] if self.ranges else None

    def may_match(self, where: pc.Expression, step_type: pa.DataType) -> bool:
        """False when no row of the part can match ``where``, which tests the step alone (:func:`decides`)."""
        values = [v for lo, hi in self.ranges for v in range(lo, hi + 1)] + ([None] if self.nulls else [])
        return pa.table({COLUMN: pa.array(values, step_type)}).filter(where).num_rows > 0


def decides(where: pc.Expression, step_type: pa.DataType) -> bool:
    """Whether ``where`` tests the step alone, so that a step range can rule a part out (not a
    lookup by trial id: only the step is known here)."""
    try:
        pa.table({COLUMN: pa.array([], step_type)}).filter(where)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError):
        return False
    return True


def path_of(part: Path) -> Path:
    """Where the step range of ``part`` lives."""
    return part.parent / f"{PREFIX}{part.name}{SUFFIX}"


def _digest(body: dict[str, object]) -> str:
    return hashlib.sha1(json.dumps(body, sort_keys=True).encode()).hexdigest()


def store(final: Path, written: Path, table: pa.Table) -> None:
    """Store the step range of ``table``, about to be renamed from ``written`` to ``final``. A table
    without a step column has none; one that cannot be written (a full disk) is left out: a hint."""
    if COLUMN not in table.column_names:
        return
    steps = StepRange.of(table.column(COLUMN))
    target = path_of(final)
    tmp = target.with_name(f"{target.name}.{HOST}.{os.getpid()}.tmp")
    try:
        size, tail = part_key(written)
        body: dict[str, object] = {"version": VERSION, "part": final.name, "size": size, "tail": tail,
                                   "ranges": [list(r) for r in steps.ranges], "nulls": steps.nulls}
        tmp.write_text(json.dumps({**body, "digest": _digest(body)}))
        os.replace(tmp, target)
    except OSError:
        tmp.unlink(missing_ok=True)


def load(part: Path) -> StepRange | None:
    """The stored step range of ``part`` when it is whole, of this version and of this very part;
    else None. Raises FileNotFoundError when the part itself is gone."""
    try:
        text = path_of(part).read_text()
    except (OSError, UnicodeDecodeError):
        return None
    try:
        body = json.loads(text)
        digest = body.pop("digest")
        if (digest != _digest(body) or body["version"] != VERSION or body["part"] != part.name):
            return None
        steps = StepRange(tuple((int(lo), int(hi)) for lo, hi in body["ranges"]), bool(body["nulls"]))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if (body["size"], body["tail"]) != part_key(part):
        return None
    return steps


def remove(folder: Path, part_names: list[str]) -> None:
    """Remove the step ranges of the named parts (after the parts themselves)."""
    for name in part_names:
        with contextlib.suppress(FileNotFoundError):
            (folder / f"{PREFIX}{name}{SUFFIX}").unlink()


def sweep(folder: Path) -> None:
    """Remove orphans: step ranges whose part is not there, and this host's dead processes' temp
    files. Run under the folder's compaction lock. A writer's range written just before its part is
    renamed may be swept too: its part is then opened, as without one."""
    for entry in os.scandir(folder):
        name = entry.name
        if not name.startswith(PREFIX):
            continue
        if name.endswith(SUFFIX):
            orphan = not (folder / name.removeprefix(PREFIX).removesuffix(SUFFIX)).exists()
        else:
            orphan = name.endswith(".tmp") and dead_temp(name)
        if orphan:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
