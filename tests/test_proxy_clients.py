"""The official openai and anthropic clients (sync, async, streaming and not, with tools) against
the proxy: replies, tool calls, token identity of the capture, forks, budgets, errors, shards.

Most tests use the scripted engine (deterministic tool calls, steered by ``say(...)`` in the
prompt) so each assertion can be exact; ``test_real_model_*`` run the embedded tiny model.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import proxy_support
import pytest
from proxy_support import ANTHROPIC_TOOLS, TOOLS, an, call_bash, oa, say, scripted_engine

from legorl.core import shards
from legorl.core.paths import RunDir
from legorl.core.schemas import Kind, SegmentReason
from legorl.proxy.budgets import Budgets
from legorl.proxy.server import ProxyServer
from legorl.trials.external import ShardSink

# the proxy tests' fixtures, bound here so that pytest finds them
tokenizer, proxy, real_proxy = proxy_support.tokenizer, proxy_support.proxy, proxy_support.real_proxy


def assert_token_identity(proxy: ProxyServer, sid: str, tools: list[dict] | None) -> None:
    """The main segment's tokens are exactly the template's render of the final conversation."""
    cap = proxy.capture(sid)
    seg = cap.segments[0]
    assert seg.reason == SegmentReason.MAIN
    r = proxy.renderer
    rendered = r.render(cap.messages, tools, add_generation_prompt=False)
    assert r.decode(seg.token_ids) + "\n" == rendered
    assert seg.token_ids == r.encode(rendered)[: len(seg.token_ids)]
    assert len(seg.token_ids) == len(seg.loss_mask) == len(seg.logprobs)


# ------------------------------------------------------------------------------------ openai


def test_openai_sync_tools_multi_turn(proxy: ProxyServer) -> None:
    sid = proxy.new_session()
    client = oa(proxy, sid)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You fix bugs."},
                                  {"role": "user", "content": "Find it. " + call_bash("ls -la", "Looking.")}]
    r = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, parallel_tool_calls=False,
                                       reasoning_effort="low", extra_body={"prompt_cache_key": "k"})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Looking."
    (tc,) = choice.message.tool_calls
    assert tc.function.name == "bash" and json.loads(tc.function.arguments) == {"command": "ls -la"}
    assert tc.id.startswith("call_")
    assert r.usage.completion_tokens > 0 and r.usage.prompt_tokens > 0
    msgs.append(choice.message.model_dump(exclude_none=True))
    msgs.append({"role": "tool", "tool_call_id": tc.id, "content": "app.py\n" + say("Fixed.")})
    r2 = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
    assert r2.choices[0].message.content == "Fixed." and r2.choices[0].finish_reason == "stop"
    cap = proxy.capture(sid)
    assert len(cap.segments) == 1 and len(cap.calls) == 2
    assert cap.calls[1].new_prompt_tokens < cap.calls[1].prompt_tokens
    assert cap.calls[0].api == "openai" and cap.calls[0].stream is False
    assert_token_identity(proxy, sid, TOOLS)


def test_openai_sync_stream_tools_and_usage(proxy: ProxyServer) -> None:
    sid = proxy.new_session()
    client = oa(proxy, sid)
    msgs = [{"role": "user", "content": call_bash("pytest -q", "Running the tests now.")}]
    chunks = list(client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, stream=True,
                                                 stream_options={"include_usage": True}))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = [c.usage for c in chunks if c.usage]
    assert content == "Running the tests now."
    assert len(calls) == 1 and calls[0].function.name == "bash"
    assert json.loads(calls[0].function.arguments) == {"command": "pytest -q"}
    assert finish == ["tool_calls"] and len(usage) == 1 and usage[0].completion_tokens > 0
    call = proxy.capture(sid).calls[0]
    assert call.stream is True and call.ttft_s is not None and call.finish_reason == "tool_calls"
    # The harness sends the streamed turn back: the session extends, no fork.
    msgs2 = [*msgs, {"role": "assistant", "content": content, "tool_calls": [
        {"id": calls[0].id, "type": "function", "function": {"name": "bash", "arguments": calls[0].function.arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "1 passed " + say("All green.")}]
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="m", messages=msgs2, tools=TOOLS, stream=True) if c.choices)
    assert text == "All green."
    assert [s.reason for s in proxy.capture(sid).segments] == ["main"]
    assert_token_identity(proxy, sid, TOOLS)


def test_openai_async_stream_and_not(proxy: ProxyServer) -> None:
    sid = proxy.new_session()

    async def go() -> tuple[str, str]:
        client = openai.AsyncOpenAI(base_url=proxy.openai_base_url(sid), api_key="x", max_retries=0)
        msgs: list[dict[str, Any]] = [{"role": "user", "content": say("one")}]
        r = await client.chat.completions.create(model="m", messages=msgs)
        msgs += [{"role": "assistant", "content": r.choices[0].message.content},
                 {"role": "user", "content": say("two two")}]
        parts = []
        async for c in await client.chat.completions.create(model="m", messages=msgs, stream=True):
            if c.choices and c.choices[0].delta.content:
                parts.append(c.choices[0].delta.content)
        await client.close()
        return r.choices[0].message.content or "", "".join(parts)

    assert asyncio.run(go()) == ("one", "two two")
    assert_token_identity(proxy, sid, None)


def test_openai_extras_logprobs_token_ids_and_stop(proxy: ProxyServer) -> None:
    sid = proxy.new_session()
    client = oa(proxy, sid)
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": say("abc STOP def")}],
                                       stop=["STOP"], logprobs=True, extra_body={"return_token_ids": True})
    assert r.choices[0].message.content == "abc " and r.choices[0].finish_reason == "stop"
    extra = r.model_extra or {}
    choice_extra = r.choices[0].model_extra or {}
    seg = proxy.capture(sid).segments[0]
    sampled = [t for t, m in zip(seg.token_ids, seg.loss_mask, strict=True) if m]
    assert choice_extra["token_ids"] == sampled and extra["prompt_token_ids"] == seg.token_ids[: -len(sampled)]
    assert "STOP" in proxy.renderer.decode(sampled)  # the segment keeps what the model actually sampled
    assert len(r.choices[0].logprobs.content) == len(sampled)


def test_openai_malformed_tool_call_is_content(proxy: ProxyServer) -> None:
    sid = proxy.new_session()
    bad = '<tool_call>\n{"name": "bash", "arguments": {oops}\n</tool_call>'
    r = oa(proxy, sid).chat.completions.create(model="m", tools=TOOLS,
                                               messages=[{"role": "user", "content": say(bad)}])
    assert r.choices[0].message.content == bad and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    assert "invalid JSON" in (proxy.capture(sid).calls[0].parse_error or "")


# ------------------------------------------------------------------------------------ anthropic


def test_anthropic_sync_tools_multi_turn(proxy: ProxyServer) -> None:
    sid = proxy.new_session()
    client = an(proxy, sid)
    system = [{"type": "text", "text": "You fix bugs."}, {"type": "text", "text": "Be brief.",
                                                         "cache_control": {"type": "ephemeral"}}]
    msgs: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": call_bash("ls", "Let me see.")}]}]
    m = client.messages.create(model="m", max_tokens=200, system=system, tools=ANTHROPIC_TOOLS, messages=msgs,
                               metadata={"user_id": "u"}, extra_body={"context_management": {"edits": []}})
    assert m.stop_reason == "tool_use"
    assert [b.type for b in m.content] == ["text", "tool_use"]
    assert m.content[0].text == "Let me see."
    tool = m.content[1]
    assert tool.name == "bash" and tool.input == {"command": "ls"} and tool.id.startswith("toolu_")
    msgs.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]})
    msgs.append({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": tool.id, "content": [{"type": "text", "text": "a.py"}]},
        {"type": "text", "text": "<system-reminder>keep going</system-reminder> " + say("Done.")}]})
    m2 = client.messages.create(model="m", max_tokens=200, system=system, tools=ANTHROPIC_TOOLS, messages=msgs)
    assert m2.stop_reason == "end_turn" and m2.content[0].text == "Done."
    assert m2.usage.input_tokens > 0 and m2.usage.output_tokens > 0
    cap = proxy.capture(sid)
    assert [s.reason for s in cap.segments] == ["main"] and cap.calls[1].api == "anthropic"
    assert cap.messages[0] == {"role": "system", "content": "You fix bugs.\nBe brief."}
    assert [m["role"] for m in cap.messages] == ["system", "user", "assistant", "tool", "user", "assistant"]
    assert_token_identity(proxy, sid, TOOLS)


def test_anthropic_stream_event_sequence(proxy: ProxyServer) -> None:
    sid = proxy.new_session()
    client = an(proxy, sid)
    msgs = [{"role": "user", "content": call_bash("git status", "Checking.")}]
    kwargs: dict[str, Any] = dict(model="m", max_tokens=300, tools=ANTHROPIC_TOOLS, messages=msgs,
                                  extra_body={"thinking": {"type": "enabled", "budget_tokens": 1024}},
                                  extra_query={"beta": "true"})
    with client.messages.stream(**kwargs) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    raw = [e for e in events if e in ("message_start", "content_block_start", "content_block_delta",
                                      "content_block_stop", "message_delta", "message_stop")]
    assert raw[0] == "message_start" and raw[-2:] == ["message_delta", "message_stop"]
    assert raw.count("content_block_start") == raw.count("content_block_stop") == 2
    assert final.stop_reason == "tool_use"
    assert final.content[0].text == "Checking." and final.content[1].input == {"command": "git status"}
    # the raw SSE: the input arrives as input_json_delta
    with httpx.stream("POST", proxy.session_url(sid) + "/v1/messages?beta=true",
                      json={**{k: v for k, v in kwargs.items() if k not in ("extra_body", "extra_query")},
                            "stream": True}) as resp:
        body = "".join(resp.iter_text())
    assert '"type":"input_json_delta"' in body and body.index("event: message_start") < body.index("event: message_stop")


def test_anthropic_async_stream_and_not(proxy: ProxyServer) -> None:
    sid = proxy.new_session()

    async def go() -> tuple[str, str]:
        client = anthropic.AsyncAnthropic(base_url=proxy.anthropic_base_url(sid), api_key="x", max_retries=0)
        msgs: list[dict[str, Any]] = [{"role": "user", "content": say("first")}]
        m = await client.messages.create(model="m", max_tokens=50, messages=msgs)
        msgs += [{"role": "assistant", "content": m.content[0].text}, {"role": "user", "content": say("second")}]
        async with client.messages.stream(model="m", max_tokens=50, messages=msgs) as s:
            text = await s.get_final_text()
        await client.close()
        return m.content[0].text, text

    assert asyncio.run(go()) == ("first", "second")
    assert_token_identity(proxy, sid, None)


def test_anthropic_stop_sequences_and_count_tokens(proxy: ProxyServer) -> None:
    sid = proxy.new_session()
    client = an(proxy, sid)
    m = client.messages.create(model="m", max_tokens=50, stop_sequences=["###"],
                               messages=[{"role": "user", "content": say("part one ### part two")}])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "###" and m.content[0].text == "part one "
    n = client.messages.count_tokens(model="m", messages=[{"role": "user", "content": "hello"}])
    assert n.input_tokens == len(proxy.renderer.encode(proxy.renderer.render(
        [{"role": "user", "content": "hello"}], None, add_generation_prompt=True)))


# ------------------------------------------------------------------------------------ forks


def test_rewrite_and_auxiliary_over_http(proxy: ProxyServer) -> None:
    sid = proxy.new_session()
    client = oa(proxy, sid)
    sys_msg = {"role": "system", "content": "agent"}
    msgs: list[dict[str, Any]] = [sys_msg, {"role": "user", "content": "task " + say("step one")}]
    r = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
    msgs += [{"role": "assistant", "content": r.choices[0].message.content},
             {"role": "user", "content": "more " + say("step two")}]
    client.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Title? " + say("A title")}])
    compacted = [sys_msg, {"role": "user", "content": "Summary: did step one. " + say("step three")}]
    client.chat.completions.create(model="m", messages=compacted, tools=TOOLS)
    cap = proxy.capture(sid)
    assert [(s.reason, s.parent) for s in cap.segments] == [("main", None), ("auxiliary", None), ("rewrite", 0)]
    assert [c.segment for c in cap.calls] == [0, 0, 1, 2]
    assert sum(cap.segments[0].loss_mask) > sum(cap.segments[2].loss_mask) > 0  # earlier segment kept
    assert cap.messages[-1]["content"] == "step three"


# ------------------------------------------------------------------------------------ budgets


def test_budget_stops_are_normal_replies(proxy: ProxyServer) -> None:
    sid = proxy.new_session(Budgets(max_turns=1))
    client = oa(proxy, sid)
    msgs = [{"role": "user", "content": call_bash("ls")}]
    assert client.chat.completions.create(model="m", messages=msgs, tools=TOOLS).choices[0].finish_reason == "tool_calls"
    r = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert "maximum number of turns" in (r.choices[0].message.content or "")
    m = an(proxy, sid).messages.create(model="m", max_tokens=9, messages=[{"role": "user", "content": "x"}])
    assert m.stop_reason == "end_turn" and "maximum number of turns" in m.content[0].text
    cap = proxy.capture(sid)
    assert cap.budget_stop == "max_turns" and [c.budget_stop for c in cap.calls] == [None, "max_turns", "max_turns"]
    assert cap.outcome() == "max_turns"


def test_context_overflow_reply_or_error(proxy: ProxyServer) -> None:
    long = [{"role": "user", "content": "word " * 400}]
    sid = proxy.new_session(Budgets(max_context=100))
    r = oa(proxy, sid).chat.completions.create(model="m", messages=long)
    assert r.choices[0].finish_reason == "stop" and "context" in (r.choices[0].message.content or "")
    assert proxy.capture(sid).calls[0].budget_stop == "context_overflow"
    sid2 = proxy.new_session(Budgets(max_context=100, context_overflow="error"))
    with pytest.raises(openai.BadRequestError) as err:
        oa(proxy, sid2).chat.completions.create(model="m", messages=long)
    assert err.value.status_code == 400 and err.value.code == "context_length_exceeded"
    with pytest.raises(anthropic.BadRequestError):
        an(proxy, sid2).messages.create(model="m", max_tokens=5, messages=long)
    # max_tokens is capped to what the context leaves: a long reply ends with "length"
    sid3 = proxy.new_session(Budgets(max_context=60))
    r3 = oa(proxy, sid3).chat.completions.create(model="m", messages=[{"role": "user", "content": say("z ", 80)}])
    assert r3.choices[0].finish_reason == "length" and len(proxy.capture(sid3).segments[0].token_ids) == 60


# ------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m"}, "messages"),
    ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": -3}, "max_tokens"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0].function"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
])
def test_openai_bad_requests(proxy: ProxyServer, body: dict[str, Any], param: str) -> None:
    sid = proxy.new_session()
    r = httpx.post(proxy.openai_base_url(sid) + "/chat/completions", json=body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    assert proxy.capture(sid).calls == []


def test_error_shapes_and_routes(proxy: ProxyServer) -> None:
    sid = proxy.new_session()
    base = proxy.session_url(sid)
    r = httpx.post(base + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(base + "/v1/messages", content=b"[1,", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(base + "/v1/messages", json={"model": "m", "max_tokens": 5, "messages": [{"role": "robot", "content": "x"}]})
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        an(proxy, sid).messages.create(model="m", max_tokens=5, messages=[])
    with pytest.raises(openai.BadRequestError):
        oa(proxy, sid).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], top_p=7)
    assert httpx.get(base + "/v1/nothing").status_code == 404
    assert httpx.get(base + "/v1/chat/completions").status_code == 405
    assert httpx.get(proxy.base_url + "/sess/unknown-id/trajectory").status_code == 404
    assert httpx.get(proxy.base_url + "/health").json()["status"] == "ok"
    models = oa(proxy, sid).models.list()
    assert [m.id for m in models.data] == ["scripted"]
    assert httpx.get(proxy.base_url + "/v1/models").json()["data"][0]["id"] == "scripted"


def test_api_key_and_session_api(tokenizer: Any, tmp_path: Path) -> None:
    with ProxyServer(scripted_engine(tokenizer), tokenizer, api_key="sekret", on_finish=ShardSink(tmp_path)) as proxy:
        assert httpx.get(proxy.base_url + "/health").status_code == 200
        assert httpx.post(proxy.base_url + "/sessions").status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=proxy.openai_base_url("abc"), api_key="wrong", max_retries=0).models.list()
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=proxy.anthropic_base_url("abc"), api_key="wrong", max_retries=0).messages.create(
                model="m", max_tokens=3, messages=[{"role": "user", "content": "x"}])
        h = {"authorization": "Bearer sekret"}
        created = httpx.post(proxy.base_url + "/sessions", headers=h,
                             json={"budgets": {"max_turns": 5}, "metadata": {"task_id": "t1", "harness": "mine"}}).json()
        sid = created["session_id"]
        assert len(sid) >= 20 and created["openai_base_url"] == proxy.openai_base_url(sid)
        assert httpx.post(proxy.base_url + "/sessions", headers=h, json={"budgets": {"max_turns": "x"}}).status_code == 400
        client = openai.OpenAI(base_url=created["openai_base_url"], api_key="sekret", max_retries=0)
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": say("hi")}])
        traj = httpx.get(created["base_url"] + "/trajectory", headers={"x-api-key": "sekret"}).json()
        assert traj["segments"][0]["reason"] == "main" and traj["calls"][0]["completion_tokens"] > 0
        assert traj["messages"][-1] == {"role": "assistant", "content": "hi"}
        # auto-created session on an unknown id
        openai.OpenAI(base_url=proxy.openai_base_url("harness-made"), api_key="sekret", max_retries=0
                      ).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        assert httpx.post(created["base_url"] + "/finish", headers=h).status_code == 200
        assert httpx.get(created["base_url"] + "/trajectory", headers=h).status_code == 404
    rows = shards.read_rows(RunDir.at(tmp_path).proxy_sessions, Kind.ROLLOUTS)
    by_task = {r.task_id: r for r in rows}
    assert set(by_task) == {"t1", "proxy/harness-made"}  # the open one was written on close
    row = by_task["t1"]
    assert row.harness == "mine" and row.segments[0].token_ids == traj["segments"][0]["token_ids"]
    assert json.loads(row.messages or "[]")[-1]["content"] == "hi"


# ------------------------------------------------------------------------------------ real model


def test_real_model_openai_and_anthropic(real_proxy: ProxyServer) -> None:
    sid = real_proxy.new_session()
    client = oa(real_proxy, sid)
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "Write a function."}]
    r = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=8, seed=3)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Again."}]
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="m", messages=msgs, tools=TOOLS, max_tokens=8, stream=True) if c.choices]
    cap = real_proxy.capture(sid)
    assert len(cap.segments) == 1 and sum(cap.segments[0].loss_mask) == sum(c.completion_tokens for c in cap.calls)
    assert all(lp < 0 for lp, m in zip(cap.segments[0].logprobs, cap.segments[0].loss_mask, strict=True) if m)
    assert "".join(parts) == cap.messages[-1]["content"]
    with an(real_proxy, sid).messages.stream(model="m", max_tokens=6, messages=[{"role": "user", "content": "hi"}]) as s:
        assert s.get_final_message().usage.output_tokens == 6 or s.get_final_message().stop_reason == "end_turn"


def test_sampling_override_wins_over_what_the_harness_asks(tokenizer: Any) -> None:
    from legorl.engines.base import SamplingParams
    from legorl.proxy.core import SamplingOverride

    engine = scripted_engine(tokenizer)
    seen: list[SamplingParams] = []
    generate, stream = engine.generate, engine.stream

    async def recording_generate(prompt_ids: list[int], params: SamplingParams) -> Any:
        seen.append(params)
        return await generate(prompt_ids, params)

    def recording_stream(prompt_ids: list[int], params: SamplingParams) -> Any:
        seen.append(params)
        return stream(prompt_ids, params)

    engine.generate, engine.stream = recording_generate, recording_stream  # type: ignore[method-assign]
    override = SamplingOverride(temperature=1.0, top_p=1.0)
    with ProxyServer(engine, tokenizer, sampling=override) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/sess/s1/v1", api_key="x")
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": say("hi")}],
                                       temperature=0.2, top_p=0.5)
        anth = anthropic.Anthropic(base_url=f"{server.base_url}/sess/s2", api_key="x")
        anth.messages.create(model="m", max_tokens=16, messages=[{"role": "user", "content": say("hi")}],
                             extra_body={"temperature": 0.3})
    assert [(p.temperature, p.top_p) for p in seen] == [(1.0, 1.0), (1.0, 1.0)]


def test_engine_failure_is_recorded_on_its_own_session(tokenizer: Any) -> None:
    from legorl.engines.scripted import ScriptedCall, ScriptedEngine

    def reply(call: ScriptedCall) -> str:
        if "explode" in call.prompt_text:
            raise RuntimeError("the engine is down")
        return "fine"

    with ProxyServer(ScriptedEngine(tokenizer, reply), tokenizer) as server:
        bad = openai.OpenAI(base_url=f"{server.base_url}/sess/bad/v1", api_key="x", max_retries=0)
        good = openai.OpenAI(base_url=f"{server.base_url}/sess/good/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError):
            bad.chat.completions.create(model="m", messages=[{"role": "user", "content": "explode"}])
        good.chat.completions.create(model="m", messages=[{"role": "user", "content": "hello"}])
        assert httpx.get(f"{server.base_url}/sess/bad/trajectory").json()["engine_errors"] == [
            "RuntimeError: the engine is down"]
        assert httpx.get(f"{server.base_url}/sess/good/trajectory").json()["engine_errors"] == []
