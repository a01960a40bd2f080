"""The off-policy corrections besides truncated IS (issue #27): masked IS (IcePop's token mask), the
sequence and geometric-mean masks, truncation at the geometric level; their figures and bad values.

Each weight is checked against a reference written here with plain Python loops over the ratios,
then through the real trainer on the tiny model: the loss and every parameter's gradient equal an
independent computation from a plain forward in which masked tokens weigh 0, and the advantages the
trainer hands TRL are exactly 0 on the masked tokens (so they carry no gradient).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from train_support import TWO_GROUPS_ONE_FORK as SPECS
from train_support import first_batch_trainer, run_fixture, token_logps

from legorl.core import metric_keys as mk
from legorl.core import shards
from legorl.core.errors import ConfigError
from legorl.core.paths import RunDir
from legorl.core.schemas import Kind, trial_key
from legorl.training.config import TrainConfig
from legorl.training.importance import importance_weights, value_tokens, weight_stats, weight_stats_by_lag

# Three rows of sampled tokens (mask 1) of different lengths, their log ratios log pi_old - log mu.
MASK = [[0, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 0]]
LOG_RATIOS = [[9.0, 0.1, -0.9, 0.5, 1.2, -0.2], [0.05, -0.02, 0.01, 7.0, 7.0, 7.0], [0.0, 0.0, 0.3, -0.4, 0.2, 5.0]]


def _tensors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rollout = torch.full((3, 6), -2.0, dtype=torch.float64)
    return rollout + torch.tensor(LOG_RATIOS, dtype=torch.float64), rollout, torch.tensor(MASK, dtype=torch.float64)


def _reference(level: str, mode: str, cap: float, lower: float) -> list[list[float]]:
    """Per position, the weight the docs' formulas give (1 where nothing is sampled), by hand."""
    out = []
    for row_mask, row_log in zip(MASK, LOG_RATIOS, strict=True):
        sampled = [lr for m, lr in zip(row_mask, row_log, strict=True) if m]
        if level == "sequence":
            seg = math.exp(sum(sampled))
        elif level == "geometric":
            seg = math.exp(sum(sampled) / len(sampled))
        row = []
        for m, lr in zip(row_mask, row_log, strict=True):
            rho = math.exp(lr) if level == "token" else seg
            if not m:
                row.append(1.0)
            elif mode == "truncate":
                row.append(min(rho, cap))
            else:
                row.append(rho if lower <= rho <= cap else 0.0)
        out.append(row)
    return out


@pytest.mark.parametrize(("level", "mode", "cap", "lower"), [
    ("token", "mask", 2.0, None),  # IcePop with [1/2, 2]
    ("token", "mask", 5.0, 0.5),  # IcePop's own [alpha, beta] = [0.5, 5]
    ("sequence", "mask", 2.0, None),
    ("geometric", "mask", 1.1, None),  # row 0's geometric mean e^0.14 is above the cap
    ("geometric", "mask", 1.3, 1.02),  # row 1's e^(0.04/3) is below the floor
    ("geometric", "truncate", 1.1, None),
])
def test_weights_equal_the_formulas_computed_by_hand(level: str, mode: str, cap: float, lower: float | None) -> None:
    floor = lower if lower is not None else 1 / cap
    weights, values, raw = importance_weights(*_tensors(), level, cap, mode, lower)
    expected = _reference(level, mode, cap, floor)
    np.testing.assert_allclose(weights.numpy(), expected, rtol=1e-12)

    # the figures: one value per token (token level) or per segment, from the same hand computation
    per_value = ([w for row, m in zip(expected, MASK, strict=True) for w, s in zip(row, m, strict=True) if s]
                 if level == "token" else [next(w for w, s in zip(row, m, strict=True) if s)
                                           for row, m in zip(expected, MASK, strict=True)])
    counts = [1] * len(per_value) if level == "token" else [sum(m) for m in MASK]
    np.testing.assert_allclose(values.numpy(), per_value, rtol=1e-12)
    assert value_tokens(torch.tensor(MASK), level).tolist() == counts
    stats = weight_stats(values, raw, cap, mode, lower, value_tokens(torch.tensor(MASK), level))
    zero = [w == 0.0 for w in per_value]
    assert stats.mean == pytest.approx(statistics.fmean(per_value))
    assert (stats.min, stats.max) == pytest.approx((min(per_value), max(per_value)))
    squares = sum(w * w for w in per_value)
    assert stats.ess == pytest.approx(sum(per_value) ** 2 / (len(per_value) * squares) if squares else 0.0)
    if mode == "mask":
        assert stats.truncated == 0.0
        assert stats.masked == pytest.approx(sum(zero) / len(zero))
        assert stats.masked_tokens == pytest.approx(sum(c for c, z in zip(counts, zero, strict=True) if z) / sum(counts))
        assert 0 < sum(zero) < len(zero)  # the case tells masked from kept
        assert {mk.IS_MASKED_FRAC, mk.IS_MASKED_TOKEN_FRAC} <= set(stats.as_dict())
    else:
        rhos = [math.exp(sum(lr for lr, s in zip(row, m, strict=True) if s) / sum(m))
                for row, m in zip(LOG_RATIOS, MASK, strict=True)]
        assert stats.truncated == pytest.approx(sum(r > cap for r in rhos) / 3) and stats.masked is None
        assert mk.IS_MASKED_FRAC not in stats.as_dict()


def test_masked_share_per_staleness_level() -> None:
    # token level, IcePop [1/2, 2]: row 0's tokens at version 4 (lag 1) hold ratios e^.1, e^-.9, e^.5, e^1.2,
    # e^-.2 (two outside); every other token at version 5 (lag 0), all inside
    versions = torch.tensor([[4] * 6, [5] * 6, [5] * 6])
    _, values, raw = importance_weights(*_tensors(), "token", 2.0, "mask")
    sampled = torch.tensor(MASK) > 0
    by_lag = weight_stats_by_lag(values, raw, versions[sampled].float(), 5, 2.0, "mask")
    assert by_lag[mk.IS_MASKED_FRAC_AT_LAG + "1"] == pytest.approx(2 / 5)
    assert by_lag[mk.IS_MASKED_FRAC_AT_LAG + "0"] == 0.0
    assert mk.IS_MASKED_FRAC_AT_LAG + "0" not in weight_stats_by_lag(values, raw, versions[sampled].float(), 5, 2.0)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"is_mode": "clip"}, "unknown --is-mode 'clip'"),
    ({"is_mode": "mask", "is_cap": 1.0}, "--is-cap must be > 1 with --is-mode mask"),
    ({"is_mode": "mask", "is_cap": 0.5}, "--is-cap must be > 1 with --is-mode mask"),
    ({"is_mode": "mask", "is_cap": 2.0, "is_lower": 3.0}, r"--is-lower must be in \(0, 1\]"),
    ({"is_mode": "mask", "is_cap": 2.0, "is_lower": 0.0}, r"--is-lower must be in \(0, 1\]"),
    ({"is_lower": 0.5}, "--is-lower 0.5 applies to --is-mode mask only"),
    ({"is_mode": "mask", "importance_sampling": "none"}, "--is-mode mask needs an importance sampling level"),
    ({"importance_sampling": "geo"}, "unknown importance sampling level 'geo'"),
    ({"is_cap": float("nan")}, "--is-cap must be > 0"),
])
def test_bad_values_are_config_errors_naming_the_option(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**kwargs)


def test_the_options_are_on_the_command_line() -> None:
    from typer.testing import CliRunner

    from legorl.cli.app import app

    runner = CliRunner()
    shown = runner.invoke(app, ["train", "--help"], env={"COLUMNS": "200"})
    assert shown.exit_code == 0 and "--is-mode" in shown.output and "--is-lower" in shown.output
    assert "geometric" in shown.output
    bad = runner.invoke(app, ["train", "--run", "x", "--model", "y", "--is-mode", "clip"])
    assert bad.exit_code == 2 and "--is-mode" in bad.output


# ------------------------------------------------------------------ through the real trainer

noisy_run = run_fixture(SPECS, logprob_noise=0.3)


def _kept(level: str, log_ratio: list[float], cap: float, lower: float) -> list[float]:
    """The mask-mode weight of each sampled token of one segment, by hand."""
    if level == "token":
        return [math.exp(x) if lower <= math.exp(x) <= cap else 0.0 for x in log_ratio]
    rho = math.exp(sum(log_ratio) / len(log_ratio))
    return [rho if lower <= rho <= cap else 0.0] * len(log_ratio)


@pytest.mark.parametrize(("loss", "level", "cap"), [("dapo", "token", 1.3), ("grpo", "geometric", 1.05)])
def test_the_trainer_gives_masked_tokens_no_gradient(
    noisy_run: RunDir, tiny_model: Path, tmp_path: Path, loss: str, level: str, cap: float
) -> None:
    eps = 0.05
    config = TrainConfig(loss=loss, importance_sampling=level, is_mode="mask", is_cap=cap,  # type: ignore[arg-type]
                         epsilon=eps)
    trainer, data, batch = first_batch_trainer(noisy_run, tiny_model, tmp_path / "out", config)
    trainer.current_gradient_accumulation_steps = 1
    model = trainer.model

    # The reference: the shards and a plain forward, not the trainer.
    raw = {row.trial_id: row for row in shards.read_rows(noisy_run.rollouts, Kind.ROLLOUTS)}
    rewards = {trial_key(s.task, s.harness, 0, s.sample): s.reward for s in SPECS}
    seqs = [data.sequences[i] for i in batch]
    segs = [raw[s.trial_id].segments[s.segment_index] for s in seqs]
    with torch.no_grad():
        old = [token_logps(model, list(s.token_ids)) for s in segs]
    weights: list[list[float]] = []  # per segment, per position: 0 where not sampled
    for s, lp_old in zip(segs, old, strict=True):
        at = [t for t, m in enumerate(s.loss_mask) if m]
        kept = _kept(level, [float(lp_old[t]) - s.logprobs[t] for t in at], cap, 1 / cap)
        row = [0.0] * len(s.token_ids)
        for t, w in zip(at, kept, strict=True):
            row[t] = w
        weights.append(row)
    masked = [w == 0.0 for s, row in zip(segs, weights, strict=True) for w, m in zip(row, s.loss_mask, strict=True)
              if m]
    assert 0 < sum(masked) < len(masked)  # some tokens masked, some kept: the case can tell

    scored = trainer._generate_and_score_completions([{"seq": i} for i in batch])
    cut = min(s.first_sampled for s in seqs)
    for row, (s, w) in enumerate(zip(seqs, weights, strict=True)):
        for t, m in enumerate(s.loss_mask):
            if m and s.advantage != 0:
                handed = float(scored["advantages"][row, t - cut])
                assert (handed == 0.0) == (w[t] == 0.0), (row, t)
    figures = trainer.recorder.summary()
    assert figures[mk.IS_MASKED_TOKEN_FRAC] == pytest.approx(sum(masked) / len(masked))
    assert figures[mk.IS_TRUNCATED_FRAC] == 0.0

    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    model.zero_grad()
    got = trainer._compute_loss(model, scored)
    got.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model.zero_grad()
    group_rewards: dict[str, list[float]] = {}
    for tid, r in rewards.items():
        group_rewards.setdefault(tid.split("/")[0], []).append(r)  # type: ignore[arg-type]
    sampled = {s.trial_id: 0.0 for s in seqs}
    for s, seg in zip(seqs, segs, strict=True):
        sampled[s.trial_id] += sum(seg.loss_mask)
    seq_losses, token_sum, token_count = [], torch.zeros((), dtype=torch.float64), 0.0
    for s, seg, lp_old, w in zip(seqs, segs, old, weights, strict=True):
        g = group_rewards[s.trial_id.split("/")[0]]
        advantage = (rewards[s.trial_id] - statistics.fmean(g)) / (statistics.stdev(g) + 1e-4)  # type: ignore[operator]
        m = torch.tensor(seg.loss_mask, dtype=torch.float64)
        n = float(m.sum())
        share = n / sampled[s.trial_id] if loss == "grpo" else 1.0  # a trial counts once (grpo)
        a = advantage * share * torch.tensor(w, dtype=torch.float64)
        ratio = torch.exp(token_logps(model, list(seg.token_ids)) - lp_old)
        per_token = -torch.minimum(ratio * a, torch.clamp(ratio, 1 - eps, 1 + eps) * a)
        seq_losses.append((per_token * m).sum() / n)
        token_sum = token_sum + (per_token * m).sum()
        token_count += n
    # the normalisers count the masked tokens too (IcePop's 1 / |y|)
    expected = sum(seq_losses) / len(sampled) if loss == "grpo" else token_sum / token_count
    assert got.item() == pytest.approx(expected.item(), abs=1e-5) and got.item() != 0.0
    expected.backward()
    assert grads.keys() == {n for n, p in model.named_parameters() if p.grad is not None} and len(grads) > 10
    for name, p in model.named_parameters():
        if name in grads:
            scale = float(p.grad.abs().max()) + 1e-12
            assert float((grads[name] - p.grad).abs().max()) / scale < 1e-3, name


def _one_update(run: RunDir, model: Path, out: Path, **options: Any) -> dict[str, float]:
    config = TrainConfig(learning_rate=1e-4, micro_batches=2, **options)
    trainer, _, batch = first_batch_trainer(run, model, out, config)
    trainer.current_gradient_accumulation_steps = trainer.steps_per_generation
    rows = [{"seq": i} for i in batch]
    for _ in range(trainer.steps_per_generation):
        trainer.training_step(trainer.model, rows)
    figures: dict[str, float] = trainer.recorder.summary()
    return figures


def test_the_figures_are_the_same_whether_old_logprobs_come_from_the_training_forward(
    noisy_run: RunDir, tiny_model: Path, tmp_path: Path
) -> None:
    options: dict[str, Any] = {"importance_sampling": "geometric", "is_mode": "mask", "is_cap": 1.05}
    separate = _one_update(noisy_run, tiny_model, tmp_path / "a", score_in_training_forward=False, **options)
    fused = _one_update(noisy_run, tiny_model, tmp_path / "b", **options)
    for key in (mk.IS_MASKED_FRAC, mk.IS_MASKED_TOKEN_FRAC, mk.IS_WEIGHT_MEAN, mk.IS_ESS):
        assert fused[key] == pytest.approx(separate[key], rel=1e-5, abs=1e-7), key
    assert 0 < separate[mk.IS_MASKED_FRAC] < 1
