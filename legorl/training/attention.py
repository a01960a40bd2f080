"""Attention over a packed row (:mod:`.packing`): each document causal on its own, fork branches on their prefix.

Registered with transformers' ``AttentionInterface`` as ``legorl_packed`` and switched on for a
model only inside :func:`packed_attention` (the ``documents`` of the row are passed through the
model's forward kwargs, so gradient checkpointing's recompute sees them too). No kernel holds a
``[T, T]`` matrix for the row; :func:`select_kernel` picks one per call:

- ``flash_varlen`` (CUDA, fp16/bf16, the ``flash_attn`` package installed): one
  ``flash_attn_varlen_func`` call over the whole row, one sequence per document prefix and one per
  branch (:func:`varlen_layout`; flash-attention aligns its causal mask bottom-right, so a branch
  whose keys are its prefix and then itself sees the prefix whole and itself causally).
- ``sdpa`` (otherwise): ``scaled_dot_product_attention`` per document with ``is_causal=True`` (the
  flash kernel on CPU, flash or memory-efficient on CUDA: memory linear in length); a branch attends
  to its prefix and itself through ``causal_lower_right`` (a kernel's own mask on CUDA; on CPU a
  ``branch x (prefix + branch)`` boolean mask, a fork's own tail being short).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface

from legorl.core.errors import LegorlError
from legorl.training.packing import Document

NAME = "legorl_packed"
FLASH_DTYPES = (torch.float16, torch.bfloat16)
Span = tuple[int, int]  # (start, length) in the packed row


@cache
def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def select_kernel(device_type: str, dtype: torch.dtype, flash_installed: bool) -> str:
    """``flash_varlen`` where flash-attention runs (CUDA, fp16/bf16, installed), else ``sdpa``."""
    return "flash_varlen" if device_type == "cuda" and dtype in FLASH_DTYPES and flash_installed else "sdpa"


def varlen_layout(documents: Sequence[Document]) -> list[tuple[int, tuple[Span, ...]]]:
    """The row as varlen sequences, in row order: each one's query count (its queries are the next
    positions of the row) and the spans of the row that are its keys (a prefix: itself; a branch:
    its document's prefix, then itself)."""
    sequences: list[tuple[int, tuple[Span, ...]]] = []
    for doc in documents:
        prefix = (doc.start, doc.prefix)
        if doc.prefix:
            sequences.append((doc.prefix, (prefix,)))
        sequences += [(length, (prefix, (start, length))) for start, length in doc.branches if length]
    return sequences


def _flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None,
                  documents: Sequence[Document]) -> torch.Tensor:
    """q (1, H, L, D), k/v (1, H_kv, L, D) -> (L, H, D)."""
    flash_attn_varlen_func = importlib.import_module("flash_attn").flash_attn_varlen_func
    layout = varlen_layout(documents)
    device = q.device
    index = torch.cat([torch.arange(s, s + n, device=device) for _, spans in layout for s, n in spans])
    q_lens = torch.tensor([n for n, _ in layout], device=device)
    k_lens = torch.tensor([sum(n for _, n in spans) for _, spans in layout], device=device)
    zero = torch.zeros(1, dtype=torch.int32, device=device)
    cu_q = torch.cat([zero, q_lens.cumsum(0).int()])
    cu_k = torch.cat([zero, k_lens.cumsum(0).int()])
    out: torch.Tensor = flash_attn_varlen_func(
        q[0].transpose(0, 1), k[0].transpose(0, 1)[index], v[0].transpose(0, 1)[index], cu_q, cu_k,
        int(q_lens.max()), int(k_lens.max()), dropout_p=0.0, softmax_scale=scale, causal=True,
    )
    return out


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, prefix: int) -> torch.Tensor:
    """Attention of ``q`` (the last ``q_len`` of ``k``'s positions) over ``k``, causal within the
    queries' own span and full over the first ``prefix`` keys."""
    if prefix == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    groups = q.shape[1] // k.shape[1]  # the lower-right bias's kernels take equal head counts
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]), scale=scale)


def _sdpa_documents(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None,
                    documents: Sequence[Document]) -> torch.Tensor:
    """q (1, H, L, D), k/v (1, H_kv, L, D) -> (1, H, L, D)."""
    out = []
    for doc in documents:
        p = slice(doc.start, doc.start + doc.prefix)
        if doc.prefix:
            out.append(_sdpa(q[:, :, p], k[:, :, p], v[:, :, p], scale, 0))
        for start, length in doc.branches:
            if length == 0:
                continue
            b = slice(start, start + length)
            keys = torch.cat([k[:, :, p], k[:, :, b]], dim=2)
            values = torch.cat([v[:, :, p], v[:, :, b]], dim=2)
            out.append(_sdpa(q[:, :, b], keys, values, scale, doc.prefix))
    return torch.cat(out, dim=2)


def packed_attention_forward(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
    sliding_window: int | None = None, legorl_documents: tuple[Document, ...] | None = None, **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; query (1, H, L, D), key/value (1, H_kv, L, D) ->
    (1, L, H, D)."""
    if legorl_documents is None:
        raise LegorlError("legorl_packed attention needs the packed documents (call the model inside packed_attention)")
    if sliding_window is not None or dropout:
        raise LegorlError("legorl_packed attention supports neither sliding windows nor attention dropout")
    if select_kernel(query.device.type, query.dtype, flash_attn_installed()) == "flash_varlen":
        return _flash_varlen(query, key, value, scaling, legorl_documents)[None], None
    return _sdpa_documents(query, key, value, scaling, legorl_documents).transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, packed_attention_forward)


@contextmanager
def packed_attention(model: torch.nn.Module) -> Iterator[None]:
    """Run ``model``'s attention layers as :func:`packed_attention_forward` while the context is open
    (keep it open through the backward pass when activations are recomputed there)."""
    found: list[Any] = [getattr(m, "config", None) for m in model.modules()]
    configs = list({id(c): c for c in found if hasattr(c, "_attn_implementation")}.values())
    saved = [c._attn_implementation for c in configs]
    try:
        for c in configs:
            c._attn_implementation = NAME
        yield
    finally:
        for c, name in zip(configs, saved, strict=True):
            c._attn_implementation = name
