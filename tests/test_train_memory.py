"""What keeps a long packed row's training memory down: freed blocks leaving the process (memory.py)
and the decoder layers run in token tiles (tiling.py; its gradients against TRL's padded path are
pinned in test_train_scale.py)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from legorl.training.attention import packed_attention
from legorl.training.packing import Document
from legorl.training.tiling import LAYER_FAMILIES, tile_tokens, token_tiles

# Frees 200 x 2 MB blocks that lie between small live ones (activations between kept tensors), after
# one 16 MB block freed has raised glibc's mmap threshold; prints the RSS they leave behind, MB.
_RETAINED = """
import sys, torch
from pathlib import Path
from legorl.training.memory import map_large_blocks
if sys.argv[1] == "map":
    assert map_large_blocks()
def rss():
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmRSS"))
    return int(line.split()[1]) / 1024
torch.ones(4 * 2**20)  # 16 MB, allocated and freed at once
before = rss()
big, small = [], []
for _ in range(200):
    big.append(torch.ones(2**19))
    small.append(torch.ones(16))
del big
print(rss() - before)
"""


def _retained(mode: str) -> float:
    done = subprocess.run([sys.executable, "-c", _RETAINED, mode], capture_output=True, text=True, check=True)
    return float(done.stdout.split()[-1])


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
@pytest.mark.heavy
def test_freed_blocks_leave_the_process() -> None:
    assert _retained("default") > 300  # glibc keeps the 400 MB freed between live blocks
    assert _retained("map") < 50


def test_tiles_are_bounded_in_bytes() -> None:
    assert tile_tokens(768, 4, 8 * 2**20) == 2730
    assert tile_tokens(4864, 2, 8 * 2**20) == 862
    assert tile_tokens(10**9, 4, 1024) == 1


def test_token_tiles_wrap_layers_or_their_mlps_and_norms_and_restore_them(
    tiny_model: Path, tiny_moe_model: Path,
) -> None:
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(tiny_model)
    layers = dense.config.num_hidden_layers
    with token_tiles(dense) as wrapped:  # each decoder layer whole, and the final norm
        assert wrapped == layers + 1
        assert "forward" in dense.model.layers[0].__dict__
    assert all("forward" not in m.__dict__ for m in dense.modules())
    moe = AutoModelForCausalLM.from_pretrained(tiny_moe_model)
    with token_tiles(moe) as wrapped:  # per layer its 4 norms; the experts' block runs whole (routing replay)
        assert wrapped == moe.config.num_hidden_layers * 4 + 1
    assert all("forward" not in m.__dict__ for m in moe.modules())


_SHAPE = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=256)


def _hidden_and_grads(model: torch.nn.Module, tile_bytes: int | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A packed row of a plain document and a forked one, through the backbone with gradient checkpointing."""
    documents = (Document(0, 20), Document(20, 10, ((30, 6), (36, 4))))
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(1))
    positions = torch.tensor([[*range(20), *range(10), *range(10, 16), *range(10, 14)]])
    model.zero_grad()
    with packed_attention(model), token_tiles(model, tile_bytes) if tile_bytes else contextlib.nullcontext():
        out = model.model(input_ids=ids, position_ids=positions, legorl_documents=documents, use_cache=False)
        out.last_hidden_state.square().sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return out.last_hidden_state.detach(), grads


@pytest.mark.parametrize("config", ["LlamaConfig", "Qwen2Config", "Qwen3Config", "MistralConfig"])
def test_tiled_layers_compute_the_layers_own_forward(config: str) -> None:
    """The tiled forward is each family's own layer forward rewritten: same hidden states and
    gradients, in float64 to the last bits, with 7-token tiles cutting documents and fork branches.
    A family outside LAYER_FAMILIES (Mistral) keeps its own layer forward with its MLPs in tiles."""
    import transformers

    torch.manual_seed(0)
    options = {"sliding_window": None} if config == "MistralConfig" else {}
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config)(**_SHAPE, **options))
    model = model.to(torch.float64).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert (type(model.model.layers[0]).__name__ in LAYER_FAMILIES) == (config != "MistralConfig")
    whole, whole_grads = _hidden_and_grads(model, None)
    tiled, tiled_grads = _hidden_and_grads(model, 7 * _SHAPE["intermediate_size"] * 8)
    torch.testing.assert_close(tiled, whole, rtol=1e-12, atol=1e-12)
    assert whole_grads.keys() == tiled_grads.keys()
    for name, grad in whole_grads.items():
        torch.testing.assert_close(tiled_grads[name], grad, rtol=1e-10, atol=1e-12, msg=name)
