"""OpenAI Responses: request validation → canonical :class:`ChatRequest`, and response / SSE event
shaping. Served stateless, the way agent CLIs use it (Codex CLI: ``store: false``, the whole
conversation in every request): nothing is stored, so ``previous_response_id``, ``conversation``,
``item_reference`` input items and ``background`` are refused with a 400 naming the field.

Translation to canonical messages:

- ``instructions`` → a leading ``system`` message; ``input`` as a string → one ``user`` message;
- ``message`` items (``type`` may be omitted): roles ``system`` / ``developer`` → ``system``,
  ``user``, ``assistant``; content a string or ``input_text`` / ``output_text`` parts (joined by
  newlines, images as ``[image]``), as chat completions reads content;
- ``function_call`` items join the assistant message just before them (a reply's text and its
  calls are separate items here, one turn in the chat template) as ``tool_calls`` (``id`` =
  ``call_id``), else start an assistant message with empty content; ``function_call_output``
  → a ``tool`` message (``tool_call_id`` = ``call_id``);
- ``reasoning`` items are dropped (the served models do not reason); any other item type is a
  400 naming it: silently dropping an item would show the policy a different conversation.

Tools: ``function`` tools are served; every other tool type (``web_search``, ``local_shell``,
``custom`` / freeform, ``file_search``, ``mcp``…) is dropped, as the chat and Messages paths drop
built-in tools: the policy can only call what the chat template renders. ``tool_choice``
``"none"`` turns tool-call parsing off; ``parallel_tool_calls``, ``reasoning``, ``text``,
``prompt_cache_key``, ``metadata``, ``store`` and any other field are accepted (typed where the
type is known) and ignored. ``max_output_tokens`` caps the sampled tokens; ``seed`` (via
``extra_body``) is honoured as in chat completions; ``include`` is honoured for
``message.output_text.logprobs`` (every sampled token's logprob on the text, as chat completions'
``logprobs: true``) and otherwise ignored (there is no encrypted reasoning to return).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from legorl.proxy.core import Api, CallResult, ChatRequest
from legorl.proxy.render import ChatRenderer
from legorl.proxy.request_parts import content_text, function_tool, temperature_and_top_p, tool_specs
from legorl.proxy.validate import (
    INT64_MAX,
    INT64_MIN,
    BadRequest,
    check_types,
    obj,
    opt_bool,
    opt_int,
    opt_list,
    opt_str,
    req_str,
)
from legorl.proxy.wire import event, token_logprobs

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}

_IGNORED_TYPES: dict[str, type | tuple[type, ...]] = {
    "parallel_tool_calls": bool, "prompt_cache_key": str, "reasoning": dict, "text": dict, "metadata": dict,
    "store": bool, "user": str, "safety_identifier": str, "service_tier": str, "truncation": str,
    "max_tool_calls": int, "top_logprobs": int, "prompt_cache_retention": str, "stream_options": dict,
    "prompt": dict,
}

# Fields that need state this proxy does not keep.
_STATEFUL = ("previous_response_id", "conversation")


@dataclass
class ResponsesOptions:
    """What the response object echoes of the request."""

    model: str
    instructions: str | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    max_output_tokens: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    text: dict[str, Any] = field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: dict[str, Any] | None = None
    logprobs: bool = False  # include: ["message.output_text.logprobs"]


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if not isinstance(role, str) or role not in _ROLES:
        raise BadRequest(f"{where}.role: must be one of {', '.join(_ROLES)}", f"{where}.role")
    return {"role": _ROLES[role], "content": content_text(item.get("content"), f"{where}.content")}


def canonical_input(value: Any) -> list[dict[str, Any]]:
    """The canonical messages of a request's ``input`` (see the module docstring)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise BadRequest("input: required string or array of items", "input")
    out: list[dict[str, Any]] = []
    for i, raw in enumerate(value):
        w = f"input[{i}]"
        item = obj(raw, w)
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(item, w))
        elif kind == "function_call":
            call = {"id": req_str(item, "call_id", f"{w}."), "type": "function",
                    "function": {"name": req_str(item, "name", f"{w}."),
                                 "arguments": req_str(item, "arguments", f"{w}.")}}
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            call_id = req_str(item, "call_id", f"{w}.")
            out.append({"role": "tool", "tool_call_id": call_id,
                        "content": content_text(item.get("output"), f"{w}.output")})
        elif kind == "reasoning":
            continue
        elif not isinstance(kind, str):
            raise BadRequest(f"{w}.type: required string", f"{w}.type")
        elif kind == "item_reference":
            raise BadRequest(f"{w}: item_reference needs stored items; this proxy stores none: send the "
                             "item itself", f"{w}.type")
        else:
            raise BadRequest(f"{w}.type: unsupported input item type {kind!r} (served: message, "
                             "function_call, function_call_output, reasoning)", f"{w}.type")
    return out


def canonical_tools(value: Any) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]]]:
    """The canonical tools of the request's ``tools`` (function tools only), and those tools as given."""
    out, served = [], []
    for w, t in tool_specs(value):
        kind = t.get("type")
        if not isinstance(kind, str):
            raise BadRequest(f"{w}.type: required string", f"{w}.type")
        if kind == "function":
            opt_bool(t, "strict", where=f"{w}.")
            out.append(function_tool(t, "parameters", f"{w}."))
            served.append(t)
        # other tool types are dropped (see the module docstring)
    return out or None, served


def _tool_choice(value: Any) -> Any:
    if value is None:
        return "auto"
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise BadRequest("tool_choice: must be none, auto, required or an object", "tool_choice")
        return value
    choice = obj(value, "tool_choice")
    req_str(choice, "type", "tool_choice.")
    return choice


def parse_request(body: Any, default_model: str) -> tuple[ChatRequest, ResponsesOptions]:
    body = obj(body, "body")
    for key in _STATEFUL:
        if body.get(key) is not None:
            raise BadRequest(f"{key}: not supported: this proxy stores no responses (use store: false and "
                             "send the whole conversation as input)", key)
    if opt_bool(body, "background"):
        raise BadRequest("background: not supported: this proxy stores no responses", "background")
    messages: list[dict[str, Any]] = []
    instructions = opt_str(body, "instructions")
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
    if body.get("input") is None:
        raise BadRequest("input: required string or array of items", "input")
    messages += canonical_input(body["input"])
    if not messages:
        raise BadRequest("input: must not be empty", "input")
    tools, served = canonical_tools(body.get("tools"))
    choice = _tool_choice(body.get("tool_choice"))
    max_output_tokens = opt_int(body, "max_output_tokens", lo=1)
    temperature, top_p = temperature_and_top_p(body, max_temperature=2.0)
    seed = opt_int(body, "seed", lo=INT64_MIN, hi=INT64_MAX)
    stream = opt_bool(body, "stream")
    include = opt_list(body, "include") or []
    if not all(isinstance(s, str) for s in include):
        raise BadRequest("include: expected an array of strings", "include")
    check_types(body, _IGNORED_TYPES)
    req = ChatRequest(
        api=Api.RESPONSES, messages=messages, tools=tools, parse_tools=choice != "none", stream=stream,
        max_tokens=max_output_tokens, temperature=temperature, top_p=top_p, seed=seed,
    )
    opts = ResponsesOptions(
        model=opt_str(body, "model") or default_model, instructions=instructions, tools=served,
        tool_choice=choice, parallel_tool_calls=opt_bool(body, "parallel_tool_calls", default=True),
        temperature=temperature, top_p=top_p, max_output_tokens=max_output_tokens,
        metadata=body.get("metadata") or {}, text=body.get("text") or {"format": {"type": "text"}},
        reasoning=body.get("reasoning"), logprobs="message.output_text.logprobs" in include,
    )
    return req, opts


# ---------------------------------------------------------------------------- responses


def overflow(message: str) -> BadRequest:
    """The 400 a prompt over the context gets."""
    return BadRequest(f"This model's maximum context length was exceeded: {message}", "input",
                      code="context_length_exceeded")


def _usage(result: CallResult) -> dict[str, Any]:
    return {"input_tokens": result.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": result.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": result.prompt_tokens + result.completion_tokens}


def _text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _message_item(msg_id: str, content: list[dict[str, Any]], status: str) -> dict[str, Any]:
    return {"id": msg_id, "type": "message", "role": "assistant", "status": status, "content": content}


def output_items(result: CallResult, msg_id: str, logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The reply's output items: its text as a message (none when it only calls tools), then one
    ``function_call`` per call (``call_id`` is the id a follow-up's items are matched by).
    ``logprobs``, when asked for, are every sampled token's, on the message's text (as in chat
    completions)."""
    items: list[dict[str, Any]] = []
    if result.content or not result.tool_calls:
        items.append(_message_item(msg_id, [_text_part(result.content, logprobs)], _status(result)))
    for tc in result.tool_calls:
        items.append({"id": "fc_" + tc.id.removeprefix("call_"), "type": "function_call", "status": "completed",
                      "call_id": tc.id, "name": tc.name, "arguments": tc.arguments_json()})
    return items


def _response(opts: ResponsesOptions, resp_id: str, created: int, status: str,
              output: list[dict[str, Any]], result: CallResult | None = None) -> dict[str, Any]:
    return {
        "id": resp_id, "object": "response", "created_at": created, "status": status,
        "background": False, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": opts.instructions, "max_output_tokens": opts.max_output_tokens, "model": opts.model,
        "output": output, "parallel_tool_calls": opts.parallel_tool_calls, "previous_response_id": None,
        "reasoning": opts.reasoning, "store": False, "temperature": opts.temperature, "text": opts.text,
        "tool_choice": opts.tool_choice, "tools": opts.tools, "top_p": opts.top_p, "truncation": "disabled",
        "usage": _usage(result) if result is not None else None, "metadata": opts.metadata,
    }


def _status(result: CallResult) -> str:
    return "incomplete" if result.finish == "length" else "completed"


def _logprobs(result: CallResult, opts: ResponsesOptions, renderer: ChatRenderer) -> list[dict[str, Any]] | None:
    return token_logprobs(result, renderer) if opts.logprobs else None


def response(result: CallResult, opts: ResponsesOptions, renderer: ChatRenderer) -> dict[str, Any]:
    items = output_items(result, "msg_" + secrets.token_hex(12), _logprobs(result, opts, renderer))
    return _response(opts, "resp_" + secrets.token_hex(12), int(time.time()), _status(result), items, result)


class EventStream:
    """Builds the SSE events of a streamed response, in the order the real API sends them, each
    with its ``sequence_number``."""

    def __init__(self, opts: ResponsesOptions, renderer: ChatRenderer):
        self.opts = opts
        self.renderer = renderer
        self.id = "resp_" + secrets.token_hex(12)
        self.msg_id = "msg_" + secrets.token_hex(12)
        self.created = int(time.time())
        self.seq = 0
        self.text_open = False

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event(kind, data)

    def start(self, prompt_tokens: int) -> bytes:
        snapshot = _response(self.opts, self.id, self.created, "in_progress", [])
        return (self._event("response.created", response=snapshot)
                + self._event("response.in_progress", response=snapshot))

    def _open_text(self) -> bytes:
        self.text_open = True
        where = {"item_id": self.msg_id, "output_index": 0}
        return (self._event("response.output_item.added", output_index=0,
                            item=_message_item(self.msg_id, [], "in_progress"))
                + self._event("response.content_part.added", **where, content_index=0, part=_text_part("")))

    def text(self, text: str) -> bytes:
        out = b"" if self.text_open else self._open_text()
        return out + self._event("response.output_text.delta", item_id=self.msg_id, output_index=0,
                                 content_index=0, delta=text, logprobs=[])

    def end(self, result: CallResult, streamed: str) -> bytes:
        out = b""
        items = output_items(result, self.msg_id, _logprobs(result, self.opts, self.renderer))
        index = 0
        if items and items[0]["type"] == "message":
            rest = result.content[len(streamed):] if result.content.startswith(streamed) else ""
            if rest:
                out += self.text(rest)
            elif not self.text_open:
                out += self._open_text()
            where = {"item_id": self.msg_id, "output_index": 0}
            part = items[0]["content"][0]
            out += self._event("response.output_text.done", **where, content_index=0, text=part["text"],
                               logprobs=part["logprobs"])
            out += self._event("response.content_part.done", **where, content_index=0, part=part)
            out += self._event("response.output_item.done", output_index=0, item=items[0])
            index = 1
        for i, item in enumerate(items[index:], start=index):
            where = {"item_id": item["id"], "output_index": i}
            out += self._event("response.output_item.added", output_index=i,
                               item={**item, "arguments": "", "status": "in_progress"})
            out += self._event("response.function_call_arguments.delta", **where, delta=item["arguments"])
            out += self._event("response.function_call_arguments.done", **where, arguments=item["arguments"])
            out += self._event("response.output_item.done", output_index=i, item=item)
        status = _status(result)
        final = _response(self.opts, self.id, self.created, status, items, result)
        return out + self._event(f"response.{status}", response=final)

    def failed(self, message: str) -> bytes:
        """The stream's end when the call failed after it began."""
        snapshot = _response(self.opts, self.id, self.created, "failed", [])
        snapshot["error"] = {"code": "server_error", "message": message}
        return self._event("response.failed", response=snapshot)
