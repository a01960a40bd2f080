"""Group advantages and trial weighting against their formulas (and TRL's own numbers)."""

from __future__ import annotations

import statistics

import numpy as np
import pytest
import torch

from legorl.training.advantages import EPS, group_advantages
from legorl.training.data import StepData, TrainSequence, Trial
from legorl.training.importance import importance_weights, weight_stats
from legorl.training.weighting import segment_scales


def test_grpo_group_normalisation_matches_formula_and_trl() -> None:
    from trl.trainer.utils import nanstd

    rewards = [1.0, 0.0, 0.0, 1.0, 0.2, 0.9, 0.4, 0.4]
    groups = ["a"] * 4 + ["b"] * 4
    adv, stats = group_advantages(rewards, groups, "group")
    for idx in (range(4), range(4, 8)):
        r = [rewards[i] for i in idx]
        for i in idx:
            assert adv[i] == pytest.approx((rewards[i] - statistics.fmean(r)) / (statistics.stdev(r) + EPS))
    # TRL's computation for fixed-size groups (grpo_trainer: mean/std per group, + 1e-4)
    t = torch.tensor(rewards).view(-1, 4)
    trl = ((t - t.mean(1, keepdim=True)) / (nanstd(t, dim=1).unsqueeze(1) + 1e-4)).view(-1)
    np.testing.assert_allclose(adv, trl.numpy(), rtol=1e-5, atol=1e-6)
    assert stats.groups == 2 and stats.zero_variance == 0


def test_dr_grpo_is_mean_only_and_batch_scaling() -> None:
    rewards, groups = [1.0, 0.0, 0.0, 0.5, 1.0], ["a", "a", "a", "b", "b"]
    adv, _ = group_advantages(rewards, groups, "none")
    np.testing.assert_allclose(adv, [2 / 3, -1 / 3, -1 / 3, -0.25, 0.25])
    batch, _ = group_advantages(rewards, groups, "batch")
    np.testing.assert_allclose(batch, adv / (statistics.stdev(rewards) + EPS))


def test_zero_variance_and_singleton_groups_carry_no_signal() -> None:
    adv, stats = group_advantages([1.0, 1.0, 0.0, 0.3, 1.0], ["a", "a", "b", "b", "c"], "group")
    assert adv[0] == adv[1] == 0.0
    assert adv[4] == 0.0  # alone in its group
    assert adv[2] < 0 < adv[3]
    assert (stats.groups, stats.zero_variance, stats.singletons) == (3, 2, 1)
    assert stats.zero_variance_share == pytest.approx(2 / 3)


def test_dropping_a_trial_only_changes_its_own_group() -> None:
    rewards, groups = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0], ["a", "a", "a", "b", "b", "b"]
    full, _ = group_advantages(rewards, groups)
    without, _ = group_advantages(rewards[:2] + rewards[3:], groups[:2] + groups[3:])
    np.testing.assert_array_equal(full[3:], without[2:])


def _data(segment_tokens: list[list[int]]) -> StepData:
    """Trials whose segments have the given numbers of sampled tokens."""
    data = StepData(step=0, trials=[], sequences=[])
    for t, lengths in enumerate(segment_tokens):
        trial = Trial(f"t{t}", "g", "h", 1.0, True)
        for n in lengths:
            mask = np.array([0] * 3 + [1] * n, dtype=np.float32)
            trial.sequences.append(len(data.sequences))
            data.sequences.append(TrainSequence(
                f"t{t}", "g", "h", 0, "main", np.zeros(len(mask), np.int64), mask, np.zeros(len(mask), np.float32),
                None, 1.0,
            ))
        data.trials.append(trial)
    return data


def test_trial_weighting_makes_segment_count_irrelevant() -> None:
    data = _data([[10], [4, 6], [30]])
    # grpo, trial weighting: segment factor T_seg / T_trial, so each trial's token weights sum to 1.
    scales = segment_scales(data, "grpo", "trial")
    assert scales == pytest.approx([1.0, 0.4, 0.6, 1.0])
    per_trial: dict[str, float] = {}
    for seq, s in zip(data.sequences, scales, strict=True):
        per_trial[seq.trial_id] = per_trial.get(seq.trial_id, 0.0) + s  # in units of one sequence
    assert per_trial == pytest.approx({"t0": 1.0, "t1": 1.0, "t2": 1.0})
    # dapo, token weighting: TRL's token-level loss as is.
    assert segment_scales(data, "dapo", "token") == pytest.approx([1.0] * 4)
    # dapo, trial weighting: 1/T_trial per token, scaled by the mean trial length (50/3).
    assert segment_scales(data, "dapo", "trial") == pytest.approx([50 / 30, 50 / 30, 50 / 30, 50 / 90])


def test_importance_weights_token_sequence_none() -> None:
    old = torch.tensor([[-1.0, -2.0, -0.5, 0.0]])
    rollout = torch.tensor([[-1.5, -1.0, -0.5, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w, values, raw = importance_weights(old, rollout, mask, "token", cap=1.5)
    stats = weight_stats(values, raw, cap=1.5)
    np.testing.assert_allclose(w[0].numpy(), [1.5, np.exp(-1.0), 1.0, 1.0], rtol=1e-6)
    assert stats.truncated == pytest.approx(1 / 3)
    v = np.array([1.5, np.exp(-1.0), 1.0])
    assert stats.ess == pytest.approx(v.sum() ** 2 / (3 * (v**2).sum()), rel=1e-6)
    w, _, _ = importance_weights(old, rollout, mask, "sequence", cap=1.5)
    np.testing.assert_allclose(w[0].numpy(), [np.exp(-0.5)] * 3 + [1.0], rtol=1e-6)
    w, _, _ = importance_weights(old, rollout, mask, "none", cap=1.5)
    assert torch.equal(w, torch.ones_like(w))
