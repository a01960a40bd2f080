"""Warm starts for host-run Python harnesses: each trial forked from an interpreter that has already
imported the harness's heavy dependencies.

A cold mini-swe-agent trial is a fresh interpreter importing litellm: ~15 s of CPU on two shared
cores before its first model call, for every trial. A :class:`ForkServer` (``_forkserver.py``,
run by the harness's own interpreter) imports those modules once; per trial it forks a child that
runs the harness's script exactly as ``python SCRIPT ARG...`` would, with the trial's environment,
cwd and log file (see that module for what the child does). The harness is not changed: the script,
its arguments, its config file and its outputs are the cold start's.

:func:`legorl.harnesses.processes.run_on_host` drives the child (a :class:`WarmProcess`) as it
drives a cold ``Popen``: the same wall-clock limit, the same kill of its process group, the same
kill of every process carrying the run's marker. A forked child's ``/proc/PID/environ`` still shows
the server's environment, so the server itself kills the child's group when the child ends or its
connection closes; only what the child forks without exec'ing and moves out of its group escapes
that, until the server stops (it carries the server's own marker, and the stopping server kills what
does). One thing a fork cannot give each trial is its own string-hash seed: it is fixed when the
server's interpreter starts.

One server per interpreter, module list and shared environment (the trial's, with every value under
the trial folder moved to the server's own folder: HOME, the XDG and config dirs), started by the
first trial that asks and kept for the life of this process, so later steps of a loop reuse it. It
dies with this process: its stdin is a pipe only this process holds. A server that cannot start is
logged once and its trials start cold; ``LEGORL_WARM_START=0`` turns warm starts off.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from legorl.harnesses.host_limits import under_limits

SERVER = Path(__file__).with_name("_forkserver.py")
SWITCH = "LEGORL_WARM_START"
_SOCKET_NAME = "fork.sock"  # _forkserver.SOCKET_NAME (that module runs in another interpreter)
_REPLY_TIMEOUT_S = 60.0
START_LIMIT_S = 600.0  # a server still importing after this long is taken as hung

log = logging.getLogger("legorl.harnesses")


def enabled() -> bool:
    """False when ``LEGORL_WARM_START`` is ``0`` (or ``false``/``no``/``off``): every trial starts cold."""
    return os.environ.get(SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


class WarmStartError(RuntimeError):
    """The fork server could not run a trial (legorl's failure, never the agent's)."""


@dataclass(frozen=True)
class ServerKey:
    """What makes two trials' warm interpreters interchangeable."""

    python: str
    modules: tuple[str, ...]
    # the shared environment: (name, value relative to the trial folder or None, value)
    env: tuple[tuple[str, str | None, str], ...]

    @classmethod
    def of(cls, python: str, modules: tuple[str, ...], env: Mapping[str, str], trial_dir: Path,
           skip: str) -> ServerKey:
        root = str(trial_dir)
        entries = []
        for name, value in sorted(env.items()):
            if name == skip:
                continue
            inside = value == root or value.startswith(root + "/")
            entries.append((name, value[len(root):] if inside else None, "" if inside else value))
        return cls(python, modules, tuple(entries))

    def environment(self, folder: Path) -> dict[str, str]:
        """The server's environment: the trial's, with the trial folder replaced by ``folder``."""
        return {name: (str(folder) + rel if rel is not None else value) for name, rel, value in self.env}


class WarmProcess:
    """A trial forked by a :class:`ForkServer`, driven like a ``subprocess.Popen``: ``pid`` (also its
    process group), ``wait`` and ``returncode``. Closing it (or this process dying) makes the server
    kill the trial's whole group if it still runs."""

    def __init__(self, conn: socket.socket, pid: int, args: list[str], buffered: bytes = b"") -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._conn = conn
        self._buf = buffered

    def wait(self, timeout: float | None = None) -> int:
        """The child's exit status (negative: killed by that signal); ``subprocess.TimeoutExpired``
        when it has not ended within ``timeout``; :class:`WarmStartError` when the server died under it
        (which killed the child: later waits say ``-SIGKILL``)."""
        if self.returncode is not None:
            return self.returncode
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buf:
            self._conn.settimeout(None if deadline is None else max(0.0, deadline - time.monotonic()))
            try:
                chunk = self._conn.recv(4096)
            except (TimeoutError, BlockingIOError):  # BlockingIOError: nothing yet, at timeout 0
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0) from None
            except OSError:
                chunk = b""
            if not chunk:
                self.returncode = -signal.SIGKILL  # the server's death takes the child (PR_SET_PDEATHSIG)
                self.close()
                raise WarmStartError(f"the fork server died while running pid {self.pid}")
            self._buf += chunk
        line = self._buf.split(b"\n", 1)[0]
        self.returncode = int(json.loads(line)["returncode"])
        self.close()
        return self.returncode

    def close(self) -> None:
        self._conn.close()


class ForkServer:
    """One ``_forkserver.py`` process: started at once, ready once its imports are done."""

    def __init__(self, key: ServerKey, marker: tuple[str, str]) -> None:
        base = tempfile.gettempdir()  # short: a unix socket path holds at most 107 bytes
        self.folder = Path(tempfile.mkdtemp(prefix="legorl-warm-", dir=base if len(base) <= 64 else "/tmp"))
        home = self.folder / "trial"
        home.mkdir()
        self.key = key
        self.owner = os.getpid()  # the server serves this process only (a fork of it starts its own)
        self.marker = marker[1]
        self.failure: str | None = None
        self.started = False  # it once took requests
        self.born = time.monotonic()
        self._ready = threading.Event()
        self._ended = threading.Event()
        try:
            env = key.environment(home) | {marker[0]: marker[1]}
            with open(self.folder / "server.log", "ab") as err:
                self.proc = subprocess.Popen(
                    under_limits([key.python, str(SERVER), str(self.folder), marker[0], *key.modules], env),
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, cwd=home, env=env,
                    start_new_session=True,
                )
        except OSError:
            shutil.rmtree(self.folder, ignore_errors=True)
            raise
        threading.Thread(target=self._watch, name="fork-server", daemon=True).start()

    @property
    def socket_path(self) -> Path:
        return self.folder / _SOCKET_NAME

    @property
    def ended(self) -> bool:
        return self._ended.is_set()

    def _watch(self) -> None:
        assert self.proc.stdout is not None
        try:
            first = self.proc.stdout.readline().decode(errors="replace").strip()
            if first == "ready":
                self.started = True
                self._ready.set()
            else:
                self.failure = first.removeprefix("error: ") or f"exited before it was ready: {self._log_tail()}"
            self.proc.stdout.read()  # EOF: the server is gone
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)
        finally:
            self.failure = self.failure or "the fork server exited"
            self._ended.set()
            self._ready.set()

    def _log_tail(self) -> str:
        try:
            self.proc.wait(timeout=5)
            text = (self.folder / "server.log").read_text(errors="replace").strip()
        except (OSError, subprocess.TimeoutExpired):
            text = ""
        return text.splitlines()[-1][-300:] if text else f"exit code {self.proc.returncode}"

    def wait_ready(self, timeout_s: float) -> None:
        """Return once the server takes requests; :class:`WarmStartError` if it did not start in time."""
        if not self._ready.wait(timeout_s):
            raise WarmStartError(f"the fork server was not ready within {timeout_s:.0f} s")
        if self.ended:
            raise WarmStartError(self.failure or "the fork server exited")

    def spawn(self, argv: list[str], env: Mapping[str, str], cwd: Path, log_fd: int) -> WarmProcess:
        """Fork a child running ``argv`` (``[python, SCRIPT, ARG...]``) in ``cwd`` with exactly ``env``,
        stdin from /dev/null and stdout/stderr on ``log_fd``."""
        body = json.dumps({"argv": argv, "env": dict(env), "cwd": str(cwd)}).encode()
        data = struct.pack(">I", len(body)) + body
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.settimeout(_REPLY_TIMEOUT_S)
            conn.connect(str(self.socket_path))
            sent = socket.send_fds(conn, [data], [log_fd])
            conn.sendall(data[sent:])
            buf = b""
            while b"\n" not in buf:
                chunk = conn.recv(4096)
                if not chunk:
                    raise WarmStartError(f"the fork server closed the connection ({self.failure or 'no reply'})")
                buf += chunk
            line, rest = buf.split(b"\n", 1)
            reply = json.loads(line)
            if "pid" not in reply:
                raise WarmStartError(f"the fork server refused the trial: {reply.get('error')}")
            return WarmProcess(conn, int(reply["pid"]), list(argv), rest)
        except (OSError, ValueError, WarmStartError) as exc:
            conn.close()
            if isinstance(exc, WarmStartError):
                raise
            raise WarmStartError(f"the fork server did not take the trial: {type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        """Stop the server (it kills every trial it still runs) and remove its folder."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()  # EOF: the server's signal to stop
        try:
            self.proc.wait(timeout=10 if self.started else 0)  # one still importing does not read its stdin
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        shutil.rmtree(self.folder, ignore_errors=True)


_servers: dict[ServerKey, ForkServer] = {}
_failed: dict[ServerKey, str] = {}
_mu = threading.Lock()


def server_for(python: str, modules: tuple[str, ...], env: Mapping[str, str], trial_dir: Path, marker_var: str,
               wait_s: float) -> ForkServer | None:
    """The ready fork server for a trial launched as ``python ...`` with ``env`` in ``trial_dir``, started
    on first use; None (the reason logged) when warm starts are unavailable, and the trial starts cold.

    ``marker_var`` is the run-marker variable (:data:`legorl.harnesses.processes.RUN_MARKER`): the
    server gets its own marker in it, and the trials' own markers do not split the servers."""
    key = ServerKey.of(python, modules, env, trial_dir, skip=marker_var)
    with _mu:
        if key in _failed:
            return None
        server = _servers.get(key)
        if server is None or server.ended or server.owner != os.getpid():
            try:
                server = _servers[key] = ForkServer(key, (marker_var, secrets.token_hex(8)))
            except OSError as exc:  # e.g. the interpreter is missing: the cold start will say so too
                _failed[key] = reason = f"{type(exc).__name__}: {exc}"
                log.warning("warm start of %s unavailable, its trials start cold: %s", python, reason)
                return None
    try:
        server.wait_ready(min(wait_s, max(0.0, START_LIMIT_S - (time.monotonic() - server.born))))
    except WarmStartError as exc:
        hung = not server.ended and time.monotonic() - server.born >= START_LIMIT_S
        if (server.ended and not server.started) or hung:  # it cannot start: trials of this kind start cold
            with _mu:
                if _servers.get(key) is server:
                    del _servers[key]
                    _failed[key] = str(exc)
            log.warning("warm start of %s unavailable, its trials start cold: %s", python, exc)
            server.close()
        else:  # still starting (a loaded machine) when the trial's time ran out: later trials wait for it again
            log.warning("warm start of %s: %s; this trial starts cold", python, exc)
        return None
    return server


def stop_servers() -> list[str]:
    """Stop every fork server of this process; their run markers (what they forked carries them)."""
    with _mu:
        servers = [server for server in _servers.values() if server.owner == os.getpid()]
        _servers.clear()
    for server in servers:
        server.close()
    return [server.marker for server in servers]


atexit.register(stop_servers)
