"""The files of a shard folder: part names, the metadata keys they carry, the journals of
compactions (:mod:`legorl.core.shards.compaction`) and the temp files of writers that died mid-write
(see :mod:`legorl.core.shards` for the contract)."""

from __future__ import annotations

import contextlib
import json
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


# A compaction's journal: ``.compact-<merged part>.json`` = {"merged": name, "replaces": [names]}.
JOURNAL_PREFIX = ".compact-"


def part_files(path: str | os.PathLike[str]) -> list[Path]:
    """The committed part files of a dataset folder, in write order (temp files are ignored, and so
    are the parts a compaction has merged while they wait for removal)."""
    folder = Path(path)
    try:
        entries = [e.name for e in os.scandir(folder)]
    except (FileNotFoundError, NotADirectoryError):
        return []
    parts = {n for n in entries if n.startswith("part-") and n.endswith(".parquet")}
    journals = [n for n in entries if n.startswith(JOURNAL_PREFIX) and n.endswith(".json")]
    hidden = merged_away(folder, journals, parts) if journals else set()
    return [folder / n for n in sorted(parts - hidden)]


def merged_away(folder: Path, journals: list[str], parts: set[str]) -> set[str]:
    """The parts that a committed merged part replaces (its journal says which): a compaction
    killed between renaming the merged part into place and removing them leaves both, and the
    merged part holds their rows."""
    hidden: set[str] = set()
    for name in journals:
        entry = read_journal(folder / name)
        if entry is not None and entry[0] in parts:
            hidden.update(entry[1])
    return hidden


def read_journal(path: Path) -> tuple[str, list[str]] | None:
    """(merged part, the parts it replaces) of a compaction journal; None when it is gone or torn."""
    try:
        data = json.loads(path.read_text())
        return str(data["merged"]), [str(n) for n in data["replaces"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None


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
        if pid == os.getpid() or alive(pid):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(entry.path)


def dead_temp(name: str) -> bool:
    """Whether ``name`` is a ``<file>.<host>.<pid>.tmp`` temp file of a process of this host that is gone."""
    parts = name.rsplit(".", 3)
    if len(parts) != 4 or parts[3] != "tmp":
        return False
    _, host, pid, _ = parts
    return host == HOST and pid.isdigit() and int(pid) != os.getpid() and not alive(int(pid))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
