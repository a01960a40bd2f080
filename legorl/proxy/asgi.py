"""The HTTP plumbing under the proxy's app and the trials' session sockets: ASGI types, routes, a
bounded request body, a JSON answer, and an error in the format of the API a path names."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from legorl.proxy.frontends import BY_ROUTE, COUNT_ROUTES, FrontEnd, errors_for
from legorl.proxy.limits import BodyMeter
from legorl.proxy.validate import SURROGATE_ESCAPE, BadRequest, without_lone_surrogates
from legorl.proxy.wire import dumps

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
MODEL_ROUTES = frozenset({*BY_ROUTE, *COUNT_ROUTES, "/v1/models", "/models"})


def session_route(path: str, session_id: str) -> str | None:
    """The model route ``path`` names under ``/sess/<session_id>``, or None: the whole of what a
    session-bound socket serves (no other session, no trajectory/finish, no admin routes)."""
    prefix = f"/sess/{session_id}"
    if path.startswith(prefix) and path[len(prefix):] in MODEL_ROUTES:
        return path[len(prefix):]
    return None


async def not_found(send: Send, path: str) -> None:
    """The 404 a session-bound socket answers for anything but its own session's model routes."""
    await send_api_error(send, errors_for(path), 404, "not found on this session's socket", code="not_found")


async def send_error(send: Send, path: str, exc: BadRequest) -> None:
    """``exc`` answered in the error format of the API ``path`` names."""
    await send_api_error(send, errors_for(path), exc.status, exc.message, exc.param, exc.code)


class Disconnected(Exception):
    """The client went away before its request body arrived."""


def split(path: str) -> tuple[str | None, str]:
    """``(session id, route)`` of ``/sess/<id>/<route>``; ``(None, path)`` of any other path."""
    if not path.startswith("/sess/"):
        return None, path
    session_id, _, rest = path[6:].partition("/")
    return session_id, "/" + rest


def require(method: str, expected: str) -> None:
    if method != expected:
        raise BadRequest(f"method {method} not allowed here (use {expected})", status=405, code="method_not_allowed")


def parse_json(raw: bytes) -> Any:
    """The body as JSON: strict UTF-8, and every string (keys too) made valid Unicode.

    JSON's ``\\uD800`` escapes can spell lone UTF-16 surrogates, which no UTF-8 writer accepts (a
    response echoing the model name, a capture holding a tool-call id, a shard): each one becomes
    U+FFFD here, before anything reads the body, as a lenient decoder would.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"the body is not UTF-8: {exc}") from None
    try:
        body = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise BadRequest(f"malformed JSON body: {exc}") from None
    return without_lone_surrogates(body) if SURROGATE_ESCAPE.search(text) else body


async def read_body(receive: Receive, limit: int, allow_empty: bool = False, meter: BodyMeter | None = None) -> bytes:
    """The request's body, at most ``limit`` bytes (a 413); each chunk is charged to ``meter`` (a
    session's bytes in flight: a 429 past its limit) before it is kept."""
    chunks: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise Disconnected()
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BadRequest(f"request body over {limit} bytes", status=413, code="request_too_large")
        if meter is not None:
            meter.take(len(chunk))
        chunks.append(chunk)
        if not msg.get("more_body", False):
            break
    raw = b"".join(chunks)
    if not raw and not allow_empty:
        raise BadRequest("empty request body: expected JSON")
    return raw


async def send_json(send: Send, status: int, data: Any) -> None:
    body = dumps(data)
    await send({"type": "http.response.start", "status": status,
                "headers": [*JSON_HEADERS, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def send_api_error(send: Send, fe: FrontEnd, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
    with contextlib.suppress(Exception):  # headers already sent or client gone
        await send_json(send, status, fe.error(status, message, param, code))
