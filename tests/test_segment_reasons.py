"""Real harnesses' history rewrites, replayed through the real proxy: every segment's reason is right and
every sampled token is captured exactly once.

The fixtures are the raw requests each real harness sent while it rewrote its own history (OpenHands'
summarizing condenser, Claude Code's compaction and a sub-agent, Codex's compaction, OpenCode's
compaction and title call), recorded by ``tests/record_harness_requests.py``; re-record them with

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python tests/record_harness_requests.py [SCENARIO ...]

(podman and the installed harnesses; a few minutes each). Replaying needs neither: each request goes,
in order, to one session of the in-process proxy over HTTP, and the engine samples the assistant turn
the harness later sent back (found in the recorded requests that follow), so the proxy sees the
conversation the harness built. The tool-call ids the proxy mints differ from the recorded ones; the
proxy matches a held turn by its content and calls then, as it does for any harness that rewrites ids.
"""

from __future__ import annotations

import json
import lzma
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from proxy_support import TOOLS
from transformers import AutoTokenizer

from legorl.engines.base import Generation, SamplingParams
from legorl.engines.scripted import ScriptedEngine
from legorl.proxy import anthropic_api, openai_api, responses_api
from legorl.proxy.budgets import Budgets
from legorl.proxy.history import same_prompt
from legorl.proxy.render import ChatRenderer
from legorl.proxy.server import ProxyServer
from legorl.proxy.sessions import Session, SessionCapture

RECORDED = Path(__file__).parent / "recorded" / "harness_requests"
ROUTES = {"anthropic": "/v1/messages", "openai": "/v1/chat/completions", "responses": "/v1/responses"}
PARSERS = {"anthropic": anthropic_api.parse_request, "openai": openai_api.parse_request,
           "responses": responses_api.parse_request}
NO_REPLY = "All done."  # what a request whose answer no later request shows gets


@dataclass
class Recorded:
    api: str
    body: dict[str, Any]
    messages: list[dict[str, Any]]  # as the proxy reads them
    tools: bool


def load(name: str) -> list[Recorded]:
    out = []
    with lzma.open(RECORDED / f"{name}.jsonl.xz", "rt", encoding="utf-8") as f:
        for line in f:
            item = json.loads(line)
            req, _ = PARSERS[item["api"]](item["body"], "policy")
            out.append(Recorded(item["api"], item["body"], req.messages, bool(req.tools)))
    return out


def _call_text(call: dict[str, Any]) -> str:
    fn = call["function"]
    args = json.loads(fn["arguments"]) if isinstance(fn["arguments"], str) else fn["arguments"]
    return "<tool_call>\n" + json.dumps({"name": fn["name"], "arguments": args}, ensure_ascii=False) + "\n</tool_call>"


def reply_text(turn: dict[str, Any]) -> str:
    """What the policy sampled for an assistant turn, in the tiny model's (Qwen) tool-call format."""
    parts = [turn.get("content") or ""] + [_call_text(c) for c in turn.get("tool_calls") or []]
    return "\n".join(p for p in parts if p)


def replies(requests: list[Recorded]) -> list[str]:
    """Each request's answer: the assistant turn the first later request of the same conversation
    holds right after this request's messages."""
    out = []
    for k, req in enumerate(requests):
        n = len(req.messages)
        found = NO_REPLY
        for later in requests[k + 1 :]:
            if (len(later.messages) > n and later.messages[n].get("role") == "assistant"
                    and later.messages[:n] == req.messages):
                found = reply_text(later.messages[n])
                break
        out.append(found)
    return out


class ReplayEngine(ScriptedEngine):
    """Samples the scripted replies, each token with its own logprob (call k, token j: -(k + 1) - j / 1e4),
    and keeps what it generated, so a capture can be checked against it token for token."""

    def __init__(self, tokenizer: Any, texts: list[str]) -> None:
        super().__init__(tokenizer, texts, name="policy", max_context=400_000)
        self.generated: list[tuple[list[int], Generation]] = []

    def _generation(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        gen = super()._generation(prompt_ids, params)
        k = len(self.generated)
        gen.logprobs = [-(k + 1) - j / 1e4 for j in range(len(gen.token_ids))]
        self.generated.append((list(prompt_ids), gen))
        return gen


def replay(tokenizer: Any, requests: list[Recorded]) -> tuple[SessionCapture, ReplayEngine]:
    engine = ReplayEngine(tokenizer, replies(requests))
    with ProxyServer(engine, tokenizer) as server:
        sid = server.new_session()
        base = server.anthropic_base_url(sid)
        with httpx.Client(timeout=120) as client:
            for k, req in enumerate(requests):
                r = client.post(base + ROUTES[req.api], json=req.body)
                assert r.status_code == 200, f"request {k}: {r.status_code} {r.text[:500]}"
        return server.capture(sid), engine


def assert_captured_exactly_once(cap: SessionCapture, engine: ReplayEngine) -> None:
    """Every call's prompt is a prefix of its segment, its sampled tokens follow there with their exact
    logprobs (mask 1), and no other token of any segment has mask 1."""
    assert len(cap.calls) == len(engine.generated)
    cursor: dict[int, int] = {}  # per segment: where the next call's prompt must end
    for call, (prompt, gen) in zip(cap.calls, engine.generated, strict=True):
        seg = cap.segments[call.segment]
        n = len(prompt)
        assert seg.token_ids[:n] == prompt, f"call {call.index}: its prompt is not its segment's prefix"
        assert n >= cursor.get(call.segment, 0)
        assert not any(seg.loss_mask[cursor.get(call.segment, 0) : n]), f"call {call.index}: mask 1 in its prompt"
        end = n + len(gen.token_ids)
        assert seg.token_ids[n:end] == gen.token_ids, f"call {call.index}: sampled tokens differ"
        assert seg.logprobs[n:end] == gen.logprobs, f"call {call.index}: logprobs differ"
        assert all(seg.loss_mask[n:end]), f"call {call.index}: sampled tokens without mask 1"
        cursor[call.segment] = end
    for i, seg in enumerate(cap.segments):
        assert len(seg.token_ids) == len(seg.loss_mask) == len(seg.logprobs)
        assert cursor.get(i) == len(seg.token_ids), f"segment {i} holds tokens after its last call"
    assert sum(sum(s.loss_mask) for s in cap.segments) == sum(len(g.token_ids) for _, g in engine.generated)


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model)


def reasons(cap: SessionCapture) -> list[tuple[str, int | None]]:
    return [(str(s.reason), s.parent) for s in cap.segments]


# ------------------------------------------------------------------------------------ each harness

MAIN, REWRITE, SUBAGENT, AUX = "main", "rewrite", "subagent", "auxiliary"

# (reason, parent) of every segment each recording makes, and the segment of every call.
EXPECTED: dict[str, tuple[list[tuple[str, int | None]], list[int]]] = {
    # main; a synchronous sub-agent (its own system prompt and tools) started by main's Agent call; then
    # three compactions (a request with system and tools that ends in a "no tools" instruction), each
    # followed by main on the summary: a rewrite of the compaction it follows, though the system
    # prompt's billing header carries another hash than before
    "claude-code-compaction": (
        [(MAIN, None), (SUBAGENT, 0), (REWRITE, 0), (REWRITE, 2), (REWRITE, 3), (REWRITE, 4), (REWRITE, 5),
         (REWRITE, 6)],
        [0, 1, 1, 1, 0, 0, 0, 0, 0, 2, 3, 3, 3, 3, 3, 4, 5, 5, 5, 5, 5, 6, 7, 7, 7]),
    # the title call comes first and has no tools: auxiliary, and the first request with tools is main;
    # tool-less summaries, main on the summary; the last compaction request keeps the tools
    "opencode-compaction": (
        [(AUX, None), (MAIN, None), (AUX, None), (REWRITE, 1), (AUX, None), (REWRITE, 3), (AUX, None),
         (REWRITE, 5), (AUX, None), (REWRITE, 7)],
        [0, 1, 1, 1, 1, 1, 1, 2, 3, 4, 5, 5, 5, 5, 6, 7, 7, 7, 7, 7, 8, 9]),
    # tool-less compaction calls, each followed by a request starting from the summary
    "codex-compaction": (
        [(MAIN, None), (AUX, None), (REWRITE, 0), (AUX, None), (REWRITE, 2), (AUX, None), (REWRITE, 4)],
        [0, 0, 0, 1, 2, 2, 2, 3, 4, 4, 4, 5, 6, 6, 6]),
    # the summarizing condenser: a tool-less summary call, then the agent on system + first events + summary
    "openhands-condenser": (
        [(MAIN, None), (AUX, None), (REWRITE, 0), (AUX, None), (REWRITE, 2), (AUX, None), (REWRITE, 4)],
        [0, 0, 0, 0, 1, 2, 2, 2, 3, 4, 4, 4, 5, 6]),
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_recorded_rewrites_get_their_reasons_and_every_token_once(name: str, tokenizer: Any) -> None:
    requests = load(name)
    cap, engine = replay(tokenizer, requests)
    assert_captured_exactly_once(cap, engine)
    segments, calls = EXPECTED[name]
    assert reasons(cap) == segments
    assert [c.segment for c in cap.calls] == calls
    # every rewrite and sub-agent names an earlier segment; mains and auxiliaries none
    assert all(p is None or p < i for i, (_, p) in enumerate(segments))


def test_claude_code_system_prompt_changes_between_calls_of_one_agent() -> None:
    """What the recording pins: the billing header line differs between main's calls, and only there."""
    main = [r.messages[0]["content"] for r in load("claude-code-compaction") if "cc_is_subagent" not in r.messages[0]["content"]]
    headers = {m.splitlines()[0] for m in main}
    assert len(headers) >= 2 and len({"\n".join(m.splitlines()[1:]) for m in main}) == 1
    assert all(same_prompt({"role": "system", "content": a}, {"role": "system", "content": main[0]}) for a in main)


# ------------------------------------------------------------------------------------ the rules


def test_volatile_lines_do_not_make_another_agent() -> None:
    prompt = "\n".join(f"Rule {i}: keep the tests green and say what you changed." for i in range(60))
    a = {"role": "system", "content": "x-billing-header: cc_version=2.1.332.1ab;\n" + prompt}
    b = {"role": "system", "content": "x-billing-header: cc_version=2.1.332.fed;\n" + prompt}  # a hash of letters only
    dated = {"role": "system", "content": "x-billing-header: cc_version=2.1.333.9c0;\nToday is 2026-12-07.\n" + prompt}
    assert same_prompt(a, b) and same_prompt(a, dated)
    other = {"role": "system", "content": "x-billing-header: cc_version=2.1.332.1ab; cc_is_subagent=true;\n"
             + "\n".join(f"Step {i}: search the code base and report back." for i in range(60))}
    assert not same_prompt(a, other)
    assert not same_prompt({"role": "system", "content": "You are helpful."},
                           {"role": "system", "content": "You write titles."})
    assert not same_prompt(a, {"role": "user", "content": a["content"]})


def _commit(s: Session, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
            reply: dict[str, Any]) -> None:
    plan = s.plan(messages, tools)
    ids = s.renderer.encode("ok")
    s.commit(plan, Generation(token_ids=[*ids, s.renderer.eot_id], logprobs=[-0.5] * (len(ids) + 1)), reply)


def test_first_request_with_tools_is_main_and_what_came_before_is_auxiliary(tokenizer: Any) -> None:
    s = Session("s", ChatRenderer(tokenizer), Budgets())
    task = {"role": "user", "content": "fix it"}
    _commit(s, [{"role": "system", "content": "Write a title."}, task], None, {"role": "assistant", "content": "ok"})
    assert [x.reason for x in s.capture().segments] == [MAIN]  # so far, a session without tools
    rules = "\n".join(f"Rule {i}: keep the tests green and say what you changed." for i in range(60))
    agent = {"role": "system", "content": "You are an agent. Today is 2026-12-07.\n" + rules}
    _commit(s, [agent, task], TOOLS, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}]})
    # a sub-agent while main waits on its call: parent main
    _commit(s, [{"role": "system", "content": "You search code."}, task], TOOLS, {"role": "assistant", "content": "ok"})
    # a tool-less summary: auxiliary
    _commit(s, [{"role": "system", "content": "Summarize."}, task], None, {"role": "assistant", "content": "ok"})
    # main again on a summary, its system prompt's date changed: a rewrite of main
    _commit(s, [{"role": "system", "content": "You are an agent. Today is 2026-12-08.\n" + rules}, task], TOOLS,
            {"role": "assistant", "content": "ok"})
    assert reasons(s.capture()) == [(AUX, None), (MAIN, None), (SUBAGENT, 1), (AUX, None), (REWRITE, 1)]


def test_a_session_without_tools_has_a_main(tokenizer: Any) -> None:
    """A text-mode harness (its actions in fenced blocks, no tools): its first request is main, a
    rewrite of it is a rewrite, another prompt is auxiliary."""
    s = Session("s", ChatRenderer(tokenizer), Budgets())
    system = {"role": "system", "content": "Act with ```bash blocks."}
    _commit(s, [system, {"role": "user", "content": "task"}], None, {"role": "assistant", "content": "ok"})
    _commit(s, [system, {"role": "user", "content": "summary of the task"}], None, {"role": "assistant", "content": "ok"})
    _commit(s, [{"role": "user", "content": "A title?"}], None, {"role": "assistant", "content": "ok"})
    assert reasons(s.capture()) == [(MAIN, None), (REWRITE, 0), (AUX, None)]
