"""Importance weights against the policy that sampled the rollouts.

The engine that generated (vLLM, bf16, another batch shape) is never exactly the trainer's model.
With ``mu`` the rollout policy (its logprobs are stored in the segments) and ``pi_old`` the trainer's
model before the update, the gradient is corrected by

    token:     w_t = min(pi_old(y_t) / mu(y_t), C)                  (truncated IS, per token)
    sequence:  w   = min(prod_t pi_old(y_t) / mu(y_t), C)            (one weight per segment)
    none:      w   = 1

over the sampled tokens (mask 1). The weight multiplies the per-token advantage; because it is
positive and detached that is the same loss as TRL's own vLLM correction (which multiplies the
clipped per-token loss by it), so TRL's losses are reused unchanged.

The figures of the weights (:class:`WeightStats`) are those of the whole batch and, under an overlapped
loop, of each staleness level: the tokens sampled ``lag`` policy versions behind the trained step
(:mod:`legorl.provenance`), a sequence-level weight counted at its segment's oldest token. Tokens of
unknown version (shards from before versions) are in the whole-batch figures only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from legorl import metric_keys as mk
from legorl.provenance import UNKNOWN_VERSION


@dataclass(frozen=True)
class WeightStats:
    mean: float
    min: float
    max: float
    truncated: float  # share of weights that hit the cap
    ess: float  # effective sample size / n, in (0, 1]

    def as_dict(self) -> dict[str, float]:
        return {
            mk.IS_WEIGHT_MEAN: self.mean,
            mk.IS_WEIGHT_MIN: self.min,
            mk.IS_WEIGHT_MAX: self.max,
            mk.IS_TRUNCATED_FRAC: self.truncated,
            mk.IS_ESS: self.ess,
        }

    def at_lag(self, lag: int) -> dict[str, float]:
        """The figures of one staleness level, under its keys ("is/ess/lag1")."""
        return {
            mk.IS_WEIGHT_MEAN_AT_LAG + str(lag): self.mean,
            mk.IS_TRUNCATED_FRAC_AT_LAG + str(lag): self.truncated,
            mk.IS_ESS_AT_LAG + str(lag): self.ess,
        }


def importance_weights(
    old_logps: torch.Tensor, rollout_logps: torch.Tensor, mask: torch.Tensor, level: str, cap: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weights of shape (B, T) (1 where the mask is 0), and what :func:`weight_stats` summarises: the
    weights and the untruncated ratios, one per sampled token (per segment at sequence level)."""
    log_ratio = (old_logps - rollout_logps) * mask
    if level == "token":
        raw = torch.exp(log_ratio)
        weights = torch.clamp(raw, max=cap)
        values, raw_values = weights[mask > 0], raw[mask > 0]
    elif level == "sequence":
        raw = torch.exp(log_ratio.sum(-1, keepdim=True))
        weights = torch.clamp(raw, max=cap).expand_as(mask)
        values, raw_values = weights[:, 0], raw[:, 0]
    elif level == "none":
        weights = torch.ones_like(mask)
        values = raw_values = weights[mask > 0]
    else:
        raise ValueError(f"unknown importance sampling level {level!r}")
    weights = torch.where(mask > 0, weights, torch.ones_like(weights))
    return weights.detach(), values.detach(), raw_values.detach()


def weight_stats(values: torch.Tensor, raw: torch.Tensor, cap: float) -> WeightStats:
    if values.numel() == 0:
        return WeightStats(1.0, 1.0, 1.0, 0.0, 1.0)
    v = values.double()
    ess = float(v.sum() ** 2 / (v.numel() * (v**2).sum()))
    return WeightStats(
        mean=float(v.mean()), min=float(v.min()), max=float(v.max()),
        truncated=float((raw > cap).double().mean()), ess=ess,
    )


def value_versions(versions: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """The policy version behind each value :func:`importance_weights` summarises, from the per-token
    ``versions`` (B, T): the sampled token's, or at sequence level the segment's oldest known one
    (:data:`UNKNOWN_VERSION` where none is known). As float, like every figure gathered across processes."""
    versions = versions.float()
    if level != "sequence":
        return versions[mask > 0]
    known = (mask > 0) & (versions != UNKNOWN_VERSION)
    oldest = torch.where(known, versions, torch.full_like(versions, torch.inf)).amin(-1)
    return torch.where(known.any(-1), oldest, torch.full_like(oldest, UNKNOWN_VERSION))


def weight_stats_by_lag(
    values: torch.Tensor, raw: torch.Tensor, versions: torch.Tensor, step: int, cap: float
) -> dict[str, float]:
    """:func:`weight_stats` per staleness level: over the values whose version (``versions``, one per
    value, :func:`value_versions`) lags ``step - version`` behind the trained ``step``, one set of
    figures per lag present; values of unknown version are left out."""
    known = versions != UNKNOWN_VERSION
    lags = step - versions[known].long()
    values, raw = values[known], raw[known]
    out: dict[str, float] = {}
    for lag in sorted(set(lags.tolist())):
        at = lags == lag
        out |= weight_stats(values[at], raw[at], cap).at_lag(lag)
    return out
