"""Per-token logprobs (and entropies) only where the loss is: hidden states for every token, the LM
head only at positions whose next token was sampled.

TRL's ``_get_per_token_logps_and_entropies`` projects every completion position through the LM
head (on CPU its fused head scores all of them, sampled or not). A coding-agent segment is mostly
environment tokens (loss mask 0), so :func:`sampled_logps` runs the backbone once over a packed
row (:mod:`.packing`, :mod:`.attention`), gathers the hidden states that predict a sampled token
and scores only those, through TRL's own chunked log-softmax kernel (``trl.kernels``: it never
materialises more than one ``[tokens, vocab chunk]`` tile, and recomputes the tile in the
backward pass), in one call whose tile is bounded in bytes (:func:`vocab_chunk`). One call, not
one per slice of positions: each call's backward allocates a whole ``[vocab, hidden]`` weight
gradient (156 MB for a 152k vocabulary at hidden 256), so k calls held k of them. The result is laid back into TRL's (B, C)
completion layout, 0 elsewhere: TRL's losses multiply every per-token term by the loss mask, so
they are unchanged.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from trl.kernels import ChunkedLogProbFunction
from trl.kernels.chunked_logprob import TOKEN_CHUNK_SIZE

from legorl.core.errors import LegorlError
from legorl.training.attention import NAME as ATTENTION
from legorl.training.packing import Packed

HEAD_TILE_BYTES = 32 * 2**20  # one [positions, vocab chunk] tile of the chunked log-softmax
MIN_VOCAB_CHUNK = 1024


def vocab_chunk(positions: int, vocab: int, element_size: int, tile_bytes: int = HEAD_TILE_BYTES) -> int:
    """LM-head columns per tile so that the kernel's tile (up to its ``TOKEN_CHUNK_SIZE`` positions
    at a time) holds at most ``tile_bytes``."""
    rows = max(1, min(positions, TOKEN_CHUNK_SIZE))
    return min(vocab, max(MIN_VOCAB_CHUNK, tile_bytes // (rows * element_size)))


@dataclass(frozen=True)
class Scored:
    logps: torch.Tensor  # (B, C)
    entropies: torch.Tensor | None  # (B, C)
    aux_loss: torch.Tensor | None


def _head_scaling(model: Any) -> tuple[float | None, float]:
    config = model.config.get_text_config()
    scale = getattr(config, "logit_scale", None)
    return getattr(config, "final_logit_softcapping", None), 1.0 if scale is None else float(scale)


def sampled_logps(
    model: Any, packed: Packed, completion_ids: torch.Tensor, score_mask: torch.Tensor, *, temperature: float,
    compute_entropy: bool, compute_aux_loss: bool = False, cast_lm_head_to_fp32: bool = False,
    tile_bytes: int = HEAD_TILE_BYTES, forward_through: torch.nn.Module | None = None,
) -> Scored:
    """Logprobs of ``completion_ids`` (B, C) at the positions ``score_mask`` (B, C) marks, from one
    forward of ``packed`` (the batch ``prompt + completion`` of width W = P + C, packed). Call it
    inside :func:`~legorl.training.attention.packed_attention` (held through the backward pass
    when activations are recomputed).

    The forward runs through ``forward_through`` (default ``model``): in a training forward under
    ``accelerate launch`` that must be the DDP wrapper of ``model``, whose forward arms the gradient
    all-reduce (a forward that bypasses it leaves each process with its own gradients, silently).
    It is the model's own causal-LM forward with no position kept for its LM head; the hidden states
    are taken from its backbone on the way."""
    text_config = model.config.get_text_config()
    if text_config._attn_implementation != ATTENTION:
        raise LegorlError("sampled_logps runs the packed row: call it inside attention.packed_attention(model)")
    kwargs: dict[str, Any] = {"legorl_documents": packed.documents, "use_cache": False}
    if compute_aux_loss:
        kwargs["output_router_logits"] = True
    backbone: list[Any] = []
    hook = model.base_model.register_forward_hook(lambda module, args, output: backbone.append(output))
    try:
        (forward_through or model)(
            input_ids=packed.input_ids, position_ids=packed.position_ids,
            logits_to_keep=torch.zeros(0, dtype=torch.long, device=packed.input_ids.device), **kwargs,
        )
    finally:
        hook.remove()
    out = backbone[-1]
    hidden = out.last_hidden_state[0]  # (L, H)

    width = packed.source.shape[1]
    prompt = width - completion_ids.shape[1]
    rows, cols = score_mask.nonzero(as_tuple=True)
    # The hidden state at position t predicts token t + 1: completion column c sits at prompt + c.
    at = packed.source[rows, prompt + cols - 1]
    if bool((at < 0).any()):
        raise ValueError("a scored position has no context in the packed row (scored padding?)")
    labels = completion_ids[rows, cols]
    head = model.get_output_embeddings()
    weight, bias = head.weight, head.bias
    softcap, logit_scale = _head_scaling(model)
    chosen = hidden[at]
    if cast_lm_head_to_fp32:
        chosen = chosen.float()
    wanted = ("log_probs", "entropy") if compute_entropy else ("log_probs",)
    mask = score_mask.bool()
    # masked_scatter keeps the graph connected (a differentiable 0) even when nothing is scored; the
    # head's weight is joined too, so every parameter gets a (zero) gradient, as DDP requires.
    full = hidden.new_zeros(mask.shape, dtype=torch.float32)
    lp = ent = full[:0, 0]
    if chosen.shape[0] == 0:
        full = full + 0.0 * weight.sum()
    else:
        columns = vocab_chunk(chosen.shape[0], weight.shape[0], 4, tile_bytes)  # the tile is fp32 at most
        with torch.autocast(chosen.device.type, enabled=False) if cast_lm_head_to_fp32 else nullcontext():
            lp, ent, *_ = ChunkedLogProbFunction.apply(
                chosen, weight, bias, labels, temperature, columns, softcap, logit_scale, wanted
            )
    per_token = full.masked_scatter(mask, lp)
    entropy = full.masked_scatter(mask, ent) if compute_entropy else None
    aux: Any = None
    if compute_aux_loss:
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

        # A shared prefix counts once per fork, as when the forks are run separately.
        aux = load_balancing_loss_func(out.router_logits, text_config.num_experts, text_config.num_experts_per_tok,
                                       packed.weight)
    return Scored(per_token, entropy, aux)
