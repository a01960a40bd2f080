"""The trainer at agent scale: the packed, padding-free path (LM head only at sampled tokens, fork
prefixes once, token-budget micro-batches, gradient checkpointing) gives TRL's padded path's loss
and gradients, dense and MoE with routing replay."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from train_support import TrialSpec, first_batch_trainer, run_fixture

from legorl.core.paths import RunDir
from legorl.training.attention import packed_attention
from legorl.training.batching import token_micro_batches
from legorl.training.config import TrainConfig
from legorl.training.data import load_step
from legorl.training.logprobs import HEAD_TILE_BYTES, sampled_logps, vocab_chunk
from legorl.training.packing import pack

# Two groups; two trials forked into a main segment and a rewrite holding it as its prefix.
SPECS = [
    TrialSpec("t1", 0, 1.0, segments=2),
    TrialSpec("t1", 1, 0.0),
    TrialSpec("t1", 2, 0.5),
    TrialSpec("t2", 0, 0.0, segments=2),
    TrialSpec("t2", 1, 1.0),
]

dense_run = run_fixture(SPECS, logprob_noise=0.3)
moe_run = run_fixture(SPECS, model="tiny_moe_model", logprob_noise=0.3)


def _trainer(run: RunDir, model: Path, out: Path, **options: Any) -> tuple[Any, list[int]]:
    config = TrainConfig(learning_rate=1e-4, **options)
    trainer, _, batch = first_batch_trainer(run, model, out, config)
    return trainer, batch


def _perturb(model: torch.nn.Module) -> None:
    """The policy a little way from the one that scored the old logprobs (ratios != 1, clipping active)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))


def _loss_and_grads(run: RunDir, model: Path, out: Path, **options: Any) -> dict[str, Any]:
    trainer, batch = _trainer(run, model, out, **options)
    trainer.current_gradient_accumulation_steps = 1
    scored = trainer._generate_and_score_completions([{"seq": i} for i in batch])
    _perturb(trainer.model)
    loss = trainer._compute_loss(trainer.model, scored)
    loss.backward()
    mask = scored["tool_mask"] > 0
    return {
        "loss": float(loss.detach()),
        "old": scored["old_per_token_logps"][mask],
        "grads": {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None},
        "forward_tokens": trainer.forward_tokens,
        "entropy": trainer._metrics["train"]["entropy"][-1],
    }


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
    assert a["loss"] != 0.0
    torch.testing.assert_close(a["old"], b["old"], rtol=1e-5, atol=1e-5)
    assert a["entropy"] == pytest.approx(b["entropy"], rel=1e-5)
    assert a["grads"].keys() == b["grads"].keys() and len(a["grads"]) > 10
    for name, grad in b["grads"].items():
        scale = float(grad.abs().max()) + 1e-12
        assert float((a["grads"][name] - grad).abs().max()) / scale < 1e-4, name


@pytest.mark.parametrize("loss", ["grpo", "dapo", "dr_grpo", "gspo"])
def test_packed_path_matches_trl_path_dense(dense_run: RunDir, tiny_model: Path, tmp_path: Path, loss: str) -> None:
    trl_path = _loss_and_grads(dense_run, tiny_model, tmp_path / "a", loss=loss, padding_free=False)
    packed = _loss_and_grads(dense_run, tiny_model, tmp_path / "b", loss=loss, share_prefixes=False)
    shared = _loss_and_grads(dense_run, tiny_model, tmp_path / "c", loss=loss)
    _assert_same(packed, trl_path)
    _assert_same(shared, trl_path)
    # packing drops the padding; sharing drops the forks' repeated prefixes on top
    assert shared["forward_tokens"] < packed["forward_tokens"] < trl_path["forward_tokens"]


def test_packed_path_matches_trl_path_moe_with_replay(moe_run: RunDir, tiny_moe_model: Path, tmp_path: Path) -> None:
    trl_path = _loss_and_grads(moe_run, tiny_moe_model, tmp_path / "a", routing_replay="on", padding_free=False)
    shared = _loss_and_grads(moe_run, tiny_moe_model, tmp_path / "b", routing_replay="on")
    _assert_same(shared, trl_path)
    assert any("router" in n or "gate" in n for n in shared["grads"])  # the aux loss and replay reach the router


def test_fork_prefix_is_packed_once() -> None:
    prompt = torch.arange(100, 140)
    forks = [torch.cat([prompt, torch.arange(k * 10, k * 10 + 5 + k)]) for k in range(3)]
    other = torch.arange(500, 530)
    rows = [*forks, other]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = r, 1
    packed = pack(ids, mask, [0, 0, 0, 1])
    assert packed.length == 40 + 5 + 6 + 7 + 30
    first, second = packed.documents
    assert (first.prefix, [n for _, n in first.branches]) == (40, [5, 6, 7])
    assert (second.prefix, second.branches) == (30, ())
    for i, r in enumerate(rows):  # every real position maps to its token, at its own position id
        at = packed.source[i, : len(r)]
        assert torch.equal(packed.input_ids[0, at], r)
        assert torch.equal(packed.position_ids[0, at], torch.arange(len(r)))
    assert torch.equal(packed.weight[0, :40], torch.full((40,), 3.0))
    separate = pack(ids, mask, [0, 1, 2, 3])
    assert separate.length == int(mask.sum())


def test_lm_head_tile_is_bounded_in_bytes_and_changes_nothing(tiny_model: Path) -> None:
    from transformers import AutoModelForCausalLM

    # 1,500 sampled positions of a 152k vocabulary: tiles of ~5.6k columns, never over the budget.
    assert vocab_chunk(1500, 151936, 4) >= 1024 and vocab_chunk(1500, 151936, 4) * 1500 * 4 <= HEAD_TILE_BYTES
    assert vocab_chunk(10, 8192, 4) == 8192
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    attention = torch.ones_like(ids)
    attention[1, 30:] = 0
    score = torch.zeros(2, 20)  # the completion is the last 20 columns
    score[0, 5:15], score[1, :8] = 1, 1
    packed = pack(ids, attention)
    results = []
    for tile in (HEAD_TILE_BYTES, 4 * 1024 * 10):  # one tile; then 1,024-column tiles, 8 per vocabulary
        model.zero_grad()
        with packed_attention(model):
            scored = sampled_logps(model, packed, ids[:, -20:], score, temperature=1.0, compute_entropy=True,
                                   tile_bytes=tile)
        scored.logps.sum().backward()
        results.append((scored.logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=attention).logits[:, -21:-1]
    reference = logits.log_softmax(-1).gather(-1, ids[:, -20:, None])[..., 0] * score
    reference.sum().backward()
    for logps, grads in results:
        torch.testing.assert_close(logps, reference.detach(), atol=1e-5, rtol=1e-5)
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)


def _accumulated_grads(trainer: Any, batch: list[int]) -> dict[str, torch.Tensor]:
    rows = [{"seq": i} for i in batch]
    trainer.current_gradient_accumulation_steps = trainer.steps_per_generation
    for _ in range(trainer.steps_per_generation):
        trainer.training_step(trainer.model, rows)
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loss", ["grpo", "dapo"])
def test_token_budget_micro_batches_give_the_full_batch_update(
    dense_run: RunDir, tiny_model: Path, tmp_path: Path, loss: str
) -> None:
    data = load_step(dense_run)
    budget = max(len(s) for s in data.sequences) * 2
    one, batch = _trainer(dense_run, tiny_model, tmp_path / "a", loss=loss)
    cut, _ = _trainer(dense_run, tiny_model, tmp_path / "b", loss=loss, max_tokens_per_micro_batch=budget)
    assert one.steps_per_generation == 1
    assert cut.steps_per_generation == token_micro_batches(data, [batch], budget) >= 3
    a, b = _accumulated_grads(one, batch), _accumulated_grads(cut, batch)
    for name, grad in a.items():
        assert float((b[name] - grad).abs().max()) <= 1e-4 * (float(grad.abs().max()) + 1e-12), name
    pieces = cut._buffered_inputs
    widths = [int(p["prompt_ids"].shape[1] + p["completion_mask"].sum(-1).sum()) for p in pieces]
    assert max(widths) <= budget


@pytest.mark.parametrize("moe", [False, True])
def test_gradient_checkpointing_gives_the_same_gradients(
    dense_run: RunDir, moe_run: RunDir, tiny_model: Path, tiny_moe_model: Path, tmp_path: Path, moe: bool
) -> None:
    run, model = (moe_run, tiny_moe_model) if moe else (dense_run, tiny_model)
    grads = []
    for checkpointing in (False, True):
        trainer, batch = _trainer(run, model, tmp_path / str(checkpointing), micro_batches=2)
        if checkpointing:
            trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        _perturb(trainer.model)  # the old logprobs come from this policy too: ratios 1, gradients non-zero
        grads.append(_accumulated_grads(trainer, batch))
    for name, grad in grads[0].items():
        assert float((grads[1][name] - grad).abs().max()) <= 1e-4 * (float(grad.abs().max()) + 1e-12), name


@pytest.mark.parametrize("moe", [False, True])
def test_checkpointed_packed_path_in_token_tiles_matches_trl_path(
    dense_run: RunDir, moe_run: RunDir, tiny_model: Path, tiny_moe_model: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, moe: bool,
) -> None:
    """With gradient checkpointing the packed path runs its decoder layers in token tiles (a
    mixture-of-experts model: its norms checkpointed, the experts' block whole; tiling.py); tiles of
    16 tokens cut every row here, as 8 MB tiles cut 32k-token rows."""
    from legorl.training import tiling

    run, model = (moe_run, tiny_moe_model) if moe else (dense_run, tiny_model)
    monkeypatch.setattr(tiling, "TILE_BYTES", 16 * 768 * 4)  # the tiny model's ffn is 768 wide
    tiles: list[int] = []
    inner = tiling.checkpoint
    monkeypatch.setattr(tiling, "checkpoint", lambda fn, x, *more, **kw: (tiles.append(x.shape[-2]), inner(fn, x, *more, **kw))[1])
    options: dict[str, Any] = {"routing_replay": "on"} if moe else {}
    trl_path = _loss_and_grads(run, model, tmp_path / "a", padding_free=False, **options)
    tiled = _loss_and_grads(run, model, tmp_path / "b", gradient_checkpointing=True, **options)
    _assert_same(tiled, trl_path)
    if moe:
        assert tiles and set(tiles) != {16}  # norms only: a mixture-of-experts block runs whole
    else:
        assert tiles.count(16) > 10  # the layers did run in 16-token tiles
