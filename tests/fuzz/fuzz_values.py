"""Values the fuzz suite throws: JSON of any shape (lone surrogates included), odd number literals
spliced into JSON text, and request bodies mutated from valid ones."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st
from proxy_support import ANTHROPIC_TOOLS, TOOLS

SURROGATES = st.sampled_from(["\ud800", "a\udfffb", "\udc00\ud800", "\ud83d", "x\ud800\udc00"])
TEXT = st.text(max_size=20) | SURROGATES
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True, allow_infinity=True)
    | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)

#: JSON text Python's json module reads as something odd (or refuses): spliced in for a placeholder.
ODD_LITERALS = [
    "1e308", "-1e308", "1e999", "-1e999", "-0", "-0.0", "5e-324", "NaN", "Infinity", "-Infinity",
    "1" + "0" * 5000, "123456789012345678901234567890", '"NaN"', '"1e308"', '"\\ud800"', '"\\udfff\\ud800"',
    '"\\u0000"', "[" * 3000 + "]" * 3000, '{"a":' * 3000 + "1" + "}" * 3000, '""', "[]", "{}", "true", "null",
]
PLACEHOLDER = "\u2063odd\u2063"  # a value no strategy draws: replaced by an odd literal in the text

OPENAI_BASE: dict[str, Any] = {"model": "m", "max_tokens": 4, "tools": TOOLS,
                               "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}
ANTHROPIC_BASE: dict[str, Any] = {"model": "m", "max_tokens": 4, "system": "s", "tools": ANTHROPIC_TOOLS,
                                  "messages": [{"role": "user", "content": [{"type": "text", "text": "u"}]}]}
KEYS = ["messages", "tools", "tool_choice", "stream", "stream_options", "max_tokens", "max_completion_tokens",
        "temperature", "top_p", "top_k", "stop", "stop_sequences", "seed", "n", "system", "thinking", "metadata",
        "logprobs", "return_token_ids", "parallel_tool_calls", "reasoning_effort", "model", "top_logprobs"]


def _value(data: st.DataObject) -> Any:
    return PLACEHOLDER if data.draw(st.integers(0, 4)) == 0 else data.draw(JSON)


def mutate(base: dict[str, Any], data: st.DataObject) -> dict[str, Any]:
    """``base`` with one to three fields (top level, last message, a content block, a tool) replaced."""
    body: dict[str, Any] = json.loads(json.dumps(base))
    for _ in range(data.draw(st.integers(1, 3))):
        where = data.draw(st.sampled_from(["top", "message", "block", "tool"]))
        value = _value(data)
        if where == "top":
            body[data.draw(st.sampled_from(KEYS) | st.text(max_size=8))] = value
        elif where == "message" and isinstance(body.get("messages"), list) and body["messages"]:
            msg = body["messages"][-1]
            if isinstance(msg, dict):
                msg[data.draw(st.sampled_from(["role", "content", "tool_calls", "tool_call_id", "name"]))] = value
        elif where == "block" and isinstance(body.get("messages"), list) and body["messages"]:
            msg = body["messages"][-1]
            if isinstance(msg, dict):
                msg["content"] = [data.draw(st.fixed_dictionaries(
                    {"type": st.sampled_from(["text", "tool_result", "tool_use", "image", "thinking", "x"])},
                    optional={"text": JSON, "content": JSON, "input": JSON, "id": JSON, "name": JSON,
                              "tool_use_id": JSON}))]
        elif where == "tool" and isinstance(body.get("tools"), list) and body["tools"]:
            tool = body["tools"][0]
            if isinstance(tool, dict):
                tool[data.draw(st.sampled_from(["function", "name", "input_schema", "type", "parameters"]))] = value
    return body


def encode(body: Any, data: st.DataObject) -> bytes:
    """``body`` as JSON bytes (ASCII: lone surrogates travel as escapes), each placeholder replaced
    by an odd literal."""
    text = json.dumps(body)
    quoted = json.dumps(PLACEHOLDER)
    while quoted in text:
        text = text.replace(quoted, data.draw(st.sampled_from(ODD_LITERALS)), 1)
    return text.encode()
