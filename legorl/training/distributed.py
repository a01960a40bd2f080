"""Whole-batch figures when each process holds a share of the batch (``accelerate launch``).

Every process scores and trains only its own rows (:func:`~legorl.training.batching.micro_batch_plan`),
but the health figures (fidelity, importance weights, routing flips) are defined over the whole
batch: the per-token values are gathered from every process before they are summarised, counts are
summed. With one process both are identities, so the figures are the same whatever the process count.
"""

from __future__ import annotations

from typing import Any

import torch


def gather_cat(accelerator: Any, values: torch.Tensor) -> torch.Tensor:
    """The 1-D ``values`` of every process, concatenated in process order (lengths may differ)."""
    if accelerator.num_processes == 1:
        return values
    counts = accelerator.gather(torch.tensor([values.numel()], device=values.device)).tolist()
    if max(counts) == 0:
        return values
    padded = accelerator.pad_across_processes(values, dim=0)
    gathered = accelerator.gather(padded).reshape(len(counts), -1)
    return torch.cat([gathered[rank, :count] for rank, count in enumerate(counts)])


def sum_across(accelerator: Any, values: list[float]) -> list[float]:
    """``values`` summed over the processes."""
    if accelerator.num_processes == 1:
        return values
    total = accelerator.reduce(torch.tensor(values, dtype=torch.float64, device=accelerator.device), reduction="sum")
    return [float(v) for v in total.tolist()]
