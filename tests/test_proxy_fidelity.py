"""Fidelity of what the proxy captures: an independent full forward pass over each captured segment
(what a trainer does) reproduces the logprobs of every sampled token, and for a MoE model the
recorded routing matches the routing of that forward pass (0 flips) and replays exactly."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import torch
from proxy_support import TOOLS
from transformers import AutoModelForCausalLM

from legorl.core.schemas import Segment
from legorl.engines.embedded import EmbeddedEngine, process_logits
from legorl.proxy.server import ProxyServer
from legorl.routing import capture_routing, count_flips, replay_routing


def _serve(model_dir: Path) -> Iterator[tuple[ProxyServer, Any]]:
    engine = EmbeddedEngine(model_dir)
    with ProxyServer(engine, model_dir) as server:
        yield server, AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    asyncio.run(engine.close())


@pytest.fixture(scope="module")
def dense(tiny_model: Path) -> Iterator[tuple[ProxyServer, Any]]:
    yield from _serve(tiny_model)


@pytest.fixture(scope="module")
def moe(tiny_moe_model: Path) -> Iterator[tuple[ProxyServer, Any]]:
    yield from _serve(tiny_moe_model)


def _conversation(proxy: ProxyServer, sid: str, turns: int, max_tokens: int, **sampling: Any) -> None:
    client = openai.OpenAI(base_url=proxy.openai_base_url(sid), api_key="x", max_retries=0)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."},
                                  {"role": "user", "content": "Fix the bug in parser.py"}]
    for turn in range(turns):
        stream = turn % 2 == 1
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                model="m", messages=msgs, tools=TOOLS, max_tokens=max_tokens, stream=True, seed=turn, **sampling)
                if c.choices)
            msgs.append({"role": "assistant", "content": text})
        else:
            r = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=max_tokens,
                                               seed=turn, **sampling)
            msgs.append(r.choices[0].message.model_dump(exclude_none=True))
        msgs.append({"role": "user", "content": f"Output of step {turn}: ok"})
    # A rewrite (compaction) so more than one segment is checked.
    client.chat.completions.create(model="m", max_tokens=max_tokens, seed=99, tools=TOOLS, **sampling,
                                   messages=[msgs[0], {"role": "user", "content": "Summary: steps done."}])


def _recompute(model: Any, seg: Segment, temperature: float = 1.0, top_p: float = 1.0,
               routing: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    ids = torch.tensor([seg.token_ids])
    with torch.no_grad():
        if routing is None:
            logits = model(ids).logits[0]
        else:
            with replay_routing(model, routing[None]):
                logits = model(ids).logits[0]
    lp = process_logits(logits[:-1], temperature, 0, top_p)
    got = lp.gather(1, ids[0, 1:, None])[:, 0].numpy()
    mask = np.array(seg.loss_mask[1:], dtype=bool)
    return got[mask], np.array(seg.logprobs[1:], dtype=np.float64)[mask]


def _check(pairs: list[tuple[np.ndarray, np.ndarray]]) -> tuple[float, float]:
    ours = np.concatenate([p[0] for p in pairs]).astype(np.float64)
    captured = np.concatenate([p[1] for p in pairs])
    assert len(ours) >= 25
    pearson = float(np.corrcoef(ours, captured)[0, 1])
    max_abs = float(np.abs(ours - captured).max())
    assert pearson >= 0.9999 and max_abs <= 1e-4, (pearson, max_abs)
    return pearson, max_abs


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.7, "top_p": 0.9}], ids=["t1", "t0.7-p0.9"])
def test_forward_pass_reproduces_captured_logprobs(dense: tuple[ProxyServer, Any], sampling: dict[str, float]) -> None:
    proxy, model = dense
    sid = proxy.new_session()
    _conversation(proxy, sid, turns=3, max_tokens=12, **sampling)
    cap = proxy.capture(sid)
    assert [s.reason for s in cap.segments] == ["main", "rewrite"]
    assert sum(cap.segments[0].loss_mask) == sum(c.completion_tokens for c in cap.calls[:3])
    pairs = [_recompute(model, s, sampling.get("temperature", 1.0), sampling.get("top_p", 1.0)) for s in cap.segments]
    _check(pairs)


def test_moe_routing_matches_and_replays(moe: tuple[ProxyServer, Any]) -> None:
    proxy, model = moe
    sid = proxy.new_session()
    _conversation(proxy, sid, turns=2, max_tokens=10)
    cap = proxy.capture(sid)
    pairs = []
    for seg in cap.segments:
        assert seg.routed_experts is not None and seg.routing_layers == 4 and seg.routing_top_k == 2
        routing = np.array(seg.routed_experts, dtype=np.int16).reshape(len(seg.token_ids), 4, 2)
        # Only the very last token (sampled, never fed forward) has no routing yet.
        assert (routing[-1] == -1).all() and (routing[:-1] >= 0).all()
        with torch.no_grad(), capture_routing(model) as rec:
            model(torch.tensor([seg.token_ids]))
        fresh = rec.take()
        flips, decisions = count_flips(routing[:-1], fresh[:-1])
        assert flips == 0 and decisions == (len(seg.token_ids) - 1) * 4
        pairs.append(_recompute(model, seg, routing=routing))
    _check(pairs)
