"""Running a harness's process: on the host in its own session, or inside the trial container.

Both are bounded by a wall-clock limit that kills the harness's whole process group. On the host,
every process the harness starts also carries a run marker (:data:`RUN_MARKER`) in its
environment, so what left the group (a ``setsid`` child) is found and killed when the run ends;
:func:`kill_host_processes` does the same for every host-run harness when the stage stops.

A launch that names modules to preload (:attr:`Launch.warm`) is forked from a warm interpreter
(:mod:`legorl.harnesses.warm`) instead of started cold, and driven the same way; when no warm
interpreter is available it starts cold.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

from legorl.harnesses import warm
from legorl.harnesses.host_limits import under_limits
from legorl.harnesses.trialfiles import read_trial_text
from legorl.sandbox.base import Sandbox

CONTAINER_TRIAL_DIR = "/legorl"  # where the per-trial folder is mounted inside the container
LOG_NAME = "harness.log"
KILL_GRACE_S = 5.0

logger = logging.getLogger("legorl.harnesses")


@dataclass
class ProcResult:
    """How a harness process ended: its exit code, whether the limit killed it, and its log's end."""

    exit_code: int | None
    timed_out: bool
    duration_s: float
    log_tail: str


@dataclass
class Launch:
    """How to start the harness: argv and environment as the process sees them."""

    argv: list[str]
    env: dict[str, str]
    # Host-run Python harnesses (argv ``[python, SCRIPT, ARG...]``): modules a warm interpreter may
    # import before the trial exists (nothing they do at import may depend on the trial's environment),
    # so the trial is forked from it (legorl.harnesses.warm); empty: a cold start.
    warm: tuple[str, ...] = ()


class HostProcess(Protocol):
    """A harness process on the host, in its own process group: a ``Popen`` or a warm fork."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


def tail(path: Path, chars: int = 4000) -> str:
    """The end of a log in the trial folder ('' when it is missing or refused)."""
    try:
        return read_trial_text(path, chars, tail=True)
    except OSError:
        return ""


_host_procs: dict[HostProcess, str] = {}  # each host-run harness and its run marker
_host_mu = threading.Lock()
# In the environment of every process a host-run harness starts: a child that leaves the harness's
# process group (setsid) still carries it, and is found by it when the run ends.
RUN_MARKER = "LEGORL_HARNESS_RUN"


def run_on_host(launch: Launch, timeout_s: float, log: Path, cwd: Path) -> ProcResult:
    """Run on the host in its own session; on timeout the whole process group is killed, and when
    the run ends every process still carrying its marker (a child that left the group) is too.
    The limit counts from here, so a warm interpreter's own start is the trial's time, as a cold
    start's imports are."""
    start = time.monotonic()
    marker = secrets.token_hex(8)
    with open(log, "ab") as out:
        proc = _start(launch, {**launch.env, RUN_MARKER: marker}, out, cwd, timeout_s)
        with _host_mu:
            _host_procs[proc] = marker
        timed_out = False
        try:
            proc.wait(timeout=max(0.0, timeout_s - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            timed_out = True
            kill_group(proc, KILL_GRACE_S)
        except BaseException:
            kill_group(proc, 0)
            raise
        finally:
            kill_marked({marker})
            with _host_mu:
                _host_procs.pop(proc, None)
    return ProcResult(proc.returncode, timed_out, time.monotonic() - start, tail(log))


def _start(launch: Launch, env: dict[str, str], out: BinaryIO, cwd: Path, timeout_s: float) -> HostProcess:
    """Fork the launch from a warm interpreter when it asks for one and one is available, else start it cold."""
    if launch.warm and len(launch.argv) >= 2:
        # Waiting for a starting server is the trial's time, as a cold start's imports are, and may take
        # all of it: starting cold meanwhile would import the same modules twice on the same cores.
        server = warm.server_for(launch.argv[0], launch.warm, launch.env, cwd, RUN_MARKER, wait_s=timeout_s)
        if server is not None:
            try:
                return server.spawn(launch.argv, env, cwd, out.fileno())
            except warm.WarmStartError as exc:
                logger.warning("warm start of %s failed, starting it cold: %s", launch.argv[1], exc)
    return subprocess.Popen(under_limits(launch.argv, env), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                            cwd=cwd, start_new_session=True)


def kill_marked(markers: set[str]) -> int:
    """KILL every process whose environment carries one of ``markers`` (see :data:`RUN_MARKER`); how many.

    A process that rewrites its own environment escapes this; it can only be a harness's own
    process on the host (agents run in their containers), so this is a safety net, not a boundary.
    """
    wanted = {f"{RUN_MARKER}={m}".encode() for m in markers}
    killed = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as handle:
                environ = set(handle.read().split(b"\0"))
        except OSError:  # gone, or not ours to read
            continue
        if environ & wanted:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry.name), signal.SIGKILL)
                killed += 1
    return killed


def kill_host_processes() -> None:
    """KILL every host-run harness of this process and what it started (their own sessions escape our
    signals), and stop the warm interpreters (with whatever they forked)."""
    with _host_mu:
        procs = dict(_host_procs)
    for proc in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    markers = set(procs.values()) | set(warm.stop_servers())
    if markers:
        kill_marked(markers)


def kill_group(proc: HostProcess, grace_s: float) -> None:
    """TERM the process group, then KILL it after ``grace_s``."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 30.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            # the leader is gone, but children in the group may linger: KILL them too
            os.killpg(proc.pid, signal.SIGKILL)
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            pass
        return


def run_in_sandbox(sandbox: Sandbox, launch: Launch, timeout_s: float, workdir: str) -> ProcResult:
    """Run inside the trial container, output to the trial folder's log; the sandbox's timeout kills
    the harness's whole process group in the container."""
    log = f"{CONTAINER_TRIAL_DIR}/{LOG_NAME}"
    script = f'exec "$@" >>{log} 2>&1 </dev/null'
    res = sandbox.exec(["sh", "-c", script, "sh", *launch.argv], timeout=timeout_s, workdir=workdir,
                       env=launch.env)
    return ProcResult(res.exit_code, res.timed_out, res.duration_s, res.output[-4000:])
