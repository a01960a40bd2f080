"""The embedded engine's running batch and the requests in it.

A :class:`Request` lives on the engine's worker thread but belongs to the event loop that submitted
it: :func:`deliver` hands its tokens back there. The :class:`RunningBatch` holds the sequences
decoding together and one KV cache left-padded to a common length; rows join after their own
prefill and leave as soon as they finish (continuous batching).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from legorl.engines.base import SamplingParams, TokenChunk


@dataclass
class Request:
    """One generation request, as the worker thread tracks it."""

    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[TokenChunk | BaseException]
    generator: torch.Generator
    max_new: int
    stop: frozenset[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    routing: list[np.ndarray] = field(default_factory=list)
    routing_sent: int = 0  # entries of ``routing`` already streamed
    cancelled: bool = False

    def emit(self, item: TokenChunk | BaseException) -> None:
        deliver([(self, item)])


def deliver(items: list[tuple[Request, TokenChunk | BaseException]]) -> None:
    """Hand items to their requests' event loops: one wake-up per loop, not one per item (a
    cross-thread wake-up costs a GIL hand-off, which adds up at one token per request per step)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Request, TokenChunk | BaseException]]] = {}
    for req, item in items:
        by_loop.setdefault(req.loop, []).append((req, item))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # the requests' event loop is gone
            for req, _ in batch:
                req.cancelled = True


def _put_all(batch: list[tuple[Request, TokenChunk | BaseException]]) -> None:
    for req, item in batch:
        req.out.put_nowait(item)


class RunningBatch:
    """The running batch: per-row requests + one left-padded KV cache ``[B, heads, S, dim]`` per layer."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.rows: list[Request] = []
        self.cache: Any = None
        self.mask: torch.Tensor | None = None  # [B, S] 1 = real cached token
        self.pos: list[int] = []  # next position id per row (= real tokens in cache)
        self.next_ids: list[int] = []  # token to feed next per row

    def add(self, req: Request, cache: Any, length: int, next_id: int) -> None:
        dev = cache.layers[0].keys.device
        new_mask = torch.ones((1, length), dtype=torch.long, device=dev)
        if not self.rows:
            self.cache, self.mask = cache, new_mask
        else:
            assert self.mask is not None
            s = max(self.mask.shape[1], length)
            for mine, theirs in zip(self.cache.layers, cache.layers, strict=True):
                mine.keys = torch.cat([_lpad(mine.keys, s), _lpad(theirs.keys, s)], 0)
                mine.values = torch.cat([_lpad(mine.values, s), _lpad(theirs.values, s)], 0)
            self.mask = torch.cat([_lpad(self.mask, s, dim=1), _lpad(new_mask, s, dim=1)], 0)
        self.rows.append(req)
        self.pos.append(length)
        self.next_ids.append(next_id)

    def drop(self, indices: list[int]) -> None:
        if not indices:
            return
        gone = set(indices)
        keep = [i for i in range(len(self.rows)) if i not in gone]
        if not keep:
            self.clear()
            return
        assert self.mask is not None
        idx = torch.tensor(keep, device=self.mask.device)
        mask = self.mask.index_select(0, idx)
        # Trim columns that are padding for every remaining row.
        real = mask.any(0).nonzero()
        start = int(real[0]) if real.numel() else 0
        self.mask = mask[:, start:]
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, idx)[:, :, start:]
            layer.values = layer.values.index_select(0, idx)[:, :, start:]
        self.rows = [self.rows[i] for i in keep]
        self.pos = [self.pos[i] for i in keep]
        self.next_ids = [self.next_ids[i] for i in keep]

    def step_inputs(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        assert self.mask is not None
        ids = torch.tensor(self.next_ids, device=device).unsqueeze(1)
        mask = torch.cat([self.mask, torch.ones((len(self.rows), 1), dtype=self.mask.dtype, device=device)], 1)
        pos = torch.tensor(self.pos, device=device).unsqueeze(1)
        return ids, mask, pos


def _lpad(t: torch.Tensor, length: int, dim: int = 2) -> torch.Tensor:
    """Left-pad ``t`` with zeros along ``dim`` to ``length``."""
    missing = length - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([torch.zeros(shape, dtype=t.dtype, device=t.device), t], dim)
