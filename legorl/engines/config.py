"""Which engine serves the policy, as ``legorl serve-proxy`` takes it (each documented field an option).

A field left unset (None) keeps the engine's own default, so each default lives once, in the
engine's constructor (:class:`~legorl.engines.embedded.EmbeddedEngine`,
:class:`~legorl.engines.vllm.VLLMEngine`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from legorl.engines.base import Engine
from legorl.errors import ConfigError


@dataclass(kw_only=True)
class EngineConfig:
    model: Path = field(metadata={"help": (
        "Model directory (weights + tokenizer + chat template); with --engine vllm only its tokenizer is read, "
        "and checkpoints are written into it for the server to reload.")})
    engine: str = field(default="embedded", metadata={"help": (
        "embedded (in-process transformers), vllm (an existing `vllm serve`), or a plug-in Engine by dotted "
        "path (package.module:Class).")})
    upstream: str | None = field(default=None, metadata={"help": "vLLM server URL (with --engine vllm)."})
    dtype: str | None = field(default=None, metadata={"help": (
        "Embedded engine dtype: float32 (default), bfloat16, float16.")})
    device: str | None = field(default=None, metadata={"help": "Embedded engine device (default: cuda if present)."})
    max_batch: int | None = field(default=None, metadata={"help": (
        "Embedded engine: sequences decoded together (continuous batching; default 32).")})
    name: str | None = field(default=None, metadata={"help": (
        "The model name the proxy answers with (default: the model directory's name).")})

    def __post_init__(self) -> None:
        if self.engine == "vllm" and not self.upstream:
            raise ConfigError("--engine vllm needs --upstream URL of a running `vllm serve`")
        if self.upstream and self.engine != "vllm":
            raise ConfigError("--upstream is the vLLM server's URL: it needs --engine vllm")

    def build(self) -> Engine:
        """The engine (loading its weights, or connecting to its server)."""
        from legorl.engines import make_engine

        given = {"name": self.name} if self.name is not None else {}
        if self.engine == "vllm":
            return make_engine("vllm", base_url=self.upstream, served_model_dir=self.model, **given)
        embedded: dict[str, Any] = {k: v for k, v in (("dtype", self.dtype), ("device", self.device),
                                                      ("max_batch", self.max_batch)) if v is not None}
        return make_engine(self.engine, model_dir=self.model, **embedded, **given)  # embedded, or a plug-in
