"""What one proxy session may hold of what all sessions share: connections, event-loop time, memory.

A trial's agent is an adversary, and every session of a proxy shares its process (file
descriptors, memory) and its one event loop. :class:`ProxyLimits` is every such limit, in one
place; the host enforces them (the session socket, the app, the stop-string matcher), never the
agent. The defaults are generous: no real harness (mini-swe-agent, OpenHands, Claude Code, Codex,
OpenCode, Terminus) comes near them, and an honest call never fails on one.

Past a limit: a connection over the socket's cap is never accepted (it waits in the kernel's
backlog, holding no descriptor of ours, until one of the session's connections closes); a call
over a session's in-flight caps gets a 429, a request over a complexity cap a 400 naming the
parameter, each in the API's own error format.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any

from legorl.core.errors import ConfigError
from legorl.proxy.validate import BadRequest

MiB = 1 << 20


@dataclass(frozen=True)
class ProxyLimits:
    """Per-session limits of the proxy (each a positive number)."""

    max_connections: int = field(default=64, metadata={"help": (
        "Open connections on one session's socket; more wait unaccepted until one closes.")})
    idle_timeout_s: float = field(default=30.0, metadata={"help": (
        "Seconds a new connection on a session socket may take to send a request's headers before "
        "it is closed.")})
    max_inflight_calls: int = field(default=16, metadata={"help": (
        "Requests in flight per session (model calls and token counts); more get a 429.")})
    max_inflight_body_mb: int = field(default=64, metadata={"help": (
        "MiB of request bodies held by one session's requests in flight; past it a 429.")})
    # a million-token conversation is ~4 MB of JSON; what the host holds per session is these bodies
    max_body_mb: int = field(default=32, metadata={"help": "MiB of one request's body; past it a 413."})
    max_stop_strings: int = field(default=64, metadata={"help": "Stop strings of one call."})
    max_stop_chars: int = field(default=16384, metadata={"help": (
        "Characters of all of one call's stop strings together.")})
    max_tools: int = field(default=512, metadata={"help": "Tools of one call."})
    max_messages: int = field(default=20000, metadata={"help": (
        "Messages (Responses: input items) of one call.")})
    max_content_parts: int = field(default=50000, metadata={"help": (
        "Content parts and tool calls of all of one call's messages together.")})
    max_json_items: int = field(default=1_000_000, metadata={"help": (
        "JSON values of one request body, counted before it is parsed as its '{', '[' and ',' bytes "
        "(strings included: an upper bound); past it a 400.")})

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ConfigError(f"proxy limit {f.name}: must be a positive number (got {value!r})")

    @property
    def max_body_bytes(self) -> int:
        return self.max_body_mb * MiB

    @property
    def max_inflight_body_bytes(self) -> int:
        return self.max_inflight_body_mb * MiB


def too_many(message: str) -> BadRequest:
    return BadRequest(message, status=429, code="rate_limit_exceeded")


class SessionLoad:
    """Calls and body bytes in flight per session id. Used on one event loop only (no locking)."""

    def __init__(self, limits: ProxyLimits) -> None:
        self.limits = limits
        self.calls: dict[str, int] = {}
        self.body_bytes: dict[str, int] = {}

    @contextlib.contextmanager
    def call(self, session_id: str) -> Iterator[BodyMeter]:
        """One request of ``session_id`` in flight (its body bytes are counted by the meter
        yielded, until the request ends); a 429 when the session has its limit in flight already."""
        n = self.calls.get(session_id, 0)
        if n >= self.limits.max_inflight_calls:
            raise too_many(f"this session already has {n} requests in flight (the limit, max_inflight_calls): "
                           "retry when one has finished")
        self.calls[session_id] = n + 1
        meter = BodyMeter(self, session_id)
        try:
            yield meter
        finally:
            meter.release()
            left = self.calls[session_id] - 1
            if left:
                self.calls[session_id] = left
            else:
                del self.calls[session_id]


class BodyMeter:
    """The body bytes one request holds, charged to its session's in-flight total."""

    def __init__(self, load: SessionLoad, session_id: str) -> None:
        self._load = load
        self._sid = session_id
        self.held = 0

    def take(self, n: int) -> None:
        totals = self._load.body_bytes
        total = totals.get(self._sid, 0) + n
        cap = self._load.limits.max_inflight_body_bytes
        if total > cap:
            raise too_many(f"this session's requests in flight hold over {cap} bytes of request bodies "
                           "(max_inflight_body_mb): retry when one has finished")
        totals[self._sid] = total
        self.held += n

    def release(self) -> None:
        if not self.held:
            return
        totals = self._load.body_bytes
        left = totals.get(self._sid, 0) - self.held
        self.held = 0
        if left > 0:
            totals[self._sid] = left
        else:
            totals.pop(self._sid, None)


# -------------------------------------------------------------------------- request complexity


def check_items(raw: bytes, limits: ProxyLimits) -> None:
    """A 400 before parsing when ``raw`` may hold more JSON values than ``limits`` allow: parsed, a
    body of tiny values (``{},{},...``) costs ~25 times its size in Python objects, and the parse holds
    the GIL (a red team's 16 MB bodies of empty objects held every session's calls for 90 s)."""
    count = raw.count(b"{") + raw.count(b"[") + raw.count(b",")
    if count > limits.max_json_items:
        raise BadRequest(f"the body holds up to {count} JSON values, over the limit of {limits.max_json_items} "
                         "(max_json_items)")


def check_request(body: Any, limits: ProxyLimits, items_key: str = "messages", stop_key: str = "stop",
                  system_key: str | None = None) -> None:
    """A 400 naming the parameter when the (parsed JSON) body of a model call asks for more than
    ``limits`` allow; the keys are where the body's dialect keeps its conversation, stop strings and
    system prompt. Run before the front end reads the body, so that the work it does is bounded too;
    a body of the wrong shape is left to it."""
    if not isinstance(body, dict):
        return
    items = body.get(items_key)
    parts = 0
    if isinstance(items, list):
        if len(items) > limits.max_messages:
            raise BadRequest(f"{items_key}: {len(items)} items, over the limit of {limits.max_messages} "
                             "(max_messages)", items_key)
        parts = sum(_parts(m) for m in items)
    system = body.get(system_key) if system_key else None
    if isinstance(system, list):
        parts += len(system)
    if parts > limits.max_content_parts:
        raise BadRequest(f"{items_key}: {parts} content parts and tool calls, over the limit of "
                         f"{limits.max_content_parts} (max_content_parts)", items_key)
    tools = body.get("tools")
    if isinstance(tools, list) and len(tools) > limits.max_tools:
        raise BadRequest(f"tools: {len(tools)} tools, over the limit of {limits.max_tools} (max_tools)", "tools")
    stop = body.get(stop_key)
    if isinstance(stop, list):
        if len(stop) > limits.max_stop_strings:
            raise BadRequest(f"{stop_key}: {len(stop)} stop strings, over the limit of {limits.max_stop_strings} "
                             "(max_stop_strings)", stop_key)
        chars = sum(len(s) for s in stop if isinstance(s, str))
    else:
        chars = len(stop) if isinstance(stop, str) else 0
    if chars > limits.max_stop_chars:
        raise BadRequest(f"{stop_key}: {chars} characters of stop strings, over the limit of "
                         f"{limits.max_stop_chars} (max_stop_chars)", stop_key)


def _parts(message: Any) -> int:
    """Content parts (one level of nested ``content`` arrays too: tool results) and tool calls."""
    if not isinstance(message, dict):
        return 0
    n = 0
    content = message.get("content")
    if isinstance(content, list):
        n += len(content)
        for part in content:
            if isinstance(part, dict) and isinstance(inner := part.get("content"), list):
                n += len(inner)
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        n += len(calls)
    return n
