"""The training-health figures of a generation batch, and the wait for figures that come from the forwards."""

from __future__ import annotations

import pytest
import torch
from accelerate import PartialState

from legorl.core import metric_keys as mk
from legorl.training.config import TrainConfig
from legorl.training.health import VALUES, HealthRecorder, no_values, routing_figures, shape_figures
from legorl.training.replay import RoutingWatch


def _values(old: list[float], rollout: list[float], harness: list[float]) -> dict[str, torch.Tensor]:
    n = len(old)
    ratio = torch.exp(torch.tensor(old) - torch.tensor(rollout))
    return {"old": torch.tensor(old), "rollout": torch.tensor(rollout), "harness": torch.tensor(harness),
            "weight": ratio.clamp(max=2.0), "raw": ratio, "version": torch.full((n,), 4.0), "tokens": torch.ones(n)}


class _Figures(list[tuple[dict[str, float], str | None]]):
    def record(self, figures: dict[str, float], harness: str | None) -> None:
        self.append((figures, harness))

    def key(self, key: str, harness: str | None = None) -> list[float]:
        return [f[key] for f, h in self if h == harness and key in f]


def _recorder(figures: _Figures, *, routing: bool = False) -> HealthRecorder:
    return HealthRecorder(PartialState(), TrainConfig(is_cap=2.0), step=5, routing=routing, replay=False,
                          record=figures.record)


def test_a_batch_gives_whole_batch_per_harness_and_per_lag_figures() -> None:
    figures = _Figures()
    values = _values([-1.0, -0.5, -2.0], [-1.2, -0.5, -1.0], [0.0, 0.0, 1.0])
    _recorder(figures).record(values, ["a", "b"], RoutingWatch(), [range(10), range(30)])
    assert figures.key(mk.LOGPROB_ABS_DIFF_MAX) == [pytest.approx(1.0)]
    assert figures.key(mk.LOGPROB_ABS_DIFF_MAX, "a") == [pytest.approx(0.2)]
    assert figures.key(mk.IS_WEIGHT_MAX) == [pytest.approx(float(torch.exp(torch.tensor(0.2))))]
    assert figures.key(mk.IS_ESS_AT_LAG + "1")  # version 4 behind step 5
    assert figures.key(mk.BATCH_SEQUENCES) == [2.0] and figures.key(mk.BATCH_PADDING_SHARE) == [0.0]
    assert not figures.key(mk.ROUTING_REPLAY)


def test_pending_values_are_recorded_once_at_the_batch_end() -> None:
    figures = _Figures()
    health = _recorder(figures)
    health.flush()
    assert figures == []  # nothing pends
    health.pend([], [range(4)])
    health.add(_values([-1.0], [-1.0], [0.0]))
    health.add(_values([-3.0], [-1.0], [0.0]))
    health.flush()
    health.flush()
    assert figures.key(mk.LOGPROB_ABS_DIFF_MAX) == [pytest.approx(2.0)]  # both micro-batches' values, once
    health.record(no_values("cpu"), [], RoutingWatch(), [range(4)])  # an empty share still counts the batch
    assert figures.key(mk.BATCH_SEQUENCES) == [1.0, 1.0] and set(no_values("cpu")) == set(VALUES)


def test_routing_and_shape_figures() -> None:
    assert routing_figures(3.0, 12.0, replay=False) == {
        mk.ROUTING_REPLAY: 0.0, mk.ROUTING_NATURAL_FLIP_RATE: 0.25, mk.ROUTING_EFFECTIVE_FLIP_RATE: 0.25}
    assert routing_figures(3.0, 12.0, replay=True)[mk.ROUTING_EFFECTIVE_FLIP_RATE] == 0.0
    assert shape_figures([2, 4], padding_free=False) == {mk.BATCH_SEQUENCES: 2.0, mk.BATCH_PADDING_SHARE: 0.25}
