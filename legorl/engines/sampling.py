"""What the embedded engine samples from, and how it draws: the logits processing a trainer
reproduces, request validation, and seeded per-row sampling of a batch.

Logprobs are those of the distribution actually sampled from: :func:`process_logits` applies
temperature, then top-k, then top-p (the order of vLLM and transformers) and returns the
log-softmax of what is left; the sampled token's entry is recorded. With ``temperature == 0`` the
token is the argmax and its logprob is taken from the same processing at temperature 1 (top-k /
top-p still applied) — a point mass would record 0.0 for every token and tell a trainer nothing.
A trainer reproduces the numbers with a full forward pass and the same :func:`process_logits`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from legorl.engines.base import MIN_TEMPERATURE, RequestRejected, SamplingParams


def process_logits(
    logits: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    top_k: int | torch.Tensor = 0,
    top_p: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """Log-probabilities ``[N, V]`` (float32) of the sampling distribution for logits ``[N, V]``.

    Temperature (0 counts as 1, see the module docstring), then top-k (ties with the k-th value are
    kept), then top-p (the smallest prefix of the sorted distribution whose mass reaches ``top_p``;
    the most likely token is always kept). Removed tokens get ``-inf``. Each of the parameters may be
    a scalar or a per-row tensor ``[N]``.
    """
    x = logits.float()
    n, v = x.shape
    dev = x.device
    t = torch.as_tensor(temperature, dtype=torch.float32, device=dev).reshape(-1, 1).expand(n, 1)
    t = torch.where(t > 0, t, torch.ones_like(t))
    x = x / t
    k = torch.as_tensor(top_k, dtype=torch.long, device=dev).reshape(-1).expand(n)
    p = torch.as_tensor(top_p, dtype=torch.float32, device=dev).reshape(-1).expand(n)
    use_k = (k > 0) & (k < v)
    use_p = p < 1.0
    if bool(use_k.any()) or bool(use_p.any()):
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        if bool(use_k.any()):
            kth = sorted_x.gather(1, (k.clamp(1, v) - 1).reshape(-1, 1))
            drop_k = use_k.reshape(-1, 1) & (x < kth)
            x = x.masked_fill(drop_k, float("-inf"))
            sorted_x = sorted_x.masked_fill(use_k.reshape(-1, 1) & (sorted_x < kth), float("-inf"))
        if bool(use_p.any()):
            probs = torch.softmax(sorted_x, dim=-1)
            before = torch.cumsum(probs, dim=-1) - probs  # mass of the strictly more likely tokens
            drop_sorted = use_p.reshape(-1, 1) & (before > p.reshape(-1, 1))
            drop_sorted[:, 0] = False
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            x = x.masked_fill(drop, float("-inf"))
    return torch.log_softmax(x, dim=-1)


def validate_params(params: SamplingParams) -> None:
    """Refuse sampling parameters the engine cannot honour (:class:`RequestRejected`, a 400)."""
    if params.max_tokens < 1:
        raise RequestRejected(f"max_tokens must be >= 1, got {params.max_tokens}")
    if not (params.temperature == 0 or MIN_TEMPERATURE <= params.temperature < math.inf):
        raise RequestRejected(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, inf), got {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise RequestRejected(f"top_p must be in (0, 1], got {params.top_p}")
    if params.top_k < 0:
        raise RequestRejected(f"top_k must be >= 0 (0 = off), got {params.top_k}")


def sample_rows(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator]
) -> tuple[list[int], list[float]]:
    """One token per row of ``logits`` ``[N, V]``, each row with its own parameters and generator;
    returns the tokens and their logprobs under :func:`process_logits`."""
    device = logits.device
    temp = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=device)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
    logp = process_logits(logits, temp, top_k, top_p)
    # Gumbel-max (argmax of logp - log Exp(1)) with per-request noise: the draw is an exact
    # sample of softmax(logp), and unlike an inverse-CDF draw it only changes under float noise
    # (batched vs alone: ~1e-6) when the two best perturbed scores nearly tie.
    v = logp.shape[1]
    noise = torch.stack([torch.empty(v).exponential_(generator=g) for g in generators]).to(logp.device)
    sampled = (logp - noise.log()).argmax(dim=-1)
    greedy = logp.argmax(dim=-1)
    tok = torch.where(temp > 0, sampled, greedy)
    picked = logp.gather(1, tok.unsqueeze(1)).squeeze(1)
    return tok.tolist(), picked.tolist()
