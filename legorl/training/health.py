"""The training-health figures of a generation batch: fidelity to the rollout policy, importance
weights (also per staleness level), routing flips, batch shape.

Scoring a batch yields per-token (or, at a segment level, per-segment) values (:data:`VALUES`); they
are gathered from every process (:mod:`.distributed`) and summarised here over the whole batch.
When the old logprobs come from the training forwards themselves, the values arrive one
micro-batch at a time and wait in :class:`HealthRecorder` until the batch's last micro-step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from legorl.core import metric_keys as mk
from legorl.training.config import TrainConfig
from legorl.training.distributed import gather_cat, sum_across
from legorl.training.importance import weight_stats, weight_stats_by_lag
from legorl.training.metrics import fidelity
from legorl.training.replay import RoutingWatch

# Per sampled token: the trainer's old logprob, the rollout's, the harness index; per weighted value
# (token, or segment at a segment level): the weight, its raw ratio, its policy version, its tokens.
VALUES = ("old", "rollout", "harness", "weight", "raw", "version", "tokens")
Values = dict[str, torch.Tensor]
Figures = list[tuple[dict[str, float], str | None]]  # (figures, harness or None for the whole batch)


def no_values(device: Any) -> Values:
    return {name: torch.zeros(0, device=device) for name in VALUES}


def batch_figures(values: Values, harnesses: Sequence[str], config: TrainConfig, step: int) -> Figures:
    """Fidelity and importance-weight figures of the whole batch's ``values`` (gathered from every
    process), the weights also per staleness level against the trained ``step``, fidelity also per
    harness (``harnesses``: the names behind the ``harness`` indices, empty when not split)."""
    old, rollout = values["old"], values["rollout"]
    everywhere = torch.ones_like(old)
    correction = (config.is_cap, config.is_mode, config.is_lower)
    out: Figures = [
        (fidelity(old, rollout, everywhere), None),
        (weight_stats(values["weight"], values["raw"], *correction, values["tokens"]).as_dict(), None),
        (weight_stats_by_lag(values["weight"], values["raw"], values["version"], step, *correction, values["tokens"]),
         None),
    ]
    for index, harness in enumerate(harnesses):
        rows = values["harness"] == index
        out.append((fidelity(old[rows], rollout[rows], everywhere[rows]), harness))
    return out


def routing_figures(flips: float, decisions: float, replay: bool) -> dict[str, float]:
    """How often the trainer's router chose other experts than the recorded ones, and how often that
    reached the loss (never, with replay)."""
    rate = flips / max(decisions, 1.0)
    return {
        mk.ROUTING_REPLAY: float(replay),
        mk.ROUTING_NATURAL_FLIP_RATE: rate,
        mk.ROUTING_EFFECTIVE_FLIP_RATE: 0.0 if replay else rate,
    }


def shape_figures(lengths: Sequence[int], padding_free: bool) -> dict[str, float]:
    """The batch's segment count and the share of a padded batch that is padding (0 when packed)."""
    padding = 0.0 if padding_free else 1.0 - sum(lengths) / (len(lengths) * max(lengths))
    return {mk.BATCH_SEQUENCES: float(len(lengths)), mk.BATCH_PADDING_SHARE: padding}


Record = Callable[[dict[str, float], "str | None"], None]


class HealthRecorder:
    """Records a generation batch's health figures through ``record`` (figures, harness), from the
    values of every process's rows (``accelerator``: gathered; one process: as they are).

    ``pend``/``add``/``flush``: a batch whose old logprobs come from its training forwards gives its
    values one micro-batch at a time; they wait here until its last micro-step flushes them."""

    def __init__(self, accelerator: Any, config: TrainConfig, step: int, *, routing: bool, replay: bool,
                 record: Record):
        self.accelerator, self.config, self.step = accelerator, config, step
        self.routing, self.replay, self.record_figures = routing, replay, record
        self.pending: tuple[list[str], list[Any]] | None = None  # the waiting batch's harness split, segments
        self.parts: dict[str, list[torch.Tensor]] = {name: [] for name in VALUES}

    def record(self, local: Values, harnesses: list[str], watch: RoutingWatch, batch: Sequence[Any]) -> None:
        """The figures of the whole batch ``batch`` (its segments) from this process's ``local`` values."""
        gathered = {name: gather_cat(self.accelerator, value) for name, value in local.items()}
        for figures, harness in batch_figures(gathered, harnesses, self.config, self.step):
            self.record_figures(figures, harness)
        if self.routing:
            flips, decisions = sum_across(self.accelerator, [float(watch.flips), float(watch.decisions)])
            self.record_figures(routing_figures(flips, decisions, self.replay), None)
        self.record_figures(shape_figures([len(s) for s in batch], self.config.padding_free), None)

    def pend(self, harnesses: list[str], batch: list[Any]) -> None:
        self.pending = (harnesses, batch)

    def add(self, values: Values) -> None:
        for name in VALUES:
            self.parts[name].append(values[name])

    def flush(self) -> None:
        """Record the pending batch's figures from the values added so far (nothing when none pends)."""
        if self.pending is None:
            return
        device = self.accelerator.device
        values = {name: torch.cat(parts) if parts else torch.zeros(0, device=device)
                  for name, parts in self.parts.items()}
        (harnesses, batch), self.pending = self.pending, None
        self.parts = {name: [] for name in VALUES}
        self.record(values, harnesses, RoutingWatch(), batch)
