"""Feed-forward blocks run in token tiles, so a long packed row's backward holds one tile of them.

With gradient checkpointing a decoder layer keeps only its input; its backward re-runs the layer,
and the feed-forward block's intermediates (gate, up, activation, product: four ``[tokens, ffn]``
tensors, and their gradients) are then alive for every token of the row at once. At 2 x 32k
packed tokens of the tiny model that is most of the backward's peak, and it grows with the row.
The block is position-wise, so inside :func:`tiled_mlp` each one runs over tiles of at most
``tile_bytes`` of intermediates, each tile checkpointed on its own: the layer's recompute keeps
only the block's input and output, and the backward re-runs one tile at a time. Same values and
gradients (up to summation order), one more forward of the block.

Only the gated MLPs of the Llama family (``gate_proj``, ``up_proj``, ``down_proj``) are tiled:
a mixture-of-experts block's router is watched by routing replay and its aux loss, so it runs whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.utils.checkpoint import checkpoint

MLP_TILE_BYTES = 8 * 2**20  # one [tokens, ffn] intermediate of a tile


def tile_tokens(ffn: int, element_size: int, tile_bytes: int = MLP_TILE_BYTES) -> int:
    """Tokens per tile so that one ``[tokens, ffn]`` intermediate holds at most ``tile_bytes``."""
    return max(1, tile_bytes // (ffn * element_size))


Forward = Callable[[torch.Tensor], torch.Tensor]


def _tiled(forward: Forward, ffn: int, tile_bytes: int) -> Forward:
    def run(x: torch.Tensor) -> torch.Tensor:
        step = tile_tokens(ffn, x.element_size(), tile_bytes)
        if x.shape[-2] <= step or not torch.is_grad_enabled():
            return forward(x)
        return torch.cat([checkpoint(forward, t, use_reentrant=False) for t in x.split(step, dim=-2)], dim=-2)

    return run


def _checkpointed(forward: Forward) -> Forward:
    def run(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = checkpoint(forward, x, use_reentrant=False) if torch.is_grad_enabled() else forward(x)
        return out

    return run


def _gated_mlps(model: torch.nn.Module) -> list[tuple[torch.nn.Module, int]]:
    """Each gated MLP and its intermediate width."""
    found = []
    for m in model.modules():
        gate, up, down = (getattr(m, name, None) for name in ("gate_proj", "up_proj", "down_proj"))
        if isinstance(gate, torch.nn.Linear) and isinstance(up, torch.nn.Linear) and isinstance(down, torch.nn.Linear):
            found.append((m, gate.out_features))
    return found


def _norms(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]


@contextmanager
def tiled_mlp(model: torch.nn.Module, tile_bytes: int | None = None) -> Iterator[int]:
    """Run ``model``'s gated MLPs in token tiles of ``tile_bytes`` (default :data:`MLP_TILE_BYTES`)
    and its RMSNorms checkpointed while the context is open (keep it open through the backward pass:
    checkpointing re-runs them there). Yields how many modules it wraps."""
    tile_bytes = MLP_TILE_BYTES if tile_bytes is None else tile_bytes
    mlps, norms = _gated_mlps(model), _norms(model)
    blocks = [m for m, _ in mlps] + norms
    own = [m.__dict__.get("forward") for m in blocks]  # a forward set on the instance (a hook), if any
    for m, ffn in mlps:
        m.forward = _tiled(m.forward, ffn, tile_bytes)
    for m in norms:
        m.forward = _checkpointed(m.forward)
    try:
        yield len(blocks)
    finally:
        for m, saved in zip(blocks, own, strict=True):
            if saved is None:
                del m.forward  # back to the class's forward
            else:
                m.forward = saved
