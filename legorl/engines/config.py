"""How the policy is served, each setting declared once: which engine (:class:`EngineSpec`, all of
:class:`EngineConfig` for ``legorl serve-proxy``) and how it samples (:class:`SamplingConfig`), with
the one greedy rule (:func:`sampled_temperature`). ``rollout``, ``eval``, ``loop``, ``train`` and
``serve-proxy`` embed these configs; their fields become options through ``legorl.cli.options``.

A field left unset (None) keeps the engine's own default, so each default lives once, in the
engine's constructor (:class:`~legorl.engines.embedded.EmbeddedEngine`,
:class:`~legorl.engines.vllm.VLLMEngine`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from legorl.core.errors import ConfigError
from legorl.engines import ENGINES
from legorl.engines.base import MIN_TEMPERATURE, Engine

#: What the policy samples at when a command that runs trials is given no temperature.
DEFAULT_TEMPERATURE = 1.0


def sampled_temperature(temperature: float) -> float:
    """The greedy rule, as the proxy applies it: what an engine samples at when asked for
    ``temperature``. Below MIN_TEMPERATURE (0 included) that is 0, greedy (as vLLM does below 1e-5)."""
    return temperature if temperature >= MIN_TEMPERATURE else 0.0


def logprob_temperature(temperature: float) -> float:
    """The greedy rule, as the trainer reads it: the temperature a sampled token's recorded logprob is
    under. A greedy token's is taken at temperature 1 (legorl/engines/sampling.py; vLLM's processed
    logprobs do the same)."""
    return 1.0 if sampled_temperature(temperature) == 0 else temperature


def check_temperature(temperature: float | None) -> None:
    if temperature is not None and not (math.isfinite(temperature) and temperature >= 0):
        raise ConfigError(f"--temperature must be a finite number >= 0 (0 = greedy), got {temperature}")


@dataclass(kw_only=True)
class SamplingConfig:
    """How the policy samples, as every command that samples or scores it takes ``--temperature``."""

    temperature: float | None = field(default=None, metadata={"help": (
        "Policy sampling temperature (0 = greedy): the proxy samples every call at it (top-p 1, top-k off), "
        "whatever the harness asks, and records it on every call; the trainer scores at the recorded one and "
        "refuses a different --temperature. Unset: rollout and loop 1.0; eval 0 for one sample, 1.0 for "
        "several; serve-proxy as each request asks; train the recorded one (1.0 for shards that record none).")})

    def __post_init__(self) -> None:
        check_temperature(self.temperature)


@dataclass(kw_only=True)
class ProxySampling(SamplingConfig):
    """``legorl serve-proxy``'s sampling: also a top-p (the trainer scores the full softmax, so the
    commands that train on their calls leave it at 1)."""

    top_p: float | None = field(default=None, metadata={"help": "Sample every call with this top-p."})


@dataclass(kw_only=True)
class EngineSpec:
    """Which engine serves the policy's model directory, as ``serve-proxy``, ``rollout``, ``eval`` and
    ``loop`` take it."""

    engine: str = field(default="embedded", metadata={"help": (
        "What serves --model: embedded (in this process, transformers), vllm (a vLLM server: --upstream URL, or "
        "without it one started here on --model and stopped at the end; see `legorl vllm install`), or, with "
        "serve-proxy, a plug-in Engine by dotted path (package.module:Class).")})
    upstream: str | None = field(default=None, metadata={"help": (
        "URL of a running vLLM server (with --engine vllm; started with the flags in docs/vllm.md), or several "
        "comma-separated: each proxy session sticks to one, a dead one is taken out (docs/vllm.md). A training "
        "loop reloads its weights each step.")})
    reload_tolerance: float | None = field(default=None, metadata={"help": (
        "vLLM: the largest |Δ| in nats between served and checkpoint logprobs that a weight reload may leave "
        "(default 1e-3, for float32 serving; raise it for a bfloat16 server).")})

    def check(self, *, plugins: bool = False) -> None:
        """Refuse an engine other than :data:`ENGINES` (unless ``plugins``: then ``make_engine`` names what
        it takes), an ``upstream`` that is not vLLM's, a tolerance that is not positive."""
        if not plugins and self.engine not in ENGINES:
            raise ConfigError(f"--engine {self.engine}: choose one of {', '.join(ENGINES)}")
        check_upstream(self.upstream, self.engine)
        if self.reload_tolerance is not None and not self.reload_tolerance > 0:
            raise ConfigError(f"--reload-tolerance {self.reload_tolerance}: must be > 0")


@dataclass(kw_only=True)
class EngineConfig(EngineSpec):
    """Everything ``legorl serve-proxy`` takes of its engine: the spec, the model and the engine's knobs."""

    model: Path = field(metadata={"help": (
        "Model directory (weights + tokenizer + chat template); with --engine vllm --upstream only its tokenizer "
        "is read.")})
    dtype: str | None = field(default=None, metadata={"help": (
        "Engine dtype: float32 (default), bfloat16, float16 (the embedded engine, or a vLLM server started here).")})
    device: str | None = field(default=None, metadata={"help": "Embedded engine device (default: cuda if present)."})
    max_batch: int | None = field(default=None, metadata={"help": (
        "Sequences decoded together (embedded: continuous batching, default 32; a vLLM server started here: "
        "its --max-num-seqs, default 8).")})
    name: str | None = field(default=None, metadata={"help": (
        "The model name the proxy answers with (default: the model directory's name).")})

    def __post_init__(self) -> None:
        self.check(plugins=True)
        if self.engine == "vllm" and self.device is not None:
            raise ConfigError("--device is the embedded engine's; a vLLM server picks its own")

    def build(self) -> Engine:
        """The engine (loading its weights, connecting to its server, or starting one)."""
        from legorl.engines import make_engine

        if self.engine == "vllm":
            from legorl.engines.vllm_server import vllm_engine

            return vllm_engine(self.model, self.upstream, name=self.name, dtype=self.dtype,
                               max_num_seqs=self.max_batch, reload_tolerance=self.reload_tolerance)
        given = {"name": self.name} if self.name is not None else {}
        embedded: dict[str, Any] = {k: v for k, v in (("dtype", self.dtype), ("device", self.device),
                                                      ("max_batch", self.max_batch)) if v is not None}
        return make_engine(self.engine, model_dir=self.model, **embedded, **given)  # embedded, or a plug-in


def check_upstream(upstream: str | None, engine: str) -> None:
    """``--upstream`` (as serve-proxy, rollout, eval and loop take it) is one or more vLLM URLs."""
    if upstream is None:
        return
    if engine != "vllm":
        raise ConfigError("--upstream is a vLLM server's URL: it needs --engine vllm")
    from legorl.engines.pool import split_upstreams

    split_upstreams(upstream)
