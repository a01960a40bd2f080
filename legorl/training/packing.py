"""Padding-free packing of a batch of segments into one row, forks sharing their prefix.

TRL's loss wants per-segment tensors of shape (B, T); the model does not. :func:`pack` lays the
real tokens of a padded batch end to end in one row (no padding at all), each segment with its
own position ids restarting at 0, and records where every (row, position) of the padded batch
went, so hidden states can be gathered back into the (B, T) layout the loss reads.

Segments of one trial that start with the same tokens (a harness that rewrote its history forks
the trial into segments repeating the same prompt) form one *document*: the shared prefix once,
then each segment's own suffix, every suffix attending to the prefix and to itself
(:mod:`.attention`). A causal model gives the prefix the same hidden states in every fork, so the
loss and gradients are those of training the forks separately, without recomputing the prefix.
For MoE models a prefix is shared only where the recorded routing agrees too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

# Forks sharing fewer tokens than this are packed as separate documents (not worth a branch).
MIN_SHARED_PREFIX = 16


@dataclass(frozen=True)
class Document:
    """One span of the packed row: ``prefix`` tokens attended to by every branch, then the branches
    (start, length), each attending to the prefix and causally to itself."""

    start: int
    prefix: int
    branches: tuple[tuple[int, int], ...] = ()


@dataclass
class Packed:
    """A padded batch (B, W) laid out in one row of ``length`` tokens."""

    input_ids: torch.Tensor  # (1, L)
    position_ids: torch.Tensor  # (1, L)
    documents: tuple[Document, ...]
    source: torch.Tensor  # (B, W) long: index in the packed row of each padded position, -1 on padding
    weight: torch.Tensor  # (1, L) float: how many segments share each packed token (aux-loss weighting)
    routing: torch.Tensor | None = None  # (1, L, layers, top_k)
    rows: int = field(default=0)

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[1])


def _common_prefix(a: torch.Tensor, b: torch.Tensor, ra: torch.Tensor | None, rb: torch.Tensor | None) -> int:
    n = min(a.shape[0], b.shape[0])
    same = a[:n] == b[:n]
    if ra is not None and rb is not None:
        same &= (ra[:n] == rb[:n]).flatten(1).all(-1)
    differs = (~same).nonzero()
    return int(differs[0, 0]) if differs.numel() else n


def fork_clusters(
    rows: Sequence[torch.Tensor], keys: Sequence[int] | None, routing: Sequence[torch.Tensor | None],
    min_shared: int = MIN_SHARED_PREFIX,
) -> list[tuple[int, list[int]]]:
    """``(shared prefix length, member rows)`` per document, in first-row order: rows with the same
    key (trial) join the first document whose prefix they share for at least ``min_shared`` tokens."""
    clusters: list[tuple[int, list[int]]] = []
    open_by_key: dict[int, list[int]] = {}  # key -> indices into clusters
    for i, ids in enumerate(rows):
        key = None if keys is None else keys[i]
        placed = False
        for c in open_by_key.get(key, []) if key is not None else []:
            shared, members = clusters[c]
            first = members[0]
            common = min(shared, _common_prefix(rows[first], ids, routing[first], routing[i]))
            if common >= min_shared:
                clusters[c] = (common, [*members, i])
                placed = True
                break
        if not placed:
            if key is not None:
                open_by_key.setdefault(key, []).append(len(clusters))
            clusters.append((int(ids.shape[0]), [i]))
    return clusters


def pack(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, fork_keys: Sequence[int] | None = None,
    routing: torch.Tensor | None = None, min_shared: int = MIN_SHARED_PREFIX,
) -> Packed:
    """Lay out the real tokens of ``input_ids`` (B, W) (right-padded, ``attention_mask`` 1 on real
    tokens) in one row; rows with the same ``fork_keys`` entry share their common prefix."""
    batch, width = input_ids.shape
    lengths = attention_mask.sum(-1).tolist()
    rows = [input_ids[b, : int(lengths[b])] for b in range(batch)]
    row_routing = [None if routing is None else routing[b, : int(lengths[b])] for b in range(batch)]
    source = torch.full((batch, width), -1, dtype=torch.long)
    ids: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    weights: list[torch.Tensor] = []
    routes: list[torch.Tensor] = []
    documents = []
    cursor = 0
    for shared, members in fork_clusters(rows, fork_keys, row_routing, min_shared):
        first = members[0]
        if len(members) == 1:
            shared = int(lengths[first])
        start = cursor
        ids.append(rows[first][:shared])
        positions.append(torch.arange(shared))
        weights.append(torch.full((shared,), float(len(members))))
        if routing is not None:
            routes.append(routing[first, :shared])
        cursor += shared
        branches = []
        for b in members:
            source[b, :shared] = torch.arange(start, start + shared)
            own = int(lengths[b]) - shared
            if len(members) > 1:
                branches.append((cursor, own))
            if own == 0:
                continue
            ids.append(rows[b][shared:])
            positions.append(torch.arange(shared, shared + own))
            weights.append(torch.ones(own))
            if routing is not None:
                routes.append(routing[b, shared : shared + own])
            source[b, shared : shared + own] = torch.arange(cursor, cursor + own)
            cursor += own
        documents.append(Document(start, shared, tuple(branches)))
    device = input_ids.device
    return Packed(
        input_ids=torch.cat(ids)[None].to(device),
        position_ids=torch.cat(positions)[None].to(device),
        documents=tuple(documents),
        source=source.to(device),
        weight=torch.cat(weights)[None].to(device),
        routing=None if routing is None else torch.cat(routes)[None],
        rows=batch,
    )


def token_chunks(lengths: Sequence[int], budget: int, max_rows: int | None = None) -> list[list[int]]:
    """Consecutive row indices cut so each chunk holds at most ``budget`` tokens (and ``max_rows`` rows);
    a row longer than the budget is a chunk of its own."""
    chunks: list[list[int]] = []
    total = 0
    for i, n in enumerate(lengths):
        if chunks and total + n <= budget and (max_rows is None or len(chunks[-1]) < max_rows):
            chunks[-1].append(i)
            total += n
        else:
            chunks.append([i])
            total = n
    return chunks
