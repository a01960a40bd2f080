"""A proxy session's own unix socket: the one network endpoint a trial container is given.

A trial runs with ``--network none``; its proxy session is served on a unix socket bind-mounted
into the container (a tiny relay inside forwards the container's own 127.0.0.1 to it). Whatever
is served on that socket is bound to the one session: only the session's model routes
(:func:`legorl.proxy.app.session_route`), nothing of other sessions, no admin routes. What one
socket may hold (connections, requests in flight, their bodies) is capped by
:class:`~legorl.proxy.limits.ProxyLimits`.

- :class:`SessionSocket` serves an ASGI app on a unix socket, on an event loop another thread runs
  (the in-process proxy's own loop, or a :class:`LoopThread`).
- :class:`SessionForwarder` is that app for a proxy in another process (``legorl rollout --proxy
  URL``): it forwards the session's model routes to the proxy's session URL, streaming, and
  answers 404 to everything else.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from legorl.core.errors import LegorlError
from legorl.proxy.asgi import (
    Disconnected,
    Receive,
    Scope,
    Send,
    not_found,
    read_body,
    send_error,
    session_route,
)
from legorl.proxy.limits import ProxyLimits, SessionLoad
from legorl.proxy.validate import BadRequest

log = logging.getLogger("legorl.proxy")

_HOP_BY_HOP = {b"host", b"content-length", b"connection", b"keep-alive", b"transfer-encoding", b"upgrade",
               b"te", b"trailer", b"proxy-authorization", b"authorization", b"x-api-key"}


class LoopThread:
    """An asyncio event loop running in a daemon thread (for serving sockets off the main thread)."""

    def __init__(self, name: str = "legorl-session-sockets") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self.loop.close()


class SessionSocket:
    """``app`` served on a new unix socket at ``path`` by uvicorn, on ``loop`` (running elsewhere).

    Whatever connects is the trial's agent, so the socket holds at most ``limits.max_connections``
    connections: at the cap it stops accepting (the kernel's backlog holds the rest, and refuses
    connections past it; none holds a descriptor of this process) until one closes. A connection
    that has not sent a request's headers ``limits.idle_timeout_s`` after it was accepted is closed.
    The accepting is ours (uvicorn is given no socket); uvicorn runs the connections.
    """

    def __init__(self, app: Any, path: str | Path, loop: asyncio.AbstractEventLoop, timeout: float = 30.0,
                 limits: ProxyLimits | None = None):
        import uvicorn

        self.path = Path(path)
        self.limits = limits or ProxyLimits()
        if len(os.fsencode(self.path)) >= 108:
            raise LegorlError(f"unix socket path too long (max 107 bytes): {self.path}")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(self.path))
            sock.listen(min(128, self.limits.max_connections))
        except OSError as exc:
            sock.close()
            raise LegorlError(f"cannot listen on {self.path}: {exc.strerror}") from None
        sock.setblocking(False)
        self._sock = sock
        self._loop = loop
        self.connections = 0  # accepted and not yet closed (read on the loop)
        self._accepting = False
        self._closed = False
        config = uvicorn.Config(app, log_config=None, log_level="warning", access_log=False, lifespan="off",
                                timeout_keep_alive=600, timeout_graceful_shutdown=5,
                                # no WebSocket protocol: an upgrade would hand the connection to one
                                # that never counts it out (the bound apps answer only http anyway)
                                http=_capped_protocol(self), ws="none")
        self._server = uvicorn.Server(config)
        self._done: Future[None] = asyncio.run_coroutine_threadsafe(self._server.serve(sockets=[]), loop)
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if self._done.done() or time.monotonic() > deadline:
                self.close()
                raise LegorlError(f"the session socket {self.path} did not start")
            time.sleep(0.002)
        asyncio.run_coroutine_threadsafe(self._start_accepting(), loop).result(timeout)

    async def _start_accepting(self) -> None:
        self._resume()

    def _resume(self) -> None:
        if not self._accepting and not self._closed:
            self._loop.add_reader(self._sock.fileno(), self._accept)
            self._accepting = True

    def _pause(self) -> None:
        if self._accepting:
            self._loop.remove_reader(self._sock.fileno())
            self._accepting = False

    def _accept(self) -> None:
        while self.connections < self.limits.max_connections:
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors or memory: try again in a while, never spin
                log.warning("session socket %s: accept failed: %s", self.path, exc)
                self._pause()
                self._loop.call_later(1.0, self._resume)
                return
            conn.setblocking(False)
            self.connections += 1
            self._loop.create_task(self._connect(conn))
        self._pause()

    async def _connect(self, conn: socket.socket) -> None:
        server = self._server
        config = server.config

        def protocol() -> asyncio.Protocol:
            return config.http_protocol_class(config=config, server_state=server.server_state,  # type: ignore[call-arg]
                                              app_state=server.lifespan.state)

        try:
            await self._loop.connect_accepted_socket(protocol, conn)
        except Exception:  # never got a protocol: connection_lost will not count it out
            conn.close()
            self.connection_closed()

    def connection_closed(self) -> None:
        self.connections -= 1
        if self.connections < self.limits.max_connections:
            self._resume()

    def _stop_accepting(self) -> None:
        self._pause()
        self._closed = True

    def close(self) -> None:
        """Stop serving (connections still open get a few seconds) and remove the socket file. Never
        raises and never waits long: a loop kept busy by what the trial sent is no error of ours (a
        red team's parse flood made this time out, and the trial infrastructure); the listening
        socket is then closed on the loop, once it gets there (its descriptor must not be reused
        while the loop still watches it)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # no new connection by name; unlink never follows a planted link
        try:
            stopped = asyncio.run_coroutine_threadsafe(_call(self._stop_accepting), self._loop)
        except RuntimeError:  # the loop is closed already: nothing watches the socket
            self._sock.close()
            return
        self._server.should_exit = True
        with contextlib.suppress(Exception):
            stopped.result(timeout=30)
            self._done.result(timeout=30)
        try:
            self._loop.call_soon_threadsafe(self._sock.close)
        except RuntimeError:  # the loop closed meanwhile
            self._sock.close()

    def __enter__(self) -> SessionSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _call(fn: Any) -> None:
    fn()


def _capped_protocol(owner: SessionSocket) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol, counting its connection out of ``owner`` when it closes, and closing
    it when no request's headers have come ``owner.limits.idle_timeout_s`` after it was accepted."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    base: Any = AutoHTTPProtocol
    idle_s = owner.limits.idle_timeout_s

    class Capped(base):
        _idle: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            self._idle = self.loop.call_later(idle_s, self._idle_close)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._idle is not None and self.cycle is not None:  # a request's headers are in
                self._idle.cancel()
                self._idle = None

        def connection_lost(self, exc: Exception | None) -> None:
            if self._idle is not None:
                self._idle.cancel()
                self._idle = None
            try:
                super().connection_lost(exc)
            finally:
                owner.connection_closed()

        def _idle_close(self) -> None:
            self._idle = None
            if not self.transport.is_closing():
                self.transport.close()

    return Capped


class SessionForwarder:
    """ASGI: the session's model routes forwarded to ``upstream`` (``http://HOST:PORT``) through
    ``client`` (an ``httpx.AsyncClient`` used on the serving loop) with the proxy's API key,
    responses streamed back as they come; anything else is a 404 here, and so is everything once
    :attr:`closed` (the session is finished: a request must not re-create it upstream)."""

    def __init__(self, upstream: str, session_id: str, client: Any, api_key: str | None = None,
                 limits: ProxyLimits | None = None) -> None:
        self.upstream = upstream.rstrip("/")
        self.session_id = session_id
        self._client = client
        self.headers = [(b"authorization", f"Bearer {api_key}".encode())] if api_key else []
        self.limits = limits or ProxyLimits()
        self._load = SessionLoad(self.limits)
        self.closed = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path: str = scope["path"]
        if self.closed or session_route(path, self.session_id) is None:
            await not_found(send, path)
            return
        # What this process holds per session is bounded here; the proxy upstream checks the
        # requests themselves (and its own in-flight limits) as for any session.
        try:
            with self._load.call(self.session_id) as meter:
                body = await read_body(receive, self.limits.max_body_bytes, allow_empty=True, meter=meter)
                await self._forward(scope, send, path, body)
        except Disconnected:
            pass
        except BadRequest as exc:
            await send_error(send, path, exc)

    async def _forward(self, scope: Scope, send: Send, path: str, body: bytes) -> None:
        import httpx

        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() not in _HOP_BY_HOP] + self.headers
        query = scope.get("query_string", b"").decode("latin-1")
        url = self.upstream + path + (f"?{query}" if query else "")
        try:
            req = self._client.build_request(scope["method"], url, headers=headers, content=body)
            resp = await self._client.send(req, stream=True)
        except httpx.HTTPError as exc:
            await send({"type": "http.response.start", "status": 502,
                        "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": f"proxy unreachable: {exc}".encode()})
            return
        try:
            out = [(k, v) for k, v in resp.headers.raw if k.lower() not in _HOP_BY_HOP]
            await send({"type": "http.response.start", "status": resp.status_code, "headers": out})
            async for chunk in resp.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except (httpx.HTTPError, OSError):
            pass  # either side went away mid-stream; nothing more to tell anyone
        finally:
            await resp.aclose()

