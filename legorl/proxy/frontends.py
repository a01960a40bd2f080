"""The three API dialects side by side, one table from a dialect to its front end: the routes it
serves, how it reads a body, shapes a reply or a stream, and says an error.

Each front end is a plain module (:mod:`.openai_api`, :mod:`.responses_api`, :mod:`.anthropic_api`);
what they share lives below them (:mod:`.request_parts`, :mod:`.wire`), never in one another."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from legorl.proxy import anthropic_api, openai_api, responses_api
from legorl.proxy.core import Api, CallResult, ChatRequest
from legorl.proxy.render import ChatRenderer
from legorl.proxy.validate import BadRequest
from legorl.proxy.wire import openai_error


class Stream(Protocol):
    """The SSE bytes of one streamed reply, in the order they are sent."""

    def start(self, prompt_tokens: int) -> bytes: ...

    def text(self, text: str) -> bytes: ...

    def end(self, result: CallResult, streamed: str) -> bytes: ...

    def failed(self, message: str) -> bytes: ...  # the call failed after the stream began


@dataclass(frozen=True)
class FrontEnd:
    api: Api
    routes: tuple[str, ...]
    parse: Callable[[Any, str], tuple[ChatRequest, Any]]  # (body, default model) -> (request, reply options)
    respond: Callable[[CallResult, Any, ChatRenderer], dict[str, Any]]
    stream: Callable[[Any, ChatRenderer], Stream]
    error: Callable[[int, str, str | None, str | None], dict[str, Any]]  # (status, message, param, code)
    overflow: Callable[[str], BadRequest]  # the 400 of a prompt over the context
    items_key: str = "messages"  # the body's conversation
    stop_key: str = "stop"
    system_key: str | None = None  # a system prompt outside the conversation


FRONT_ENDS: dict[Api, FrontEnd] = {fe.api: fe for fe in (
    FrontEnd(Api.CHAT, ("/v1/chat/completions", "/chat/completions"), openai_api.parse_request,
             openai_api.response, openai_api.ChunkStream, openai_error, openai_api.overflow),
    FrontEnd(Api.RESPONSES, ("/v1/responses", "/responses"), responses_api.parse_request, responses_api.response,
             responses_api.EventStream, openai_error, responses_api.overflow, items_key="input"),
    FrontEnd(Api.MESSAGES, ("/v1/messages", "/messages"), anthropic_api.parse_request, anthropic_api.response,
             anthropic_api.EventStream, anthropic_api.error_body, anthropic_api.overflow,
             stop_key="stop_sequences", system_key="system"),
)}
BY_ROUTE: dict[str, FrontEnd] = {route: fe for fe in FRONT_ENDS.values() for route in fe.routes}
COUNT_ROUTES = ("/v1/messages/count_tokens", "/messages/count_tokens")  # Anthropic's, read as a message


def errors_for(path: str) -> FrontEnd:
    """Whose error format a request to ``path`` gets: Anthropic's under ``/messages``, else OpenAI's."""
    return FRONT_ENDS[Api.MESSAGES if "/messages" in path else Api.CHAT]
