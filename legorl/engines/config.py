"""Which engine serves the policy, as ``legorl serve-proxy`` takes it (each documented field an option).

A field left unset (None) keeps the engine's own default, so each default lives once, in the
engine's constructor (:class:`~legorl.engines.embedded.EmbeddedEngine`,
:class:`~legorl.engines.vllm.VLLMEngine`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from legorl.core.errors import ConfigError
from legorl.engines.base import Engine

UPSTREAM_HELP = ("URL of a running vLLM server (with --engine vllm; started with the flags in docs/vllm.md), or "
                 "several comma-separated: each proxy session sticks to one, a dead one is taken out (docs/vllm.md).")


@dataclass(kw_only=True)
class EngineConfig:
    model: Path = field(metadata={"help": (
        "Model directory (weights + tokenizer + chat template); with --engine vllm --upstream only its tokenizer "
        "is read.")})
    engine: str = field(default="embedded", metadata={"help": (
        "embedded (in-process transformers), vllm (a vLLM server: --upstream URL, or without it one started "
        "here on --model and stopped at the end; see `legorl vllm install`), or a plug-in Engine by dotted "
        "path (package.module:Class).")})
    upstream: str | None = field(default=None, metadata={"help": UPSTREAM_HELP})
    dtype: str | None = field(default=None, metadata={"help": (
        "Engine dtype: float32 (default), bfloat16, float16 (the embedded engine, or a vLLM server started here).")})
    device: str | None = field(default=None, metadata={"help": "Embedded engine device (default: cuda if present)."})
    max_batch: int | None = field(default=None, metadata={"help": (
        "Sequences decoded together (embedded: continuous batching, default 32; a vLLM server started here: "
        "its --max-num-seqs, default 8).")})
    reload_tolerance: float | None = field(default=None, metadata={"help": (
        "vLLM: the largest |Δ| in nats between served and checkpoint logprobs that a weight reload may leave "
        "(default 1e-3, for float32 serving; raise it for a bfloat16 server).")})
    name: str | None = field(default=None, metadata={"help": (
        "The model name the proxy answers with (default: the model directory's name).")})

    def __post_init__(self) -> None:
        check_upstream(self.upstream, self.engine)
        if self.engine == "vllm" and self.device is not None:
            raise ConfigError("--device is the embedded engine's; a vLLM server picks its own")
        if self.reload_tolerance is not None and not self.reload_tolerance > 0:
            raise ConfigError(f"--reload-tolerance {self.reload_tolerance}: must be > 0")

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
