"""``ProxyServer``: the proxy embedded in a Python process (the rollout stage starts one itself).

It serves on a loopback port in a background thread with its own event loop; the engine's
requests run on that loop. Everything else (creating sessions, reading captures) is safe to call
from any thread::

    with ProxyServer(engine, tokenizer_dir) as proxy:
        sid = proxy.new_session(Budgets(max_turns=30))
        client = openai.OpenAI(base_url=proxy.openai_base_url(sid), api_key="x")
        ...
        capture = proxy.finish(sid)   # SessionCapture: segments, calls, messages
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from legorl.core.errors import LegorlError
from legorl.engines.base import Engine
from legorl.proxy.app import ProxyApp
from legorl.proxy.budgets import Budgets
from legorl.proxy.core import ProxyCore, SamplingOverride
from legorl.proxy.limits import ProxyLimits
from legorl.proxy.render import ChatRenderer
from legorl.proxy.session_socket import SessionSocket
from legorl.proxy.sessions import SessionCapture
from legorl.proxy.toolparse import ToolParser, get_parser

log = logging.getLogger("legorl.proxy")


def load_tokenizer(path: str | Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        raise LegorlError(f"{path}: cannot load a tokenizer: {exc}") from None


class ProxyServer:
    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        budgets: Budgets | None = None,
        on_finish: Callable[[SessionCapture], None] | None = None,
        parser: str | ToolParser | None = None,
        auto_create: bool = True,
        sampling: SamplingOverride | None = None,
        single_session: bool = False,
        limits: ProxyLimits | None = None,
    ):
        if isinstance(tokenizer, str | Path):
            tokenizer = load_tokenizer(tokenizer)
        self.renderer = ChatRenderer(tokenizer)
        tool_parser = get_parser(parser) if isinstance(parser, str) else parser
        self.core = ProxyCore(engine, self.renderer, tool_parser, budgets, on_finish=on_finish, sampling=sampling)
        self.limits = limits or ProxyLimits()
        self.app = ProxyApp(self.core, api_key=api_key, auto_create=auto_create, single_session=single_session,
                            limits=self.limits)
        self.host = host
        self._port = port
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._server: Any = None
        self._error: BaseException | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 30.0) -> ProxyServer:
        import uvicorn

        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # proto=IPPROTO_TCP matters: asyncio only sets TCP_NODELAY on accepted sockets whose proto
        # says TCP, and without it every keep-alive response waits ~40 ms (Nagle x delayed ACK).
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.bind((self.host, self._port))
        except OSError as exc:
            sock.close()
            raise LegorlError(f"cannot listen on {self.host}:{self._port}: {exc.strerror}") from None
        sock.listen(1024)
        sock.setblocking(False)
        self._sock = sock
        self._port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off",
                                timeout_keep_alive=600)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, name="legorl-proxy", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if self._error is not None or not self._thread.is_alive():
                raise LegorlError(f"the proxy failed to start: {self._error}")
            if time.monotonic() > deadline:
                raise LegorlError("the proxy did not start within {timeout} s")
            time.sleep(0.005)
        return self

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self.loop = loop
        try:
            loop.run_until_complete(self._server.serve(sockets=[self._sock]))
        except BaseException as exc:  # reported by start()
            self._error = exc
        finally:
            loop.close()

    def close(self) -> list[SessionCapture]:
        """Stop serving; sessions still open are finished (and written when there is a run dir)."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        return self.core.finish_all()

    def __enter__(self) -> ProxyServer:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ addresses

    @property
    def port(self) -> int:
        return self._port

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self._port}"

    def session_url(self, session_id: str) -> str:
        """Anthropic clients take this as base URL (``ANTHROPIC_BASE_URL``)."""
        return f"{self.base_url}/sess/{session_id}"

    def openai_base_url(self, session_id: str) -> str:
        return self.session_url(session_id) + "/v1"

    def anthropic_base_url(self, session_id: str) -> str:
        return self.session_url(session_id)

    # ------------------------------------------------------------------ sessions

    def new_session(self, budgets: Budgets | None = None, metadata: dict[str, Any] | None = None) -> str:
        return self.core.new_session(budgets, metadata).id

    def serve_session(self, session_id: str, path: str | Path) -> SessionSocket:
        """Serve session ``session_id`` alone on a new unix socket at ``path`` (a trial's one
        endpoint: see :mod:`legorl.proxy.session_socket`); ``close()`` it when the trial is over."""
        if self.loop is None or self.core.get(session_id) is None:
            raise LegorlError(f"cannot serve session {session_id}: the proxy is not running or has no such session")
        return SessionSocket(self.app.bound_to(session_id), path, self.loop, limits=self.limits)

    def capture(self, session_id: str) -> SessionCapture:
        session = self.core.get(session_id)
        if session is None:
            raise LegorlError(f"unknown proxy session {session_id}")
        return session.capture()

    def finish(self, session_id: str) -> SessionCapture | None:
        """End a session: its capture (written as a shard with a run dir), or None if unknown."""
        return self.core.finish(session_id)
