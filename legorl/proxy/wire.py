"""What the front ends write alike: JSON bytes, server-sent-event frames, and what OpenAI chat and
Responses share (the error body, the sampled tokens' logprobs)."""

from __future__ import annotations

import json
from typing import Any

from legorl.proxy.core import CallResult
from legorl.proxy.render import ChatRenderer


def dumps(data: Any) -> bytes:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()


def sse(data: dict[str, Any]) -> bytes:
    """An unnamed event (OpenAI chat completions' chunks)."""
    return b"data: " + dumps(data) + b"\n\n"


def event(name: str, data: dict[str, Any]) -> bytes:
    """A named event (Anthropic Messages, OpenAI Responses)."""
    return b"event: " + name.encode() + b"\ndata: " + dumps(data) + b"\n\n"


def token_logprobs(result: CallResult, renderer: ChatRenderer) -> list[dict[str, Any]]:
    """Each sampled token (tool-call text included) with its logprob, as ``logprobs`` entries."""
    return [{"token": renderer.decode([t]), "logprob": lp, "bytes": None, "top_logprobs": []}
            for t, lp in zip(result.token_ids, result.logprobs, strict=False)]


_OPENAI_KINDS = {429: "requests", 500: "server_error"}  # else invalid_request_error


def openai_error(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """An OpenAI error body (chat completions and Responses)."""
    return {"error": {"message": message, "type": _OPENAI_KINDS.get(status, "invalid_request_error"),
                      "param": param, "code": code}}
