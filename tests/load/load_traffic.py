"""Client traffic for the load suite: one session's conversation in one of five client styles, and a
record of every HTTP response the clients saw (status, latency).

Every session plants its own nonce in the prompt (and, with the scripted engine, in the replies it
asks for), so a capture holding any other session's nonce is cross-talk.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import anthropic
import httpx2
import openai
from proxy_support import ANTHROPIC_TOOLS, TOOLS, call_bash, say

from legorl.proxy.server import ProxyServer

#: The client styles, cycled over sessions: the four official-client ways a harness talks, and a
#: client that drops its stream after the first event and retries the request (as harnesses do).
KINDS = ("openai", "openai-stream", "anthropic", "anthropic-stream", "disconnect")
NONCE = re.compile(r"N\d{4}x[0-9a-f]{12}")


def new_nonce(index: int) -> str:
    return f"N{index % 10000:04d}x{secrets.token_hex(6)}"


@dataclass
class Traffic:
    """Every response the clients got (by status) and each model call's client-side latency."""

    statuses: Counter[int] = field(default_factory=Counter)
    latencies_s: list[float] = field(default_factory=list)
    disconnects: int = 0

    async def on_response(self, response: httpx2.Response) -> None:
        self.statuses[response.status_code] += 1

    @property
    def requests(self) -> int:
        return sum(self.statuses.values())

    @property
    def server_errors(self) -> int:
        return sum(n for status, n in self.statuses.items() if status >= 500)

    def percentile_ms(self, q: float) -> float:
        ordered = sorted(self.latencies_s)
        if not ordered:
            return 0.0
        return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)


def shared_client(traffic: Traffic) -> httpx2.AsyncClient:
    """One connection pool for all sessions' official clients (as one harness process would have)."""
    return httpx2.AsyncClient(timeout=300, event_hooks={"response": [traffic.on_response]},
                             limits=httpx2.Limits(max_connections=512, max_keepalive_connections=256))


@dataclass
class Prompts:
    first: str
    after: str
    expected_command: str
    expected_reply: str
    max_tokens: int = 128  # the scripted tool call is 50-80 tokens (hex nonces vary)


def prompts(nonce: str, max_tokens: int = 128) -> Prompts:
    """The session's prompts: the scripted engine answers the first with a tool call, the tool result
    (or user message) after it with a text reply; both name the nonce."""
    command = f"grep -n {nonce} ."
    reply = f"Fixed {nonce}."
    return Prompts(first=f"Session {nonce}: fix the issue. " + call_bash(command, f"Looking at {nonce}."),
                   after=f"result for {nonce} " + say(reply), expected_command=command, expected_reply=reply,
                   max_tokens=max_tokens)


async def _timed(traffic: Traffic, make: Any) -> Any:
    t0 = time.perf_counter()
    out = await make()
    traffic.latencies_s.append(time.perf_counter() - t0)
    return out


async def _openai_turn(oc: openai.AsyncOpenAI, traffic: Traffic, msgs: list[dict[str, Any]], max_tokens: int,
                       stream: bool, tools: bool) -> dict[str, Any]:
    kw: dict[str, Any] = {"tools": TOOLS} if tools else {}
    if not stream:
        r = await _timed(traffic, lambda: oc.chat.completions.create(
            model="m", messages=msgs, max_tokens=max_tokens, seed=len(msgs), **kw))
        return dict(r.choices[0].message.model_dump(exclude_none=True))

    async def consume() -> dict[str, Any]:
        parts, calls = [], []
        async for c in await oc.chat.completions.create(model="m", messages=msgs, max_tokens=max_tokens,
                                                        seed=len(msgs), stream=True, **kw):
            if c.choices and c.choices[0].delta.content:
                parts.append(c.choices[0].delta.content)
            if c.choices and c.choices[0].delta.tool_calls:
                calls += [tc.model_dump(exclude_none=True) for tc in c.choices[0].delta.tool_calls]
        reply: dict[str, Any] = {"role": "assistant", "content": "".join(parts)}
        if calls:
            reply["tool_calls"] = [{k: v for k, v in tc.items() if k != "index"} for tc in calls]
        return reply

    return dict(await _timed(traffic, consume))


async def _openai_session(proxy: ProxyServer, http: httpx2.AsyncClient, traffic: Traffic, sid: str, p: Prompts,
                          stream: bool, tools: bool) -> None:
    oc = openai.AsyncOpenAI(base_url=proxy.openai_base_url(sid), api_key="x", max_retries=0, http_client=http)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "agent"}, {"role": "user", "content": p.first}]
    for _ in range(2):
        reply = await _openai_turn(oc, traffic, msgs, p.max_tokens, stream, tools)
        msgs.append(reply)
        if reply.get("tool_calls"):
            msgs.append({"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": p.after})
        else:
            msgs.append({"role": "user", "content": p.after})


async def _anthropic_session(proxy: ProxyServer, http: httpx2.AsyncClient, traffic: Traffic, sid: str, p: Prompts,
                             stream: bool, tools: bool) -> None:
    ac = anthropic.AsyncAnthropic(base_url=proxy.anthropic_base_url(sid), api_key="x", max_retries=0,
                                  http_client=http)
    msgs: list[dict[str, Any]] = [{"role": "user", "content": p.first}]
    kw: dict[str, Any] = {"tools": ANTHROPIC_TOOLS} if tools else {}
    for _ in range(2):
        async def call() -> Any:
            if not stream:
                return await ac.messages.create(model="m", system="agent", messages=msgs, max_tokens=p.max_tokens, **kw)
            async with ac.messages.stream(model="m", system="agent", messages=msgs, max_tokens=p.max_tokens, **kw) as s:
                return await s.get_final_message()

        m = await _timed(traffic, call)
        msgs.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]})
        uses = [b for b in m.content if b.type == "tool_use"]
        if uses:
            msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                       "content": p.after}]})
        else:
            msgs.append({"role": "user", "content": p.after})


async def _disconnecting_session(proxy: ProxyServer, http: httpx2.AsyncClient, traffic: Traffic, sid: str,
                                 p: Prompts, tools: bool) -> None:
    """Streams the first request, hangs up after the first event, then does what a harness does: sends
    the same request again (not streamed) and goes on with the conversation."""
    body = {"model": "m", "max_tokens": p.max_tokens, "stream": True,
            "messages": [{"role": "system", "content": "agent"}, {"role": "user", "content": p.first}]}
    if tools:
        body["tools"] = TOOLS
    async with http.stream("POST", proxy.openai_base_url(sid) + "/chat/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data:"):
                break
    traffic.disconnects += 1
    await _openai_session(proxy, http, traffic, sid, p, stream=False, tools=tools)


async def run_session(proxy: ProxyServer, http: httpx2.AsyncClient, traffic: Traffic, sid: str, nonce: str,
                      kind: str, tools: bool, max_tokens: int) -> None:
    """Session ``sid``'s whole conversation in client style ``kind`` (one of :data:`KINDS`)."""
    p = prompts(nonce, max_tokens)
    if kind.startswith("openai"):
        await _openai_session(proxy, http, traffic, sid, p, stream=kind.endswith("stream"), tools=tools)
    elif kind.startswith("anthropic"):
        await _anthropic_session(proxy, http, traffic, sid, p, stream=kind.endswith("stream"), tools=tools)
    else:
        await _disconnecting_session(proxy, http, traffic, sid, p, tools)


async def finish(http: httpx2.AsyncClient, proxy: ProxyServer, sid: str) -> dict[str, Any]:
    """``POST /sess/<sid>/finish``: the capture it returns. (A dropped stream's call is complete by
    now: the retry after it waited for the session's lock.)"""
    resp = await http.post(proxy.session_url(sid) + "/finish")
    assert resp.status_code == 200, resp.text
    return dict(json.loads(resp.content))
