"""MoE routing capture and replay (R3) on the real tiny Qwen3-MoE model."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from legorl.core.errors import LegorlError
from legorl.engines.base import SamplingParams
from legorl.engines.embedded import EmbeddedEngine, process_logits
from legorl.routing import capture_routing, count_flips, moe_routers, replay_routing, routing_shape


@pytest.fixture(scope="module")
def moe(tiny_moe_model: Path):
    return AutoModelForCausalLM.from_pretrained(tiny_moe_model).eval()


@pytest.fixture(scope="module")
def generated(tiny_moe_model: Path):
    """Three sampled sequences from the embedded engine, with their captured routing."""

    async def go():
        eng = EmbeddedEngine(tiny_moe_model)
        prompts = [list(range(100 + 7 * i, 140 + 9 * i)) for i in range(3)]
        gens = await asyncio.gather(*(eng.generate(p, SamplingParams(max_tokens=40, seed=i)) for i, p in enumerate(prompts)))
        await eng.close()
        return prompts, gens

    return asyncio.run(go())


def _seq_logprobs(model, prompt: list[int], gen, routing=None) -> tuple[np.ndarray, np.ndarray, int]:
    """Full forward pass over prompt+completion: (logprobs of sampled tokens, routing used, natural flips)."""
    ids = torch.tensor([prompt + gen.token_ids])
    with torch.no_grad():
        if routing is None:
            with capture_routing(model) as cap:
                logits = model(ids).logits
            flips = 0
        else:
            with replay_routing(model, torch.as_tensor(routing).unsqueeze(0)) as rp, capture_routing(model) as cap:
                logits = model(ids).logits
            flips = rp.flips
    lp = process_logits(logits[0, len(prompt) - 1 : -1]).gather(1, torch.tensor(gen.token_ids)[:, None])[:, 0]
    return lp.numpy(), cap.take(), flips


def test_shape_and_routers(moe) -> None:
    assert routing_shape(moe) == (4, 2)
    assert len(moe_routers(moe)) == 4
    dense_like = torch.nn.Linear(2, 2)
    assert routing_shape(dense_like) is None
    with pytest.raises(LegorlError, match="no MoE routers"), replay_routing(dense_like):
        pass


def test_replaying_captured_routing_is_bitwise_identity(moe) -> None:
    ids = torch.randint(0, 8000, (2, 33), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), capture_routing(moe) as cap:
        plain = moe(ids).logits
    routing = cap.take()
    assert routing.shape == (2 * 33, 4, 2) and routing.dtype == np.int16
    with torch.no_grad(), replay_routing(moe, routing.reshape(2, 33, 4, 2)) as rp:
        replayed = moe(ids).logits
    assert torch.equal(plain, replayed)
    assert (rp.flips, rp.decisions) == (0, 2 * 33 * 4)


def test_replay_forces_other_experts_and_keeps_router_gradient(moe) -> None:
    ids = torch.randint(0, 8000, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), capture_routing(moe) as cap:
        plain = moe(ids).logits
    natural = cap.take()
    forced = (natural + 1) % 8  # every decision changed
    moe.zero_grad()
    with replay_routing(moe, forced[None]) as rp, capture_routing(moe) as used:
        out = moe(ids).logits
        out.logsumexp(-1).sum().backward()
    assert count_flips(used.take(), forced) == (0, 16 * 4)  # the model ran the forced experts
    assert rp.flips == 16 * 4  # and knew the router would have chosen otherwise
    assert not torch.allclose(plain, out)
    for router in moe_routers(moe):
        grad = router.get_parameter("weight").grad
        assert grad is not None and grad.abs().sum() > 0
    moe.zero_grad()
    with pytest.raises(LegorlError, match="covers 15 tokens"), replay_routing(moe, forced[None, :15]):
        moe(ids)
    with pytest.raises(LegorlError, match="expected"):
        replay_routing(moe, np.zeros((1, 16, 3, 2))).__enter__()


def test_minus_one_rows_leave_the_router_free(moe) -> None:
    ids = torch.randint(0, 8000, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        plain = moe(ids).logits
        with replay_routing(moe, np.full((1, 10, 4, 2), -1, dtype=np.int16)) as rp:
            free = moe(ids).logits
    assert torch.equal(plain, free) and rp.flips == 0


def test_engine_routing_replays_with_zero_flips_and_fp32_logprobs(moe, generated) -> None:
    """Acceptance: routing captured at generation, replayed in a training forward pass."""
    prompts, gens = generated
    gen_lp, re_lp = [], []
    for prompt, gen in zip(prompts, gens, strict=True):
        assert gen.routed_experts.shape == (len(prompt) + len(gen.token_ids), 4, 2)
        assert (gen.routed_experts[-1] == -1).all()  # the last sampled token was never fed forward
        _, natural, _ = _seq_logprobs(moe, prompt, gen)
        # Same weights: the training forward routes every fed token exactly as generation did.
        assert count_flips(natural[:-1], gen.routed_experts[:-1])[0] == 0
        lp, used, flips = _seq_logprobs(moe, prompt, gen, gen.routed_experts)
        assert flips == 0
        assert count_flips(used[:-1], gen.routed_experts[:-1])[0] == 0
        gen_lp += gen.logprobs
        re_lp += lp.tolist()
    a, b = np.array(gen_lp), np.array(re_lp)
    assert np.abs(a - b).max() <= 1e-4
    assert np.corrcoef(a, b)[0, 1] >= 0.9999


def test_perturbed_weights_flip_routing_and_replay_removes_flips(tiny_moe_model: Path, generated) -> None:
    """With 1e-2 relative weight noise (about a policy step), some decisions flip; replay forces them back."""
    prompts, gens = generated
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_model).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 1e-2 * p.std())  # 1% of each tensor's scale
    flips_free = decisions = flips_replay = 0
    gap_free, gap_replay = [], []
    for prompt, gen in zip(prompts, gens, strict=True):
        lp_free, natural, _ = _seq_logprobs(model, prompt, gen)
        f, n = count_flips(natural[:-1], gen.routed_experts[:-1])
        flips_free += f
        decisions += n
        lp_rep, used, _ = _seq_logprobs(model, prompt, gen, gen.routed_experts)
        flips_replay += count_flips(used[:-1], gen.routed_experts[:-1])[0]
        gap_free += np.abs(lp_free - gen.logprobs).tolist()
        gap_replay += np.abs(lp_rep - gen.logprobs).tolist()
    print(f"flips without replay: {flips_free}/{decisions} ({flips_free / decisions:.2%}); with replay: {flips_replay}; "
          f"mean |Δlogprob| {np.mean(gap_free):.4f} -> {np.mean(gap_replay):.4f}")
    assert flips_free > 0
    assert flips_replay == 0
