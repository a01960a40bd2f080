"""Inference engines: token ids in, sampled token ids + logprobs (+ MoE routing) out.

``make_engine(kind, ...)`` builds one by name: ``embedded`` (a model directory served in-process),
``vllm`` (an existing ``vllm serve`` at a URL), ``scripted`` (fixed completions, for tests), or a
plug-in by dotted path (``mypkg.engines:MyEngine``): a class or factory whose result satisfies the
:class:`Engine` protocol.
"""

from __future__ import annotations

from typing import Any, cast

from legorl.core.errors import ConfigError
from legorl.core.plugins import is_dotted_path, load_object, missing_members
from legorl.engines.base import Engine, Generation, PromptTooLong, RequestRejected, SamplingParams, TokenChunk

#: The engines that serve a model directory by name (beside them: a plug-in ``package.module:Class``,
#: which only ``serve-proxy`` takes).
ENGINES = ("embedded", "vllm")
ENGINE_KINDS = (*ENGINES, "scripted")  # what make_engine takes by name (scripted: fixed completions, for tests)
_ENGINE_ATTRIBUTES = ("name", "max_context")
_ENGINE_METHODS = ("generate", "stream", "load_weights", "close")


def make_engine(kind: str, **kwargs: Any) -> Engine:
    """Build an engine by name; ``kwargs`` go to its constructor.

    ``make_engine("embedded", model_dir=...)``, ``make_engine("vllm", base_url=..., model=...)``,
    ``make_engine("scripted", tokenizer=..., completions=[...])``, ``make_engine("mypkg.mod:MyEngine", ...)``.
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
    if is_dotted_path(kind):
        return _plugin_engine(kind, kwargs)
    raise ConfigError(f"unknown engine {kind!r}: choose one of {', '.join(ENGINE_KINDS)} "
                      "(or a plug-in as package.module:Class)")


def _plugin_engine(spec: str, kwargs: dict[str, Any]) -> Engine:
    factory = load_object(spec, "engine")
    where = f"engine {spec!r}"
    if not callable(factory):
        raise ConfigError(f"{where}: not an engine class or factory (a {type(factory).__name__})")
    if isinstance(factory, type):  # its methods can be checked before anything is built
        missing = missing_members(factory, (), _ENGINE_METHODS)
        if missing:
            raise ConfigError(f"{where}: not an engine: the class lacks {', '.join(missing)} "
                              "(see the legorl.engines.Engine protocol)")
    engine = factory(**kwargs)
    missing = missing_members(engine, _ENGINE_ATTRIBUTES, _ENGINE_METHODS)
    if missing:
        raise ConfigError(f"{where}: not an engine: what it built lacks {', '.join(missing)} "
                          "(see the legorl.engines.Engine protocol)")
    return cast(Engine, engine)


__all__ = ["ENGINE_KINDS", "Engine", "Generation", "PromptTooLong", "RequestRejected", "SamplingParams", "TokenChunk",
           "make_engine"]
