"""The engine interface. Engines know tokens, never HTTP protocols or chat formats (the proxy does)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from legorl.core.errors import ConfigError


class RequestRejected(ConfigError):
    """The engine refused this request for what it holds (its prompt, its sampling parameters): the
    caller's error (the proxy answers it with a 400), never an engine failure — which would mark
    the session's trial as infrastructure. Engines raise anything else for their own failures."""


class PromptTooLong(RequestRejected):
    """The prompt leaves no room for a single generated token in the engine's context."""


#: The smallest temperature an engine samples at. Logits divided by less can overflow float32
#: (``1e-40`` turns every logprob into NaN); the proxy treats any temperature in ``(0, MIN_TEMPERATURE)``
#: as 0 (greedy), as vLLM does below 1e-5, and the embedded engine refuses one.
MIN_TEMPERATURE = 1e-4


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k truncation
    stop_token_ids: tuple[int, ...] = ()  # generation ends after emitting one of these (it is kept)
    seed: int | None = None


@dataclass
class Generation:
    """What the policy sampled for one request.

    ``logprobs[i]`` is the log-probability of ``token_ids[i]`` under the distribution it was
    actually sampled from (after temperature / top-k / top-p). ``routed_experts`` is
    ``[prompt_len + len(token_ids), layers, top_k]`` int16 for MoE models, covering the prompt too
    (the training forward pass needs routing for every position), else None.
    """

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "stop"  # "stop" (a stop token) | "length" (max_tokens or context)
    routed_experts: np.ndarray | None = None
    prompt_tokens: int = 0


@dataclass
class TokenChunk:
    """A piece of a generation as it is produced (for streaming); the final chunk has ``final``.

    ``routed_experts`` (MoE engines that stream routing) holds the routing rows ``[n, layers, k]``
    of the positions fed forward since the previous chunk: the prompt's with the first token, then
    one per token (the previous one's). A consumer that stops reading early (a stop string) still
    has the routing of every token it keeps but the last, which was never fed forward (-1).
    """

    token_ids: list[int]
    logprobs: list[float]
    final: Generation | None = None
    routed_experts: np.ndarray | None = None


@runtime_checkable
class Engine(Protocol):
    """One policy behind an async token interface. Implementations: embedded, vllm, scripted."""

    name: str  # model name reported to clients
    max_context: int  # prompt + completion tokens the engine accepts

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation: ...

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[TokenChunk]:
        """Yield chunks as tokens are sampled; the last chunk carries the complete Generation."""
        ...

    async def load_weights(self, path: str) -> None:
        """Serve the checkpoint at ``path`` from the next request on (between policy steps)."""
        ...

    async def close(self) -> None: ...


#: The proxy session an engine call serves, set by the proxy around each call (None outside a
#: session): the protocol has no session argument, and an engine pool routes by it.
current_session: ContextVar[str | None] = ContextVar("legorl_current_session", default=None)


@runtime_checkable
class HealthProbed(Protocol):
    """An engine that can say whether it serves (optional; an engine pool probes it to take a dead
    engine out and bring it back). Answers promptly; False or an exception: not serving."""

    async def healthy(self) -> bool: ...
