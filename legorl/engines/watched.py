"""An engine wrapper that counts what a rollout's progress line shows: calls in flight, busy time,
sampled tokens, failures."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator

from legorl.engines.base import Engine, Generation, SamplingParams, TokenChunk


class WatchedEngine:
    """Delegates to an engine and keeps what the progress line needs: calls in flight, busy time,
    sampled tokens, failures. (Which trial an engine failure hit is recorded by the proxy session.)"""

    def __init__(self, engine: Engine):
        self.inner = engine
        self.name = engine.name
        self.max_context = engine.max_context
        self.in_flight = 0
        self.tokens = 0
        self.failures: list[tuple[float, str]] = []
        self._busy_since: float | None = None
        self._busy = 0.0
        self._mu = threading.Lock()

    def _enter(self) -> None:
        with self._mu:
            if self.in_flight == 0:
                self._busy_since = time.monotonic()
            self.in_flight += 1

    def _exit(self, tokens: int, error: BaseException | None) -> None:
        with self._mu:
            self.in_flight -= 1
            self.tokens += tokens
            if self.in_flight == 0 and self._busy_since is not None:
                self._busy += time.monotonic() - self._busy_since
                self._busy_since = None
            if error is not None:
                self.failures.append((time.time(), f"{type(error).__name__}: {error}"))

    def busy_seconds(self) -> float:
        with self._mu:
            extra = time.monotonic() - self._busy_since if self._busy_since is not None else 0.0
            return self._busy + extra

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        self._enter()
        gen: Generation | None = None
        try:
            gen = await self.inner.generate(prompt_ids, params)
            return gen
        except Exception as exc:
            self._exit(0, exc)
            raise
        finally:
            if gen is not None:
                self._exit(len(gen.token_ids), None)

    async def stream(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[TokenChunk]:
        self._enter()
        tokens, error = 0, None
        try:
            async for chunk in self.inner.stream(prompt_ids, params):
                tokens += len(chunk.token_ids)
                yield chunk
        except Exception as exc:
            error = exc
            raise
        finally:
            self._exit(tokens, error)

    async def load_weights(self, path: str) -> None:
        await self.inner.load_weights(path)

    async def close(self) -> None:
        await self.inner.close()
