"""What keeps a long packed row's training memory down: freed blocks leaving the process (memory.py)
and the MLPs run in token tiles (tiling.py; its gradients against TRL's padded path are pinned in
test_train_scale.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from legorl.training.tiling import tile_tokens, tiled_mlp

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


def test_tiled_mlp_wraps_gated_mlps_and_norms_and_restores_them(tiny_model: Path, tiny_moe_model: Path) -> None:
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(tiny_model)
    layers = dense.config.num_hidden_layers
    with tiled_mlp(dense) as wrapped:  # per layer: the MLP, 2 norms, q and k norms; and the final norm
        assert wrapped == layers * 5 + 1
        assert "forward" in dense.model.layers[0].mlp.__dict__
    assert all("forward" not in m.__dict__ for m in dense.modules())
    moe = AutoModelForCausalLM.from_pretrained(tiny_moe_model)
    with tiled_mlp(moe) as wrapped:  # the experts' block runs whole (routing replay watches its router)
        assert wrapped == moe.config.num_hidden_layers * 4 + 1
    x = torch.randn(1, 50, dense.config.hidden_size)
    mlp = dense.model.layers[0].mlp
    with tiled_mlp(dense, tile_bytes=7 * dense.config.intermediate_size * 4):
        tiled = mlp(x)
    torch.testing.assert_close(tiled, mlp(x))
