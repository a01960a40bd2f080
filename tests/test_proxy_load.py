"""Many sessions at once, and fuzzed bad requests: 64 concurrent sessions with mixed APIs and
streaming give 64 separate, correct trajectories; no malformed request yields a 500 or touches
another session."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from proxy_support import ANTHROPIC_TOOLS, TOOLS, call_bash, say, scripted_engine
from transformers import AutoTokenizer

from legorl.engines.embedded import EmbeddedEngine
from legorl.proxy.server import ProxyServer


@pytest.fixture(scope="module")
def real_proxy(tiny_model: Path) -> Iterator[ProxyServer]:
    engine = EmbeddedEngine(tiny_model, max_batch=16)
    with ProxyServer(engine, tiny_model) as server:
        yield server
    asyncio.run(engine.close())


@pytest.fixture(scope="module")
def scripted_proxy(tiny_model: Path) -> Iterator[ProxyServer]:
    tok = AutoTokenizer.from_pretrained(tiny_model)
    with ProxyServer(scripted_engine(tok), tok) as server:
        yield server


async def _session(proxy: ProxyServer, i: int, tools: bool) -> str:
    """Two turns in session ``i`` with one of four client styles (OpenAI / Anthropic, streamed or not).

    The first user message asks (scripted engine) for a tool call; the tool result asks for a text
    reply; a reply without tool calls is answered by a user message.
    """
    sid = proxy.new_session()
    kind = i % 4
    first = f"Session {i}: fix issue #{i * 7}. " + call_bash(f"grep -n bug{i} .", f"Looking {i}.")
    after = f"result of session {i} " + say(f"Fixed in session {i}.")
    if kind < 2:
        oc = openai.AsyncOpenAI(base_url=proxy.openai_base_url(sid), api_key="x", max_retries=0)
        msgs: list[dict[str, Any]] = [{"role": "system", "content": "agent"}, {"role": "user", "content": first}]
        kw: dict[str, Any] = {"tools": TOOLS} if tools else {}
        for _ in range(2):
            if kind == 0:
                r = await oc.chat.completions.create(model="m", messages=msgs, max_tokens=40, seed=i, **kw)
                reply = r.choices[0].message.model_dump(exclude_none=True)
            else:
                parts, calls = [], []
                async for c in await oc.chat.completions.create(model="m", messages=msgs, max_tokens=40, seed=i,
                                                                stream=True, **kw):
                    if c.choices and c.choices[0].delta.content:
                        parts.append(c.choices[0].delta.content)
                    if c.choices and c.choices[0].delta.tool_calls:
                        calls += [tc.model_dump(exclude_none=True) for tc in c.choices[0].delta.tool_calls]
                reply = {"role": "assistant", "content": "".join(parts)}
                if calls:
                    reply["tool_calls"] = [{k: v for k, v in tc.items() if k != "index"} for tc in calls]
            msgs.append(reply)
            if reply.get("tool_calls"):
                msgs.append({"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": after})
            else:
                msgs.append({"role": "user", "content": after})
        await oc.close()
    else:
        ac = anthropic.AsyncAnthropic(base_url=proxy.anthropic_base_url(sid), api_key="x", max_retries=0)
        amsgs: list[dict[str, Any]] = [{"role": "user", "content": first}]
        akw: dict[str, Any] = {"tools": ANTHROPIC_TOOLS} if tools else {}
        for _ in range(2):
            if kind == 2:
                m = await ac.messages.create(model="m", system="agent", messages=amsgs, max_tokens=40, **akw)
            else:
                async with ac.messages.stream(model="m", system="agent", messages=amsgs, max_tokens=40, **akw) as s:
                    m = await s.get_final_message()
            amsgs.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]})
            uses = [b for b in m.content if b.type == "tool_use"]
            if uses:
                amsgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                           "content": after}]})
            else:
                amsgs.append({"role": "user", "content": after})
        await ac.close()
    return sid


def _check_sessions(proxy: ProxyServer, sids: list[str], tools: bool, exact: bool) -> None:
    r = proxy.renderer
    assert len(set(sids)) == len(sids)
    for i, sid in enumerate(sids):
        cap = proxy.capture(sid)
        assert len(cap.calls) == 2 and [c.segment for c in cap.calls] == [0, 0], i
        assert [s.reason for s in cap.segments] == ["main"], i
        seg = cap.segments[0]
        assert sum(seg.loss_mask) == sum(c.completion_tokens for c in cap.calls) > 0
        # Its own conversation, and exactly what the template renders for it.
        assert f"Session {i}:" in cap.messages[1]["content"]
        assert cap.messages[-1]["role"] == "assistant"
        rendered = r.render(cap.messages, TOOLS if tools else None, add_generation_prompt=False)
        # A random model may end a turn with <|endoftext|> (also a stop token): the segment keeps it
        # (it is what was sampled) and the proxy closes the turn with <|im_end|> as the template does.
        text = r.decode(seg.token_ids).replace("<|endoftext|><|im_end|>", "<|im_end|>")
        text = text.removesuffix("<|endoftext|>")
        at = next((k for k, (a, b) in enumerate(zip(rendered, text, strict=False)) if a != b), len(text))
        assert rendered.startswith(text) and rendered[len(text):] in ("\n", "<|im_end|>\n"), (
            i, at, text[at - 30 : at + 30], rendered[at - 30 : at + 30])
        if exact:  # scripted replies: the tool call, then the text the tool result asked for
            assert cap.messages[2]["tool_calls"][0]["function"]["arguments"] == json.dumps({"command": f"grep -n bug{i} ."})
            assert cap.messages[-1]["content"] == f"Fixed in session {i}."
            assert seg.token_ids == r.encode(rendered)[: len(seg.token_ids)]
        for j in range(len(sids)):
            if j != i:
                assert f"Session {j}:" not in text and f"session {j} " not in text


def test_64_concurrent_sessions_mixed(scripted_proxy: ProxyServer) -> None:
    async def go() -> list[str]:
        return await asyncio.gather(*(_session(scripted_proxy, i, tools=True) for i in range(64)))

    _check_sessions(scripted_proxy, asyncio.run(go()), tools=True, exact=True)


def test_concurrent_sessions_real_model(real_proxy: ProxyServer) -> None:
    """The same traffic on the embedded engine (batched decoding), fewer sessions: CPU time."""

    async def go() -> list[str]:
        return await asyncio.gather(*(_session(real_proxy, i, tools=False) for i in range(16)))

    _check_sessions(real_proxy, asyncio.run(go()), tools=False, exact=False)


# ------------------------------------------------------------------------------------ fuzzing


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
_OPENAI_BASE: dict[str, Any] = {"model": "m", "max_tokens": 4, "tools": TOOLS,
                                "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}
_ANTHROPIC_BASE: dict[str, Any] = {"model": "m", "max_tokens": 4, "system": "s", "tools": ANTHROPIC_TOOLS,
                                   "messages": [{"role": "user", "content": [{"type": "text", "text": "u"}]}]}
_KEYS = ["messages", "tools", "tool_choice", "stream", "stream_options", "max_tokens", "max_completion_tokens",
         "temperature", "top_p", "top_k", "stop", "stop_sequences", "seed", "n", "system", "thinking", "metadata",
         "logprobs", "return_token_ids", "parallel_tool_calls", "reasoning_effort", "model"]


def _mutate(base: dict[str, Any], data: st.DataObject) -> Any:
    body = json.loads(json.dumps(base))
    for _ in range(data.draw(st.integers(1, 3))):
        where = data.draw(st.sampled_from(["top", "message", "block", "tool"]))
        value = data.draw(_json)
        if where == "top":
            body[data.draw(st.sampled_from(_KEYS) | st.text(max_size=8))] = value
        elif where == "message" and isinstance(body.get("messages"), list) and body["messages"]:
            msg = body["messages"][-1]
            if isinstance(msg, dict):
                msg[data.draw(st.sampled_from(["role", "content", "tool_calls", "tool_call_id", "name"]))] = value
        elif where == "block" and isinstance(body.get("messages"), list) and body["messages"]:
            msg = body["messages"][-1]
            if isinstance(msg, dict):
                msg["content"] = [data.draw(st.fixed_dictionaries(
                    {"type": st.sampled_from(["text", "tool_result", "tool_use", "image", "thinking", "x"])},
                    optional={"text": _json, "content": _json, "input": _json, "id": _json, "name": _json,
                              "tool_use_id": _json}))]
        elif where == "tool" and isinstance(body.get("tools"), list) and body["tools"]:
            tool = body["tools"][0]
            if isinstance(tool, dict):
                tool[data.draw(st.sampled_from(["function", "name", "input_schema", "type", "parameters"]))] = value
    return body


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_requests_never_500_nor_leak(scripted_proxy: ProxyServer, data: st.DataObject) -> None:
    proxy = scripted_proxy
    bystander = proxy.core.get("bystander")
    if bystander is None:
        proxy.core.new_session(session_id="bystander")
        openai.OpenAI(base_url=proxy.openai_base_url("bystander"), api_key="x", max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": say("stable")}])
    before = proxy.capture("bystander").to_json()
    api = data.draw(st.sampled_from(["openai", "anthropic"]))
    route = "/v1/chat/completions" if api == "openai" else "/v1/messages"
    mode = data.draw(st.sampled_from(["mutate", "mutate", "mutate", "json", "bytes"]))
    sid = data.draw(st.sampled_from(["fuzz-a", "fuzz-b"]))
    url = proxy.session_url(sid) + route
    if mode == "bytes":
        resp = httpx.post(url, content=data.draw(st.binary(max_size=64)), timeout=30)
    elif mode == "json":
        resp = httpx.post(url, content=json.dumps(data.draw(_json)).encode(), timeout=30)
    else:
        body = _mutate(_OPENAI_BASE if api == "openai" else _ANTHROPIC_BASE, data)
        resp = httpx.post(url, content=json.dumps(body).encode(), timeout=30)
    assert resp.status_code < 500, resp.text
    if resp.status_code >= 400:
        err = resp.json()
        assert ("error" in err and "message" in err["error"]) if api == "openai" else err["type"] == "error"
    assert proxy.capture("bystander").to_json() == before
