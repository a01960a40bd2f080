"""Stored segments as TRL's inputs, and the importance weights folded into per-token advantages."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from legorl.training.batching import BatchTotals, pad
from legorl.training.config import TrainConfig
from legorl.training.data import TrainSequence
from legorl.training.importance import importance_weights
from legorl.training.scoring import (
    FROM_FORWARD,
    NO_WORK,
    fold_weights,
    fork_keys,
    no_op,
    pieces,
    trial_advantages,
    trl_inputs,
)


def _seq(trial: str, n: int, first: int, advantage: float = 1.0, scale: float = 1.0) -> TrainSequence:
    mask = np.zeros(n, dtype=np.float32)
    mask[first:] = 1.0
    return TrainSequence(
        trial_id=trial, group_id="g", harness="h", segment_index=0, reason="final",
        token_ids=np.arange(1, n + 1, dtype=np.int64), loss_mask=mask,
        logprobs=np.where(mask > 0, -1.0, 0.0).astype(np.float32), routed_experts=None, reward=1.0,
        advantage=advantage, scale=scale,
    )


def test_rows_of_one_trial_share_a_key_only_when_prefixes_are_shared() -> None:
    seqs = [_seq("a", 4, 1), _seq("b", 4, 1), _seq("a", 5, 2)]
    assert fork_keys(seqs, share_prefixes=True).tolist() == [0, 1, 0]
    assert fork_keys(seqs, share_prefixes=False).tolist() == [-1, -1, -1]


def test_trl_inputs_mark_the_sampled_tokens_and_count_the_batch() -> None:
    seqs = [_seq("a", 5, 2), _seq("b", 3, 1)]
    totals = BatchTotals.of(seqs)
    inputs = trl_inputs(pad(seqs, 0), fork_keys(seqs, True), totals, None, "cpu")
    assert inputs["prompt_ids"].shape == (2, 1) and inputs["completion_ids"].shape == (2, 4)
    assert inputs["tool_mask"].tolist() == [[0, 1, 1, 1], [1, 1, 0, 0]]
    assert inputs["completion_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert float(inputs["num_items_in_batch"]) == totals.sampled == 5
    assert "routed_experts" not in inputs


@pytest.mark.parametrize("loss", ["grpo", "dapo"])
def test_grpo_averages_over_trials_not_segments(loss: str) -> None:
    seqs = [_seq("a", 4, 1, advantage=1.0, scale=0.5), _seq("a", 4, 1, advantage=1.0, scale=0.5), _seq("b", 4, 1, -2.0)]
    got = trial_advantages(seqs, BatchTotals.of(seqs), TrainConfig(loss=loss), "cpu")  # type: ignore[arg-type]
    factor = 3 / 2 if loss == "grpo" else 1.0
    assert got.tolist() == pytest.approx([0.5 * factor, 0.5 * factor, -2.0 * factor])


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_fold_weights_is_the_advantage_times_the_capped_ratio(level: str) -> None:
    config = TrainConfig(importance_sampling=level, is_cap=1.5)  # type: ignore[arg-type]
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])  # the second row only pads its piece
    old = torch.tensor([[-1.0, -0.2, 0.0], [0.0, 0.0, 0.0]])
    rollout = torch.tensor([[-1.5, -0.4, 0.0], [0.0, 0.0, 0.0]])
    advantage = torch.tensor([2.0, 0.0])
    versions = torch.tensor([[3, 4, -1], [-1, -1, -1]])
    harness = torch.tensor([1.0, 0.0])
    got, values = fold_weights(old, rollout, mask, advantage, versions, harness, config)
    weights, _, _ = importance_weights(old, rollout, mask, level, 1.5)
    assert torch.equal(got, advantage[:, None] * weights)
    assert float(got[0, 0]) == pytest.approx(2.0 * min(1.5, float(np.exp(0.5 + 0.2)) if level == "sequence"
                                                      else float(np.exp(0.5))))
    assert values["old"].tolist() == pytest.approx([-1.0, -0.2]) and values["harness"].tolist() == [1.0, 1.0]
    per_row = level == "sequence"
    assert values["weight"].numel() == 2  # two sampled tokens, or (segment level) two rows
    _, trained = fold_weights(old, rollout, mask, advantage, versions, harness, config, trained_rows_only=True)
    assert trained["weight"].numel() == (1 if per_row else 2)  # the padding row is left out of the figures
    assert trained["version"].tolist() == ([3.0] if per_row else [3.0, 4.0])


def test_a_no_op_piece_trains_nothing_and_says_whether_it_runs() -> None:
    seq = _seq("a", 6, 2)
    totals = BatchTotals.of([seq])
    for run in (True, False):
        piece = no_op(seq, totals, "cpu", routing=False, run=run)
        assert piece[NO_WORK] is (not run) and FROM_FORWARD not in piece
        assert float(piece["tool_mask"].sum()) == 0.0 and float(piece["advantages"].abs().sum()) == 0.0
        assert piece["prompt_ids"].tolist() == [[1]] and piece["completion_ids"].tolist() == [[2]]


def test_pieces_cut_a_process_share_pad_it_and_keep_each_row_weighing_the_same() -> None:
    seqs = [_seq("a", 5, 2), _seq("b", 4, 1), _seq("c", 6, 3)]
    totals = BatchTotals.of(seqs)
    scored = trl_inputs(pad(seqs, 0), fork_keys(seqs, True), totals, None, "cpu")
    scored["advantages"] = torch.ones_like(scored["tool_mask"])
    plan = [[[], []], [[0], [1, 2]]]  # micro-batch 0 empty everywhere; process 0 holds one row of micro-batch 1
    mine = pieces(scored, plan, 0, totals, seqs[0], "cpu", per_row_loss=True, routing=False)
    assert len(mine) == 2 and mine[0][NO_WORK] is True  # no process trains in it: it does not run
    assert mine[1]["prompt_ids"].shape[0] == 2  # padded to the other process's two rows
    assert float(mine[1]["tool_mask"][1].sum()) == 0.0  # the padding row trains nothing
    assert float(mine[1]["advantages"][0, -1]) == pytest.approx(2 * 2 * 2 / 3)  # height x chunks x ranks / rows
    theirs = pieces(scored, plan, 1, totals, seqs[0], "cpu", per_row_loss=False, routing=False)
    assert theirs[1]["prompt_ids"].shape[0] == 2 and float(theirs[1]["advantages"].max()) == 1.0
