"""Training health figures, and the recorder that writes them as ``metrics`` shards (long format).

Fidelity of the trainer to the rollout policy, over sampled tokens, with ``lp_r`` the logprobs the
engine recorded and ``lp_t`` the trainer's recompute (before the update), under the keys of
:mod:`legorl.core.metric_keys`:

- ``fidelity/logprob_pearson``: Pearson correlation of ``lp_r`` and ``lp_t`` (1.0 = identical up to
  an affine map; fp32 engine vs fp32 trainer gives ~1.000000, bf16 ~0.99999);
- ``fidelity/mismatch_kl``: KL(mu || pi) estimated with k3 = exp(d) - 1 - d, d = lp_t - lp_r (>= 0,
  unbiased for samples from mu); ``fidelity/mismatch_kl_k1`` = mean(lp_r - lp_t);
- ``fidelity/logprob_abs_diff_max``.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import torch

from legorl.core import metric_keys as mk
from legorl.core import shards
from legorl.core.schemas import Kind, MetricRow


def fidelity(trainer_logps: torch.Tensor, rollout_logps: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Agreement of the trainer's logprobs with the rollout's over the tokens where ``mask`` is 1."""
    sel = mask > 0
    t = trainer_logps[sel].double()
    r = rollout_logps[sel].double()
    if t.numel() == 0:
        return {}
    d = t - r
    out = {
        mk.MISMATCH_KL: float((torch.exp(d) - 1 - d).mean()),
        mk.MISMATCH_KL_K1: float((-d).mean()),
        mk.LOGPROB_ABS_DIFF_MAX: float(d.abs().max()),
    }
    if t.numel() > 1:
        tc, rc = t - t.mean(), r - r.mean()
        denom = math.sqrt(float((tc**2).sum()) * float((rc**2).sum()))
        out[mk.LOGPROB_PEARSON] = float((tc * rc).sum()) / denom if denom > 0 else float("nan")
    return out


class MetricsRecorder:
    """Collects figures over one training step; each (key, harness) becomes one row (their mean)."""

    def __init__(self) -> None:
        self._values: dict[tuple[str, str | None], list[float]] = defaultdict(list)

    def add(self, key: str, value: float | None, harness: str | None = None) -> None:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return
        self._values[(key, harness)].append(float(value))

    def update(self, values: dict[str, float], harness: str | None = None) -> None:
        for key, value in values.items():
            self.add(key, value, harness)

    def merge(self, other: MetricsRecorder) -> None:
        for key, values in other._values.items():
            self._values[key].extend(values)

    def summary(self) -> dict[str, float]:
        """Overall figures (no harness) as a flat dict; per-harness ones as ``key@harness``."""
        out = {}
        for (key, harness), values in sorted(self._values.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")):
            out[key if harness is None else f"{key}@{harness}"] = sum(values) / len(values)
        return out

    def rows(self, step: int, stage: str = "train") -> list[MetricRow]:
        now = time.time()
        return [
            MetricRow(step=step, key=key, value=sum(values) / len(values), harness=harness, stage=stage, time=now)
            for (key, harness), values in self._values.items()
        ]

    def write(self, path: Path, step: int, command: str | None = None) -> Path | None:
        return shards.write(path, Kind.METRICS, self.rows(step), command=command)


def harness_split(harnesses: Iterable[str]) -> list[str]:
    """The harnesses to report separately: all of them when the batch mixes more than one."""
    unique = sorted(set(harnesses))
    return unique if len(unique) > 1 else []
