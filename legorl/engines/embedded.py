"""The embedded engine: a transformers model in-process (CPU or GPU) with continuous batching.

One worker thread owns the model. Requests arrive from any event loop; each is prefilled alone
(batch 1, no padding, so prompt logits and routing are exactly those of a plain forward pass) and
then joins the running batch, whose KV cache is left-padded to a common length. Every decode step
feeds the last sampled token of each active sequence in one forward pass, samples each row with its
own parameters and its own seeded generator, and streams the token back to the request's event
loop. Finished rows leave the batch at once and new ones join between steps, so a long generation
never holds up a new request (continuous batching).

Sampling (what the logprobs mean, how a trainer reproduces them) is in :mod:`.sampling`; the
batch and its requests are in :mod:`.batching`.

The engine stops a sequence after the model's EOS ids (from ``generation_config``; vLLM does the
same unless told ``ignore_eos``) or any of ``stop_token_ids``; the stop token is kept.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import math
import queue
import secrets
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from legorl.core.errors import ConfigError, LegorlError
from legorl.engines.base import Generation, PromptTooLong, RequestRejected, SamplingParams, TokenChunk
from legorl.engines.batching import Request, RunningBatch, deliver
from legorl.engines.sampling import process_logits, sample_rows, validate_params
from legorl.routing import capture_routing, routing_shape

__all__ = ["EmbeddedEngine", "EngineStats", "measure_throughput", "process_logits"]

# One from_pretrained at a time in this process: two at once (two engines of a pool loading a
# checkpoint) race on transformers' process-wide meta-device init ("Cannot copy out of meta tensor").
_LOADING = threading.Lock()

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


@dataclass
class EngineStats:
    """Counters for tests and benchmarks: how much batching actually happened."""

    prefills: int = 0
    decode_steps: int = 0
    decode_tokens: int = 0
    max_batch: int = 0
    batch_sizes: Counter[int] = field(default_factory=Counter)
    loads: int = 0


class EmbeddedEngine:
    """A transformers causal LM served in-process behind the :class:`~legorl.engines.base.Engine` API.

    ``dtype`` is float32 by default (logprob fidelity ~1e-6 against a float32 recompute); bfloat16
    halves memory at ~1e-2 logprob error. ``max_batch`` bounds how many sequences decode together.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str | None = None,
        dtype: str = "float32",
        max_batch: int = 32,
        max_context: int | None = None,
        name: str | None = None,
    ):
        if dtype not in _DTYPES:
            raise ConfigError(f"unknown dtype {dtype!r}: choose one of {', '.join(_DTYPES)}")
        if max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1, got {max_batch}")
        self.model_dir = Path(model_dir)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = _DTYPES[dtype]
        self.max_batch = max_batch
        self.name = name or self.model_dir.name
        self.model = self._load(self.model_dir)
        cfg = self.model.config
        self.max_context = int(max_context or cfg.max_position_embeddings)
        eos = getattr(self.model.generation_config, "eos_token_id", None) or cfg.eos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.routing_shape = routing_shape(self.model)
        # transformers >= 5.2x names the cache argument `cache`; older versions `past_key_values`.
        params = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        if getattr(cfg, "use_sliding_window", False):
            self.max_batch = 1  # sliding-window caches cannot be left-padded and merged
        self.stats = EngineStats()
        self._inbox: queue.Queue[Request | tuple[str, Path, Future[None]] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    # --------------------------------------------------------------------------------- public API

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        final: Generation | None = None
        async for chunk in self.stream(prompt_ids, params):
            final = chunk.final or final
        assert final is not None
        return final

    async def stream(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[TokenChunk]:
        req = self._submit(list(prompt_ids), params)
        try:
            while True:
                item = await req.out.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.final is not None:
                    return
        finally:
            req.cancelled = True  # the consumer stopped early (client gone): free the batch slot

    async def load_weights(self, path: str) -> None:
        """Swap in the checkpoint at ``path``: in-flight sequences finish on the old weights first,
        new requests wait and then run on the new ones."""
        fut: Future[None] = Future()
        self._ensure_worker()
        self._inbox.put(("load", Path(path), fut))
        await asyncio.wrap_future(fut)

    async def close(self) -> None:
        self._closed = True
        if self._thread is not None:
            self._inbox.put(None)
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    # ------------------------------------------------------------------------------------ plumbing

    def _load(self, path: Path) -> Any:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        if not (Path(path) / "config.json").exists():
            raise ConfigError(f"{path}: not a model directory (no config.json); build one with `legorl model init`")
        hf_logging.disable_progress_bar()
        with _LOADING:
            model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype)
        return model.to(self.device).eval()

    def _submit(self, prompt: list[int], params: SamplingParams) -> Request:
        if self._closed:
            raise LegorlError("engine is closed")
        validate_params(params)
        if not prompt:
            raise RequestRejected("empty prompt: at least one token is required")
        if len(prompt) >= self.max_context:
            raise PromptTooLong(f"prompt of {len(prompt)} tokens leaves no room in the context of {self.max_context}")
        vocab = self.model.config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise RequestRejected(f"prompt holds token ids outside [0, {vocab})")
        gen = torch.Generator(device="cpu")
        gen.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
        req = Request(
            prompt=prompt,
            params=params,
            loop=asyncio.get_running_loop(),
            out=asyncio.Queue(),
            generator=gen,
            max_new=min(params.max_tokens, self.max_context - len(prompt)),
            stop=frozenset(params.stop_token_ids) | frozenset(self.eos_token_ids),
        )
        self._ensure_worker()
        self._inbox.put(req)
        return req

    def _ensure_worker(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=f"legorl-engine-{self.name}", daemon=True)
                self._thread.start()

    # ------------------------------------------------------------------------------ worker thread

    def _run(self) -> None:
        """The worker loop. ``pending`` is FIFO: a weight load waits for every request queued before
        it to finish (on the old weights) and holds every request queued after it."""
        batch = RunningBatch()
        pending: collections.deque[Request | tuple[str, Path, Future[None]]] = collections.deque()
        with torch.inference_mode():
            while True:
                # Collect new work: block only when there is nothing to do.
                try:
                    item = self._inbox.get(timeout=0.5) if not (batch.rows or pending) else self._inbox.get_nowait()
                    while True:
                        if item is None:
                            self._shutdown(batch, pending)
                            return
                        pending.append(item)
                        item = self._inbox.get_nowait()
                except queue.Empty:
                    pass
                try:
                    while pending:
                        head = pending[0]
                        if isinstance(head, tuple):
                            if batch.rows:
                                break  # drain first
                            pending.popleft()
                            self._swap_weights(head[1], head[2])
                        elif len(batch.rows) < self.max_batch:
                            pending.popleft()
                            if not head.cancelled:
                                self._prefill(head, batch)
                        else:
                            break
                    if batch.rows:
                        self._decode_step(batch)
                except Exception as e:  # a broken step fails its requests, not the engine
                    err = e if isinstance(e, LegorlError) else LegorlError(f"engine step failed: {type(e).__name__}: {e}")
                    self._fail_all(batch.rows, err)
                    batch.clear()

    def _swap_weights(self, path: Path, fut: Future[None]) -> None:
        try:
            self.model = self._load(path)
            self.stats.loads += 1
            fut.set_result(None)
        except Exception as e:  # keep serving the old weights
            fut.set_exception(e if isinstance(e, LegorlError) else LegorlError(f"{path}: {e}"))

    def _shutdown(self, batch: RunningBatch, pending: collections.deque[Request | tuple[str, Path, Future[None]]]) -> None:
        err = LegorlError("engine closed")
        self._fail_all(batch.rows, err)
        for it in pending:
            if isinstance(it, tuple):
                it[2].set_exception(err)
            else:
                it.emit(err)

    @staticmethod
    def _fail_all(reqs: list[Request], err: BaseException) -> None:
        for r in reqs:
            r.emit(err)

    def _forward(self, ids: torch.Tensor, cache: Any, **kw: Any) -> tuple[torch.Tensor, Any, np.ndarray | None]:
        kw[self._cache_kwarg] = cache
        with capture_routing(self.model) as cap:
            out = self.model(input_ids=ids, use_cache=True, **kw)
        routing = cap.take() if self.routing_shape else None
        new_cache = out.cache if hasattr(out, "cache") else out.past_key_values
        return out.logits[:, -1, :], new_cache, routing

    def _prefill(self, req: Request, batch: RunningBatch) -> None:
        from transformers import DynamicCache

        ids = torch.tensor([req.prompt], device=self.device)
        logits, cache, routing = self._forward(ids, cache=DynamicCache(config=self.model.config), logits_to_keep=1)
        self.stats.prefills += 1
        if routing is not None:
            req.routing.append(routing)
        tok, lp = self._sample(logits, [req])
        out: list[tuple[Request, TokenChunk | BaseException]] = []
        if not self._accept(req, tok[0], lp[0], out):
            batch.add(req, cache, len(req.prompt), tok[0])
        deliver(out)

    def _decode_step(self, batch: RunningBatch) -> None:
        batch.drop([i for i, r in enumerate(batch.rows) if r.cancelled])
        if not batch.rows:
            return
        ids, mask, pos = batch.step_inputs(self.device)
        logits, cache, routing = self._forward(
            ids, attention_mask=mask, position_ids=pos, cache=batch.cache
        )
        batch.cache = cache
        batch.mask = mask
        n = len(batch.rows)
        self.stats.decode_steps += 1
        self.stats.decode_tokens += n
        self.stats.max_batch = max(self.stats.max_batch, n)
        self.stats.batch_sizes[n] += 1
        if routing is not None:
            for i, r in enumerate(batch.rows):
                r.routing.append(routing[i : i + 1])
        toks, lps = self._sample(logits, batch.rows)
        done = []
        out: list[tuple[Request, TokenChunk | BaseException]] = []
        for i, r in enumerate(batch.rows):
            batch.pos[i] += 1
            batch.next_ids[i] = toks[i]
            if self._accept(r, toks[i], lps[i], out):
                done.append(i)
        deliver(out)
        batch.drop(done)

    @staticmethod
    def _sample(logits: torch.Tensor, reqs: list[Request]) -> tuple[list[int], list[float]]:
        return sample_rows(logits, [r.params for r in reqs], [r.generator for r in reqs])

    def _accept(self, req: Request, tok: int, lp: float, out: list[tuple[Request, TokenChunk | BaseException]]) -> bool:
        """Record one sampled token and queue its chunk in ``out``; True when the sequence is finished."""
        if not math.isfinite(lp):  # never hand out a logprob a trainer cannot use: fail the request
            out.append((req, LegorlError(f"engine sampled token {tok} with a non-finite logprob ({lp})")))
            return True
        req.tokens.append(tok)
        req.logprobs.append(lp)
        finished = tok in req.stop or len(req.tokens) >= req.max_new or req.cancelled
        final = None
        if finished:
            final = Generation(
                token_ids=list(req.tokens),
                logprobs=list(req.logprobs),
                finish_reason="stop" if tok in req.stop else "length",
                routed_experts=self._routing(req),
                prompt_tokens=len(req.prompt),
            )
        rows = None
        if len(req.routing) > req.routing_sent:
            rows = np.concatenate(req.routing[req.routing_sent:], axis=0)
            req.routing_sent = len(req.routing)
        out.append((req, TokenChunk(token_ids=[tok], logprobs=[lp], final=final, routed_experts=rows)))
        return finished

    def _routing(self, req: Request) -> np.ndarray | None:
        """``[prompt + generated, layers, k]``; the last sampled token was never fed forward, so its
        row is -1 (replay leaves it to the router; its logits predict nothing inside the sequence)."""
        if self.routing_shape is None:
            return None
        layers, k = self.routing_shape
        tail = np.full((1, layers, k), -1, dtype=np.int16)
        out = np.concatenate([*req.routing, tail], axis=0)
        assert out.shape[0] == len(req.prompt) + len(req.tokens)
        return out


def measure_throughput(engine: EmbeddedEngine, prompts: list[list[int]], params: SamplingParams) -> dict[str, float]:
    """Run ``prompts`` concurrently; tokens/s over wall time (used by the benchmark and the report)."""

    async def go() -> list[Generation]:
        return await asyncio.gather(*(engine.generate(p, params) for p in prompts))

    t0 = time.perf_counter()
    gens = asyncio.run(go())
    dt = time.perf_counter() - t0
    n = sum(len(g.token_ids) for g in gens)
    return {"tokens": n, "seconds": dt, "tokens_per_s": n / dt}
