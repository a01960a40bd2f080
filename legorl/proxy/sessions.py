"""Per-session token capture: a tree of token sequences (segments) and the calls that built them.

Invariant: a segment's ``token_ids`` are exactly what the engine was given as prompt plus what it
sampled, in order, so a trainer's forward pass over a segment sees what the policy saw. Prompt
tokens have mask 0, sampled tokens mask 1 with their sampling logprobs.

How a request is placed (``Session.plan``):

1. **Extension.** The request extends segment *s* when *s*'s held conversation is a prefix of the
   request's messages — earlier assistant turns matched by tool-call id or content, never by
   re-tokenizing — and the tools are the same. The whole conversation is rendered as text, the
   render of the held conversation must be a prefix of it (the template is prefix-preserving; if
   it is not, e.g. it drops old reasoning, this check fails and the request forks), and only the
   new suffix is tokenized and appended (mask 0) after the exactly sampled ids. Most recent
   segments are tried first.
2. **Fork.** Otherwise a new segment starts from a fresh render of the full prompt (so sampled
   text that now sits inside a rewritten prompt has mask 0 there; the earlier segment is kept).
   Its reason:
   - ``rewrite``: the same agent as an earlier non-auxiliary segment — the same first message (system
     prompt, up to volatile lines: :func:`same_prompt`) and the same tool names (compaction, edited
     tool results, injected reminders, a retried request); ``parent`` is the latest such segment;
   - ``main``: the session's first request with tools (a session that never sends tools: its first
     request). Tool-less segments before it (a title call as the very first request) become
     ``auxiliary`` then;
   - ``subagent``: has tools but another system prompt or tool set; ``parent`` is the latest segment
     waiting on a tool call (the one that started it), if any;
   - ``auxiliary``: no tools in a session that uses tools (title generation, summaries).

A harness's system prompt may change between calls of the same agent in lines that carry no
meaning for the policy's job (Claude Code's billing header with a per-call hash, a date, a counter):
such lines must not turn the agent's own compaction into a sub-agent.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from legorl.core.schemas import Call, Outcome, Segment, SegmentReason, budget_outcome
from legorl.engines.base import Generation
from legorl.proxy.budgets import Budgets
from legorl.proxy.history import Message, same_assistant_turn, same_prompt, tool_names, tools_key
from legorl.proxy.render import ChatRenderer


def new_session_id() -> str:
    return secrets.token_urlsafe(18)


@dataclass
class _SegmentState:
    reason: str
    parent: int | None
    tools: list[dict[str, Any]] | None
    tools_key: str
    first_message: Message | None
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    routing: list[np.ndarray] = field(default_factory=list)
    routing_missing: bool = False
    messages: list[Message] = field(default_factory=list)
    sampled_turns: set[int] = field(default_factory=set)  # indices into messages of sampled replies
    render_text: str | None = None  # template render of ``messages``; None = cannot be extended
    pending_prompt: str | None = None  # render_text is still to be computed (see Session.prepare)
    last_sampled: list[int] = field(default_factory=list)

    def to_segment(self) -> Segment:
        seg = Segment(
            token_ids=list(self.tokens),
            loss_mask=list(self.mask),
            logprobs=list(self.logprobs),
            reason=self.reason,
            parent=self.parent,
        )
        if self.routing and not self.routing_missing:
            arr = np.concatenate(self.routing, axis=0)
            if arr.shape[0] == len(self.tokens):
                seg.routed_experts = arr.astype(np.int16).reshape(-1).tolist()
                seg.routing_layers = int(arr.shape[1])
                seg.routing_top_k = int(arr.shape[2])
        return seg


@dataclass
class Plan:
    """Where a request's prompt goes and what the engine is given."""

    segment: int | None  # the segment extended, or None: a new one
    reason: str
    parent: int | None
    prompt_ids: list[int]
    new_ids: list[int]
    prompt_text: str  # the full render (marked: ChatRenderer.render_marked), generation prompt included
    messages: list[Message]  # the request's conversation, held sampled turns substituted
    tools: list[dict[str, Any]] | None
    sampled_turns: set[int]


@dataclass
class InFlight:
    """The call a session is generating right now, as the proxy measured it (not the agent's to write)."""

    started: float = field(default_factory=time.perf_counter)  # when the proxy took the request
    first_token_s: float | None = None  # seconds until the engine's first sampled token
    sampled: int = 0  # tokens the engine has sampled for it so far
    ended: float | None = None  # when it stopped without an answer (cancelled, or the engine failed)

    def snapshot(self) -> dict[str, Any]:
        return {"elapsed_s": round((self.ended or time.perf_counter()) - self.started, 3),
                "first_token_s": None if self.first_token_s is None else round(self.first_token_s, 3),
                "sampled_tokens": self.sampled}


@dataclass
class SessionCapture:
    """Everything a session captured, as plain data (a snapshot; the session goes on)."""

    session_id: str
    segments: list[Segment]
    calls: list[Call]
    messages: list[Message]
    budget_stop: str | None
    created_at: float
    model: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    engine_errors: list[str] = field(default_factory=list)  # calls the engine failed (answered 500)
    # the call still generating when the snapshot was taken (InFlight.snapshot), e.g. at a trial's kill
    in_flight: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "model": self.model,
            "created_at": self.created_at,
            "budget_stop": self.budget_stop,
            "engine_errors": self.engine_errors,
            "in_flight": self.in_flight,
            "metadata": self.metadata,
            "segments": [s.to_dict() for s in self.segments],
            "calls": [c.to_dict() for c in self.calls],
            "messages": self.messages,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SessionCapture:
        """The inverse of :meth:`to_json` (what ``POST /sess/<id>/finish`` answers)."""
        return cls(
            session_id=str(data["session_id"]),
            segments=[Segment.from_dict(s) for s in data.get("segments") or []],
            calls=[Call.from_dict(c) for c in data.get("calls") or []],
            messages=list(data.get("messages") or []),
            budget_stop=data.get("budget_stop"),
            created_at=float(data.get("created_at") or 0.0),
            model=data.get("model"),
            metadata=dict(data.get("metadata") or {}),
            engine_errors=list(data.get("engine_errors") or []),
            in_flight=dict(data["in_flight"]) if isinstance(data.get("in_flight"), dict) else None,
        )

    def outcome(self) -> str:
        """The trial outcome the proxy can tell on its own (a harness adapter knows better)."""
        return budget_outcome(self.budget_stop) if self.budget_stop else Outcome.NO_SUBMISSION


class Session:
    """One trial's capture. Requests are serialized by ``lock`` (held by the caller around a call)."""

    def __init__(self, session_id: str, renderer: ChatRenderer, budgets: Budgets,
                 metadata: dict[str, Any] | None = None, model: str | None = None):
        self.id = session_id
        self.renderer = renderer
        self.budgets = budgets
        self.metadata = dict(metadata or {})
        self.model = model
        self.created_at = time.time()
        self.lock = asyncio.Lock()
        self._mu = threading.Lock()  # guards state against capture() from other threads
        self.segments: list[_SegmentState] = []
        self.calls: list[Call] = []
        self.turns = 0
        self.budget_stop: str | None = None
        self.engine_errors: list[str] = []
        self.final_messages: list[Message] = []
        self.in_flight: InFlight | None = None  # set by the proxy core around each generating call

    # ------------------------------------------------------------------ placing a request

    def plan(self, messages: list[Message], tools: list[dict[str, Any]] | None) -> Plan:
        key = tools_key(tools)
        renderer = self.renderer
        for idx in range(len(self.segments) - 1, -1, -1):
            seg = self.segments[idx]
            n = len(seg.messages)
            if seg.tools_key != key or len(messages) <= n:
                continue
            self._ensure_render(seg)
            if seg.render_text is None:
                continue
            if not all(
                same_assistant_turn(seg.messages[i], messages[i]) if i in seg.sampled_turns
                else seg.messages[i] == messages[i]
                for i in range(n)
            ):
                continue
            merged = seg.messages + messages[n:]
            full = renderer.render_marked(merged, tools, add_generation_prompt=True)
            if not full.startswith(seg.render_text):
                continue  # the template rewrites earlier turns: fork below
            new_ids = renderer.encode(renderer.bridge(seg.last_sampled) + full[len(seg.render_text) :])
            return Plan(idx, seg.reason, seg.parent, seg.tokens + new_ids, new_ids, full, merged, tools,
                        set(seg.sampled_turns))
        full = renderer.render_marked(messages, tools, add_generation_prompt=True)
        ids = renderer.encode(full)
        reason, parent = self._classify(messages, tools, key)
        return Plan(None, reason, parent, ids, ids, full, list(messages), tools, set())

    def _classify(self, messages: list[Message], tools: list[dict[str, Any]] | None,
                  key: str) -> tuple[str, int | None]:
        """The reason (and parent) of a new segment: see the module docstring."""
        first = messages[0] if messages else None
        names = tool_names(tools)
        with_tools = any(s.tools for s in self.segments)
        for idx in range(len(self.segments) - 1, -1, -1):
            seg = self.segments[idx]
            if seg.reason == SegmentReason.AUXILIARY or (with_tools and not seg.tools):
                continue  # a tool-less segment of a session with tools is auxiliary, or about to be
            if (seg.tools_key == key or tool_names(seg.tools) == names) and same_prompt(seg.first_message, first):
                return SegmentReason.REWRITE, idx
        if tools:
            if not with_tools:
                return SegmentReason.MAIN, None
            return SegmentReason.SUBAGENT, self._waiting_on_a_tool()
        if with_tools or self.segments:
            return SegmentReason.AUXILIARY, None
        return SegmentReason.MAIN, None  # a session without tools so far: its first request

    def _waiting_on_a_tool(self) -> int | None:
        """The latest agent segment whose last turn is a tool call not answered yet (a sub-agent's caller)."""
        for idx in range(len(self.segments) - 1, -1, -1):
            seg = self.segments[idx]
            if seg.tools and seg.reason != SegmentReason.AUXILIARY and seg.messages and seg.messages[-1].get("tool_calls"):
                return idx
        return None

    # ------------------------------------------------------------------ recording

    def commit(self, plan: Plan, gen: Generation, reply: Message) -> int:
        """Append a call's prompt suffix and sampled tokens; returns the segment index."""
        messages = [*plan.messages, reply]
        sampled_turns = {*plan.sampled_turns, len(messages) - 1}
        with self._mu:
            if plan.segment is None:
                if plan.reason == SegmentReason.MAIN and plan.tools:
                    for earlier in self.segments:  # what came before the first request with tools
                        earlier.reason, earlier.parent = SegmentReason.AUXILIARY, None
                seg = _SegmentState(
                    reason=plan.reason, parent=plan.parent, tools=plan.tools, tools_key=tools_key(plan.tools),
                    first_message=plan.messages[0] if plan.messages else None,
                )
                self.segments.append(seg)
                index = len(self.segments) - 1
            else:
                index = plan.segment
                seg = self.segments[index]
            held = len(seg.tokens)
            seg.tokens.extend(plan.new_ids)
            seg.mask.extend([0] * len(plan.new_ids))
            seg.logprobs.extend([0.0] * len(plan.new_ids))
            seg.tokens.extend(gen.token_ids)
            seg.mask.extend([1] * len(gen.token_ids))
            seg.logprobs.extend(float(x) for x in gen.logprobs)
            self._add_routing(seg, gen, held, len(plan.prompt_ids))
            seg.messages = messages
            seg.sampled_turns = sampled_turns
            seg.render_text = None
            seg.pending_prompt = plan.prompt_text
            seg.last_sampled = list(gen.token_ids)
            self.turns += 1
            if plan.reason != SegmentReason.AUXILIARY:
                self.final_messages = messages
        return index

    def _ensure_render(self, seg: _SegmentState) -> None:
        """Render the held conversation (the text the next request must start with), once.

        The template must reproduce the prompt it generated from followed by a normally closed
        assistant turn; if it does not (it re-renders earlier turns), the segment is not extended.
        """
        if seg.pending_prompt is None:
            return
        text = self.renderer.render_marked(seg.messages, seg.tools, add_generation_prompt=False)
        ok = text.startswith(seg.pending_prompt) and text.endswith(self.renderer.closing)
        seg.render_text = text if ok else None
        seg.pending_prompt = None

    def prepare(self) -> None:
        """Do the rendering the next request would need now (called while the harness runs its
        tool, after a response is sent, so it stays off the latency path). Safe to skip."""
        for seg in self.segments:
            self._ensure_render(seg)

    @staticmethod
    def _add_routing(seg: _SegmentState, gen: Generation, held: int, prompt_len: int) -> None:
        arr = gen.routed_experts
        if arr is None:
            if seg.routing:
                seg.routing_missing = True
            return
        arr = np.asarray(arr)
        if arr.ndim != 3 or arr.shape[0] < prompt_len + len(gen.token_ids):
            seg.routing_missing = True
            return
        # Rows for positions the segment already held stay as recorded when they were sampled, except
        # the previous call's last sampled token: it was never fed forward then (row of -1) and is now.
        if seg.routing and held > 0 and bool((seg.routing[-1][-1] < 0).all()):
            seg.routing[-1][-1] = arr[held - 1]
        seg.routing.append(np.array(arr[held : prompt_len + len(gen.token_ids)], dtype=np.int16))

    def record_call(self, call: Call) -> None:
        with self._mu:
            call.index = len(self.calls)
            self.calls.append(call)

    def record_stop(self, reason: str, messages: list[Message], reply: Message) -> None:
        with self._mu:
            self.budget_stop = self.budget_stop or reason
            self.final_messages = [*messages, reply]

    def total_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.segments)

    def capture(self) -> SessionCapture:
        with self._mu:
            return SessionCapture(
                session_id=self.id,
                segments=[s.to_segment() for s in self.segments],
                calls=[Call.from_dict(c.to_dict()) for c in self.calls],
                messages=json.loads(json.dumps(self.final_messages)),
                budget_stop=self.budget_stop,
                created_at=self.created_at,
                model=self.model,
                metadata=dict(self.metadata),
                engine_errors=list(self.engine_errors),
                in_flight=self.in_flight.snapshot() if self.in_flight is not None else None,
            )
