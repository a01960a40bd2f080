"""The proxy under load (issue #12): rounds of 128 concurrent sessions, mixing the official OpenAI
and Anthropic clients, streamed and not, tool calls, and clients that hang up mid-stream, for a
bounded time, on the scripted engine and on the embedded tiny model.

Invariants: no 5xx; no cross-talk (each capture holds its own nonce and no other); every session's
capture is exactly its conversation (token identity with the scripted engine; with the real model
an independent forward pass reproduces each loss-masked token's recorded logprob); finished
sessions are released (the session table empties, the Session objects are collected, RSS
plateaus over rounds). Figures go to load.json (see conftest.py).
"""

from __future__ import annotations

import asyncio
import gc
import sys
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
import numpy as np
import torch
from load_checks import check_shape, nonces_seen, recomputed_logprobs
from load_traffic import KINDS, Traffic, finish, new_nonce, run_session, shared_client
from transformers import AutoModelForCausalLM

from legorl.proxy.server import ProxyServer

SESSIONS = 128
MiB = 1 << 20


def rss_bytes() -> int:
    """This process's resident set (the proxy serves from a thread of it)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@dataclass
class LoadRun:
    """Rounds of :data:`SESSIONS` concurrent sessions against one proxy, and what they showed."""

    proxy: ProxyServer
    tools: bool
    exact: bool  # scripted replies: check token identity, not just the template's shape
    max_tokens: int = 128
    traffic: Traffic = field(default_factory=Traffic)
    rounds: int = 0
    sessions: int = 0
    cross_talk: int = 0
    rss_after_round: list[int] = field(default_factory=list)
    python_blocks_after_round: list[int] = field(default_factory=list)  # sys.getallocatedblocks()
    captures: list[dict[str, Any]] = field(default_factory=list)  # the last round's

    async def _one(self, http: httpx2.AsyncClient, index: int, alive: weakref.WeakSet[Any]) -> tuple[str, str, str]:
        nonce, kind = new_nonce(index), KINDS[index % len(KINDS)]
        if index % 2:  # half the sessions are made over HTTP, half by a request to an unknown id
            resp = await http.post(self.proxy.base_url + "/sessions", json={"metadata": {"nonce": nonce}})
            assert resp.status_code == 200, resp.text
            sid = resp.json()["session_id"]
        else:
            sid = f"load-{nonce}"
        await run_session(self.proxy, http, self.traffic, sid, nonce, kind, self.tools, self.max_tokens)
        session = self.proxy.core.get(sid)
        assert session is not None
        alive.add(session)
        return sid, nonce, kind

    async def _round(self) -> weakref.WeakSet[Any]:
        alive: weakref.WeakSet[Any] = weakref.WeakSet()
        first = self.sessions
        async with shared_client(self.traffic) as http:
            done = await asyncio.gather(*(self._one(http, first + i, alive) for i in range(SESSIONS)))
            finished = await asyncio.gather(*(finish(http, self.proxy, sid) for sid, _, _ in done))
        self.captures = []
        for (_, nonce, kind), capture in zip(done, finished, strict=True):
            seen = nonces_seen(capture, self.proxy.renderer)
            self.cross_talk += len(seen - {nonce})
            assert seen == {nonce}, (kind, nonce, seen)
            check_shape(capture, kind, nonce, self.proxy.renderer, self.tools, self.exact)
            self.captures.append(capture)
        self.sessions += SESSIONS
        self.rounds += 1
        return alive

    def run(self, budget_s: float, min_rounds: int) -> None:
        """Rounds until ``budget_s`` is spent (at least ``min_rounds``), each one checked and released."""
        start = time.monotonic()
        while self.rounds < min_rounds or time.monotonic() - start < budget_s:
            alive = asyncio.run(self._round())
            assert not self.proxy.core.sessions, "finished sessions are still in the session table"
            engine_log = getattr(self.proxy.core.engine, "calls", None)
            if isinstance(engine_log, list):  # the scripted engine's own record of every call
                engine_log.clear()
            for _ in range(100):
                gc.collect()
                if not alive:
                    break
                time.sleep(0.02)
            assert not alive, f"{len(alive)} finished sessions are still referenced"
            self.rss_after_round.append(rss_bytes())
            self.python_blocks_after_round.append(sys.getallocatedblocks())
            assert self.traffic.server_errors == 0, self.traffic.statuses

    def figures(self) -> dict[str, Any]:
        rss = self.rss_after_round
        return {
            "concurrent_sessions": SESSIONS, "rounds": self.rounds, "sessions": self.sessions,
            "requests": self.traffic.requests, "model_calls": len(self.traffic.latencies_s),
            "statuses": {str(k): v for k, v in sorted(self.traffic.statuses.items())},
            "server_errors_5xx": self.traffic.server_errors, "cross_talk": self.cross_talk,
            "streams_dropped_by_client": self.traffic.disconnects,
            "latency_p50_ms": self.traffic.percentile_ms(0.50), "latency_p99_ms": self.traffic.percentile_ms(0.99),
            "rss_mib_after_each_round": [round(r / MiB, 1) for r in rss],
            "rss_growth_mib_after_round_1": round((rss[-1] - rss[0]) / MiB, 1),
            "python_blocks_after_each_round": self.python_blocks_after_round,
            "session_table_after_finish": len(self.proxy.core.sessions),
        }


def _plateaus(rss: list[int], blocks: list[int], slack: int) -> None:
    """Python's live allocations after the second round grow by no more than the test's own
    per-round records (a few per session; the last round's captures are replaced, not kept). RSS after the first round (imports, pools, allocator arenas warmed) grows by at most ``slack``
    in all, and the second half of the rounds grows less than the first half did plus ``slack / 4``:
    growth per round would keep adding up."""
    assert blocks[-1] - blocks[1] <= 20 * SESSIONS * len(blocks), blocks
    assert rss[-1] - rss[0] <= slack, [r // MiB for r in rss]
    half = len(rss) // 2
    assert rss[-1] - rss[half] <= max(0, rss[half] - rss[0]) + slack // 4, [r // MiB for r in rss]


def test_128_concurrent_sessions_scripted_engine(scripted_proxy: ProxyServer, long_profile: bool,
                                                 load_figures: dict[str, Any]) -> None:
    load = LoadRun(scripted_proxy, tools=True, exact=True)
    load.run(budget_s=300 if long_profile else 30, min_rounds=4)
    load_figures["scripted"] = load.figures()
    _plateaus(load.rss_after_round, load.python_blocks_after_round, slack=48 * MiB)


def test_128_concurrent_sessions_real_model(real_proxy: ProxyServer, tiny_model: Path, long_profile: bool,
                                            load_figures: dict[str, Any]) -> None:
    """The same traffic on the embedded engine (batched decoding, no tools: a random model's text)."""
    load = LoadRun(real_proxy, tools=False, exact=False, max_tokens=16)
    load.run(budget_s=240 if long_profile else 0, min_rounds=3 if long_profile else 1)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    ours, recorded = recomputed_logprobs(model, [s for c in load.captures for s in c["segments"]])
    max_abs = float(np.abs(ours - recorded).max())
    pearson = float(np.corrcoef(ours, recorded)[0, 1])
    load_figures["real_model"] = {**load.figures(), "masked_tokens_checked": len(ours),
                                  "logprob_max_abs_diff": max_abs, "logprob_pearson": pearson}
    assert len(ours) >= 1000 and pearson >= 0.9999 and max_abs <= 1e-4, (len(ours), pearson, max_abs)
    if long_profile:
        _plateaus(load.rss_after_round, load.python_blocks_after_round, slack=64 * MiB)
