"""Batches of whole groups, and padding segments into the tensors TRL's loss expects.

TRL's ``_compute_loss`` takes ``prompt_ids`` (left part) and ``completion_ids`` (right part) and
scores only the completion part. A segment is not a prompt and a completion: it is a prompt, then
sampled turns interleaved with tool output. We cut every row of a batch at the same place ``P``,
the earliest first sampled token in the batch, so the "prompt" part needs no padding at all and
the "completion" part is right-padded; the loss mask (``tool_mask`` in TRL) keeps only sampled
tokens. The padded width is the longest segment, never ``max prompt + max completion``.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch.utils.data import Sampler

from legorl.training.data import StepData, TrainSequence
from legorl.trials.provenance import UNKNOWN_VERSION


def make_batches(data: StepData, groups_per_batch: int | None, seed: int) -> list[list[int]]:
    """Generation batches as lists of sequence indices; each holds whole groups (shuffled, seeded)."""
    groups = list(data.groups().values())
    random.Random(seed).shuffle(groups)
    size = groups_per_batch or len(groups)
    batches = []
    for start in range(0, len(groups), size):
        seqs = [s for trial_ids in groups[start : start + size] for t in trial_ids for s in data.trials[t].sequences]
        batches.append(seqs)
    return batches


class GroupBatchSampler(Sampler[list[int]]):
    """Yields each generation batch ``repeat`` times in a row (TRL reuses it for that many micro-steps)."""

    def __init__(self, batches: list[list[int]], repeat: int):
        self.batches = batches
        self.repeat = repeat

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.batches:
            for _ in range(self.repeat):
                yield batch

    def __len__(self) -> int:
        return len(self.batches) * self.repeat


@dataclass
class Padded:
    prompt_ids: torch.Tensor  # (B, P)
    completion_ids: torch.Tensor  # (B, C)
    completion_mask: torch.Tensor  # (B, C) 1 on real tokens (attention)
    loss_mask: torch.Tensor  # (B, C) 1 on sampled tokens
    rollout_logps: torch.Tensor  # (B, C)
    routing: torch.Tensor | None  # (B, P + C, layers, top_k), -1 on padding / unknown
    versions: torch.Tensor  # (B, C) policy version of each sampled token, -1 on padding / unknown

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([torch.ones_like(self.prompt_ids), self.completion_mask], dim=1)


def pad(seqs: Sequence[TrainSequence], pad_id: int) -> Padded:
    cut = min(s.first_sampled for s in seqs)
    width = max(len(s) for s in seqs)
    n = len(seqs)
    if cut < 1:
        raise ValueError(f"a segment samples its first token with no context: {[s.trial_id for s in seqs]}")
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    real = torch.zeros((n, width), dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.float32)
    logps = torch.zeros((n, width), dtype=torch.float32)
    versions = torch.full((n, width), UNKNOWN_VERSION, dtype=torch.long)
    with_routing = [s.routed_experts for s in seqs if s.routed_experts is not None]
    routing = None
    if with_routing:
        layers, top_k = with_routing[0].shape[1:]
        routing = torch.full((n, width, layers, top_k), -1, dtype=torch.long)
    for i, s in enumerate(seqs):
        t = len(s)
        ids[i, :t] = torch.from_numpy(s.token_ids)
        real[i, :t] = 1
        mask[i, :t] = torch.from_numpy(s.loss_mask)
        logps[i, :t] = torch.from_numpy(s.logprobs)
        if s.versions is not None:
            versions[i, :t] = torch.from_numpy(s.versions)
        if routing is not None and s.routed_experts is not None:
            routing[i, :t] = torch.from_numpy(s.routed_experts.astype("int64"))
    return Padded(
        prompt_ids=ids[:, :cut],
        completion_ids=ids[:, cut:],
        completion_mask=real[:, cut:],
        loss_mask=mask[:, cut:],
        rollout_logps=logps[:, cut:],
        routing=routing,
        versions=versions[:, cut:],
    )


@dataclass(frozen=True)
class BatchTotals:
    """What a generation batch's loss is normalised by, counted over the whole batch before any trial
    is skipped (zero advantage) or the batch is shared out between processes, so neither changes it."""

    rows: int  # segments: TRL's grpo / dr_grpo average over them
    trials: int
    sampled: int  # sampled tokens: dapo's normaliser (TRL's num_items_in_batch)

    @classmethod
    def of(cls, seqs: Sequence[TrainSequence]) -> BatchTotals:
        return cls(len(seqs), len({s.trial_id for s in seqs}), sum(s.n_sampled for s in seqs))


def micro_batch_plan(
    seqs: Sequence[TrainSequence], chunks: int, ranks: int, generator: torch.Generator, *,
    keep_trials_together: bool = True, by_tokens: bool = False,
) -> list[list[list[int]]]:
    """``plan[k][r]``: the positions in ``seqs`` that process ``r`` trains in micro-batch ``k``.

    The trials (or, without ``keep_trials_together``, the segments) are shuffled and cut into
    ``chunks`` micro-batches of equal trial counts (differing by at most one), or with ``by_tokens``
    balanced token counts (longest first onto the lightest); each micro-batch is then cut the same
    way into ``ranks`` shares. So micro-batch ``k`` is the same whatever the process count, and the
    processes' shares of it are disjoint: TRL's per-micro-batch figures, which it reduces across
    processes, come out as in one process. A micro-batch or share may be empty (fewer trials than
    pieces); empty micro-batches come first, so the last one, where processes synchronise their
    gradients, is never empty."""
    units: dict[object, list[int]] = {}
    for i, s in enumerate(seqs):
        units.setdefault(s.trial_id if keep_trials_together else i, []).append(i)
    members = list(units.values())
    sizes = [sum(len(seqs[i]) for i in rows) for rows in members]
    order = torch.randperm(len(members), generator=generator).tolist()
    micro = _cut(order, sizes, chunks, by_tokens)
    micro.sort(key=lambda m: len(m) > 0)  # stable
    return [[[i for u in share for i in members[u]] for share in _cut(m, sizes, ranks, by_tokens)] for m in micro]


def _cut(units: list[int], sizes: list[int], k: int, by_tokens: bool) -> list[list[int]]:
    if not by_tokens:
        return [part.tolist() for part in torch.tensor_split(torch.tensor(units, dtype=torch.long), k)]
    pieces: list[list[int]] = [[] for _ in range(k)]
    load = [0] * k
    for u in sorted(units, key=lambda u: -sizes[u]):  # stable: ties keep the shuffled order
        lightest = min(range(k), key=lambda p: (load[p], len(pieces[p])))
        pieces[lightest].append(u)
        load[lightest] += sizes[u]
    return pieces


def take(batch: dict[str, object], rows: list[int], advantage_factor: float = 1.0) -> dict[str, object]:
    """Rows ``rows`` of a scored batch, keeping only the completion columns they use.

    TRL's grpo and dr_grpo losses average over a micro-batch's rows, then over the micro-batches
    (and DDP averages over processes), so a piece of ``n_k`` rows out of a batch of ``n`` cut into
    ``m`` pieces has its advantages scaled by ``n_k * m / n`` (``advantage_factor``): every row weighs
    ``1 / n`` whatever the cut (a positive factor: clipping is unchanged)."""
    index = torch.tensor(rows, dtype=torch.long)
    piece: dict[str, object] = {}
    for key, value in batch.items():
        piece[key] = value[index] if isinstance(value, torch.Tensor) and value.ndim > 0 else value
    if advantage_factor != 1.0:
        for key in ("advantages", "trial_advantages"):  # per token, or per row until the forward folds them
            if key in piece:
                piece[key] = piece[key] * advantage_factor  # type: ignore[operator]
    return _trim(piece)


def pad_rows(piece: dict[str, object], rows: int) -> dict[str, object]:
    """``piece`` grown to ``rows`` rows with copies of its first row that train nothing (no sampled
    token, advantage 0; one fork key with the original, so packing computes them once). Under DDP
    every process's piece of a micro-batch must have as many rows: TRL gathers per-row figures."""
    extra = rows - int(piece["prompt_ids"].shape[0])  # type: ignore[attr-defined]
    if extra <= 0:
        return piece
    out: dict[str, object] = {}
    for key, value in piece.items():
        if isinstance(value, torch.Tensor) and value.ndim > 0:
            copies = value[:1].expand(extra, *value.shape[1:])
            if key in ("tool_mask", "advantages", "trial_advantages"):
                copies = torch.zeros_like(copies)
            value = torch.cat([value, copies])
        out[key] = value
    return out


def token_micro_batches(data: StepData, batches: list[list[int]], budget: int) -> int:
    """How many micro-batches each generation batch needs for pieces of at most ``budget`` tokens (a
    trial is never cut; one longer than the budget is a piece of its own): the most any batch needs."""
    most = 1
    for batch in batches:
        per_trial: dict[str, int] = {}
        for i in batch:
            seq = data.sequences[i]
            per_trial[seq.trial_id] = per_trial.get(seq.trial_id, 0) + len(seq)
        sizes = sorted(per_trial.values(), reverse=True)
        limit = max(budget, sizes[0])
        k = max(1, -(-sum(sizes) // budget))
        while k < len(sizes) and _lpt_max(sizes, k) > limit:
            k += 1
        most = max(most, min(k, len(sizes)))
    return most


def _lpt_max(sizes: list[int], k: int) -> int:
    load = [0] * k
    for size in sizes:
        load[load.index(min(load))] += size
    return max(load)


def _trim(piece: dict[str, object]) -> dict[str, object]:
    mask = piece["completion_mask"]
    assert isinstance(mask, torch.Tensor)
    used = int(mask.sum(0).nonzero().max()) + 1 if mask.any() else 1
    full = mask.shape[1]
    if used == full:
        return piece
    prompt = piece["prompt_ids"]
    assert isinstance(prompt, torch.Tensor)
    for key in ("completion_ids", "completion_mask", "tool_mask", "advantages", "old_per_token_logps",
                "rollout_logps", "token_versions"):
        value = piece.get(key)
        if isinstance(value, torch.Tensor) and value.ndim == 2 and value.shape[1] == full:
            piece[key] = value[:, :used]
    routing = piece.get("routed_experts")
    if isinstance(routing, torch.Tensor):
        piece["routed_experts"] = routing[:, : prompt.shape[1] + used]
    return piece
