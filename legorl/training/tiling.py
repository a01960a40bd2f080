"""Decoder layers run in token tiles, so a long packed row's backward holds one tile of them.

With gradient checkpointing a decoder layer keeps only its input; its backward re-runs the layer,
and every intermediate of the layer (the norms, the q/k/v projections and their rotary embedding,
the feed-forward block's gate, up, activation and product, and their gradients) is then alive for
every token of the row at once: ~28 KB per packed token of the tiny model, most of a long row's
backward peak. Everything in a Llama-family layer but the attention kernel is per position, so
inside :func:`token_tiles` each such layer runs as

1. *project*, in tiles: input norm, q/k/v projections, q/k norms, rotary embedding;
2. the packed attention kernel, once over the whole row (it saves its inputs and output);
3. *finish*, in tiles: output projection, residual, post-attention norm, MLP, residual;

each tile checkpointed on its own. The layer's recompute then keeps the attention kernel's q, k, v
and output whole and nothing else, and the backward re-runs one tile at a time. Same values and
gradients (up to summation order), one more forward of everything but the attention kernel.

The tiled forward is the layer's own forward rewritten, so it is used only for the families whose
forward it was checked against (:data:`LAYER_FAMILIES`; ``tests/test_train_memory.py`` compares
each), only in the packed path (``legorl_packed`` attention, no cache), and only where the layer's
feed-forward block is a gated MLP: a mixture-of-experts block's router is watched by routing replay
and its aux loss, so it runs whole. Other layers keep their gated MLPs in token tiles and their
RMSNorms checkpointed, which is what any Llama-like family shares.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from legorl.training.attention import NAME as PACKED_ATTENTION
from legorl.training.attention import packed_attention_forward

TILE_BYTES = 8 * 2**20  # one [tokens, ffn] intermediate of a tile
LAYER_FAMILIES = frozenset({"LlamaDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer"})


def tile_tokens(ffn: int, element_size: int, tile_bytes: int = TILE_BYTES) -> int:
    """Tokens per tile so that one ``[tokens, ffn]`` intermediate holds at most ``tile_bytes``."""
    return max(1, tile_bytes // (ffn * element_size))


Forward = Callable[..., Any]


def _tiled_mlp(forward: Forward, ffn: int, tile_bytes: int) -> Forward:
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


def _tiled_layer(layer: Any, ffn: int, tile_bytes: int) -> Forward:
    attn: Any = layer.self_attn
    rotate = sys.modules[type(attn).__module__].apply_rotary_pos_emb
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    whole: Forward = layer.forward

    def project(h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = layer.input_layernorm(h)
        shape = (*x.shape[:-1], -1, attn.head_dim)
        q, k, v = attn.q_proj(x).view(shape), attn.k_proj(x).view(shape), attn.v_proj(x).view(shape)
        if q_norm is not None and k_norm is not None:
            q, k = q_norm(q), k_norm(k)
        q, k = rotate(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return q, k, v.transpose(1, 2)

    def finish(attended: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        h = h + attn.o_proj(attended)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def tiled(hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        step = tile_tokens(ffn, hidden_states.element_size(), tile_bytes)
        cos, sin = kwargs.pop("position_embeddings")
        mask = kwargs.pop("attention_mask", None)
        passed = {k: v for k, v in kwargs.items() if k not in ("cache", "past_key_values", "use_cache")}
        pieces = [checkpoint(project, h, c, s, use_reentrant=False)
                  for h, c, s in zip(hidden_states.split(step, 1), cos.split(step, 1), sin.split(step, 1), strict=True)]
        q, k, v = (torch.cat(part, dim=2) for part in zip(*pieces, strict=True))
        del pieces
        attended, _ = packed_attention_forward(attn, q, k, v, mask, scaling=attn.scaling,
                                               dropout=attn.attention_dropout if attn.training else 0.0,
                                               sliding_window=getattr(attn, "sliding_window", None), **passed)
        attended = attended.reshape(*hidden_states.shape[:-1], -1)
        return torch.cat([checkpoint(finish, a, h, use_reentrant=False)
                          for a, h in zip(attended.split(step, 1), hidden_states.split(step, 1), strict=True)], dim=1)

    def run(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if (args or hidden_states.shape[1] <= tile_tokens(ffn, hidden_states.element_size(), tile_bytes)
                or not torch.is_grad_enabled() or kwargs.get("position_embeddings") is None
                or attn.config._attn_implementation != PACKED_ATTENTION
                or kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None):
            return whole(hidden_states, *args, **kwargs)
        if layer.gradient_checkpointing and layer.training:
            # The class's forward is what transformers wraps in the layer's checkpoint: this one must do it too.
            return layer._gradient_checkpointing_func(partial(tiled, **kwargs), hidden_states)
        return tiled(hidden_states, **kwargs)

    return run


def _gated_width(mlp: Any) -> int | None:
    """The intermediate width of a gated MLP (``gate_proj``/``up_proj``/``down_proj``), else None."""
    gate, up, down = (getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj"))
    linear = torch.nn.Linear
    if isinstance(gate, linear) and isinstance(up, linear) and isinstance(down, linear):
        return gate.out_features
    return None


def _plan(model: torch.nn.Module, tile_bytes: int) -> list[tuple[torch.nn.Module, Forward]]:
    """Each module to wrap and its wrapped forward: Llama-family layers whole, elsewhere the gated
    MLPs and the RMSNorms."""
    plan: list[tuple[torch.nn.Module, Forward]] = []
    inside: set[int] = set()
    for m in model.modules():
        width = _gated_width(getattr(m, "mlp", None))
        if type(m).__name__ in LAYER_FAMILIES and width is not None:
            plan.append((m, _tiled_layer(m, width, tile_bytes)))
            inside |= {id(sub) for sub in m.modules()}
    for m in model.modules():
        if id(m) in inside:
            continue
        width = _gated_width(m)
        if width is not None:
            plan.append((m, _tiled_mlp(m.forward, width, tile_bytes)))
        elif type(m).__name__.endswith("RMSNorm"):
            plan.append((m, _checkpointed(m.forward)))
    return plan


@contextmanager
def token_tiles(model: torch.nn.Module, tile_bytes: int | None = None) -> Iterator[int]:
    """Run ``model``'s decoder layers in token tiles of ``tile_bytes`` (default :data:`TILE_BYTES`)
    while the context is open (keep it open through the backward pass: checkpointing re-runs them
    there). Yields how many modules it wraps."""
    plan = _plan(model, TILE_BYTES if tile_bytes is None else tile_bytes)
    own = [m.__dict__.get("forward") for m, _ in plan]  # a forward set on the instance (a hook), if any
    for m, forward in plan:
        m.forward = forward
    try:
        yield len(plan)
    finally:
        for (m, _), saved in zip(plan, own, strict=True):
            if saved is None:
                del m.forward  # back to the class's forward
            else:
                m.forward = saved
