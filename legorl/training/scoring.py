"""A micro-batch of stored segments as the inputs TRL's loss reads, and the importance weights folded in.

TRL's ``_compute_loss`` reads ``prompt_ids``/``completion_ids`` with their masks, ``tool_mask`` (1 on
the tokens the model sampled), ``old_per_token_logps``, per-token ``advantages`` of shape (B, T) and
``num_items_in_batch``. :func:`trl_inputs` makes them from padded segments (:mod:`.batching`);
:func:`fold_weights` turns the old logprobs into importance weights against the rollout's
(:mod:`.importance`) multiplied into each trial's advantage, and returns the health values of
:mod:`.health`. Two markers travel with a micro-batch: :data:`NO_WORK` (no process trains in it: it
does not run) and :data:`FROM_FORWARD` (its old logprobs come from its own training forward).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from legorl.core.errors import LegorlError
from legorl.training.batching import BatchTotals, Padded, pad_rows, take
from legorl.training.config import TrainConfig
from legorl.training.data import TrainSequence
from legorl.training.health import Values
from legorl.training.importance import SEGMENT_LEVELS, importance_weights, value_tokens, value_versions
from legorl.training.packing import MIN_SHARED_PREFIX, Packed, pack

NO_WORK = "legorl_no_work"
FROM_FORWARD = "legorl_old_from_forward"


def pad_token_id(processing_class: Any) -> int:
    """The id segments are padded with: the tokenizer's pad token, else its eos token."""
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise LegorlError("the tokenizer has neither a pad nor an eos token")
    return int(pad_id)


def fork_keys(seqs: Sequence[TrainSequence], share_prefixes: bool) -> torch.Tensor:
    """One key per row: rows of one trial may share a prefix (-1 for every row: none shares)."""
    if not share_prefixes:
        return torch.full((len(seqs),), -1, dtype=torch.long)
    trials: dict[str, int] = {}
    return torch.tensor([trials.setdefault(s.trial_id, len(trials)) for s in seqs], dtype=torch.long)


def pack_rows(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, keys: torch.Tensor, routing: torch.Tensor | None,
) -> Packed:
    """:func:`~.packing.pack` with the rows of a key sharing prefixes and a row of key -1 alone."""
    distinct = [int(k) if k >= 0 else -1 - i for i, k in enumerate(keys.tolist())]
    return pack(input_ids, attention_mask, distinct, routing, MIN_SHARED_PREFIX)


def trial_advantages(seqs: Sequence[TrainSequence], totals: BatchTotals, config: TrainConfig, device: Any) -> torch.Tensor:
    """Each row's trial advantage times its segment weight (:mod:`.weighting`), one per row."""
    advantage = torch.tensor([s.advantage * s.scale for s in seqs], dtype=torch.float32, device=device)
    if config.trl_loss_type == "grpo":
        # TRL averages over sequences; a trial's segments were scaled to sum to one sequence, so
        # averaging over trials instead is a factor sequences / trials (1 without forks).
        advantage *= totals.rows / totals.trials
    return advantage


def trl_inputs(
    padded: Padded, keys: torch.Tensor, totals: BatchTotals, routing: torch.Tensor | None, device: Any,
) -> dict[str, Any]:
    """The tensors TRL's loss reads, less the advantages and old logprobs (:func:`fold_weights`)."""
    inputs: dict[str, Any] = {
        "prompt_ids": padded.prompt_ids.to(device),
        "prompt_mask": torch.ones_like(padded.prompt_ids).to(device),
        "completion_ids": padded.completion_ids.to(device),
        "completion_mask": padded.completion_mask.to(device),
        "tool_mask": padded.loss_mask.to(device),
        "num_items_in_batch": torch.tensor(float(totals.sampled), device=device),
        "fork_keys": keys,
    }
    if routing is not None:
        inputs["routed_experts"] = routing
    return inputs


def fold_weights(
    old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, advantage: torch.Tensor, versions: torch.Tensor,
    harness: torch.Tensor, config: TrainConfig, *, trained_rows_only: bool = False,
) -> tuple[torch.Tensor, Values]:
    """Per-token advantages (B, T): each row's trial ``advantage`` times the importance weights of the
    old logprobs ``old`` against the ``rollout``'s over the sampled tokens (``mask``), and the health
    values of the rows (``versions``: per token; ``harness``: one index per row). ``trained_rows_only``:
    at a segment level, leave out the values of rows with no sampled token (rows that only pad)."""
    level = config.importance_sampling
    weights, weight, raw = importance_weights(old, rollout, mask, level, config.is_cap, config.is_mode, config.is_lower)
    sampled = mask > 0
    version, tokens = value_versions(versions, mask, level), value_tokens(mask, level)
    if trained_rows_only and level in SEGMENT_LEVELS:  # one weight per row
        trained = sampled.any(-1)
        weight, raw, version, tokens = weight[trained], raw[trained], version[trained], tokens[trained]
    values = {"old": old[sampled], "rollout": rollout[sampled], "harness": harness[:, None].expand_as(mask)[sampled],
              "weight": weight, "raw": raw, "version": version, "tokens": tokens}
    return advantage[:, None] * weights, values


def no_op(seq: TrainSequence, totals: BatchTotals, device: Any, *, routing: bool, run: bool) -> dict[str, Any]:
    """A micro-batch that changes no weight: two tokens of ``seq``, none of them trained. ``run``:
    another process trains in this micro-step, so this one must run it too (DDP's collectives);
    otherwise it is marked :data:`NO_WORK` and does not run at all. ``routing``: carry ``seq``'s."""
    ids = torch.from_numpy(seq.token_ids[:2]).to(device)[None]
    ones = torch.ones((1, 1), dtype=torch.long, device=device)
    zeros = torch.zeros((1, 1), dtype=torch.float32, device=device)
    out: dict[str, Any] = {
        "prompt_ids": ids[:, :1], "prompt_mask": ones, "completion_ids": ids[:, 1:], "completion_mask": ones,
        "tool_mask": zeros, "advantages": zeros, "old_per_token_logps": zeros,
        "num_items_in_batch": torch.tensor(float(totals.sampled), device=device),
        "fork_keys": torch.full((1,), -1, dtype=torch.long, device=device), NO_WORK: not run,
    }
    if routing and seq.routed_experts is not None:
        out["routed_experts"] = torch.from_numpy(seq.routed_experts[:2].astype("int64")).to(device)[None]
    return out


def pieces(
    scored: dict[str, Any], plan: list[list[list[int]]], process: int, totals: BatchTotals, spare: TrainSequence,
    device: Any, *, per_row_loss: bool, routing: bool,
) -> list[dict[str, Any]]:
    """Process ``process``'s piece of each micro-batch of ``plan`` (:func:`~.batching.micro_batch_plan`),
    cut from ``scored``, its rows of every micro-batch in order; an empty share is a :func:`no_op` of
    ``spare``. Every process's piece of a micro-batch has as many rows (TRL gathers per-row figures);
    ``per_row_loss`` (grpo, dr_grpo average over a piece's rows): advantages rescaled so each row weighs
    the same whatever the cut (:func:`~.batching.take`)."""
    chunks, ranks = len(plan), len(plan[0])
    out, start = [], 0
    for micro in plan:
        share = micro[process]
        height = max(1, *(len(s) for s in micro)) if ranks > 1 else len(share)
        if not share:
            out.append(pad_rows(no_op(spare, totals, device, routing=routing, run=any(micro)), height))
            continue
        factor = height * chunks * ranks / totals.rows if per_row_loss else 1.0
        out.append(pad_rows(take(scored, list(range(start, start + len(share))), factor), height))
        start += len(share)
    return out
