"""Weight sync: make the engine serve the checkpoint a train step just wrote.

- Embedded engine (CPU or GPU, in-process): ``await engine.load_weights(path)``, between steps.
- vLLM server: push the checkpoint's tensors through the server's weight-transfer routes
  (``/pause``, ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``,
  ``/reset_prefix_cache``, ``/resume``) over an NCCL group the trainer joins as an extra rank.
  We drive them with TRL's :class:`trl.generation.vllm_client.VLLMClient`, which speaks this
  protocol for the installed vLLM version. The server must run with ``VLLM_SERVER_DEV_MODE=1`` and
  ``--weight-transfer-config '{"backend": "nccl"}'``; the trainer side needs CUDA and ``vllm``.

**Untested here**: these machines have no GPU and vLLM's wheel does not serve on CPU. The embedded
path is what the CPU loop uses; the vLLM path is written for GPU machines and is checked there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from legorl.engines.base import Engine
from legorl.errors import LegorlError


async def reload_embedded(engine: Engine, checkpoint: str | Path) -> None:
    """Let an in-process engine serve ``checkpoint`` from its next request on."""
    if not (Path(checkpoint) / "config.json").exists():
        raise LegorlError(f"{checkpoint}: not a model checkpoint (no config.json)")
    await engine.load_weights(str(checkpoint))


class VLLMWeightPusher:
    """Pushes checkpoints into a running vLLM server over NCCL (one communicator per pusher)."""

    def __init__(
        self, base_url: str, device: int | str = 0, group_port: int = 51216, timeout_s: float = 60.0,
        dtype: str = "bfloat16",
    ):
        """``dtype``: the server's weight dtype (what ``vllm serve --dtype`` loaded)."""
        try:
            from trl.generation.vllm_client import VLLMClient
        except ImportError as exc:  # pragma: no cover - depends on the GPU machine's install
            raise LegorlError(f"pushing weights to vLLM needs trl[vllm] installed: {exc}") from exc
        try:
            self.client: Any = VLLMClient(base_url=base_url, group_port=group_port, connection_timeout=timeout_s)
            self.client.init_communicator(device=device)
        except (ImportError, NotImplementedError, RuntimeError, ConnectionError) as exc:
            raise LegorlError(f"vLLM weight transfer at {base_url} is not available: {exc}") from exc
        self.base_url = base_url.rstrip("/")
        self.device = device
        self.dtype = dtype

    def push(self, checkpoint: str | Path) -> int:
        """Load ``checkpoint`` on the trainer's GPU and broadcast every tensor; returns how many."""
        import torch
        from transformers import AutoModelForCausalLM

        model: Any = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, self.dtype))
        model.to(f"cuda:{self.device}" if isinstance(self.device, int) else self.device)
        self.client._post(f"{self.base_url}/pause", json={})
        try:
            with self.client.weight_update():
                self.client.update_model_params(model)
            self.client.reset_prefix_cache()
        finally:
            self.client._post(f"{self.base_url}/resume", json={})
        return sum(1 for _ in model.parameters())

    def close(self) -> None:
        self.client.close_communicator()
