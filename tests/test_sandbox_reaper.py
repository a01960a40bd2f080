"""Containers outlive no one: removal on SIGTERM, and the reaper for SIGKILL and deadlines."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from legorl.sandbox import PodmanBackend, SandboxSpec, reap
from legorl.sandbox.host import run_podman
from legorl.sandbox.reaper import owner_labels, stale

OWNER = """
import sys, time
from legorl.sandbox import PodmanBackend, SandboxSpec
box = PodmanBackend().create(SandboxSpec(image=sys.argv[1], labels={"run": "pytest-reaper"}))
assert box.exec("true").exit_code == 0  # the API service is up
print(box.name, flush=True)
time.sleep(600)
"""


def exists(name: str) -> bool:
    return run_podman(["container", "exists", name], check=False).returncode == 0


def cmdlines() -> list[str]:
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            with contextlib.suppress(OSError):
                raw = Path(f"/proc/{pid}/cmdline").read_bytes()
                out.append(raw.replace(b"\0", b" ").decode(errors="replace"))
    return out


def spawn_owner(image: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-c", OWNER, image], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    name = proc.stdout.readline().strip()
    assert name.startswith("legorl-pytest-reaper-") and exists(name)
    return proc, name


@pytest.mark.podman
def test_sigkilled_owner_leaves_a_container_the_reaper_removes(image: str) -> None:
    proc, name = spawn_owner(image)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert exists(name)  # SIGKILL ran no cleanup
    reaped = reap()
    assert (name, "owner dead") in [(r.name, r.reason) for r in reaped]
    assert not exists(name)
    # nor does the owner's private podman API service outlive it (its watchdog polls each second)
    deadline = time.monotonic() + 10
    while any("system service" in cmd and f" {proc.pid}" in cmd for cmd in cmdlines()):
        assert time.monotonic() < deadline, "the owner's podman service outlived it"
        time.sleep(0.2)


@pytest.mark.podman
def test_sigterm_removes_the_owners_containers(image: str) -> None:
    proc, name = spawn_owner(image)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == -signal.SIGTERM  # it still dies of SIGTERM
    assert not exists(name)


@pytest.mark.podman
def test_deadline_passed_is_reaped_and_live_owner_is_not(image: str) -> None:
    backend = PodmanBackend()
    with backend.create(SandboxSpec(image=image, deadline_s=0)) as expired, \
            backend.create(SandboxSpec(image=image, deadline_s=3600)) as current:
        time.sleep(1.1)
        found = {r.name: r.reason for r in reap(dry_run=True)}
        assert found.get(expired.name) == "deadline passed"
        assert current.name not in found
        reap()
        assert not exists(expired.name) and exists(current.name)


def test_stale_rules() -> None:
    mine = owner_labels()
    assert stale(mine) is None
    assert stale({**mine, "legorl.deadline": str(int(time.time()) - 5)}) == "deadline passed"
    assert stale({**mine, "legorl.owner_start": "1"}) == "owner dead"  # the pid was recycled
    dead = subprocess.Popen(["true"])
    dead.wait()
    assert stale({**mine, "legorl.owner_pid": str(dead.pid)}) == "owner dead"
    assert stale({**mine, "legorl.owner_host": "another-host", "legorl.owner_pid": str(dead.pid)}) is None
    assert stale({"legorl": "1"}) is None  # unknown owner, no deadline: leave it alone
    assert int(mine["legorl.owner_pid"]) == os.getpid()
