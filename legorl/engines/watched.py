"""An engine wrapper that counts what a rollout's progress line shows (calls in flight, busy time,
sampled tokens, failures) and numbers the weights every call samples from.

Policy versions (:attr:`WatchedEngine.policy_version`): 0 is the weights the engine was opened
with (or the version a caller says they are), and each completed :meth:`~WatchedEngine.load_weights`
adds 1 (or sets the version its caller names). A swap happens only between calls: it waits until every call in flight has finished, and
calls that arrive meanwhile wait for it, so a call samples every token from the version it started
on — whatever the engine behind does with requests queued across a reload (the embedded engine
and vLLM's pause both let them through to the new weights, which is why the gate is here and not
left to them). The proxy reads the version while its call is in flight (:meth:`call_version`).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator

from legorl.engines.base import Engine, Generation, SamplingParams, TokenChunk


class _Wakeup:
    """Coroutines waiting for a change another thread makes: the proxy's calls wait on the proxy's event
    loop, a weight load on its caller's; each waiter gets a future on its own loop (no thread is held)."""

    def __init__(self) -> None:
        self._waiting: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def add(self) -> asyncio.Future[None]:
        """A future resolved by the next :meth:`fire` (call with the owner's lock held)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._waiting.append((loop, future))
        return future

    def fire(self) -> None:
        """Wake every waiter (call with the owner's lock held)."""
        waiting, self._waiting = self._waiting, []
        for loop, future in waiting:
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits any more
                loop.call_soon_threadsafe(_resolve, future)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class WatchedEngine:
    """Delegates to an engine and keeps what the progress line needs — calls in flight, busy time,
    sampled tokens, failures — and the policy version of the weights it serves. (Which trial an
    engine failure hit is recorded by the proxy session.)"""

    def __init__(self, engine: Engine, policy_version: int = 0):
        self.inner = engine
        self.name = engine.name
        self.max_context = engine.max_context
        self.policy_version = policy_version
        self.in_flight = 0
        self.tokens = 0  # sampled so far, by finished calls and calls in flight alike
        self.failures: list[tuple[float, str]] = []
        self._busy_since: float | None = None
        self._busy = 0.0
        self._swapping = False
        self._opened = _Wakeup()  # a swap ended: waiting calls (and swaps) may go
        self._drained = _Wakeup()  # the last call in flight ended: a waiting swap may go
        self._mu = threading.Lock()

    async def _enter(self) -> int:
        """Count a call in (after any swap under way); the version it samples from."""
        while True:
            with self._mu:
                if not self._swapping:
                    if self.in_flight == 0:
                        self._busy_since = time.monotonic()
                    self.in_flight += 1
                    return self.policy_version
                opened = self._opened.add()
            await opened

    def _exit(self, tokens: int, error: BaseException | None) -> None:
        with self._mu:
            self.in_flight -= 1
            self.tokens += tokens
            if self.in_flight == 0:
                if self._busy_since is not None:
                    self._busy += time.monotonic() - self._busy_since
                    self._busy_since = None
                self._drained.fire()
            if error is not None:
                self.failures.append((time.time(), f"{type(error).__name__}: {error}"))

    def busy_seconds(self) -> float:
        with self._mu:
            extra = time.monotonic() - self._busy_since if self._busy_since is not None else 0.0
            return self._busy + extra

    @property
    def swapping(self) -> bool:
        """A weight load is under way (waiting for the calls in flight, or loading)."""
        with self._mu:
            return self._swapping

    def call_version(self) -> int | None:
        """The version a call in flight samples from: exact while the caller's call is in flight (no swap
        completes before it ends); None when no call is (then there is nothing to attribute)."""
        with self._mu:
            return self.policy_version if self.in_flight > 0 else None

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        await self._enter()
        gen: Generation | None = None
        try:
            gen = await self.inner.generate(prompt_ids, params)
            return gen
        except BaseException as exc:
            self._exit(0, exc if isinstance(exc, Exception) else None)
            raise
        finally:
            if gen is not None:
                self._exit(len(gen.token_ids), None)

    async def stream(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[TokenChunk]:
        await self._enter()
        error = None
        try:
            async for chunk in self.inner.stream(prompt_ids, params):
                with self._mu:  # counted as they come: a throughput figure sees calls still generating
                    self.tokens += len(chunk.token_ids)
                yield chunk
        except Exception as exc:
            error = exc
            raise
        finally:
            self._exit(0, error)

    async def load_weights(self, path: str, version: int | None = None) -> None:
        """Serve the checkpoint at ``path`` from the next call on: waits for the calls in flight to finish
        (on the old weights), holds new ones meanwhile, then counts the new version — ``version`` when the
        caller knows which one those weights are (the loop: checkpoint ``step-S`` is S + 1), else one more
        than now; a failed load keeps the old one. Concurrent loads run one after another."""
        while True:
            with self._mu:
                if not self._swapping:
                    self._swapping = True
                    break
                opened = self._opened.add()
            await opened
        loaded = False
        try:
            while True:
                with self._mu:
                    if self.in_flight == 0:
                        break
                    drained = self._drained.add()
                await drained
            await self.inner.load_weights(path)
            loaded = True
        finally:
            with self._mu:
                self._swapping = False
                if loaded:
                    self.policy_version = self.policy_version + 1 if version is None else version
                self._opened.fire()

    async def close(self) -> None:
        await self.inner.close()
