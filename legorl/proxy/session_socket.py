"""A proxy session's own unix socket: the one network endpoint a trial container is given.

A trial runs with ``--network none``; its proxy session is served on a unix socket bind-mounted
into the container (a tiny relay inside forwards the container's own 127.0.0.1 to it). Whatever
is served on that socket is bound to the one session: only the session's model routes
(:func:`legorl.proxy.app.session_route`), nothing of other sessions, no admin routes.

- :class:`SessionSocket` serves an ASGI app on a unix socket, on an event loop another thread runs
  (the in-process proxy's own loop, or a :class:`LoopThread`).
- :class:`SessionForwarder` is that app for a proxy in another process (``legorl rollout --proxy
  URL``): it forwards the session's model routes to the proxy's session URL, streaming, and
  answers 404 to everything else.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from legorl.errors import LegorlError
from legorl.proxy.app import Disconnected, Receive, Scope, Send, not_found, read_body, session_route
from legorl.proxy.validate import BadRequest

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
    """``app`` served on a new unix socket at ``path`` by uvicorn, on ``loop`` (running elsewhere)."""

    def __init__(self, app: Any, path: str | Path, loop: asyncio.AbstractEventLoop, timeout: float = 30.0):
        import uvicorn

        self.path = Path(path)
        if len(os.fsencode(self.path)) >= 108:
            raise LegorlError(f"unix socket path too long (max 107 bytes): {self.path}")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(self.path))
            sock.listen(128)
        except OSError as exc:
            sock.close()
            raise LegorlError(f"cannot listen on {self.path}: {exc.strerror}") from None
        sock.setblocking(False)
        self._sock = sock
        config = uvicorn.Config(app, log_config=None, log_level="warning", access_log=False, lifespan="off",
                                timeout_keep_alive=600, timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        self._done: Future[None] = asyncio.run_coroutine_threadsafe(self._server.serve(sockets=[sock]), loop)
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if self._done.done() or time.monotonic() > deadline:
                self.close()
                raise LegorlError(f"the session socket {self.path} did not start")
            time.sleep(0.002)

    def close(self) -> None:
        """Stop serving (connections still open get a few seconds) and remove the socket file."""
        self._server.should_exit = True
        with contextlib.suppress(Exception):
            self._done.result(timeout=30)
        self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # unlink never follows a link someone put in its place

    def __enter__(self) -> SessionSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SessionForwarder:
    """ASGI: the session's model routes forwarded to ``upstream`` (``http://HOST:PORT``) through
    ``client`` (an ``httpx.AsyncClient`` used on the serving loop) with the proxy's API key,
    responses streamed back as they come; anything else is a 404 here, and so is everything once
    :attr:`closed` (the session is finished: a request must not re-create it upstream)."""

    def __init__(self, upstream: str, session_id: str, client: Any, api_key: str | None = None,
                 max_body_bytes: int = 64 << 20) -> None:
        self.upstream = upstream.rstrip("/")
        self.session_id = session_id
        self._client = client
        self.headers = [(b"authorization", f"Bearer {api_key}".encode())] if api_key else []
        self.max_body = max_body_bytes
        self.closed = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        import httpx

        if scope["type"] != "http":
            return
        path: str = scope["path"]
        if self.closed or session_route(path, self.session_id) is None:
            await not_found(send, path)
            return
        try:
            body = await read_body(receive, self.max_body, allow_empty=True)
        except (Disconnected, BadRequest):  # gone, or a body over the limit: nothing to forward
            return
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
