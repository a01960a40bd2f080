"""The one network endpoint of an in-container harness: its proxy session, through a unix socket.

Trial containers run with ``--network none``: no route out, no host loopback. For a harness that
runs inside the container, the rollout makes a :class:`ProxyChannel` — a short host folder holding
the relay script, mounted read-only at ``/legorl-proxy``, where the proxy then serves the trial's
session alone on ``proxy.sock`` (:meth:`legorl.proxy.server.ProxyServer.serve_session`). The
container's main process is the relay (``python3 -I``), which forwards each connection to the
container's own ``127.0.0.1:PORT`` to that socket; the harness is pointed at
``http://127.0.0.1:PORT/sess/<id>/v1``. If the agent kills the relay, its container stops: the
agent's doing, never infrastructure.

Host-run harnesses (mini-swe-agent, ``simple``) need no channel: they reach the proxy from the
host and exec their commands in the same no-network container.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from legorl.core.errors import LegorlError
from legorl.sandbox.base import Sandbox

RELAY = Path(__file__).with_name("_relay.py")
CONTAINER_DIR = "/legorl-proxy"
PORT = 4180  # on the container's own loopback
SOCKET_NAME = "proxy.sock"

_PROBE = """\
import sys, time, urllib.request
deadline = time.time() + float(sys.argv[2])
while True:
    try:
        urllib.request.urlopen(sys.argv[1], timeout=10).read()
        break
    except Exception as exc:
        if time.time() > deadline:
            sys.exit(f"{type(exc).__name__}: {exc}")
        time.sleep(0.05)
"""


@dataclass(frozen=True)
class ProxyChannel:
    host_dir: Path

    @classmethod
    def create(cls) -> ProxyChannel:
        """A fresh folder for one trial (short: a unix socket path holds at most 107 bytes)."""
        base = tempfile.gettempdir()
        host_dir = Path(tempfile.mkdtemp(prefix="legorl-proxy-", dir=base if len(base) <= 64 else "/tmp"))
        shutil.copy(RELAY, host_dir / "relay.py")
        return cls(host_dir)

    @property
    def socket_path(self) -> Path:
        """Where the proxy serves the session, on the host."""
        return self.host_dir / SOCKET_NAME

    @property
    def mount(self) -> tuple[str, str, bool]:
        return (str(self.host_dir), CONTAINER_DIR, True)

    @property
    def command(self) -> tuple[str, ...]:
        """The container's main process: the relay."""
        return ("python3", "-I", f"{CONTAINER_DIR}/relay.py", str(PORT), f"{CONTAINER_DIR}/{SOCKET_NAME}")

    @staticmethod
    def session_url(session_id: str) -> str:
        """The session's Anthropic base URL inside the container (the OpenAI one adds ``/v1``)."""
        return f"http://127.0.0.1:{PORT}/sess/{session_id}"

    def check(self, box: Sandbox, session_id: str, timeout_s: float = 20.0) -> None:
        """Raise unless the session answers through the relay (before the harness starts: a
        failure here is legorl's, e.g. an image without python3)."""
        url = self.session_url(session_id) + "/v1/models"
        res = box.exec(["python3", "-I", "-c", _PROBE, url, str(timeout_s)], timeout=timeout_s + 10)
        if res.exit_code != 0:
            raise LegorlError(f"the trial container cannot reach its proxy session: {res.output.strip()[-300:]}")

    def close(self) -> None:
        shutil.rmtree(self.host_dir, ignore_errors=True)
