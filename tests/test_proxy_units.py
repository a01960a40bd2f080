"""The proxy's parts with the real tiny-model tokenizer: rendering seams, tool-call parsing,
incremental text with stop strings, budgets, and the session tree's placement rules."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from proxy_support import TOOLS, tool_call_text
from transformers import AutoTokenizer

from legorl.core.errors import ConfigError
from legorl.core.schemas import SegmentReason
from legorl.engines.base import Generation
from legorl.proxy.budgets import Budgets
from legorl.proxy.history import same_assistant_turn
from legorl.proxy.render import ChatRenderer
from legorl.proxy.sessions import Session
from legorl.proxy.textstream import TextAssembler
from legorl.proxy.toolparse import HermesParser, detect_parser, get_parser


@pytest.fixture(scope="module")
def renderer(tiny_model: Path) -> ChatRenderer:
    return ChatRenderer(AutoTokenizer.from_pretrained(tiny_model))


# ----------------------------------------------------------------------------- rendering


def test_renderer_matches_apply_chat_template(renderer: ChatRenderer) -> None:
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "a.py"}]
    for gen_prompt in (True, False):
        ours = renderer.render(msgs, TOOLS, add_generation_prompt=gen_prompt)
        theirs = renderer.tokenizer.apply_chat_template(msgs, tools=TOOLS, tokenize=False,
                                                        add_generation_prompt=gen_prompt)
        assert ours == theirs
    assert renderer.closing == "<|im_end|>\n"
    assert renderer.eot_text == "<|im_end|>"
    assert renderer.eot_id in renderer.stop_token_ids
    assert renderer.tokenizer.convert_tokens_to_ids("<|endoftext|>") in renderer.stop_token_ids


def test_a_long_prompt_tokenized_a_message_at_a_time_gives_the_whole_prompts_ids(renderer: ChatRenderer) -> None:
    """Past SPLIT_ABOVE characters a prompt is tokenized piece by piece at its special tokens (the
    tokenizer's memory is the longest message's): the ids are those of the whole text."""
    from legorl.proxy import render

    assert renderer._splits_exactly
    chunk = "def f(x):\n    return x + 1  # café, 日本語\n\n\n  spaces   and\ttabs\n"
    msgs = [{"role": "system", "content": "sys"}]
    msgs += [{"role": "user" if i % 2 else "assistant", "content": chunk * (400 + i)} for i in range(60)]
    text = renderer.render_marked(msgs, TOOLS, add_generation_prompt=True)
    assert len(text) > render.SPLIT_ABOVE
    assert renderer.encode(text) == renderer._encode(text)


def test_bridge_closes_a_turn(renderer: ChatRenderer) -> None:
    ids = renderer.encode("hello")
    assert renderer.bridge([*ids, renderer.eot_id]) == "\n"  # the model closed its turn itself
    assert renderer.bridge(ids) == "<|im_end|>\n"  # cut by length / a stop string: close it for it


# ----------------------------------------------------------------------------- tool parsing


def test_hermes_parses_calls_and_content() -> None:
    p = HermesParser()
    text = tool_call_text("bash", {"command": "ls -la"}, content="Let me look.")
    out = p.parse(text)
    assert out.error is None and out.content == "Let me look."
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("bash", {"command": "ls -la"})]
    two = p.parse(tool_call_text("a", {}) + "\n" + tool_call_text("b", {"x": [1, 2]}))
    assert [(c.name, c.arguments) for c in two.tool_calls] == [("a", {}), ("b", {"x": [1, 2]})]
    string_args = p.parse('<tool_call>{"name": "f", "arguments": "{\\"k\\": 1}"}</tool_call>')
    assert string_args.tool_calls[0].arguments == {"k": 1}
    assert p.parse("no calls here").tool_calls == []


@pytest.mark.parametrize("bad", [
    "<tool_call>\n{not json}\n</tool_call>",
    "<tool_call>\n{\"name\": \"bash\", \"arguments\": {}}",  # unterminated
    "<tool_call>[1, 2]</tool_call>",
    "<tool_call>{\"arguments\": {}}</tool_call>",
    "<tool_call>{\"name\": \"x\", \"arguments\": [1]}</tool_call>",
    "<tool_call>{\"name\": \"x\", \"arguments\": \"nope\"}</tool_call>",
])
def test_hermes_malformed_is_content_with_error(bad: str) -> None:
    out = HermesParser().parse("hi " + bad)
    assert out.tool_calls == [] and out.content == "hi " + bad and out.error


def test_parser_registry() -> None:
    assert isinstance(get_parser("qwen"), HermesParser)
    assert isinstance(detect_parser("... <tool_call> ..."), HermesParser)
    assert detect_parser("plain").parse("<tool_call>{}</tool_call>").tool_calls == []
    with pytest.raises(ConfigError, match="unknown tool-call parser"):
        get_parser("nope")


# ----------------------------------------------------------------------------- text assembly


def _push_all(asm: TextAssembler, ids: list[int]) -> list[str]:
    deltas = []
    for t in ids:
        stop = asm.push(t)
        if d := asm.content_delta():
            deltas.append(d)
        if stop:
            break
    return deltas


def test_stop_string_cuts_after_the_completing_token(renderer: ChatRenderer) -> None:
    ids = renderer.encode("alpha beta STOP gamma delta")
    asm = TextAssembler(renderer.decode, renderer.stop_token_ids, ["STOP"])
    deltas = _push_all(asm, ids)
    assert asm.stop_sequence == "STOP"
    kept = asm.kept_ids()
    assert "STOP" in renderer.decode(kept) and "STOP" not in renderer.decode(kept[:-1])
    assert asm.finish() == "alpha beta "
    assert "".join(deltas) == "alpha beta"  # trailing whitespace is held back while streaming
    assert "STOP" not in "".join(deltas)


def test_stream_holds_back_tool_calls_and_handles_utf8(renderer: ChatRenderer) -> None:
    text = "Voilà — 日本語 ok" + "\n" + tool_call_text("bash", {"command": "ls"})
    ids = [*renderer.encode(text), renderer.eot_id]
    asm = TextAssembler(renderer.decode, renderer.stop_token_ids, [], "<tool_call>")
    deltas = _push_all(asm, ids)
    assert asm.finish() == text
    assert "".join(deltas) == "Voilà — 日本語 ok"
    assert HermesParser().parse(asm.text).content == "".join(deltas)


def test_partial_utf8_bytes_never_stream_replacement_chars(renderer: ChatRenderer) -> None:
    # A byte-level model can emit half a character; the stream must wait for the rest.
    table = _gpt2_bytes_to_unicode()
    byte_ids = [renderer.tokenizer.convert_tokens_to_ids(table[b]) for b in "é".encode()]
    asm = TextAssembler(renderer.decode, renderer.stop_token_ids)
    asm.push(byte_ids[0])
    assert asm.content_delta() == ""
    asm.push(byte_ids[1])
    asm.push(renderer.encode("x")[0])
    assert asm.content_delta() == "éx"


def _gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character table (the byte-level BPE alphabet)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = list(bs)
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + len(cs) - 188)
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


# ----------------------------------------------------------------------------- budgets


def test_budgets_from_dict() -> None:
    b = Budgets.from_dict({"max_turns": 3, "max_wall_s": 1.5, "context_overflow": "error"})
    assert b.max_turns == 3 and b.max_wall_s == 1.5 and b.context_overflow == "error"
    assert b.check_before_call(3, 0, 0.0) == "max_turns"
    for bad in ({"max_turns": 0}, {"max_turns": "3"}, {"nope": 1}, {"context_overflow": "x"}, [1]):
        with pytest.raises(ConfigError):
            Budgets.from_dict(bad)


# ----------------------------------------------------------------------------- the session tree


def _gen(renderer: ChatRenderer, text: str, close: bool = True) -> Generation:
    ids = renderer.encode(text) + ([renderer.eot_id] if close else [])
    return Generation(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop" if close else "length")


def _turn(session: Session, renderer: ChatRenderer, msgs: list[dict], tools, text: str, close: bool = True,
          tool_calls: list[dict] | None = None) -> tuple[int, dict]:
    plan = session.plan(msgs, tools)
    reply: dict = {"role": "assistant", "content": text}
    if tool_calls:
        reply["tool_calls"] = tool_calls
    seg = session.commit(plan, _gen(renderer, text if not tool_calls else tool_call_text(
        tool_calls[0]["function"]["name"], json.loads(tool_calls[0]["function"]["arguments"]), text), close), reply)
    return seg, reply


def test_extension_appends_only_the_new_suffix(renderer: ChatRenderer) -> None:
    s = Session("s", renderer, Budgets())
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "list files"}]
    call = {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}
    seg0, reply = _turn(s, renderer, msgs, TOOLS, "", tool_calls=[call])
    # The harness echoes the turn back with the arguments re-serialised and content null → "".
    echoed = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": '{"command":"ls"}'}}]}
    msgs2 = [*msgs, echoed, {"role": "tool", "tool_call_id": "call_1", "content": "a.py"}]
    plan = s.plan(msgs2, TOOLS)
    assert plan.segment == 0
    assert renderer.decode(plan.new_ids) == "\n<|im_start|>user\n<tool_response>\na.py\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    seg1 = s.commit(plan, _gen(renderer, "Done."), {"role": "assistant", "content": "Done."})
    assert seg0 == seg1 == 0 and len(s.segments) == 1
    seg = s.capture().segments[0]
    final = [*msgs, reply, msgs2[-1], {"role": "assistant", "content": "Done."}]
    rendered = renderer.render(final, TOOLS, add_generation_prompt=False)
    assert renderer.decode(seg.token_ids) + "\n" == rendered
    assert seg.token_ids == renderer.encode(rendered)[: len(seg.token_ids)]
    sampled = [t for t, m in zip(seg.token_ids, seg.loss_mask, strict=True) if m]
    assert renderer.decode(sampled) == tool_call_text("bash", {"command": "ls"}) + "<|im_end|>Done.<|im_end|>"
    assert all(lp == 0.0 for lp, m in zip(seg.logprobs, seg.loss_mask, strict=True) if not m)


def test_non_canonical_sampled_tokens_are_kept_exactly(renderer: ChatRenderer) -> None:
    s = Session("s", renderer, Budgets())
    msgs = [{"role": "user", "content": "hi"}]
    odd = [renderer.tokenizer.convert_tokens_to_ids(c) for c in "hello"]  # not how BPE would spell it
    plan = s.plan(msgs, None)
    s.commit(plan, Generation(token_ids=[*odd, renderer.eot_id], logprobs=[-1.0] * 6), {"role": "assistant", "content": "hello"})
    plan2 = s.plan([*msgs, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}], None)
    assert plan2.segment == 0
    assert plan2.prompt_ids[len(plan.prompt_ids) : len(plan.prompt_ids) + 6] == [*odd, renderer.eot_id]


def test_forks_rewrite_subagent_auxiliary(renderer: ChatRenderer) -> None:
    s = Session("s", renderer, Budgets())
    main = [{"role": "system", "content": "agent"}, {"role": "user", "content": "task"}]
    _, r1 = _turn(s, renderer, main, TOOLS, "thinking")
    _turn(s, renderer, [*main, r1, {"role": "user", "content": "go on"}], TOOLS, "more")
    # Compaction: same system prompt and tools, the history replaced by a summary.
    plan = s.plan([main[0], {"role": "user", "content": "summary of the work so far"}], TOOLS)
    assert plan.segment is None and plan.reason == SegmentReason.REWRITE and plan.parent == 0
    s.commit(plan, _gen(renderer, "x"), {"role": "assistant", "content": "x"})
    # Edited history (a tool result rewritten) also forks.
    plan = s.plan([*main, {**r1, "content": "thinking differently"}, {"role": "user", "content": "go on"}], TOOLS)
    assert plan.reason == SegmentReason.REWRITE
    sub = s.plan([{"role": "system", "content": "you are a sub-agent"}, {"role": "user", "content": "search"}], TOOLS)
    assert sub.reason == SegmentReason.SUBAGENT
    aux = s.plan([{"role": "user", "content": "title for: task"}], None)
    assert aux.reason == SegmentReason.AUXILIARY
    segs = s.capture().segments
    assert [x.reason for x in segs] == ["main", "rewrite"] and segs[1].parent == 0
    # The rewrite starts from a fresh render: nothing sampled earlier is trained there.
    assert sum(segs[1].loss_mask) == len(_gen(renderer, "x").token_ids)
    # The final conversation is the latest non-auxiliary one.
    assert s.capture().messages[-1] == {"role": "assistant", "content": "x"}


def test_same_assistant_turn_rules() -> None:
    held = {"role": "assistant", "content": "a", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}
    assert same_assistant_turn(held, {**held, "content": "edited"})  # ids decide
    other_id = {**held, "tool_calls": [{**held["tool_calls"][0], "id": "zz"}]}
    assert same_assistant_turn(held, other_id)  # same call, other id: content + arguments decide
    changed = {**held, "tool_calls": [{"id": "zz", "type": "function", "function": {"name": "f", "arguments": '{"x": 2}'}}]}
    assert not same_assistant_turn(held, changed)
    assert same_assistant_turn({"role": "assistant", "content": " hi \n"}, {"role": "assistant", "content": "hi"})
    assert not same_assistant_turn({"role": "assistant", "content": "hi"}, {"role": "user", "content": "hi"})


def test_routing_is_assembled_per_segment(renderer: ChatRenderer) -> None:
    s = Session("s", renderer, Budgets())
    msgs = [{"role": "user", "content": "hi"}]
    plan = s.plan(msgs, None)
    gen = _gen(renderer, "yo")
    p, t = len(plan.prompt_ids), len(gen.token_ids)
    routing = np.arange((p + t) * 2 * 2, dtype=np.int16).reshape(p + t, 2, 2)
    routing[-1] = -1  # the last sampled token was never fed forward
    gen.routed_experts = routing
    s.commit(plan, gen, {"role": "assistant", "content": "yo"})
    plan2 = s.plan([*msgs, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "x"}], None)
    gen2 = _gen(renderer, "z")
    total = len(plan2.prompt_ids) + len(gen2.token_ids)
    r2 = np.full((total, 2, 2), 7, dtype=np.int16)
    gen2.routed_experts = r2
    s.commit(plan2, gen2, {"role": "assistant", "content": "z"})
    seg = s.capture().segments[0]
    arr = np.array(seg.routed_experts, dtype=np.int16).reshape(-1, 2, 2)
    assert seg.routing_layers == 2 and seg.routing_top_k == 2 and arr.shape[0] == len(seg.token_ids)
    assert (arr[: p + t - 1] == routing[:-1]).all()  # what was recorded when sampled stays
    assert (arr[p + t - 1] == 7).all()  # the -1 row is filled from the next call's prefill
    assert (arr[p + t :] == 7).all()


def test_turn_ended_by_another_stop_token_is_closed_by_the_template(renderer: ChatRenderer) -> None:
    s = Session("s", renderer, Budgets())
    msgs = [{"role": "user", "content": "hi"}]
    eos = renderer.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    plan = s.plan(msgs, None)
    s.commit(plan, Generation(token_ids=[*renderer.encode("yo"), eos], logprobs=[-1.0] * 2), {"role": "assistant", "content": "yo"})
    plan2 = s.plan([*msgs, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "x"}], None)
    assert plan2.segment == 0
    assert renderer.decode(plan2.new_ids).startswith("<|im_end|>\n<|im_start|>user\nx")


def test_anthropic_system_entries_inside_messages_are_kept_in_order() -> None:
    # Claude Code >= 2.1.250 sends an environment block as a `system` entry mid-conversation.
    from legorl.proxy.anthropic_api import parse_request
    from legorl.proxy.validate import BadRequest

    body = {"model": "m", "max_tokens": 8, "system": [{"type": "text", "text": "top"}], "messages": [
        {"role": "user", "content": "hi"},
        {"role": "system", "content": [{"type": "text", "text": "env: /testbed"}]},
        {"role": "user", "content": "go"},
    ]}
    req, _ = parse_request(body, "m")
    assert [(m["role"], m["content"]) for m in req.messages] == [
        ("system", "top"), ("user", "hi"), ("system", "env: /testbed"), ("user", "go")]
    body["messages"][1]["role"] = "robot"
    with pytest.raises(BadRequest, match=r"messages\[1\]\.role"):
        parse_request(body, "m")
