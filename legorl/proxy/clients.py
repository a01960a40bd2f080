"""The proxy as a rollout uses it: a :class:`ProxyHandle`, in this process or an external one.

Either way a session ends in the proxy's own :class:`~legorl.proxy.sessions.SessionCapture`: the
in-process handle hands over the server's object, the remote one rebuilds it from the JSON the
server's ``POST /sess/<id>/finish`` answers. A session the proxy does not know (any more) gives an
empty capture.
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from legorl.core.errors import LegorlError
from legorl.engines.base import Engine
from legorl.engines.watched import WatchedEngine
from legorl.proxy.budgets import Budgets
from legorl.proxy.limits import ProxyLimits
from legorl.proxy.sessions import SessionCapture

if TYPE_CHECKING:
    import httpx

    from legorl.proxy.session_socket import LoopThread, SessionForwarder


class Closable(Protocol):
    def close(self) -> None: ...


class ProxyHandle(Protocol):
    """The proxy as the rollout stage uses it: in-process, or an external ``legorl serve-proxy``."""

    model: str
    context_tokens: int | None
    limits: ProxyLimits  # what each session socket it serves may hold

    def new_session(self, budgets: Budgets, metadata: dict[str, Any]) -> tuple[str, str, str]:
        """A fresh session: (id, OpenAI base URL, Anthropic base URL), reachable from the host."""
        ...

    def serve_session(self, session_id: str, path: Path) -> Closable:
        """Serve the session alone on a new unix socket at ``path`` (an in-container trial's one endpoint)."""
        ...

    def finish(self, session_id: str) -> SessionCapture:
        """End the session: what it captured (empty when the proxy does not know the session)."""
        ...


def empty_capture(session_id: str) -> SessionCapture:
    """The capture of a session nothing is known of."""
    return SessionCapture(session_id, segments=[], calls=[], messages=[], budget_stop=None, created_at=time.time())


class InProcessProxy:
    """A :class:`~legorl.proxy.server.ProxyServer` on a loopback port of this process."""

    def __init__(self, engine: Engine, tokenizer: Any, temperature: float | None = None,
                 limits: ProxyLimits | None = None):
        """``temperature``, when given, is what every call samples at, whatever the harness asks."""
        from legorl.proxy.core import SamplingOverride
        from legorl.proxy.server import ProxyServer

        self.engine = WatchedEngine(engine)
        sampling = SamplingOverride.policy(temperature) if temperature is not None else None
        self.server = ProxyServer(self.engine, tokenizer, sampling=sampling, limits=limits)
        self.limits = self.server.limits
        self.model = engine.name
        self.context_tokens: int | None = engine.max_context

    def __enter__(self) -> InProcessProxy:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.close()

    def new_session(self, budgets: Budgets, metadata: dict[str, Any]) -> tuple[str, str, str]:
        sid = self.server.new_session(budgets, metadata)
        return sid, self.server.openai_base_url(sid), self.server.anthropic_base_url(sid)

    def serve_session(self, session_id: str, path: Path) -> Closable:
        return self.server.serve_session(session_id, path)

    def finish(self, session_id: str) -> SessionCapture:
        return self.server.finish(session_id) or empty_capture(session_id)


class RemoteProxy:
    """An external ``legorl serve-proxy`` at ``url``: sessions over its HTTP API. A session's unix
    socket is served here, in the rollout process, by a forwarder bound to that session
    (:class:`~legorl.proxy.session_socket.SessionForwarder`) that relays its model routes to the
    proxy's session URL over TCP."""

    def __init__(self, url: str, api_key: str | None = None, limits: ProxyLimits | None = None):
        """``limits``: what each session socket served here may hold (the proxy applies its own)."""
        import httpx

        self.url = url.rstrip("/")
        self.api_key = api_key
        self.limits = limits or ProxyLimits()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=self.url, headers=headers, timeout=60)
        self._loop: LoopThread | None = None  # serves the session sockets, started on first use
        self._forward: httpx.AsyncClient | None = None  # the forwarders' shared client (lives on that loop)
        self._forwarders: dict[str, SessionForwarder] = {}
        self._mu = threading.Lock()
        try:
            models = self.client.get("/v1/models").raise_for_status().json()["data"]
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            raise LegorlError(f"--proxy {url}: not a legorl proxy ({type(exc).__name__}: {exc})") from None
        self.model = str(models[0]["id"]) if models else "policy"
        self.context_tokens = models[0].get("max_model_len") if models else None

    def __enter__(self) -> RemoteProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.close()
        if self._loop is not None:
            import asyncio

            if self._forward is not None:
                with contextlib.suppress(Exception):
                    asyncio.run_coroutine_threadsafe(self._forward.aclose(), self._loop.loop).result(timeout=10)
            self._loop.close()
            self._loop = None

    def serve_session(self, session_id: str, path: Path) -> Closable:
        import httpx

        from legorl.proxy.session_socket import LoopThread, SessionForwarder, SessionSocket

        with self._mu:
            if self._loop is None:
                self._loop = LoopThread()
                self._forward = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0))
            assert self._forward is not None
            app = self._forwarders[session_id] = SessionForwarder(self.url, session_id, self._forward, self.api_key,
                                                                  self.limits)
            loop = self._loop.loop
        return SessionSocket(app, path, loop, limits=self.limits)

    def new_session(self, budgets: Budgets, metadata: dict[str, Any]) -> tuple[str, str, str]:
        body = {"budgets": {k: v for k, v in budgets.to_dict().items() if v is not None}, "metadata": metadata}
        data = self.client.post("/sessions", json=body).raise_for_status().json()
        sid = data["session_id"]
        return sid, f"{self.url}/sess/{sid}/v1", f"{self.url}/sess/{sid}"

    def finish(self, session_id: str) -> SessionCapture:
        with self._mu:
            forwarder = self._forwarders.pop(session_id, None)
        if forwarder is not None:
            forwarder.closed = True
        response = self.client.post(f"/sess/{session_id}/finish")
        if response.status_code == 404:
            return empty_capture(session_id)
        return SessionCapture.from_json(response.raise_for_status().json())
