"""Inference engines: token ids in, sampled token ids + logprobs (+ MoE routing) out.

``make_engine(kind, ...)`` builds one by name: ``embedded`` (a model directory served in-process),
``vllm`` (an existing ``vllm serve`` at a URL), ``scripted`` (fixed completions, for tests).
"""

from __future__ import annotations

from typing import Any

from legorl.engines.base import Engine, Generation, PromptTooLong, RequestRejected, SamplingParams, TokenChunk
from legorl.errors import ConfigError

ENGINE_KINDS = ("embedded", "vllm", "scripted")


def make_engine(kind: str, **kwargs: Any) -> Engine:
    """Build an engine by name; ``kwargs`` go to its constructor.

    ``make_engine("embedded", model_dir=...)``, ``make_engine("vllm", base_url=..., model=...)``,
    ``make_engine("scripted", tokenizer=..., completions=[...])``.
    """
    if kind == "embedded":
        from legorl.engines.embedded import EmbeddedEngine

        return EmbeddedEngine(**kwargs)
    if kind == "vllm":
        from legorl.engines.vllm import VLLMEngine

        return VLLMEngine(**kwargs)
    if kind == "scripted":
        from legorl.engines.scripted import ScriptedEngine

        return ScriptedEngine(**kwargs)
    raise ConfigError(f"unknown engine {kind!r}: choose one of {', '.join(ENGINE_KINDS)}")


__all__ = ["ENGINE_KINDS", "Engine", "Generation", "PromptTooLong", "RequestRejected", "SamplingParams", "TokenChunk",
           "make_engine"]
