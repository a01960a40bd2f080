"""The packed row's attention kernel: which one runs where, and the flash-attention varlen layout
giving the per-document path's attention (checked on CPU by running each varlen sequence through a
bottom-right causal SDPA, the mask flash-attention applies); on CUDA with flash_attn, the kernel itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from legorl.training.attention import (
    _flash_varlen,
    _sdpa_documents,
    flash_attn_installed,
    packed_attention_forward,
    select_kernel,
    varlen_layout,
)
from legorl.training.packing import Document, pack


def test_kernel_selection() -> None:
    assert select_kernel("cuda", torch.bfloat16, True) == "flash_varlen"
    assert select_kernel("cuda", torch.float16, True) == "flash_varlen"
    assert select_kernel("cuda", torch.float32, True) == "sdpa"  # flash-attention has no fp32 kernel
    assert select_kernel("cuda", torch.bfloat16, False) == "sdpa"  # not installed: SDPA's own kernels
    assert select_kernel("cpu", torch.bfloat16, True) == "sdpa"
    assert select_kernel("cpu", torch.float32, False) == "sdpa"


def _forked_row() -> tuple[Document, ...]:
    """Three forks of a 40-token prompt (own tails 5, 0 and 7 tokens) and a lone 30-token segment."""
    prompt = torch.arange(100, 140)
    rows = [torch.cat([prompt, torch.arange(0, 5)]), prompt.clone(), torch.cat([prompt, torch.arange(20, 27)]),
            torch.arange(500, 530)]
    ids = torch.zeros(len(rows), 47, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = r, 1
    return pack(ids, mask, [0, 0, 0, 1]).documents


def test_varlen_layout_of_a_forked_row() -> None:
    documents = _forked_row()
    assert documents == (Document(0, 40, ((40, 5), (45, 0), (45, 7))), Document(52, 30))
    assert varlen_layout(documents) == [
        (40, ((0, 40),)),
        (5, ((0, 40), (40, 5))),
        (7, ((0, 40), (45, 7))),  # the empty fork has no queries
        (30, ((52, 30),)),
    ]


def _varlen_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: tuple[Document, ...]) -> torch.Tensor:
    """What flash_attn_varlen_func(causal=True) computes on :func:`varlen_layout`: per sequence, its
    queries over its keys with the causal mask aligned bottom-right."""
    out, cursor = [], 0
    groups = q.shape[1] // k.shape[1]
    for n, spans in varlen_layout(documents):
        keys = torch.cat([k[:, :, s : s + m] for s, m in spans], dim=2).repeat_interleave(groups, dim=1)
        values = torch.cat([v[:, :, s : s + m] for s, m in spans], dim=2).repeat_interleave(groups, dim=1)
        mask = causal_lower_right(n, keys.shape[2])
        out.append(F.scaled_dot_product_attention(q[:, :, cursor : cursor + n], keys, values, attn_mask=mask))
        cursor += n
    return torch.cat(out, dim=2)


def _qkv(length: int, device: str = "cpu", dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(1, 4, length, 64), (1, 2, length, 64), (1, 2, length, 64)]
    return [torch.randn(s, generator=gen).to(device, dtype) for s in shapes]


def test_varlen_layout_gives_the_per_document_attention() -> None:
    documents = _forked_row()
    q, k, v = _qkv(82)
    torch.testing.assert_close(_varlen_reference(q, k, v, documents), _sdpa_documents(q, k, v, None, documents))
    # and the per-document path is a dense masked attention: the fork's tails see the prompt, not each other
    allowed = torch.zeros(82, 82, dtype=torch.bool)
    allowed[:40, :40] = torch.ones(40, 40, dtype=torch.bool).tril()
    allowed[40:45, :40] = allowed[45:52, :40] = True
    allowed[40:45, 40:45] = torch.ones(5, 5, dtype=torch.bool).tril()
    allowed[45:52, 45:52] = torch.ones(7, 7, dtype=torch.bool).tril()
    allowed[52:, 52:] = torch.ones(30, 30, dtype=torch.bool).tril()
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
    torch.testing.assert_close(_sdpa_documents(q, k, v, None, documents), dense)


@pytest.mark.skipif(not (torch.cuda.is_available() and flash_attn_installed()), reason="needs CUDA and flash_attn")
def test_flash_varlen_kernel_matches_the_per_document_path_on_cuda() -> None:
    documents = _forked_row()
    q, k, v = _qkv(82, "cuda", torch.bfloat16)
    out, _ = packed_attention_forward(torch.nn.Module(), q, k, v, None, legorl_documents=documents)
    reference = _sdpa_documents(q.float(), k.float(), v.float(), None, documents).transpose(1, 2)
    torch.testing.assert_close(out.float(), reference, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(_flash_varlen(q, k, v, None, documents)[None], out)
