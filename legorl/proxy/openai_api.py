"""OpenAI Chat Completions: request validation → canonical :class:`ChatRequest`, and response /
SSE chunk shaping.

Accepted and ignored (typed where the type is known): ``reasoning_effort``, ``prompt_cache_key``,
``parallel_tool_calls``, ``user``, ``metadata``, ``store``, penalties, ``response_format``,
``logit_bias``, and anything else. ``extra_body`` fields arrive at the top level (the client
merges them); ``return_token_ids: true`` adds vLLM's ``prompt_token_ids`` / per-choice
``token_ids`` to the response, ``logprobs: true`` the sampled tokens' logprobs.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass
from typing import Any

from legorl.proxy.core import Api, CallResult, ChatRequest
from legorl.proxy.render import ChatRenderer
from legorl.proxy.request_parts import (
    content_text,
    function_tool,
    messages_array,
    temperature_and_top_p,
    tool_specs,
)
from legorl.proxy.validate import (
    INT64_MAX,
    INT64_MIN,
    BadRequest,
    check_types,
    obj,
    opt_bool,
    opt_int,
    opt_list,
    opt_obj,
    opt_str,
    req_str,
)
from legorl.proxy.wire import openai_error, sse, token_logprobs

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
          "tool": "tool", "function": "tool"}

_IGNORED_TYPES: dict[str, type | tuple[type, ...]] = {
    "reasoning_effort": str, "prompt_cache_key": str, "parallel_tool_calls": bool, "user": str,
    "metadata": dict, "store": bool, "frequency_penalty": (int, float), "presence_penalty": (int, float),
    "response_format": dict, "logit_bias": dict, "service_level": str, "service_tier": str,
    "return_token_ids": bool, "top_logprobs": int, "repetition_penalty": (int, float), "min_p": (int, float),
}


@dataclass
class OpenAIOptions:
    model: str
    include_usage: bool = False
    logprobs: bool = False
    return_token_ids: bool = False


def overflow(message: str) -> BadRequest:
    """The 400 a prompt over the context gets."""
    return BadRequest(f"This model's maximum context length was exceeded: {message}", "messages",
                      code="context_length_exceeded")


def _tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise BadRequest(f"{where}: expected an array", where)
    out = []
    for i, tc in enumerate(value):
        w = f"{where}[{i}]"
        tc = obj(tc, w)
        fn = obj(tc.get("function"), f"{w}.function")
        name = req_str(fn, "name", f"{w}.function.")
        args = fn.get("arguments", "{}")
        if isinstance(args, dict):
            args = json.dumps(args, ensure_ascii=False)
        elif args is None:
            args = "{}"
        elif not isinstance(args, str):
            raise BadRequest(f"{w}.function.arguments: expected a JSON string", f"{w}.function.arguments")
        call_id = tc.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise BadRequest(f"{w}.id: expected a string", f"{w}.id")
        out.append({"id": call_id or "", "type": "function", "function": {"name": name, "arguments": args}})
    return out


def canonical_messages(value: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages_array(value)):
        w = f"messages[{i}]"
        m = obj(m, w)
        role = m.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise BadRequest(f"{w}.role: must be one of {', '.join(_ROLES)}", f"{w}.role")
        canon_role = _ROLES[role]
        msg: dict[str, Any] = {"role": canon_role, "content": content_text(m.get("content"), f"{w}.content")}
        if canon_role == "assistant" and m.get("tool_calls") is not None:
            calls = _tool_calls(m["tool_calls"], f"{w}.tool_calls")
            if calls:
                msg["tool_calls"] = calls
        if canon_role == "tool":
            msg["tool_call_id"] = opt_str(m, "tool_call_id", f"{w}.") or ""
        name = opt_str(m, "name", f"{w}.")
        if name is not None and canon_role == "tool":
            msg["name"] = name
        out.append(msg)
    return out


def canonical_tools(value: Any) -> list[dict[str, Any]] | None:
    out = []
    for w, t in tool_specs(value):
        if t.get("type", "function") != "function":
            continue  # built-in tools of other providers: not renderable, skipped
        out.append(function_tool(obj(t.get("function"), f"{w}.function"), "parameters", f"{w}.function."))
    return out or None


def parse_request(body: Any, default_model: str) -> tuple[ChatRequest, OpenAIOptions]:
    body = obj(body, "body")
    messages = canonical_messages(body.get("messages"))
    tools = canonical_tools(body.get("tools"))
    choice = body.get("tool_choice")
    parse_tools = True
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise BadRequest("tool_choice: must be none, auto, required or a function", "tool_choice")
        parse_tools = choice != "none"
    elif choice is not None and not isinstance(choice, dict):
        raise BadRequest("tool_choice: must be a string or an object", "tool_choice")
    model = opt_str(body, "model") or default_model
    stream = opt_bool(body, "stream")
    options = opt_obj(body, "stream_options")
    include_usage = opt_bool(options, "include_usage", where="stream_options.") if options else False
    max_tokens = opt_int(body, "max_completion_tokens", lo=1)
    legacy = opt_int(body, "max_tokens", lo=1)
    if max_tokens is None:
        max_tokens = legacy
    n = opt_int(body, "n", lo=1)
    if n is not None and n != 1:
        raise BadRequest("n: only 1 is supported", "n")
    stop_raw = body.get("stop")
    if stop_raw is None:
        stop: list[str] = []
    elif isinstance(stop_raw, str):
        stop = [stop_raw]
    elif isinstance(stop_raw, list) and all(isinstance(s, str) for s in stop_raw):
        stop = list(stop_raw)
    else:
        raise BadRequest("stop: expected a string or an array of strings", "stop")
    temperature, top_p = temperature_and_top_p(body, max_temperature=2.0)
    top_k = opt_int(body, "top_k", hi=INT64_MAX)
    seed = opt_int(body, "seed", lo=INT64_MIN, hi=INT64_MAX)
    logprobs = opt_bool(body, "logprobs")
    opt_list(body, "modalities")
    check_types(body, _IGNORED_TYPES)
    req = ChatRequest(
        api=Api.CHAT, messages=messages, tools=tools, parse_tools=parse_tools, stream=stream,
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=max(0, top_k or 0), seed=seed,
        stop=stop,
    )
    return req, OpenAIOptions(model=model, include_usage=include_usage, logprobs=logprobs,
                              return_token_ids=body.get("return_token_ids") is True)


# ---------------------------------------------------------------------------- responses

_FINISH = {"stop": "stop", "stop_sequence": "stop", "length": "length", "tool_calls": "tool_calls"}


def _tool_calls_out(result: CallResult) -> list[dict[str, Any]]:
    return [
        {"id": tc.id, "type": "function", "function": {"name": tc.name, "arguments": tc.arguments_json()}}
        for tc in result.tool_calls
    ]


def _usage(result: CallResult) -> dict[str, int]:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens}


def _logprobs(result: CallResult, renderer: ChatRenderer) -> dict[str, Any]:
    return {"content": token_logprobs(result, renderer)}


def response(result: CallResult, opts: OpenAIOptions, renderer: ChatRenderer) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": result.content}
    if result.tool_calls:
        message["tool_calls"] = _tool_calls_out(result)
        if not result.content:
            message["content"] = None
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": _FINISH[result.finish],
                              "logprobs": _logprobs(result, renderer) if opts.logprobs else None}
    out: dict[str, Any] = {
        "id": "chatcmpl-" + secrets.token_hex(12), "object": "chat.completion", "created": int(time.time()),
        "model": opts.model, "choices": [choice], "usage": _usage(result),
    }
    if opts.return_token_ids:
        out["prompt_token_ids"] = result.prompt_ids
        choice["token_ids"] = result.token_ids
    return out


class ChunkStream:
    """Builds the SSE ``data:`` lines of a streamed chat completion."""

    def __init__(self, opts: OpenAIOptions, renderer: ChatRenderer):
        self.opts = opts
        self.id = "chatcmpl-" + secrets.token_hex(12)
        self.created = int(time.time())

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> bytes:
        data = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.opts.model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        return sse(data)

    def start(self, prompt_tokens: int) -> bytes:
        return self._chunk({"role": "assistant", "content": ""})

    def text(self, text: str) -> bytes:
        return self._chunk({"content": text})

    def end(self, result: CallResult, streamed: str) -> bytes:
        out = b""
        if result.content.startswith(streamed) and len(result.content) > len(streamed):
            out += self.text(result.content[len(streamed):])
        for i, tc in enumerate(_tool_calls_out(result)):
            out += self._chunk({"tool_calls": [{"index": i, **tc}]})
        final: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                 "model": self.opts.model,
                 "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": _FINISH[result.finish]}]}
        if self.opts.return_token_ids:
            final["prompt_token_ids"] = result.prompt_ids
            final["choices"] = [{**final["choices"][0], "token_ids": result.token_ids}]
        out += sse(final)
        if self.opts.include_usage:
            out += sse({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                        "model": self.opts.model, "choices": [], "usage": _usage(result)})
        return out + b"data: [DONE]\n\n"

    def failed(self, message: str) -> bytes:
        return sse(openai_error(500, message))

