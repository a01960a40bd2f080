"""Anthropic Messages: request validation → canonical (OpenAI-style) messages, and response / SSE
event shaping.

Translation to canonical messages:

- ``system`` (a string or text blocks, joined by newlines) → a leading ``system`` message;
- a user turn's ``tool_result`` blocks → ``tool`` messages (``tool_call_id`` = ``tool_use_id``),
  its text blocks → a ``user`` message, in block order (consecutive text blocks are joined);
- an assistant turn's text blocks → ``content``, ``tool_use`` blocks → ``tool_calls`` (arguments
  are ``json.dumps(input)``), ``thinking`` / ``redacted_thinking`` blocks are dropped;
- images and documents become a ``[image]`` / ``[document]`` placeholder (the model is text-only);
- ``thinking``, ``context_management``, ``metadata``, ``cache_control``, ``service_tier`` and
  any other field are accepted and ignored; ``?beta=true`` is ignored.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from legorl.proxy.core import Api, CallResult, ChatRequest
from legorl.proxy.render import ChatRenderer
from legorl.proxy.request_parts import (
    function_tool,
    messages_array,
    temperature_and_top_p,
    tool_specs,
)
from legorl.proxy.validate import (
    INT64_MAX,
    BadRequest,
    check_types,
    obj,
    opt_bool,
    opt_int,
    opt_list,
    opt_str,
    req_str,
)
from legorl.proxy.wire import event

_IGNORED_TYPES: dict[str, type | tuple[type, ...]] = {
    "metadata": dict, "thinking": dict, "context_management": dict, "service_tier": str,
    "container": (str, dict), "mcp_servers": list, "betas": list,
}


@dataclass
class AnthropicOptions:
    model: str


_KINDS = {401: "authentication_error", 404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
          500: "api_error"}  # else invalid_request_error


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _KINDS.get(status, "invalid_request_error"), "message": message}}


def overflow(message: str) -> BadRequest:
    """The 400 a prompt over the context gets."""
    return BadRequest(f"prompt is too long: {message}")


def _text_of(value: Any, where: str) -> str:
    """Text of a string or of a list of blocks (tool_result content, system)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise BadRequest(f"{where}: expected a string or an array of blocks", where)
    parts = []
    for i, block in enumerate(value):
        b = obj(block, f"{where}[{i}]")
        kind = b.get("type")
        if kind == "text":
            parts.append(req_str(b, "text", f"{where}[{i}]."))
        elif kind in ("image", "document"):
            parts.append(f"[{kind}]")
        elif not isinstance(kind, str):
            raise BadRequest(f"{where}[{i}].type: required string", f"{where}[{i}].type")
    return "\n".join(parts)


def _typed_blocks(content: Any, where: str) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """``(where[i], type, block)`` for each block of a turn's array of content blocks."""
    if not isinstance(content, list):
        raise BadRequest(f"{where}: expected a string or an array of blocks", where)
    for i, block in enumerate(content):
        w = f"{where}[{i}]"
        b = obj(block, w)
        kind = b.get("type")
        if not isinstance(kind, str):
            raise BadRequest(f"{w}.type: required string", f"{w}.type")
        yield w, kind, b


def _user_turn(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    out: list[dict[str, Any]] = []
    texts: list[str] = []

    def flush() -> None:
        if texts:
            out.append({"role": "user", "content": "\n".join(texts)})
            texts.clear()

    for w, kind, b in _typed_blocks(content, where):
        if kind == "text":
            texts.append(req_str(b, "text", f"{w}."))
        elif kind == "tool_result":
            flush()
            tool_use_id = req_str(b, "tool_use_id", f"{w}.")
            opt_bool(b, "is_error", where=f"{w}.")
            out.append({"role": "tool", "tool_call_id": tool_use_id, "content": _text_of(b.get("content"), f"{w}.content")})
        elif kind in ("image", "document"):
            texts.append(f"[{kind}]")
        # other block types (search results, server tool results...) carry nothing the model reads
    flush()
    if not out:
        out.append({"role": "user", "content": ""})
    return out


def _assistant_turn(content: Any, where: str) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for w, kind, b in _typed_blocks(content, where):
        if kind == "text":
            texts.append(req_str(b, "text", f"{w}."))
        elif kind == "tool_use":
            call_id = req_str(b, "id", f"{w}.")
            name = req_str(b, "name", f"{w}.")
            args = b.get("input", {})
            if not isinstance(args, dict):
                raise BadRequest(f"{w}.input: expected an object", f"{w}.input")
            calls.append({"id": call_id, "type": "function",
                          "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        msg["tool_calls"] = calls
    return msg


def canonical_tools(value: Any) -> list[dict[str, Any]] | None:
    out = []
    for w, t in tool_specs(value):
        if "input_schema" not in t and t.get("type") not in (None, "custom"):
            continue  # server tools (web search, bash_2025...): nothing the model renders
        out.append(function_tool(t, "input_schema", f"{w}."))
    return out or None


def parse_request(body: Any, default_model: str) -> tuple[ChatRequest, AnthropicOptions]:
    body = obj(body, "body")
    raw = messages_array(body.get("messages"))
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        text = _text_of(system, "system")
        if text or isinstance(system, str):
            messages.append({"role": "system", "content": text})
    for i, m in enumerate(raw):
        w = f"messages[{i}]"
        m = obj(m, w)
        role = m.get("role")
        if role == "user":
            messages.extend(_user_turn(m.get("content"), f"{w}.content"))
        elif role == "assistant":
            messages.append(_assistant_turn(m.get("content"), f"{w}.content"))
        elif role == "system":  # Claude Code >= 2.1.250 sends environment blocks mid-conversation
            messages.append({"role": "system", "content": _text_of(m.get("content"), f"{w}.content")})
        else:
            raise BadRequest(f"{w}.role: must be 'user', 'assistant' or 'system'", f"{w}.role")
    tools = canonical_tools(body.get("tools"))
    choice = body.get("tool_choice")
    parse_tools = True
    if choice is not None:
        choice = obj(choice, "tool_choice")
        kind = choice.get("type")
        if kind not in ("auto", "any", "tool", "none"):
            raise BadRequest("tool_choice.type: must be auto, any, tool or none", "tool_choice.type")
        parse_tools = kind != "none"
    model = opt_str(body, "model") or default_model
    max_tokens = opt_int(body, "max_tokens", lo=1)
    stop = opt_list(body, "stop_sequences") or []
    if not all(isinstance(s, str) for s in stop):
        raise BadRequest("stop_sequences: expected an array of strings", "stop_sequences")
    temperature, top_p = temperature_and_top_p(body, max_temperature=1.0)
    top_k = opt_int(body, "top_k", lo=0, hi=INT64_MAX)
    stream = opt_bool(body, "stream")
    check_types(body, _IGNORED_TYPES)
    req = ChatRequest(
        api=Api.MESSAGES, messages=messages, tools=tools, parse_tools=parse_tools, stream=stream,
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k or 0, stop=list(stop),
    )
    return req, AnthropicOptions(model=model)


# ---------------------------------------------------------------------------- responses

_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "stop_sequence": "stop_sequence"}


def _usage(result: CallResult) -> dict[str, Any]:
    return {"input_tokens": result.prompt_tokens, "output_tokens": result.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}


def response(result: CallResult, opts: AnthropicOptions, renderer: ChatRenderer) -> dict[str, Any]:
    blocks: list[dict[str, Any]] = []
    if result.content or not result.tool_calls:
        blocks.append({"type": "text", "text": result.content})
    for tc in result.tool_calls:
        blocks.append({"type": "tool_use", "id": tc.id, "name": tc.name, "input": tc.arguments})
    return {
        "id": "msg_" + secrets.token_hex(12), "type": "message", "role": "assistant", "model": opts.model,
        "content": blocks, "stop_reason": _STOP[result.finish], "stop_sequence": result.stop_sequence,
        "usage": _usage(result),
    }


class EventStream:
    """Builds the SSE events of a streamed message, in the order the real API sends them."""

    def __init__(self, opts: AnthropicOptions, renderer: ChatRenderer):
        self.opts = opts
        self.id = "msg_" + secrets.token_hex(12)
        self.index = 0
        self.text_open = False

    def start(self, prompt_tokens: int) -> bytes:
        message: dict[str, Any] = {"id": self.id, "type": "message", "role": "assistant", "model": self.opts.model,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": prompt_tokens, "output_tokens": 0,
                             "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}
        return event("message_start", {"type": "message_start", "message": message}) + event(
            "ping", {"type": "ping"})

    def _open_text(self) -> bytes:
        self.text_open = True
        return event("content_block_start", {"type": "content_block_start", "index": self.index,
                                             "content_block": {"type": "text", "text": ""}})

    def text(self, text: str) -> bytes:
        out = b"" if self.text_open else self._open_text()
        return out + event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                   "delta": {"type": "text_delta", "text": text}})

    def end(self, result: CallResult, streamed: str) -> bytes:
        out = b""
        rest = result.content[len(streamed):] if result.content.startswith(streamed) else ""
        if rest:
            out += self.text(rest)
        elif not self.text_open and not result.tool_calls:
            out += self._open_text()
        if self.text_open:
            out += event("content_block_stop", {"type": "content_block_stop", "index": self.index})
            self.index += 1
        for tc in result.tool_calls:
            out += event("content_block_start", {
                "type": "content_block_start", "index": self.index,
                "content_block": {"type": "tool_use", "id": tc.id, "name": tc.name, "input": {}}})
            out += event("content_block_delta", {
                "type": "content_block_delta", "index": self.index,
                "delta": {"type": "input_json_delta", "partial_json": tc.arguments_json()}})
            out += event("content_block_stop", {"type": "content_block_stop", "index": self.index})
            self.index += 1
        out += event("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": _STOP[result.finish], "stop_sequence": result.stop_sequence},
            "usage": {"output_tokens": result.completion_tokens, "input_tokens": result.prompt_tokens}})
        return out + event("message_stop", {"type": "message_stop"})

    def failed(self, message: str) -> bytes:
        return event("error", error_body(500, message))
