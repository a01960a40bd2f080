"""The reaper: removes legorl containers whose owner died (SIGKILL skips every cleanup) or whose
deadline passed.

Every container legorl creates carries labels naming its owner — pid, the pid's start time (so a
recycled pid does not keep a dead owner's container alive), and host — and an optional deadline
(Unix time). Each stage calls :func:`reap` when it starts; ``legorl setup --reap`` calls it by hand.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass

from legorl.sandbox.host import run_podman

LABEL = "legorl"
OWNER_PID = "legorl.owner_pid"
OWNER_START = "legorl.owner_start"
OWNER_HOST = "legorl.owner_host"
DEADLINE = "legorl.deadline"


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # fields after "(comm)" start at field 3


def owner_labels(deadline_s: float | None = None) -> dict[str, str]:
    """Labels that tie a container to this process (and its deadline, when it has one)."""
    pid = os.getpid()
    labels = {LABEL: "1", OWNER_PID: str(pid), OWNER_START: _start_time(pid) or "", OWNER_HOST: socket.gethostname()}
    if deadline_s is not None:
        labels[DEADLINE] = str(int(time.time() + deadline_s))
    return labels


def owner_alive(labels: dict[str, str]) -> bool:
    """Whether the process that created a container still runs. Unknown owners count as alive."""
    if labels.get(OWNER_HOST, socket.gethostname()) != socket.gethostname():
        return True  # another host's pids mean nothing here; its deadline still applies
    try:
        pid = int(labels.get(OWNER_PID, ""))
    except ValueError:
        return True
    started = _start_time(pid)
    if started is None:
        return False
    want = labels.get(OWNER_START, "")
    return not want or want == started


@dataclass
class Reaped:
    name: str
    reason: str  # "owner dead" | "deadline passed"


def stale(labels: dict[str, str], now: float | None = None) -> str | None:
    """Why a container with these labels should go, or None if it should stay."""
    deadline = labels.get(DEADLINE)
    if deadline and deadline.isdigit() and int(deadline) < (now if now is not None else time.time()):
        return "deadline passed"
    if not owner_alive(labels):
        return "owner dead"
    return None


def reap(dry_run: bool = False) -> list[Reaped]:
    """Remove every legorl container whose owner is dead or whose deadline has passed."""
    proc = run_podman(["ps", "-a", "--filter", f"label={LABEL}=1", "--format", "json"], timeout=120)
    found: list[Reaped] = []
    for item in json.loads(proc.stdout or b"[]") or []:
        reason = stale(item.get("Labels") or {})
        if reason is not None:
            names = item.get("Names") or [item["Id"]]
            found.append(Reaped(names[0], reason))
    if found and not dry_run:
        # -i: a container removed meanwhile (its owner's own cleanup) is not an error
        run_podman(["rm", "-f", "-i", "-t", "0", *[r.name for r in found]], timeout=300, check=False)
    return found
