"""Attention over a packed row (:mod:`.packing`): each document causal on its own, fork branches on their prefix.

Registered with transformers' ``AttentionInterface`` as ``legorl_packed`` and switched on for a
model only inside :func:`packed_attention` (the ``documents`` of the row are passed through the
model's forward kwargs, so gradient checkpointing's recompute sees them too). A document without
branches is one ``scaled_dot_product_attention(is_causal=True)`` call with no mask (on CPU that is
the flash kernel: memory linear in length); a branch attends to its document's prefix and
causally to itself through a (branch x prefix + branch) mask.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from legorl.errors import LegorlError
from legorl.training.packing import Document

NAME = "legorl_packed"


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, prefix: int) -> torch.Tensor:
    """Attention of ``q`` (the last ``q_len`` of ``k``'s positions) over ``k``, causal within the
    queries' own span and full over the first ``prefix`` keys."""
    gqa = q.shape[1] != k.shape[1]
    if prefix == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    n = q.shape[2]
    mask = torch.ones(n, prefix + n, dtype=torch.bool, device=q.device)
    mask[:, prefix:] = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def packed_attention_forward(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
    sliding_window: int | None = None, legorl_documents: tuple[Document, ...] | None = None, **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; query (1, H, L, D), key/value (1, H_kv, L, D)."""
    if legorl_documents is None:
        raise LegorlError("legorl_packed attention needs the packed documents (call the model inside packed_attention)")
    if sliding_window is not None or dropout:
        raise LegorlError("legorl_packed attention supports neither sliding windows nor attention dropout")
    out = []
    for doc in legorl_documents:
        p = slice(doc.start, doc.start + doc.prefix)
        if doc.prefix:
            out.append(_attend(query[:, :, p], key[:, :, p], value[:, :, p], scaling, 0))
        for start, length in doc.branches:
            if length == 0:
                continue
            b = slice(start, start + length)
            k = torch.cat([key[:, :, p], key[:, :, b]], dim=2)
            v = torch.cat([value[:, :, p], value[:, :, b]], dim=2)
            out.append(_attend(query[:, :, b], k, v, scaling, doc.prefix))
    return torch.cat(out, dim=2).transpose(1, 2).contiguous(), None


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
