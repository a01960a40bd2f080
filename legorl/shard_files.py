"""The files of a shard folder: part names, the metadata keys they carry, and the temp files of
writers that died mid-write (see :mod:`legorl.shards` for the contract)."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import time
import uuid
from pathlib import Path

PART_GLOB = "part-*.parquet"
META_KIND = b"legorl.kind"
META_VERSION = b"legorl.schema_version"
META_COMMAND = b"legorl.command"
META_WRITER = b"legorl.writer"
META_CREATED = b"legorl.created_at"


def part_files(path: str | os.PathLike[str]) -> list[Path]:
    """The committed part files of a dataset folder, in write order (temp files are ignored)."""
    folder = Path(path)
    if not folder.is_dir():
        return []
    return sorted(folder.glob(PART_GLOB))


def new_part_name() -> str:
    # Sortable by write time; pid + random suffix keep concurrent writers apart.
    return f"part-{time.time_ns():020d}-{os.getpid()}-{uuid.uuid4().hex[:8]}.parquet"


HOST = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname()) or "host"
# .part-<ns>-<pid>-<hex>.parquet.<host>.tmp (or, from earlier versions, without the host)
_TEMP_NAME = re.compile(r"^\.part-\d+-(\d+)-[0-9a-f]+\.parquet(?:\.([A-Za-z0-9_-]+))?\.tmp$")
_swept: set[Path] = set()


def sweep_dead_writers(folder: Path) -> None:
    """Remove the temp files of writers on this host that died mid-write (once per folder and process).

    Readers never see a temp file; this only keeps ``inspect`` from counting it for ever. A temp
    file of another host (a shared filesystem) is left alone: its writer's pid means nothing here.
    """
    if folder in _swept:
        return
    _swept.add(folder)
    for entry in os.scandir(folder):
        match = _TEMP_NAME.match(entry.name)
        if match is None or (match.group(2) or HOST) != HOST:
            continue
        pid = int(match.group(1))
        if pid == os.getpid() or _alive(pid):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(entry.path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
