"""Group-relative advantages (GRPO), one value per trial.

A group is every attempt at the same task with the same policy step (``group_id``). With rewards
``r_1..r_G`` of the trials kept in a group (infrastructure failures are already gone, so they
neither pull the mean down nor inflate the spread):

    A_i = r_i - mean(r)                      # Dr.GRPO: scale = "none"
    A_i = (r_i - mean(r)) / (std(r) + eps)   # GRPO:    scale = "group"
    A_i = (r_i - mean(r)) / (std(r_all) + eps)   # scale = "batch": one std over the whole step

``std`` is the unbiased (Bessel-corrected) standard deviation and ``eps = 1e-4``, as in TRL, so
these numbers equal TRL's own for a fixed-size group. A group whose rewards are all equal has
``A = 0`` for every trial: it carries no signal and is counted (``zero_variance``). A group with a
single trial left is counted the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

EPS = 1e-4


@dataclass(frozen=True)
class GroupStats:
    groups: int
    zero_variance: int  # groups whose rewards are all equal (including single-trial groups)
    singletons: int  # groups with one trial left

    @property
    def zero_variance_share(self) -> float:
        return self.zero_variance / self.groups if self.groups else 0.0


def group_advantages(
    rewards: Sequence[float], group_ids: Sequence[str], scale: str = "group", eps: float = EPS
) -> tuple[np.ndarray, GroupStats]:
    """Advantages for trials with ``rewards``, normalised within each group of ``group_ids``."""
    if len(rewards) != len(group_ids):
        raise ValueError(f"{len(rewards)} rewards but {len(group_ids)} group ids")
    r = np.asarray(rewards, dtype=np.float64)
    groups: dict[str, list[int]] = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(i)

    advantages = np.zeros_like(r)
    zero_variance = singletons = 0
    for members in groups.values():
        idx = np.asarray(members)
        r_g = r[idx]
        if len(r_g) < 2:
            singletons += 1
            zero_variance += 1
            continue  # no baseline to compare against: A = 0
        std_g = r_g.std(ddof=1)
        if np.isclose(std_g, 0.0):
            zero_variance += 1
            continue  # every trial scored the same: A = 0
        advantages[idx] = r_g - r_g.mean()
        if scale == "group":
            advantages[idx] /= std_g + eps

    if scale == "batch":
        std_all = r.std(ddof=1) if len(r) > 1 else 0.0
        advantages /= std_all + eps
    elif scale not in ("group", "none"):
        raise ValueError(f"unknown reward scaling {scale!r}")
    return advantages, GroupStats(len(groups), zero_variance, singletons)
