"""The training stage refuses rollouts it cannot train on honestly (issue #12): a sampled token
whose rollout logprob is not finite (NaN, inf) stops the step with an error naming the trial."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from train_support import TrialSpec, make_run

from legorl.core import shards
from legorl.core.errors import LegorlError
from legorl.core.paths import RunDir
from legorl.core.schemas import Kind
from legorl.stages.train import run_train
from legorl.training.config import TrainConfig
from legorl.training.data import load_step


def _corrupt(src: RunDir, dst: Path, value: float, masked: bool) -> RunDir:
    """A copy of ``src`` whose first trial has ``value`` as the logprob of one sampled (or prompt) token."""
    run = RunDir.at(dst)
    rows = shards.read_rows(src.rollouts, Kind.ROLLOUTS)
    seg = rows[0].segments[0]
    pos = seg.loss_mask.index(1) if masked else seg.loss_mask.index(0)
    seg.logprobs[pos] = value
    shards.write(run.rollouts, Kind.ROLLOUTS, rows)
    shards.write(run.grades, Kind.GRADES, shards.read_rows(src.grades, Kind.GRADES))
    return run


@pytest.fixture(scope="module")
def clean_run(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> RunDir:
    specs = [TrialSpec("t1", i, r) for i, r in enumerate([1.0, 0.0])]
    return make_run(tmp_path_factory.mktemp("clean") / "run", tiny_model, specs, turns=(3, 2))


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_rollout_logprob_on_a_sampled_token_refuses_the_step(
    clean_run: RunDir, tiny_model: Path, tmp_path: Path, value: float
) -> None:
    run = _corrupt(clean_run, tmp_path / "run", value, masked=True)
    trial = shards.read_rows(run.rollouts, Kind.ROLLOUTS)[0].trial_id
    with pytest.raises(LegorlError, match=rf"trial {trial} segment 0: 1 sampled token\(s\) have non-finite"):
        load_step(run)
    with pytest.raises(LegorlError, match="non-finite rollout logprobs"):
        run_train(run.root, tiny_model, None, TrainConfig())


def test_a_non_finite_value_outside_the_loss_mask_is_ignored(clean_run: RunDir, tmp_path: Path) -> None:
    run = _corrupt(clean_run, tmp_path / "run", math.nan, masked=False)
    assert len(load_step(run).sequences) == 2
