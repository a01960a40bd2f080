"""A private ``podman system service`` for the calls where the CLI's start-up cost dominates.

Each ``podman`` CLI call pays ~0.1–0.2 s of process start-up; through the REST API of a running
service an exec round-trip or a file copy costs a third of that (``benchmarks/sandbox.py``). The
backend therefore sends exec and file copies through this service and keeps the CLI for creating
and removing containers, where both cost the same.

One service per legorl process, on a private socket under the cache dir, started on first use
with legorl's containers.conf. A watchdog shell kills it when its owner exits — SIGKILL included —
so no service outlives legorl. If the service cannot be started (or podman-py is missing), callers
fall back to the CLI.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from legorl.sandbox.host import podman_env, podman_path

_WATCHDOG = 'podman="$1"; sock="$2"; owner="$3"; "$podman" system service --time=0 "unix://$sock" & svc=$!; ' \
            'while kill -0 "$owner" 2>/dev/null && kill -0 "$svc" 2>/dev/null; do sleep 1; done; ' \
            'kill "$svc" 2>/dev/null; wait "$svc"; rm -rf "$(dirname "$sock")"'


class Service:
    """The running service and a podman-py client per thread (requests sessions are not shared)."""

    def __init__(self, socket_path: Path, process: subprocess.Popen[bytes], tmpdir: str) -> None:
        self.socket_path = socket_path
        self.process = process
        self._tmpdir = tmpdir
        self._local = threading.local()

    def client(self) -> Any:
        client = getattr(self._local, "client", None)
        if client is None:
            from podman import PodmanClient

            client = PodmanClient(base_url=f"unix://{self.socket_path}")
            self._local.client = client
        return client

    def container(self, name: str) -> Any:
        """A podman-py Container for ``name`` without an inspect round-trip."""
        return self.client().containers.prepare_model(attrs={"Id": name, "Name": name})

    def alive(self) -> bool:
        return self.process.poll() is None and self.socket_path.exists()

    def stop(self) -> None:
        """Stop the watchdog and the service together (they share a process group)."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
        shutil.rmtree(self._tmpdir, ignore_errors=True)


_service: Service | None = None
_failed = False
_lock = threading.Lock()


def _start(timeout_s: float = 20.0) -> Service:
    from podman import PodmanClient  # ImportError: no podman-py, the caller falls back to the CLI

    tmpdir = tempfile.mkdtemp(prefix="podman-api-")
    sock = Path(tmpdir) / "podman.sock"
    proc = subprocess.Popen(["sh", "-c", _WATCHDOG, "sh", podman_path(), str(sock), str(os.getpid())],
                            env=podman_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # a Ctrl-C in the terminal must not kill it first
    deadline = time.monotonic() + timeout_s
    with PodmanClient(base_url=f"unix://{sock}") as probe:
        while True:
            if sock.exists():
                try:
                    if probe.ping():
                        break
                except Exception:
                    pass
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("podman system service did not start")
            time.sleep(0.02)
    service = Service(sock, proc, tmpdir)
    import atexit

    atexit.register(service.stop)
    return service


def get_service() -> Service | None:
    """The process's service, started on first use; None if it cannot run here (use the CLI)."""
    global _service, _failed
    with _lock:
        if _service is not None and _service.alive():
            return _service
        if _failed:
            return None
        try:
            _service = _start()
        except (ImportError, RuntimeError, OSError):
            _failed = True
            _service = None
        return _service
