"""The proxy's HTTP surface: a plain ASGI app (no framework routing: the hot path is a couple of
string checks, JSON in, JSON or SSE out).

Routes (``<id>`` is a session id; ``?beta=true`` and other query strings are ignored):

- ``POST /sess/<id>/v1/chat/completions`` — OpenAI chat completions (also ``/sess/<id>/chat/completions``)
- ``POST /sess/<id>/v1/responses`` — OpenAI Responses, stateless (also ``/sess/<id>/responses``)
- ``POST /sess/<id>/v1/messages`` — Anthropic messages; ``POST /sess/<id>/v1/messages/count_tokens``
- ``GET /v1/models``, ``GET /sess/<id>/v1/models`` — the served model (OpenAI + Anthropic fields)
- ``GET /health``
- ``POST /sessions`` — create a session: body ``{"budgets": {...}, "metadata": {...}}`` (both
  optional; a budget not given keeps the server's default); returns its id and base URLs
- ``GET /sess/<id>/trajectory`` — the captured segments, calls and conversation as JSON
- ``POST /sess/<id>/finish`` (or ``DELETE /sess/<id>``) — end the session: its capture is returned,
  written as a shard when the proxy has a run directory, and dropped from memory
- ``POST /v1/chat/completions``, ``POST /v1/responses``, ``POST /v1/messages`` (no session in the
  URL) — a 404 saying to use ``/sess/<id>``, unless the app serves a single session (``single_session=True``,
  ``serve-proxy --single-session``): then they are the ``default`` session. Otherwise every client
  given a bare base URL would share (and read, and extend) one capture.

Unknown session ids on the model routes create a session with the default budgets (harnesses
cannot create sessions themselves; a per-trial URL is all they are given). ``/trajectory`` and
``/finish`` of an unknown id are 404. With an API key, every route but ``/health`` needs it as
``Authorization: Bearer`` or ``x-api-key``.

:meth:`ProxyApp.bound_to` is the app a trial's own socket serves (:mod:`legorl.proxy.session_socket`):
only ``/sess/<that id>`` + a model route (:func:`session_route`), only while that session exists
(never created by a request), without the API key (the socket is the credential); everything
else is a 404 there.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import re
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from legorl.core.errors import LegorlError
from legorl.proxy.asgi import (
    SSE_HEADERS,
    Disconnected,
    Receive,
    Scope,
    Send,
    not_found,
    parse_json,
    read_body,
    require,
    send_api_error,
    send_json,
    session_route,
    split,
)
from legorl.proxy.budgets import Budgets
from legorl.proxy.core import (
    Api,
    CallResult,
    ChatRequest,
    ContextOverflow,
    ProxyCore,
    Started,
    TextDelta,
    cannot_fit,
)
from legorl.proxy.frontends import BY_ROUTE, COUNT_ROUTES, FRONT_ENDS, FrontEnd, errors_for
from legorl.proxy.limits import ProxyLimits, SessionLoad, check_items, check_request
from legorl.proxy.sessions import Session
from legorl.proxy.validate import BadRequest

log = logging.getLogger("legorl.proxy")

_SESSION_ID = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")
class ProxyApp:
    def __init__(self, core: ProxyCore, api_key: str | None = None, auto_create: bool = True,
                 single_session: bool = False, limits: ProxyLimits | None = None):
        self.core = core
        self.api_key = api_key
        self.auto_create = auto_create
        self.single_session = single_session
        self.limits = limits or ProxyLimits()
        self.max_body = self.limits.max_body_bytes
        self.load = SessionLoad(self.limits)  # what each session has in flight
        # Bodies are parsed off the event loop, two at a time whatever the number of sessions: a
        # parse holds the GIL and its objects, so more at once buy no speed, only memory.
        self._parser = ThreadPoolExecutor(max_workers=2, thread_name_prefix="legorl-parse")

    def bound_to(self, session_id: str) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
        """The app a socket bound to ``session_id`` serves (see the module docstring)."""

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                return
            if session_route(scope["path"], session_id) is None or self.core.get(session_id) is None:
                await not_found(send, scope["path"])
                return
            await self.__call__(scope, receive, send, bound=session_id)

        return app

    async def __call__(self, scope: Scope, receive: Receive, send: Send, bound: str | None = None) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path: str = scope["path"]
        method: str = scope["method"]
        fe = BY_ROUTE.get(split(path)[1]) or errors_for(path)  # who answers its errors
        try:
            await self._route(scope, receive, send, path, method, bound)
        except BadRequest as exc:
            await send_api_error(send, fe, exc.status, exc.message, exc.param, exc.code)
        except ContextOverflow as exc:
            over = fe.overflow(str(exc))
            await send_api_error(send, fe, over.status, over.message, over.param, over.code)
        except Disconnected:
            pass
        except Exception as exc:  # a bug or an engine failure: a server error, logged, never a hang
            log.exception("proxy request %s %s failed", method, path)
            await send_api_error(send, fe, 500, f"internal error: {type(exc).__name__}: {exc}")

    # ------------------------------------------------------------------ routing

    async def _route(self, scope: Scope, receive: Receive, send: Send, path: str, method: str,
                     bound: str | None) -> None:
        if path == "/health":
            await send_json(send, 200, {"status": "ok", "model": self.core.engine.name,
                                    "sessions": len(self.core.sessions), **self.core.engine_status()})
            return
        if bound is None:
            self._check_key(scope)
        session_id, sub = split(path)
        if session_id is not None and not _SESSION_ID.match(session_id):
            raise BadRequest("malformed session id in the URL", status=404, code="not_found")
        if sub in ("/v1/models", "/models"):
            require(method, "GET")
            await send_json(send, 200, self._models())
            return
        if session_id is None and sub == "/sessions":
            require(method, "POST")
            await self._create_session(scope, await read_body(receive, self.max_body, allow_empty=True), send)
            return
        fe = BY_ROUTE.get(sub)
        if fe is not None:
            require(method, "POST")
            if session_id is None and not self.single_session:
                raise BadRequest(
                    f"{path} names no session: use the base URL /sess/<id>/v1 (OpenAI) or /sess/<id> "
                    "(Anthropic), with an id from POST /sessions", status=404, code="not_found")
            create = bound is None and (self.auto_create or session_id is None)
            session = self._session(session_id or "default", create=create)
            with self.load.call(session.id) as meter:
                req, opts = await self._parse(await read_body(receive, self.max_body, meter=meter), fe)
                await self._chat(send, session, req, opts, fe)
            return
        if sub in COUNT_ROUTES:
            require(method, "POST")
            with self.load.call(session_id or "default") as meter:
                req, _ = await self._parse(await read_body(receive, self.max_body, meter=meter),
                                           FRONT_ENDS[Api.MESSAGES])
                counted = self.core.get(session_id or "default")
                # one count at a time per session, as its calls go: the renders share one thread pool
                async with counted.lock if counted is not None else contextlib.nullcontext():
                    tokens = await asyncio.to_thread(self._count, req)  # CPU work
                await send_json(send, 200, {"input_tokens": tokens})
            return
        if session_id is not None and (sub == "/trajectory" or sub == "/"):
            if sub == "/" and method == "DELETE":
                await self._finish(send, session_id)
                return
            require(method, "GET")
            found = self.core.get(session_id)
            if found is None:
                raise BadRequest(f"unknown session {session_id}", status=404, code="not_found")
            await send_json(send, 200, found.capture().to_json())
            return
        if session_id is not None and sub == "/finish":
            require(method, "POST")
            await self._finish(send, session_id)
            return
        raise BadRequest(f"no route {method} {path}", status=404, code="not_found")

    def _check_key(self, scope: Scope) -> None:
        if not self.api_key:
            return
        given = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization" and value.lower().startswith(b"bearer "):
                given = value[7:].strip()
            elif name == b"x-api-key":
                given = value.strip()
        if not hmac.compare_digest(given, self.api_key.encode()):
            raise BadRequest("invalid API key", status=401, code="invalid_api_key")

    def _session(self, session_id: str, create: bool) -> Session:
        session = self.core.get(session_id, create=create)
        if session is None:
            raise BadRequest(f"unknown session {session_id}", status=404, code="not_found")
        return session

    def _models(self) -> dict[str, Any]:
        name = self.core.engine.name
        entry = {"id": name, "object": "model", "created": 0, "owned_by": "legorl", "type": "model",
                 "display_name": name, "created_at": "1970-01-01T00:00:00Z",
                 "max_model_len": self.core.engine.max_context}
        return {"object": "list", "data": [entry], "has_more": False, "first_id": name, "last_id": name}

    def _count(self, req: ChatRequest) -> int:
        ctx = self.core.engine.max_context
        if cannot_fit(req, ctx):  # not worth rendering
            raise ContextOverflow(f"the request has {req.body_bytes} bytes; the context holds {ctx} tokens")
        try:
            text = self.core.renderer.render_marked(req.messages, req.tools, add_generation_prompt=True)
        except Exception as exc:
            raise BadRequest(f"the chat template cannot render these messages: {exc}", "messages") from None
        return len(self.core.renderer.encode(text))

    async def _create_session(self, scope: Scope, raw: bytes, send: Send) -> None:
        body = parse_json(raw) if raw.strip() else {}
        if not isinstance(body, dict):
            raise BadRequest("body: expected an object")
        try:
            budgets = Budgets.from_dict(body.get("budgets"), base=self.core.default_budgets)
        except LegorlError as exc:
            raise BadRequest(str(exc), "budgets") from None
        metadata = body.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            raise BadRequest("metadata: expected an object", "metadata")
        session = self.core.new_session(budgets, metadata)
        host = "localhost"
        for name, value in scope.get("headers", []):
            if name == b"host":
                host = value.decode("latin-1")
        base = f"http://{host}/sess/{session.id}"
        await send_json(send, 200, {"session_id": session.id, "base_url": base, "openai_base_url": base + "/v1",
                                "anthropic_base_url": base, "budgets": session.budgets.to_dict()})

    async def _finish(self, send: Send, session_id: str) -> None:
        capture = self.core.finish(session_id)
        if capture is None:
            raise BadRequest(f"unknown session {session_id}", status=404, code="not_found")
        await send_json(send, 200, capture.to_json())

    # ------------------------------------------------------------------ model calls

    async def _parse(self, raw: bytes, fe: FrontEnd) -> tuple[ChatRequest, Any]:
        """A model call's body read by its front end, off the event loop; the parsed JSON is dropped
        once read, so a call in flight holds its request, not what else its body carried."""
        check_items(raw, self.limits)
        return await asyncio.get_running_loop().run_in_executor(self._parser, self._read_request, raw, fe)

    def _read_request(self, raw: bytes, fe: FrontEnd) -> tuple[ChatRequest, Any]:
        body = parse_json(raw)
        check_request(body, self.limits, fe.items_key, fe.stop_key, fe.system_key)
        read: tuple[ChatRequest, Any]
        try:
            read = fe.parse(body, self.core.engine.name)
        except BadRequest:
            raise
        except Exception as exc:  # input the validators did not foresee is still bad input
            raise BadRequest(f"invalid request: {type(exc).__name__}: {exc}") from None
        read[0].body_bytes = len(raw)
        return read

    async def _chat(self, send: Send, session: Session, req: ChatRequest, opts: Any, fe: FrontEnd) -> None:
        """One model call; ``fe`` shapes the reply."""
        try:
            await self._respond(send, session, req, fe, opts)
        finally:
            asyncio.get_running_loop().call_soon(_prepare, session)

    async def _respond(self, send: Send, session: Session, req: ChatRequest, fe: FrontEnd, opts: Any) -> None:
        renderer = self.core.renderer
        events = self.core.call(session, req)
        if not req.stream:
            await send_json(send, 200, fe.respond(await _consume(events), opts, renderer))
            return
        stream = fe.stream(opts, renderer)
        started = False
        alive = True
        streamed = ""

        async def emit(data: bytes) -> None:
            nonlocal alive
            if not alive or not data:
                return
            try:
                await send({"type": "http.response.body", "body": data, "more_body": True})
            except Exception:  # the client went away: finish the call anyway so it is captured
                alive = False

        try:
            async for ev in events:
                if not started:
                    started = True
                    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
                    await emit(stream.start(ev.prompt_tokens if isinstance(ev, Started) else 0))
                if isinstance(ev, TextDelta):
                    streamed += ev.text
                    await emit(stream.text(ev.text))
                elif isinstance(ev, CallResult):
                    await emit(stream.end(ev, streamed))
        except Exception as exc:
            if not started:
                raise
            log.exception("streamed call failed in session %s", session.id)
            await emit(stream.failed(str(exc)))
        if alive:
            with contextlib.suppress(Exception):
                await send({"type": "http.response.body", "body": b"", "more_body": False})


def _prepare(session: Session) -> None:
    if not session.lock.locked():  # a request in flight renders for itself
        try:
            session.prepare()
        except Exception:  # the next request will meet (and report) the same problem
            log.exception("session %s: rendering ahead failed", session.id)


async def _consume(events: Any) -> CallResult:
    result: CallResult | None = None
    async for ev in events:
        if isinstance(ev, CallResult):
            result = ev
    assert result is not None
    return result


