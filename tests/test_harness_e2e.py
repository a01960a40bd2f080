"""Each real harness (every install recipe) runs a trial end to end against the embedded tiny model.

The model is random, so nothing gets solved: the point is the plumbing — a fresh sandbox, a proxy
session, the unmodified harness, a trial row whose segments are exactly what the proxy captured,
with the outcome and the per-call records filled in.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from rollout_support import import_one

from legorl.core import shards
from legorl.core.schemas import Kind, Outcome
from legorl.engines.embedded import EmbeddedEngine
from legorl.harnesses.install import RECIPES
from legorl.proxy.clients import InProcessProxy
from legorl.proxy.sessions import SessionCapture
from legorl.stages.rollout import RolloutConfig, rollout_stage

pytestmark = [pytest.mark.podman, pytest.mark.harness, pytest.mark.slow]


class RecordingProxy(InProcessProxy):
    """The real in-process proxy, keeping a copy of every capture it hands to the stage."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        self.captures: list[SessionCapture] = []

    def finish(self, session_id: str) -> SessionCapture:
        cap = super().finish(session_id)
        self.captures.append(cap)
        return cap


@pytest.fixture(scope="module")
def proxy(tiny_model: Path) -> Iterator[RecordingProxy]:
    engine = EmbeddedEngine(tiny_model, max_batch=4)
    with RecordingProxy(engine, str(tiny_model)) as handle:
        yield handle
    asyncio.run(engine.close())


@pytest.mark.parametrize("name", list(RECIPES))
def test_harness_trial_against_the_tiny_model(name: str, proxy: RecordingProxy, base_image: str,
                                              tmp_path: Path) -> None:
    run = tmp_path / "run"
    task = import_one(run, tmp_path)
    cfg = RolloutConfig(run=run, harnesses=[name], timeout_s=240, max_turns=2, max_tokens=8, retries=0)
    summary = rollout_stage(cfg, proxy)

    [row] = shards.read_rows(run / "rollouts", Kind.ROLLOUTS)
    detail = f"{name}: {row.outcome} {row.error}"
    assert (row.task_id, row.harness) == (task.instance_id, name)
    assert not row.infra_failure, detail
    assert row.outcome in set(Outcome) - {Outcome.INFRA_ERROR}, detail
    assert row.calls, detail  # the harness reached the model through its own session
    assert all(c.finish_reason for c in row.calls)
    # the row's segments are the proxy's capture, token for token, mask and logprobs included
    cap = proxy.captures[-1]
    assert row.segments and [s.to_dict() for s in row.segments] == [s.to_dict() for s in cap.segments]
    assert [c.to_dict() for c in row.calls] == [c.to_dict() for c in cap.calls]
    for seg in row.segments:
        assert len(seg.token_ids) == len(seg.loss_mask) == len(seg.logprobs)
        assert sum(seg.loss_mask) > 0  # sampled tokens are in it
    assert row.conversation(), detail
    t = row.timings
    assert t.sandbox_s and t.agent_s and t.model_s is not None and t.total_s
    assert t.total_s >= t.agent_s
    assert summary.as_dict()["ran"] == 1
