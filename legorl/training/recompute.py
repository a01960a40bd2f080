"""The old logprobs of a batch, recomputed before the update in bounded chunks.

Without gradient and before any weight changes, the trainer scores every sampled token of a
micro-batch once (TRL's ``old_per_token_logps``, and the importance weights against the rollout's).
Padding-free (the default), rows are cut into chunks of at most ``logprob_max_tokens`` tokens and
``logprob_batch_size`` rows, each packed (:mod:`.packing`) and scored at its sampled positions only
(:func:`~.logprobs.sampled_logps`); otherwise chunks of ``logprob_batch_size`` padded rows go through
TRL's own forward. Routing is replayed (or watched) per chunk (:mod:`.replay`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from legorl.training.attention import packed_attention
from legorl.training.config import TrainConfig
from legorl.training.logprobs import sampled_logps
from legorl.training.packing import token_chunks
from legorl.training.replay import RoutingWatch
from legorl.training.scoring import pack_rows

PaddedForward = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]  # TRL's: ids, mask, logits_to_keep
RoutingContext = Callable[[torch.Tensor | None, RoutingWatch], AbstractContextManager[None]]


def old_logps(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
    routing: torch.Tensor | None, score_mask: torch.Tensor | None, fork_keys: torch.Tensor | None,
    config: TrainConfig, *, temperature: float, padded_forward: PaddedForward, routing_context: RoutingContext,
    autocast: Callable[[], AbstractContextManager[None]],
) -> tuple[torch.Tensor, RoutingWatch]:
    """Per-token logprobs (B, C) of the last ``logits_to_keep`` positions of ``input_ids`` (B, W), and
    how the router's own choices differed from ``routing`` (when watched). ``score_mask`` (B, C): the
    positions to score, packed; None: every position, padded, through ``padded_forward``."""
    watch = RoutingWatch()
    padding_free = config.padding_free and score_mask is not None
    if padding_free:
        chunks = token_chunks(attention_mask.sum(-1).tolist(), config.logprob_max_tokens, config.logprob_batch_size)
    else:
        size = config.logprob_batch_size
        chunks = [list(range(s, min(s + size, input_ids.shape[0]))) for s in range(0, input_ids.shape[0], size)]
    out = []
    for chunk in chunks:
        rows = torch.tensor(chunk, device=input_ids.device)
        chunk_routing = None if routing is None else routing[rows]
        if not padding_free:
            with routing_context(chunk_routing, watch):
                out.append(padded_forward(input_ids[rows], attention_mask[rows], logits_to_keep))
            continue
        assert score_mask is not None
        keys = fork_keys[rows] if fork_keys is not None else torch.full((len(chunk),), -1)
        packed = pack_rows(input_ids[rows], attention_mask[rows], keys, chunk_routing)
        with packed_attention(model), routing_context(packed.routing, watch), autocast():
            scored = sampled_logps(
                model, packed, input_ids[rows, -logits_to_keep:], score_mask[rows], temperature=temperature,
                compute_entropy=False, cast_lm_head_to_fp32=config.cast_lm_head_to_fp32,
            )
        out.append(scored.logps)
    return torch.cat(out, dim=0), watch
