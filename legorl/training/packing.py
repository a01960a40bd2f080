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
from itertools import pairwise
from typing import Any

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


def _order_key(ids: torch.Tensor, routing: torch.Tensor | None) -> list[Any]:
    """A row as a sequence that sorts lexicographically by its tokens (and their routing, for MoE)."""
    if routing is None:
        return ids.tolist()
    flat = routing.reshape(routing.shape[0], -1).numpy()
    return list(zip(ids.tolist(), (r.tobytes() for r in flat), strict=True))


def _best_runs(
    rows: Sequence[torch.Tensor], routing: Sequence[torch.Tensor | None], members: list[int], min_shared: int,
) -> list[tuple[int, list[int]]]:
    """One key's rows split into the documents that recompute the fewest tokens.

    A set of rows shares the prefix common to all of them; in lexicographic order that is the least
    common prefix of neighbours between its first and last row, and a row in between only adds to
    what is shared, so the best split is into runs of that order. A run of ``m`` rows sharing ``p``
    tokens saves ``(m - 1) * p``; dynamic programming over the run boundaries finds the best split (a
    sub-agent whose prompt shares only a header with the main agent's stays apart, and the main
    agent's forks keep their long prefix)."""
    order = sorted(members, key=lambda i: _order_key(rows[i], routing[i]))
    n = len(order)
    adjacent = [_common_prefix(rows[a], rows[b], routing[a], routing[b]) for a, b in pairwise(order)]
    best = [0] * (n + 1)  # best[e]: tokens saved by the best split of order[:e]
    cut = [0] * (n + 1)  # where the last run of that split starts
    for e in range(1, n + 1):
        best[e], cut[e] = best[e - 1], e - 1  # order[e - 1] alone
        shared = None
        for s in range(e - 2, -1, -1):  # the run order[s:e]
            shared = adjacent[s] if shared is None else min(shared, adjacent[s])
            if shared < min_shared:
                break
            if best[s] + (e - s - 1) * shared > best[e]:
                best[e], cut[e] = best[s] + (e - s - 1) * shared, s
    runs: list[tuple[int, list[int]]] = []
    e = n
    while e > 0:
        s = cut[e]
        run = sorted(order[s:e])
        runs.append((min(adjacent[s : e - 1]) if e - s > 1 else int(rows[run[0]].shape[0]), run))
        e = s
    return runs


def fork_clusters(
    rows: Sequence[torch.Tensor], keys: Sequence[int] | None, routing: Sequence[torch.Tensor | None],
    min_shared: int = MIN_SHARED_PREFIX,
) -> list[tuple[int, list[int]]]:
    """``(shared prefix length, member rows)`` per document, in first-row order: the rows of one key
    (trial) split into the documents that save the most recomputed tokens (:func:`_best_runs`), each
    sharing at least ``min_shared`` tokens; a row alone (or of no key) shares its whole length."""
    clusters: list[tuple[int, list[int]]] = []
    by_key: dict[int, list[int]] = {}
    for i, ids in enumerate(rows):
        key = None if keys is None else keys[i]
        if key is None:
            clusters.append((int(ids.shape[0]), [i]))
        else:
            by_key.setdefault(key, []).append(i)
    for members in by_key.values():
        clusters.extend(_best_runs(rows, routing, members, min_shared))
    return sorted(clusters, key=lambda c: c[1][0])


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
