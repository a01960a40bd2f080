"""Importance weights against the policy that sampled the rollouts.

The engine that generated (vLLM, bf16, another batch shape) is never exactly the trainer's model,
and under an overlapped loop it may be a few versions older. With ``mu`` the rollout policy (its
logprobs are stored in the segments), ``pi_old`` the trainer's model before the update and
``r_t = pi_old(y_t) / mu(y_t)`` over the sampled tokens (mask 1), a *level* says which ratio a weight
is made of:

    token:      rho_t = r_t                                        (one per token)
    sequence:   rho   = prod_t r_t                                 (one per segment)
    geometric:  rho   = exp(mean_t log r_t) = (prod_t r_t)^(1/T)   (one per segment, length-free)
    none:       w = 1

and a *mode* what becomes of it, with cap ``C`` and floor ``L`` (default ``1/C``):

    truncate:   w = min(rho, C)                  truncated IS (TIS: Yao et al., "Your Efficient RL
                                                 Framework Secretly Brings You Off-Policy RL Training", 2025)
    mask:       w = rho * 1[L <= rho <= C]       masked IS: at token level IcePop's M(r; alpha, beta)
                                                 (Ling Team, "Every Step Evolves", Ring-1T, 2025) and slime's
                                                 ``--tis-mode mask``; at sequence / geometric level verl's
                                                 rejection sampling ``rollout_rs=sequence|geometric``
                                                 ("When Speed Kills Stability", Liu, Li et al., 2025)

(the names of verl's ``rollout_is_level`` / ``rollout_is_mode`` / ``rollout_is_threshold(_lower)``).
A masked token or segment gets weight 0: no gradient, but it still counts in the loss's normaliser,
as in IcePop's objective (verl and slime also drop it from the normaliser; here the normalisers are
counted over the whole batch before training, :mod:`legorl.training.batching`).

The weight multiplies the per-token advantage; because it is non-negative and detached that is the
same loss as TRL's own vLLM correction (which multiplies the clipped per-token loss by it), so TRL's
losses are reused unchanged.

The figures of the weights (:class:`WeightStats`) are those of the whole batch and, under an overlapped
loop, of each staleness level: the tokens sampled ``lag`` policy versions behind the trained step
(:mod:`legorl.trials.provenance`), a segment-level weight counted at its segment's oldest token. Tokens of
unknown version (shards from before versions) are in the whole-batch figures only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from legorl.core import metric_keys as mk
from legorl.trials.provenance import UNKNOWN_VERSION

SEGMENT_LEVELS: tuple[str, ...] = ("sequence", "geometric")  # one weight per segment


@dataclass(frozen=True)
class WeightStats:
    mean: float
    min: float
    max: float
    truncated: float  # share of weights that hit the cap (truncate mode)
    ess: float  # effective sample size / n, in [0, 1] (0: every weight masked)
    masked: float | None = None  # mask mode: share of weights set to 0 (tokens, or segments)
    masked_tokens: float | None = None  # mask mode: share of sampled tokens whose weight is 0

    def as_dict(self) -> dict[str, float]:
        out = {
            mk.IS_WEIGHT_MEAN: self.mean,
            mk.IS_WEIGHT_MIN: self.min,
            mk.IS_WEIGHT_MAX: self.max,
            mk.IS_TRUNCATED_FRAC: self.truncated,
            mk.IS_ESS: self.ess,
        }
        if self.masked is not None and self.masked_tokens is not None:
            out |= {mk.IS_MASKED_FRAC: self.masked, mk.IS_MASKED_TOKEN_FRAC: self.masked_tokens}
        return out

    def at_lag(self, lag: int) -> dict[str, float]:
        """The figures of one staleness level, under its keys ("is/ess/lag1")."""
        out = {
            mk.IS_WEIGHT_MEAN_AT_LAG + str(lag): self.mean,
            mk.IS_TRUNCATED_FRAC_AT_LAG + str(lag): self.truncated,
            mk.IS_ESS_AT_LAG + str(lag): self.ess,
        }
        if self.masked is not None:
            out[mk.IS_MASKED_FRAC_AT_LAG + str(lag)] = self.masked
        return out


def floor_of(cap: float, lower: float | None) -> float:
    """The mask's lower bound: ``lower``, or ``1 / cap`` (verl's and slime's default)."""
    return lower if lower is not None else 1.0 / cap


def importance_weights(
    old_logps: torch.Tensor, rollout_logps: torch.Tensor, mask: torch.Tensor, level: str, cap: float,
    mode: str = "truncate", lower: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weights of shape (B, T) (1 where the mask is 0), and what :func:`weight_stats` summarises: the
    weights and the raw ratios ``rho``, one per sampled token (per segment at a segment level)."""
    log_ratio = (old_logps - rollout_logps) * mask
    if level == "token":
        raw = torch.exp(log_ratio)
    elif level == "sequence":
        raw = torch.exp(log_ratio.sum(-1, keepdim=True)).expand_as(mask)
    elif level == "geometric":
        tokens = mask.sum(-1, keepdim=True).clamp(min=1)
        raw = torch.exp(log_ratio.sum(-1, keepdim=True) / tokens).expand_as(mask)
    elif level == "none":
        raw = torch.ones_like(mask)
    else:
        raise ValueError(f"unknown importance sampling level {level!r}")
    if level == "none":
        weights = raw
    elif mode == "truncate":
        weights = torch.clamp(raw, max=cap)
    elif mode == "mask":
        kept = (raw >= floor_of(cap, lower)) & (raw <= cap)
        weights = torch.where(kept, raw, torch.zeros_like(raw))
    else:
        raise ValueError(f"unknown importance sampling mode {mode!r}")
    if level in SEGMENT_LEVELS:
        values, raw_values = weights[:, 0], raw[:, 0]
    else:
        values, raw_values = weights[mask > 0], raw[mask > 0]
    weights = torch.where(mask > 0, weights, torch.ones_like(weights))
    return weights.detach(), values.detach(), raw_values.detach()


def value_tokens(mask: torch.Tensor, level: str) -> torch.Tensor:
    """How many sampled tokens each value :func:`importance_weights` summarises stands for: 1 per
    token, or a segment's sampled tokens at a segment level. As float, like every gathered figure."""
    if level in SEGMENT_LEVELS:
        return mask.float().sum(-1)
    return torch.ones_like(mask.float())[mask > 0]


def weight_stats(
    values: torch.Tensor, raw: torch.Tensor, cap: float, mode: str = "truncate", lower: float | None = None,
    tokens: torch.Tensor | None = None,
) -> WeightStats:
    """The figures of the weights ``values`` (and their raw ratios ``raw``); under the mask mode also
    the share masked, of the values and of the sampled tokens they stand for (``tokens``,
    :func:`value_tokens`; default one each)."""
    masking = mode == "mask"
    if values.numel() == 0:
        return WeightStats(1.0, 1.0, 1.0, 0.0, 1.0, *((0.0, 0.0) if masking else (None, None)))
    v = values.double()
    square_sum = float((v**2).sum())
    ess = float(v.sum() ** 2 / (v.numel() * square_sum)) if square_sum > 0 else 0.0
    masked = masked_tokens = None
    if masking:
        out = ((raw < floor_of(cap, lower)) | (raw > cap)).double()
        n = tokens.double() if tokens is not None else torch.ones_like(out)
        masked, masked_tokens = float(out.mean()), float((out * n).sum() / n.sum())
    return WeightStats(
        mean=float(v.mean()), min=float(v.min()), max=float(v.max()),
        truncated=0.0 if masking else float((raw > cap).double().mean()), ess=ess,
        masked=masked, masked_tokens=masked_tokens,
    )


def value_versions(versions: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """The policy version behind each value :func:`importance_weights` summarises, from the per-token
    ``versions`` (B, T): the sampled token's, or at a segment level the segment's oldest known one
    (:data:`UNKNOWN_VERSION` where none is known). As float, like every figure gathered across processes."""
    versions = versions.float()
    if level not in SEGMENT_LEVELS:
        return versions[mask > 0]
    known = (mask > 0) & (versions != UNKNOWN_VERSION)
    oldest = torch.where(known, versions, torch.full_like(versions, torch.inf)).amin(-1)
    return torch.where(known.any(-1), oldest, torch.full_like(oldest, UNKNOWN_VERSION))


def weight_stats_by_lag(
    values: torch.Tensor, raw: torch.Tensor, versions: torch.Tensor, step: int, cap: float,
    mode: str = "truncate", lower: float | None = None, tokens: torch.Tensor | None = None,
) -> dict[str, float]:
    """:func:`weight_stats` per staleness level: over the values whose version (``versions``, one per
    value, :func:`value_versions`) lags ``step - version`` behind the trained ``step``, one set of
    figures per lag present; values of unknown version are left out."""
    known = versions != UNKNOWN_VERSION
    lags = step - versions[known].long()
    values, raw = values[known], raw[known]
    tokens = tokens[known] if tokens is not None else None
    out: dict[str, float] = {}
    for lag in sorted(set(lags.tolist())):
        at = lags == lag
        out |= weight_stats(values[at], raw[at], cap, mode, lower, None if tokens is None else tokens[at]).at_lag(lag)
    return out
