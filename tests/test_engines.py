"""The embedded and scripted engines on the real tiny model: fidelity, sampling, batching, weights."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import cast

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from legorl.core.errors import ConfigError, LegorlError
from legorl.engines import Engine, PromptTooLong, make_engine
from legorl.engines.base import Generation, SamplingParams, TokenChunk
from legorl.engines.embedded import EmbeddedEngine, process_logits
from legorl.engines.scripted import ScriptedCall, ScriptedEngine

PROMPTS = [list(range(200 + 11 * i, 230 + 13 * i)) for i in range(6)]


@pytest.fixture(scope="module")
def engine(tiny_model: Path):
    eng = EmbeddedEngine(tiny_model)
    yield eng
    asyncio.run(eng.close())


def run(coro):
    return asyncio.run(coro)


def gen_all(eng: Engine, params: list[SamplingParams], prompts=PROMPTS) -> list[Generation]:
    async def go():
        return await asyncio.gather(*(eng.generate(p, sp) for p, sp in zip(prompts, params, strict=True)))

    return run(go())


def recompute(model, prompt: list[int], gen: Generation, sp: SamplingParams) -> np.ndarray:
    """What a trainer does: one full forward over prompt+completion, same logit processing."""
    ids = torch.tensor([prompt + gen.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
    lp = process_logits(logits, sp.temperature, sp.top_k, sp.top_p)
    return lp.gather(1, torch.tensor(gen.token_ids)[:, None])[:, 0].numpy()


def test_is_an_engine(engine: EmbeddedEngine) -> None:
    assert isinstance(engine, Engine)
    assert engine.max_context >= 8192
    assert engine.eos_token_ids and engine.routing_shape is None


@pytest.mark.parametrize(
    "sp",
    [
        SamplingParams(max_tokens=40, temperature=1.0),
        SamplingParams(max_tokens=40, temperature=0.7, top_p=0.9, top_k=200),
        SamplingParams(max_tokens=40, temperature=1.3, top_k=50),
    ],
    ids=["t1", "t0.7-p0.9-k200", "t1.3-k50"],
)
def test_fidelity_full_forward_reproduces_logprobs(engine: EmbeddedEngine, sp: SamplingParams) -> None:
    """Acceptance: Pearson >= 0.9999 and max |Δ| <= 1e-4 in fp32, processed distribution."""
    params = [SamplingParams(**{**sp.__dict__, "seed": i}) for i in range(len(PROMPTS))]
    gens = gen_all(engine, params)
    a = np.concatenate([g.logprobs for g in gens])
    b = np.concatenate([recompute(engine.model, p, g, s) for p, g, s in zip(PROMPTS, gens, params, strict=True)])
    assert len(a) > 100
    assert np.isfinite(a).all()
    assert np.abs(a - b).max() <= 1e-4
    assert np.corrcoef(a, b)[0, 1] >= 0.9999
    if sp.top_k or sp.top_p < 1:  # the processing was really applied: logprobs are above the raw ones
        raw = np.concatenate([recompute(engine.model, p, g, SamplingParams()) for p, g in zip(PROMPTS, gens, strict=True)])
        assert (a > raw + 1e-3).mean() > 0.9


def test_process_logits_top_k_top_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    assert torch.isinf(process_logits(logits, top_k=2)[0, 2:]).all()
    kept = process_logits(logits, top_p=0.8)[0]  # 0.5+0.2 < 0.8 -> the third token completes the mass
    assert torch.isfinite(kept[:3]).all() and torch.isinf(kept[3:]).all()
    assert torch.allclose(kept[:3].exp(), torch.tensor([0.5, 0.2, 0.15]) / 0.85)
    assert torch.isfinite(process_logits(logits, top_p=0.01)[0, 0])  # the best token always stays
    per_row = process_logits(logits.repeat(2, 1), top_k=torch.tensor([1, 0]))
    assert torch.isinf(per_row[0, 1:]).all() and torch.isfinite(per_row[1]).all()
    hot = process_logits(logits, temperature=2.0)[0].exp()
    assert torch.allclose(hot, torch.softmax(logits[0] / 2, -1))


def test_greedy_seeds_and_limits(engine: EmbeddedEngine, tiny_model: Path) -> None:
    greedy = gen_all(engine, [SamplingParams(max_tokens=12, temperature=0.0)] * 2, PROMPTS[:2])
    ids = torch.tensor([PROMPTS[0] + greedy[0].token_ids])
    with torch.no_grad():
        argmax = engine.model(ids).logits[0, len(PROMPTS[0]) - 1 : -1].argmax(-1).tolist()
    assert greedy[0].token_ids == argmax
    a, b, c = gen_all(engine, [SamplingParams(max_tokens=20, seed=7)] * 2 + [SamplingParams(max_tokens=20, seed=8)],
                      [PROMPTS[0]] * 3)
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids
    assert a.finish_reason == "length" and len(a.token_ids) == 20 and a.prompt_tokens == len(PROMPTS[0])
    # stop ids end the sequence and are kept
    stop_at = a.token_ids[5]
    s = run(engine.generate(PROMPTS[0], SamplingParams(max_tokens=20, seed=7, stop_token_ids=(stop_at,))))
    first = a.token_ids.index(stop_at)
    assert s.token_ids == a.token_ids[: first + 1] and s.finish_reason == "stop"
    # the context bounds the completion; a prompt that fills it is refused
    small = EmbeddedEngine(tiny_model, max_context=len(PROMPTS[0]) + 3)
    g = run(small.generate(PROMPTS[0], SamplingParams(max_tokens=50, seed=0)))
    assert len(g.token_ids) == 3 and g.finish_reason == "length"
    with pytest.raises(PromptTooLong):
        run(small.generate(list(range(len(PROMPTS[0]) + 3)), SamplingParams()))
    with pytest.raises(ConfigError, match="top_p"):
        run(small.generate(PROMPTS[0], SamplingParams(top_p=0.0)))
    with pytest.raises(ConfigError, match="outside"):
        run(small.generate([10**9], SamplingParams()))
    run(small.close())


def test_concurrent_requests_are_batched_and_match_unbatched(engine: EmbeddedEngine) -> None:
    params = [SamplingParams(max_tokens=30, seed=100 + i, temperature=0.9, top_p=0.95) for i in range(len(PROMPTS))]
    alone = [run(engine.generate(p, sp)) for p, sp in zip(PROMPTS, params, strict=True)]
    before = engine.stats.max_batch
    steps_before = engine.stats.decode_steps
    together = gen_all(engine, params)
    assert engine.stats.max_batch >= 2 or before >= 2
    assert max(k for k, v in engine.stats.batch_sizes.items() if v) >= 2
    assert engine.stats.decode_steps - steps_before < sum(len(g.token_ids) for g in together) // 2
    for x, y in zip(alone, together, strict=True):
        assert x.token_ids == y.token_ids  # same seed, same tokens (Gumbel-max draws; see legorl/engines/sampling.py)
        assert np.abs(np.array(x.logprobs) - np.array(y.logprobs)).max() <= 1e-5


def test_stream_and_cancel(engine: EmbeddedEngine) -> None:
    async def go():
        chunks = [c async for c in engine.stream(PROMPTS[0], SamplingParams(max_tokens=15, seed=3))]
        whole = await engine.generate(PROMPTS[0], SamplingParams(max_tokens=15, seed=3))
        # a consumer that leaves early frees its slot; the engine keeps serving
        agen = cast(AsyncGenerator[TokenChunk, None], engine.stream(PROMPTS[1], SamplingParams(max_tokens=500, seed=3)))
        async for _ in agen:
            break
        await agen.aclose()
        after = await engine.generate(PROMPTS[1], SamplingParams(max_tokens=5, seed=3))
        return chunks, whole, after

    chunks, whole, after = run(go())
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids
    assert chunks[-1].final is not None and chunks[-1].final.token_ids == whole.token_ids
    assert all(c.final is None for c in chunks[:-1])
    assert len(after.token_ids) == 5


def test_event_loop_stays_responsive(engine: EmbeddedEngine) -> None:
    """Model compute runs on the worker thread: a ticker on the loop keeps ticking during decoding."""

    async def go():
        gaps: list[float] = []
        done = asyncio.Event()

        async def ticker():
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        t = asyncio.create_task(ticker())
        await engine.generate(PROMPTS[2] * 20, SamplingParams(max_tokens=60, seed=1))
        done.set()
        await t
        return gaps

    gaps = run(go())
    assert len(gaps) > 10
    assert np.median(gaps) < 0.05


def test_load_weights_changes_outputs(engine: EmbeddedEngine, tiny_model: Path, tmp_path: Path) -> None:
    sp = SamplingParams(max_tokens=20, seed=11)
    before = run(engine.generate(PROMPTS[0], sp))
    other = tmp_path / "step1"
    shutil.copytree(tiny_model, other)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)  # tied: sharper distributions
    model.save_pretrained(other)

    async def swap_while_generating():
        inflight = asyncio.create_task(engine.generate(PROMPTS[0], sp))
        await asyncio.sleep(0)
        await engine.load_weights(str(other))
        return await inflight, await engine.generate(PROMPTS[0], sp)

    old_run, after = run(swap_while_generating())
    assert old_run.token_ids == before.token_ids  # in flight when the swap was asked: finished on old weights
    assert after.token_ids != before.token_ids
    assert np.mean(after.logprobs) > np.mean(before.logprobs)  # sharper
    with pytest.raises(LegorlError, match="not a model directory"):
        run(engine.load_weights(str(tmp_path / "missing")))
    run(engine.load_weights(str(tiny_model)))
    assert run(engine.generate(PROMPTS[0], sp)).token_ids == before.token_ids
    assert engine.stats.loads >= 2


def test_scripted_engine(tiny_model: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model)
    texts = ['<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>', "All done.<|im_end|>"]
    eng = make_engine("scripted", tokenizer=tok, completions=texts)
    assert isinstance(eng, Engine)
    a = run(eng.generate([1, 2, 3], SamplingParams()))
    assert tok.decode(a.token_ids) == texts[0] + "<|im_end|>" and a.finish_reason == "stop"
    assert a.logprobs == [0.0] * len(a.token_ids)

    async def chunks():
        return [c async for c in eng.stream([1, 2, 3], SamplingParams())]

    cs = run(chunks())
    assert tok.decode([t for c in cs for t in c.token_ids]) == texts[1]
    with pytest.raises(LegorlError, match="ran out of completions"):
        run(eng.generate([1], SamplingParams()))
    short = run(ScriptedEngine(tok, texts).generate([1], SamplingParams(max_tokens=3)))
    assert len(short.token_ids) == 3 and short.finish_reason == "length"

    def by_prompt(call: ScriptedCall) -> str:
        return "yes" if "hello" in call.prompt_text else "no"

    fn = ScriptedEngine(str(tiny_model), by_prompt)
    assert tok.decode(run(fn.generate(tok.encode("hello there"), SamplingParams())).token_ids) == "yes<|im_end|>"
    with pytest.raises(ConfigError, match="unknown engine"):
        make_engine("nope")
