"""A trial that ends while its first call is still in flight is judged by what the proxy measured:
the policy still sampling a long first reply is the agent's outcome; an engine that never produced
a token of it is infrastructure. (Issue #12: 3 of 6 mini-swe-agent trials ended `timeout` with
zero recorded calls, their only call still generating.)"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
from transformers import AutoTokenizer

from legorl.core.schemas import Outcome
from legorl.demo.taskgen import write_task_set
from legorl.engines.base import Generation, SamplingParams, TokenChunk
from legorl.harnesses.base import End, HarnessRun, ProxyView, classify
from legorl.proxy.clients import InProcessProxy
from legorl.proxy.server import ProxyServer
from legorl.stages.rollout import RolloutConfig, rollout_stage
from legorl.stages.tasks import import_stage


class SlowEngine:
    """Samples ``tokens`` copies of one token, ``per_token_s`` apart, after ``first_token_s``
    (``first_token_s=None``: never produces one)."""

    name = "slow"
    max_context = 2048

    def __init__(self, token_id: int, eos: int, *, tokens: int, per_token_s: float, first_token_s: float | None):
        self.token_id, self.eos, self.tokens = token_id, eos, tokens
        self.per_token_s, self.first_token_s = per_token_s, first_token_s

    async def stream(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[TokenChunk]:
        if self.first_token_s is None:
            await asyncio.sleep(3600)
        await asyncio.sleep(self.first_token_s or 0.0)
        ids = [self.token_id] * min(self.tokens, params.max_tokens - 1) + [self.eos]
        for i, token in enumerate(ids):
            last = i == len(ids) - 1
            final = Generation(token_ids=ids, logprobs=[-1.0] * len(ids), finish_reason="stop",
                               prompt_tokens=len(prompt_ids)) if last else None
            yield TokenChunk(token_ids=[token], logprobs=[-1.0], final=final)
            await asyncio.sleep(self.per_token_s)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        final = None
        async for chunk in self.stream(prompt_ids, params):
            final = chunk.final or final
        assert final is not None
        return final

    async def load_weights(self, path: str) -> None:
        return None

    async def close(self) -> None:
        return None


def _engine(tiny_model: Path, **kw: Any) -> tuple[SlowEngine, Any]:
    tok = AutoTokenizer.from_pretrained(tiny_model)
    word = tok.encode(" hello", add_special_tokens=False)[0]
    return SlowEngine(word, tok.eos_token_id, **kw), tok


def _run(ended: End, timed_out: bool) -> HarnessRun:
    return HarnessRun(ended, "detail", None, timed_out, 10.0, Path("/nonexistent"))


def test_classify_by_what_the_proxy_measured_of_the_call_in_flight() -> None:
    sampling = {"elapsed_s": 9.5, "first_token_s": 0.4, "sampled_tokens": 120}
    outcome, why = classify(_run(End.UNKNOWN, True), ProxyView(calls=0, in_flight=sampling), True, None)
    assert outcome is Outcome.TIMEOUT and "still sampling its first reply (120 tokens" in (why or "")
    # the harness gave up on the long reply itself: still the agent's (never a way to dodge a 0)
    outcome, _ = classify(_run(End.API_ERROR, False), ProxyView(calls=0, in_flight=sampling), True, None)
    assert outcome is Outcome.HARNESS_CRASH
    stuck = {"elapsed_s": 9.5, "first_token_s": None, "sampled_tokens": 0}
    outcome, why = classify(_run(End.UNKNOWN, True), ProxyView(calls=0, in_flight=stuck), True, None)
    assert outcome is Outcome.INFRA_ERROR and "had not sampled a token" in (why or "")
    outcome, why = classify(_run(End.UNKNOWN, True), ProxyView(calls=0), True, None)
    assert outcome is Outcome.INFRA_ERROR and "never reached the model" in (why or "")
    # an engine failure outranks everything
    outcome, _ = classify(_run(End.UNKNOWN, True), ProxyView(calls=0, in_flight=sampling, engine_error="boom"),
                          True, None)
    assert outcome is Outcome.INFRA_ERROR


@pytest.mark.parametrize("stream", [False, True])
def test_the_capture_of_a_session_finished_mid_call_says_how_far_the_call_got(tiny_model: Path, stream: bool) -> None:
    engine, tok = _engine(tiny_model, tokens=400, per_token_s=0.01, first_token_s=0.05)
    with ProxyServer(engine, tok) as server:  # type: ignore[arg-type]
        sid = server.new_session()
        client = openai.OpenAI(base_url=server.openai_base_url(sid), api_key="x", max_retries=0, timeout=30)

        def ask() -> None:
            try:
                response = client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}], stream=stream)
                if stream:
                    for _ in response:  # type: ignore[union-attr]
                        pass
            except openai.APIError:
                pass

        caller = threading.Thread(target=ask, daemon=True)
        caller.start()
        time.sleep(1.5)
        capture = server.finish(sid)
        caller.join(timeout=30)
    assert capture is not None and capture.calls == []
    assert capture.in_flight is not None
    assert capture.in_flight["sampled_tokens"] > 10 and capture.in_flight["first_token_s"] < 1.0
    assert capture.in_flight["elapsed_s"] >= 1.0


@pytest.mark.podman
@pytest.mark.slow
@pytest.mark.parametrize(("first_token_s", "expected"), [
    (0.1, Outcome.HARNESS_CRASH),  # sampling a reply too long for the trial: the policy's doing
    (None, Outcome.INFRA_ERROR),  # the engine never started it: not the agent's
])
def test_a_trial_whose_only_call_outlives_it(tmp_path: Path, tiny_model: Path, base_image: str,
                                             first_token_s: float | None, expected: Outcome) -> None:
    run = tmp_path / f"inflight-{'stuck' if first_token_s is None else 'slow'}-{time.monotonic_ns()}"
    import_stage(str(write_task_set(tmp_path / "set", 1, seed=5)), run / "tasks")
    engine, tok = _engine(tiny_model, tokens=2000, per_token_s=0.1, first_token_s=first_token_s)
    cfg = RolloutConfig(run=run, harnesses=["simple"], timeout_s=8, max_turns=2, retries=0)
    with InProcessProxy(engine, tok) as proxy:  # type: ignore[arg-type]
        summary = rollout_stage(cfg, proxy)
    [row] = summary.rows
    assert row.outcome == expected, row.error
    assert row.infra_failure is (expected is Outcome.INFRA_ERROR)
    assert row.error is not None
