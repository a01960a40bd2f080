"""Several engines behind one proxy: :class:`EnginePool` is one :class:`~legorl.engines.base.Engine`.

Routing: each proxy session sticks to one engine, by rendezvous hashing of its id
(:data:`~legorl.engines.base.current_session`, set by the proxy) over the live engines, so an
engine's prefix cache keeps its sessions' prompts and an engine taken out moves only its own
sessions. A call outside any session goes to the engine with the fewest calls in flight.

Health: a background thread probes every engine that has ``healthy()``
(:class:`~legorl.engines.base.HealthProbed`) each ``probe_interval`` seconds. An engine that fails a
probe or a call (anything but :class:`~legorl.engines.base.RequestRejected`, the caller's error) is
taken out: the failed call still raises, so its trial ends as an infrastructure error (and is
retried), and the session's later calls go to a live engine. A later passing probe brings it back,
first loading the checkpoint it missed while out (with that engine's own reload check), so it never
serves an old policy. An engine without a probe, once out, stays out. With no live engine every call
fails with :class:`NoLiveEngine`, an engine error.

Weights: :meth:`EnginePool.load_weights` loads into every live engine at once; one that fails its
load is taken out; the load fails only when every engine failed it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from legorl.core.errors import ConfigError, LegorlError
from legorl.engines.base import (
    Engine,
    Generation,
    HealthProbed,
    RequestRejected,
    SamplingParams,
    TokenChunk,
    current_session,
)

log = logging.getLogger(__name__)

PROBE_INTERVAL_S = 5.0
PROBE_TIMEOUT_S = 3.0
_PLACED_MAX = 65536  # sessions whose engine the status counts (the most recent: ids come from the URL)


class NoLiveEngine(LegorlError):
    """Every engine of the pool is out: the call fails as the engine's (infrastructure)."""


def split_upstreams(value: str) -> list[str]:
    """``--upstream``'s URLs: one, or several comma-separated (each at most once)."""
    urls = [u.strip() for u in value.split(",")]
    if not all(urls):
        raise ConfigError(f"--upstream {value!r}: an empty URL (give URLs separated by single commas)")
    doubled = sorted({u for u in urls if urls.count(u) > 1})
    if doubled:
        raise ConfigError(f"--upstream {value!r}: {', '.join(doubled)} given twice")
    return urls


def _weight(session: str, label: str) -> int:
    key = f"{session}\0{label}".encode("utf-8", "surrogatepass")  # a session id is whatever the URL held
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")


@dataclass(eq=False)
class _Member:
    engine: Engine
    label: str
    live: bool = True
    stale: bool = False  # out during a weight load: loads the pool's checkpoint before serving again
    in_flight: int = 0
    calls: int = 0
    failures: int = 0
    last_error: str | None = None


class EnginePool:
    """One :class:`~legorl.engines.base.Engine` over several serving the same model (see the module)."""

    def __init__(self, engines: Sequence[Engine], *, labels: Sequence[str] | None = None,
                 probe_interval: float = PROBE_INTERVAL_S, probe_timeout: float = PROBE_TIMEOUT_S):
        """``labels``: how status and logs name each engine (default: its ``base_url``, else its index)."""
        if not engines:
            raise ConfigError("an engine pool needs at least one engine")
        names = sorted({e.name for e in engines})
        if len(names) > 1:
            raise ConfigError(f"the pool's engines serve different models ({', '.join(names)}): give them one name")
        if labels is None:
            labels = [str(getattr(e, "base_url", f"engine-{i}")) for i, e in enumerate(engines)]
        if len(labels) != len(engines) or len(set(labels)) != len(labels):
            raise ConfigError(f"engine pool labels {list(labels)}: one distinct label per engine")
        if not probe_interval > 0 or not probe_timeout > 0:
            raise ConfigError(f"probe interval {probe_interval} s and timeout {probe_timeout} s: both must be > 0")
        self.name = names[0]
        self.max_context = min(e.max_context for e in engines)
        self.probe_interval = probe_interval
        self.probe_timeout = probe_timeout
        self.members = [_Member(e, label) for e, label in zip(engines, labels, strict=True)]
        self._placed: OrderedDict[str, _Member] = OrderedDict()  # session -> the engine of its last call
        self._checkpoint: str | None = None  # the last weights loaded: what an engine coming back loads
        self._mu = threading.Lock()
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    # ------------------------------------------------------------------------------------ routing

    def _choose(self) -> _Member:
        self._ensure_watcher()
        session = current_session.get()
        with self._mu:
            live = [m for m in self.members if m.live]
            if not live:
                why = "; ".join(f"{m.label}: {m.last_error}" for m in self.members)
                raise NoLiveEngine(f"no live engine in the pool ({why})")
            if session is None:
                member = min(live, key=lambda m: m.in_flight)
            else:
                member = max(live, key=lambda m: _weight(session, m.label))
                self._placed[session] = member
                self._placed.move_to_end(session)
                if len(self._placed) > _PLACED_MAX:
                    self._placed.popitem(last=False)
            member.in_flight += 1
            member.calls += 1
            return member

    def _done(self, member: _Member, error: BaseException | None) -> None:
        with self._mu:
            member.in_flight -= 1
        if isinstance(error, Exception) and not isinstance(error, RequestRejected):
            self._take_out(member, f"call failed: {type(error).__name__}: {error}")

    def _take_out(self, member: _Member, why: str) -> None:
        why = why.splitlines()[0][:300] if why else why
        with self._mu:
            member.failures += 1
            member.last_error = why
            was_live, member.live = member.live, False
        if was_live:
            log.warning("engine %s taken out of the pool: %s", member.label, why)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        member = self._choose()
        error: BaseException | None = None
        try:
            return await member.engine.generate(prompt_ids, params)
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._done(member, error)

    async def stream(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[TokenChunk]:
        member = self._choose()
        error: BaseException | None = None
        try:
            inner = member.engine.stream(prompt_ids, params)
            async with contextlib.aclosing(inner):  # type: ignore[type-var]
                async for chunk in inner:
                    yield chunk
        except GeneratorExit:  # the consumer stopped reading (a stop string): not a failure
            raise
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._done(member, error)

    # ------------------------------------------------------------------------------------ weights

    async def load_weights(self, path: str) -> None:
        self._ensure_watcher()
        with self._mu:
            self._checkpoint = path
            targets = [m for m in self.members if m.live]
            for m in self.members:
                m.stale = not m.live
        if not targets:
            raise NoLiveEngine(f"no live engine in the pool to load {path} into")
        results = await asyncio.gather(*(m.engine.load_weights(path) for m in targets), return_exceptions=True)
        failed: list[tuple[_Member, BaseException]] = []
        for member, result in zip(targets, results, strict=True):
            if isinstance(result, BaseException):
                failed.append((member, result))
                with self._mu:
                    member.stale = True
                self._take_out(member, f"failed to load {path}: {type(result).__name__}: {result}")
        if len(failed) == len(targets):
            why = "; ".join(f"{m.label}: {type(e).__name__}: {e}" for m, e in failed)
            raise LegorlError(f"every engine of the pool failed to load {path}: {why}") from failed[0][1]

    # ------------------------------------------------------------------------------------- health

    def _ensure_watcher(self) -> None:
        if self._watcher is not None or self._stop.is_set():
            return
        if not any(isinstance(m.engine, HealthProbed) for m in self.members):
            return
        with self._mu:
            if self._watcher is None:
                self._watcher = threading.Thread(target=lambda: asyncio.run(self._watch()),
                                                 name="legorl-engine-pool", daemon=True)
                self._watcher.start()

    async def _watch(self) -> None:
        while not self._stop.is_set():
            await asyncio.gather(*(self._probe(m) for m in self.members if isinstance(m.engine, HealthProbed)))
            await asyncio.to_thread(self._stop.wait, self.probe_interval)

    async def _probe(self, member: _Member) -> None:
        engine: Any = member.engine
        try:
            ok = bool(await asyncio.wait_for(engine.healthy(), self.probe_timeout))
            why = "health probe answered not healthy"
        except Exception as exc:
            ok, why = False, f"health probe failed: {type(exc).__name__}: {exc}"
        if not ok:
            self._take_out(member, why)
            return
        while True:  # back: first catch up on the weights loaded while it was out
            with self._mu:
                if member.live:
                    return
                target = self._checkpoint if member.stale else None
                if target is None:
                    member.live = True
                    log.warning("engine %s back in the pool", member.label)
                    return
            try:
                await member.engine.load_weights(target)
            except Exception as exc:
                self._take_out(member, f"failed to load {target} on coming back: {type(exc).__name__}: {exc}")
                return
            with self._mu:
                if self._checkpoint == target:
                    member.stale = False

    async def healthy(self) -> bool:
        with self._mu:
            return any(m.live for m in self.members)

    def status(self) -> list[dict[str, Any]]:
        """Per engine: live, sessions routed to it (their last call), calls, failures, the last failure."""
        with self._mu:
            sessions = {id(m): 0 for m in self.members}
            for m in self._placed.values():
                sessions[id(m)] += 1
            return [{"engine": m.label, "live": m.live, "sessions": sessions[id(m)], "calls": m.calls,
                     "in_flight": m.in_flight, "failures": m.failures, "last_error": m.last_error}
                    for m in self.members]

    async def close(self) -> None:
        self._stop.set()
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            await asyncio.to_thread(watcher.join, self.probe_timeout + 30.0)
        errors = [r for r in await asyncio.gather(*(m.engine.close() for m in self.members), return_exceptions=True)
                  if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
