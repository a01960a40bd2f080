"""The protocol-independent heart of the proxy: sessions, and one model call from canonical
messages to a captured, parsed reply.

The HTTP layer (``app.py``) turns OpenAI / Anthropic requests into a :class:`ChatRequest` and the
events of :meth:`ProxyCore.call` (text deltas, then one :class:`CallResult`) into responses.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np

from legorl.core.errors import LegorlError
from legorl.core.schemas import Call
from legorl.engines import PromptTooLong, RequestRejected
from legorl.engines.base import Engine, Generation, SamplingParams, current_session
from legorl.engines.config import sampled_temperature
from legorl.engines.watched import WatchedEngine
from legorl.proxy import budgets as B
from legorl.proxy.budgets import Budgets
from legorl.proxy.history import Message
from legorl.proxy.render import ChatRenderer
from legorl.proxy.sessions import InFlight, Plan, Session, SessionCapture, new_session_id
from legorl.proxy.textstream import TextAssembler
from legorl.proxy.toolparse import ParsedOutput, ToolCall, ToolParser, detect_parser
from legorl.proxy.validate import BadRequest


class Api(StrEnum):
    """The API dialect a call came in (its value is what captures and shards record)."""

    CHAT = "openai"  # OpenAI chat completions
    RESPONSES = "responses"  # OpenAI Responses
    MESSAGES = "anthropic"  # Anthropic Messages


@dataclass
class ChatRequest:
    """A model call in canonical form (OpenAI-style messages), whichever API it came from."""

    api: Api
    messages: list[Message]
    tools: list[dict[str, Any]] | None = None
    parse_tools: bool = True  # False for tool_choice "none"
    stream: bool = False
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    body_bytes: int = 0  # the request body's size: what rendering it may cost (see BYTES_PER_TOKEN)


@dataclass
class Started:
    """The prompt is placed and generation begins (streams send their headers now)."""

    prompt_tokens: int


@dataclass
class TextDelta:
    text: str


@dataclass
class CallResult:
    content: str
    tool_calls: list[ToolCall]
    finish: str  # "stop" | "length" | "tool_calls" | "stop_sequence"
    prompt_tokens: int
    completion_tokens: int
    stop_sequence: str | None = None
    prompt_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    parse_error: str | None = None
    budget_stop: str | None = None


@dataclass(frozen=True)
class SamplingOverride:
    """Sampling the policy is run at, whatever the harness asks for (None keeps the request's value).

    For RL the sampling distribution is the trainer's choice, not the harness's: the trainer
    recomputes logprobs at one temperature, and some harnesses (Claude Code) cannot be given one.
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None

    @classmethod
    def policy(cls, temperature: float, top_p: float | None = None) -> SamplingOverride:
        """The policy's own distribution: the full softmax at ``temperature`` (no top-k, top-p 1 unless
        given), the one the trainer can recompute — whatever truncation a harness asks for."""
        return cls(temperature=temperature, top_p=1.0 if top_p is None else top_p, top_k=0)

    def apply(self, req: ChatRequest) -> None:
        if self.temperature is not None:
            req.temperature = self.temperature
        if self.top_p is not None:
            req.top_p = self.top_p
        if self.top_k is not None:
            req.top_k = self.top_k


def _streamed_routing(rows: list[Any], n: int) -> Any:
    """``[n, layers, k]`` routing from streamed chunks' rows, the last (never fed) position -1; None
    when the engine streamed fewer rows (then the segment records its routing as missing)."""
    if not rows:
        return None
    arr = np.concatenate(rows, axis=0)
    if arr.shape[0] == n - 1:
        arr = np.concatenate([arr, np.full((1, *arr.shape[1:]), -1, dtype=arr.dtype)], axis=0)
    return arr[:n] if arr.shape[0] >= n else None


# A request body of more bytes than this per token of the context cannot fit it (JSON-escaped CJK
# text, ~1 token per 6-byte escape, is the densest honest body), so it is an overflow before it is
# rendered: rendering and tokenizing cost time on every session's GIL and memory in proportion to
# the text (a red team's 14 MB prompts to a 1M-token context held other sessions' calls for 40 s).
BYTES_PER_TOKEN = 32


def cannot_fit(req: ChatRequest, ctx: int) -> bool:
    """``req``'s body is too big for a context of ``ctx`` tokens, before anything renders it."""
    return req.body_bytes > BYTES_PER_TOKEN * ctx


class ContextOverflow(Exception):
    """The prompt does not fit the context and the session's budgets ask for an error reply."""


class ProxyCore:
    def __init__(
        self,
        engine: Engine,
        renderer: ChatRenderer,
        parser: ToolParser | None = None,
        default_budgets: Budgets | None = None,
        on_finish: Callable[[SessionCapture], None] | None = None,
        sampling: SamplingOverride | None = None,
    ):
        self.engine = engine
        self.sampling = sampling
        self.renderer = renderer
        self.parser = parser or detect_parser(renderer.chat_template)
        self.default_budgets = default_budgets or Budgets()
        self.on_finish = on_finish
        self.sessions: dict[str, Session] = {}
        self._mu = threading.Lock()

    # ------------------------------------------------------------------ sessions

    def new_session(self, budgets: Budgets | None = None, metadata: dict[str, Any] | None = None,
                    session_id: str | None = None) -> Session:
        sid = session_id or new_session_id()
        session = Session(sid, self.renderer, budgets or self.default_budgets, metadata, model=self.engine.name)
        with self._mu:
            self.sessions.setdefault(sid, session)
            return self.sessions[sid]

    def get(self, session_id: str, create: bool = False) -> Session | None:
        session = self.sessions.get(session_id)
        if session is None and create:
            session = self.new_session(session_id=session_id)
        return session

    def finish(self, session_id: str) -> SessionCapture | None:
        with self._mu:
            session = self.sessions.pop(session_id, None)
        if session is None:
            return None
        capture = session.capture()
        if self.on_finish is not None:
            self.on_finish(capture)
        return capture

    def finish_all(self) -> list[SessionCapture]:
        return [c for sid in list(self.sessions) if (c := self.finish(sid)) is not None]

    # ------------------------------------------------------------------ one call

    async def call(self, session: Session, req: ChatRequest) -> AsyncIterator[Started | TextDelta | CallResult]:
        """Run one model call for ``session``: yields Started, content deltas (streaming only), the result.

        A budget stop yields only the result."""
        async with session.lock:
            started = time.time()
            t0 = time.perf_counter()
            call = Call(index=0, api=req.api.value, stream=req.stream, segment=-1, started_at=started)
            budgets = session.budgets
            stop = budgets.check_before_call(session.turns, session.total_tokens(), session.created_at)
            ctx = min(self.engine.max_context, budgets.max_context or self.engine.max_context)
            if stop is None and cannot_fit(req, ctx):
                if budgets.context_overflow == "error":
                    raise ContextOverflow(f"the request has {req.body_bytes} bytes; the context holds {ctx} tokens")
                stop = B.CONTEXT_OVERFLOW
            if stop is None:
                try:
                    # rendering and tokenizing a long prompt is CPU work: off the event loop, so one
                    # session's huge request never stalls every other session's calls
                    plan = await asyncio.to_thread(session.plan, req.messages, req.tools)
                except Exception as exc:  # the template rejects these messages (or they nest absurdly)
                    raise BadRequest(f"the chat template cannot render these messages: "
                                     f"{type(exc).__name__}: {exc}", "messages") from None
                room = ctx - len(plan.prompt_ids)
                if room < 1:
                    if budgets.context_overflow == "error":
                        raise ContextOverflow(
                            f"the prompt has {len(plan.prompt_ids)} tokens; the context holds {ctx}"
                        )
                    stop = B.CONTEXT_OVERFLOW
            if stop is not None:
                result = self._budget_stop(session, req, stop, call, t0)
                yield result
                return
            max_new = room
            for cap in (req.max_tokens, budgets.max_tokens_per_call):
                if cap is not None:
                    max_new = min(max_new, cap)
            if budgets.max_total_tokens is not None:
                max_new = min(max_new, budgets.max_total_tokens - session.total_tokens() - len(plan.new_ids))
                if max_new < 1:
                    yield self._budget_stop(session, req, B.MAX_TOTAL_TOKENS, call, t0)
                    return
            if self.sampling is not None:
                self.sampling.apply(req)
            params = SamplingParams(
                max_tokens=max_new, temperature=sampled_temperature(req.temperature), top_p=req.top_p, top_k=req.top_k,
                stop_token_ids=self.renderer.stop_token_ids, seed=req.seed,
            )
            marker = self.parser.start_marker if (req.tools and req.parse_tools) else None
            text = TextAssembler(self.renderer.decode, self.renderer.stop_token_ids, req.stop, marker)
            # What the proxy measures of the call while it runs: a trial killed mid-call is judged by it.
            progress = session.in_flight = InFlight(started=t0)
            # Streamed from the engine even when the client wants one answer, so that progress is known;
            # only stop strings and client streaming need the text assembled token by token.
            per_token = bool(req.stream or req.stop)
            try:
                gen: Generation | None = None
                announced = False
                version: int | None = None
                seen_lps: list[float] = []
                seen_routing: list[Any] = []
                stream = self.engine.stream(plan.prompt_ids, params)
                placed = current_session.set(session.id)  # which engine of a pool serves it
                try:
                    async for chunk in stream:
                        if not announced:  # the engine took the request (it may refuse it: a 400)
                            announced = True
                            version = self._call_version()  # read while the call is in flight: exact
                            yield Started(len(plan.prompt_ids))
                        if call.ttft_s is None and chunk.token_ids:
                            call.ttft_s = progress.first_token_s = time.perf_counter() - t0
                        progress.sampled += len(chunk.token_ids)
                        if chunk.final is not None and not per_token:
                            gen = chunk.final
                            break
                        seen_lps.extend(chunk.logprobs)
                        if chunk.routed_experts is not None:
                            seen_routing.append(chunk.routed_experts)
                        cut = False
                        for tid in chunk.token_ids if per_token else ():
                            if text.push(tid):
                                cut = True
                                break
                        if req.stream and (delta := text.content_delta()):
                            yield TextDelta(delta)
                        if chunk.final is not None:
                            gen = chunk.final
                        if cut:
                            break
                finally:
                    await stream.aclose()  # type: ignore[attr-defined]
                    with contextlib.suppress(ValueError):  # resumed in another context: nothing to undo
                        current_session.reset(placed)
                if text.cut is not None:
                    # Cut after the token that completed a stop string (see textstream.py); the
                    # routing of the kept tokens is the final chunk's, else the streamed rows'.
                    kept = text.kept_ids()
                    n = len(plan.prompt_ids) + len(kept)
                    routed = gen.routed_experts if gen else _streamed_routing(seen_routing, n)
                    gen = Generation(
                        token_ids=kept,
                        logprobs=seen_lps[: len(kept)],
                        finish_reason="stop",
                        routed_experts=None if routed is None else routed[:n],
                        prompt_tokens=len(plan.prompt_ids),
                    )
                elif gen is None:
                    raise RuntimeError("the engine's stream ended without a final chunk")
                if not per_token:
                    text.ids = list(gen.token_ids)  # no stop strings: one decode at the end suffices
                if not all(map(math.isfinite, gen.logprobs)):  # the engine's fault: never recorded
                    raise LegorlError("the engine returned a non-finite logprob for a sampled token")
            except PromptTooLong:
                session.in_flight = None
                if budgets.context_overflow == "error":
                    raise ContextOverflow("the prompt does not fit the engine's context") from None
                yield self._budget_stop(session, req, B.CONTEXT_OVERFLOW, call, t0)
                return
            except RequestRejected as exc:  # what the request holds, not the engine's failure
                session.in_flight = None
                raise BadRequest(f"the engine rejected the request: {exc}") from None
            except Exception as exc:  # the engine failed: an infrastructure error of this session
                session.engine_errors.append(f"{type(exc).__name__}: {exc}".splitlines()[0])
                progress.ended = time.perf_counter()
                raise
            except BaseException:  # cancelled (the harness went away mid-call): what it reached stays on record
                progress.ended = time.perf_counter()
                raise
            session.in_flight = None
            # The distribution actually sampled (after overrides and the greedy rule): a trainer reads it.
            call.temperature, call.top_p, call.top_k = params.temperature, params.top_p, params.top_k
            call.policy_version = version
            result = self._finish(session, req, plan, gen, text, call, t0)
            yield result

    def engine_status(self) -> dict[str, Any]:
        """What the engine reports of itself for ``/health``: an engine pool's per-engine status."""
        engine = self.engine.inner if isinstance(self.engine, WatchedEngine) else self.engine
        status = getattr(engine, "status", None)
        return {"engines": status()} if callable(status) else {}

    def _call_version(self) -> int | None:
        """The policy version of the call in flight; None (unknown) behind an engine whose weight loads
        this process does not see (one not wrapped in a :class:`WatchedEngine`)."""
        return self.engine.call_version() if isinstance(self.engine, WatchedEngine) else None

    def _finish(self, session: Session, req: ChatRequest, plan: Plan, gen: Generation, text: TextAssembler,
                call: Call, t0: float) -> CallResult:
        raw = text.finish()
        parsed = self.parser.parse(raw) if (req.tools and req.parse_tools) else ParsedOutput(content=raw)
        content = parsed.content
        if req.stream and not content.startswith(text.emitted):
            content = text.emitted + content  # what was streamed stays part of the reply
        prefix = "toolu_" if req.api is Api.MESSAGES else "call_"
        for tc in parsed.tool_calls:
            tc.id = prefix + secrets.token_hex(12)
        if text.stop_sequence is not None:
            finish = "stop_sequence"
        elif parsed.tool_calls:
            finish = "tool_calls"
        else:
            finish = "length" if gen.finish_reason == "length" else "stop"
        reply: Message = {"role": "assistant", "content": content}
        if parsed.tool_calls:
            reply["tool_calls"] = [
                {"id": tc.id, "type": "function", "function": {"name": tc.name, "arguments": tc.arguments_json()}}
                for tc in parsed.tool_calls
            ]
        segment = session.commit(plan, gen, reply)
        call.segment = segment
        call.latency_s = time.perf_counter() - t0
        call.prompt_tokens = len(plan.prompt_ids)
        call.new_prompt_tokens = len(plan.new_ids)
        call.completion_tokens = len(gen.token_ids)
        call.finish_reason = finish
        call.parse_error = parsed.error
        session.record_call(call)
        return CallResult(
            content=content, tool_calls=parsed.tool_calls, finish=finish,
            prompt_tokens=len(plan.prompt_ids), completion_tokens=len(gen.token_ids),
            stop_sequence=text.stop_sequence, prompt_ids=plan.prompt_ids, token_ids=list(gen.token_ids),
            logprobs=list(gen.logprobs), parse_error=parsed.error,
        )

    def _budget_stop(self, session: Session, req: ChatRequest, reason: str, call: Call, t0: float) -> CallResult:
        content = B.stop_message(reason, session.budgets)
        session.record_stop(reason, req.messages, {"role": "assistant", "content": content})
        call.latency_s = time.perf_counter() - t0
        call.finish_reason = "stop"
        call.budget_stop = reason
        session.record_call(call)
        return CallResult(content=content, tool_calls=[], finish="stop", prompt_tokens=0, completion_tokens=0,
                          budget_stop=reason)
