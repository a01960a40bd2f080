"""The training stage on shards sampled from a real tiny model: loss, infrastructure failures, fidelity,
stage outputs, resume."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pytest
import torch
from train_support import TWO_GROUPS_ONE_FORK as SPECS
from train_support import TrialSpec, first_batch_trainer, make_run, run_fixture, token_logps

from legorl.core import metric_keys as mk
from legorl.core import shards
from legorl.core.errors import LegorlError
from legorl.core.paths import Checkpoints, RunDir
from legorl.core.schemas import Kind
from legorl.stages.train import prepare, run_train
from legorl.training.config import TrainConfig
from legorl.training.data import load_step

# rollout logprobs perturbed (N(0, 0.3)) so importance weights vary and some hit the cap
noisy_run = run_fixture(SPECS, logprob_noise=0.3)
# rollout logprobs exactly as sampled by the model in fp32
exact_run = run_fixture(SPECS)


@pytest.mark.parametrize(
    ("loss", "level"), [("grpo", "token"), ("dapo", "sequence"), ("dr_grpo", "none"), ("gspo", "token")]
)
def test_loss_matches_independent_computation(
    noisy_run: RunDir, tiny_model: Path, tmp_path: Path, loss: str, level: str
) -> None:
    cap, eps = 1.3, 0.05
    config = TrainConfig(loss=loss, importance_sampling=level, is_cap=cap, epsilon=eps)  # type: ignore[arg-type]
    trainer, data, batch = first_batch_trainer(noisy_run, tiny_model, tmp_path / "out", config)
    trainer.current_gradient_accumulation_steps = 1
    model = trainer.model

    # Everything below the trainer's call comes from the shards and a plain forward, not from the trainer.
    raw = {row.trial_id: row for row in shards.read_rows(noisy_run.rollouts, Kind.ROLLOUTS)}
    rewards = {spec_key(s): s.reward for s in SPECS}
    segs = [raw[data.sequences[i].trial_id].segments[data.sequences[i].segment_index] for i in batch]
    trial_of = [data.sequences[i].trial_id for i in batch]
    with torch.no_grad():
        old = [token_logps(model, s.token_ids) for s in segs]

    scored = trainer._generate_and_score_completions([{"seq": i} for i in batch])
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    got = float(trainer._compute_loss(model, scored).detach())

    with torch.no_grad():
        new = [token_logps(model, s.token_ids) for s in segs]
    group_rewards: dict[str, list[float]] = {}
    for tid, r in rewards.items():
        group_rewards.setdefault(tid.split("/")[0], []).append(r)  # type: ignore[arg-type]
    scale_by_std = loss != "dr_grpo"

    def advantage(trial_id: str) -> float:
        g = group_rewards[trial_id.split("/")[0]]
        a = rewards[trial_id] - statistics.fmean(g)  # type: ignore[operator]
        return a / (statistics.stdev(g) + 1e-4) if scale_by_std else a

    sampled = {t: 0.0 for t in trial_of}
    for t, s in zip(trial_of, segs, strict=True):
        sampled[t] += sum(s.loss_mask)
    per_sequence = loss in ("grpo", "gspo")
    seq_losses, token_sum, token_count = [], 0.0, 0.0
    for t, s, lp_old, lp_new in zip(trial_of, segs, old, new, strict=True):
        m = torch.tensor(s.loss_mask, dtype=torch.float64)
        rollout = torch.tensor(s.logprobs, dtype=torch.float64)
        n = m.sum()
        # trial weighting: grpo/gspo -> each trial once (T_seg / T_trial); dapo/dr_grpo -> each token once (1)
        weight = float(n) / sampled[t] if per_sequence else 1.0
        if level == "token":
            w = torch.clamp(torch.exp((lp_old - rollout) * m), max=cap)
        elif level == "sequence":
            w = torch.clamp(torch.exp(((lp_old - rollout) * m).sum()), max=cap).expand_as(m)
        else:
            w = torch.ones_like(m)
        a = advantage(t) * weight * w
        if loss == "gspo":
            ratio = torch.exp(((lp_new - lp_old) * m).sum() / n).expand_as(m)
        else:
            ratio = torch.exp(lp_new - lp_old)
        per_token = -torch.minimum(ratio * a, torch.clamp(ratio, 1 - eps, 1 + eps) * a)
        seq_losses.append(float((per_token * m).sum() / n))
        token_sum += float((per_token * m).sum())
        token_count += float(n)
    if per_sequence:
        expected = sum(seq_losses) / len(sampled)  # a mean over trials (a forked trial counts once)
    elif loss == "dapo":
        expected = token_sum / token_count
    else:  # dr_grpo: constant normaliser B * max_length
        expected = token_sum / (len(segs) * max(len(s.token_ids) for s in segs))
    assert got == pytest.approx(expected, abs=1e-5)
    # the fixture makes the test meaningful: weights vary and some are truncated, clipping is active
    assert trainer.recorder.summary()[mk.IS_WEIGHT_MIN] < 1.0 or level == "none"
    if level == "token":
        assert trainer.recorder.summary()[mk.IS_TRUNCATED_FRAC] > 0


@pytest.mark.parametrize("loss", ["grpo", "dapo"])
def test_splitting_a_trial_into_segments_changes_nothing(
    noisy_run: RunDir, tiny_model: Path, tmp_path: Path, loss: str
) -> None:
    """The same sampled tokens as one segment or as a main segment plus a fork: same loss."""
    unsplit = make_run(tmp_path / "unsplit", tiny_model, [TrialSpec(s.task, s.sample, s.reward) for s in SPECS],
                       logprob_noise=0.3)
    losses = []
    for run in (noisy_run, unsplit):
        config = TrainConfig(loss=loss)  # type: ignore[arg-type]
        trainer, _, batch = first_batch_trainer(run, tiny_model, tmp_path / "out", config)
        trainer.current_gradient_accumulation_steps = 1
        scored = trainer._generate_and_score_completions([{"seq": i} for i in batch])
        losses.append(float(trainer._compute_loss(trainer.model, scored).detach()))
    assert len(load_step(noisy_run).sequences) == len(load_step(unsplit).sequences) + 1
    assert losses[0] == pytest.approx(losses[1], abs=1e-6)
    assert losses[0] != 0.0


def spec_key(spec: TrialSpec) -> str:
    from legorl.core.schemas import trial_key

    return trial_key(spec.task, spec.harness, 0, spec.sample)


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(checkpoint / "model.safetensors"))


def test_infra_failure_leaves_no_trace(tiny_model: Path, tmp_path: Path) -> None:
    """An infra failure (rollout side or grading side) neither changes its group's advantages nor the update."""
    clean = [TrialSpec("t1", i, r) for i, r in enumerate([1.0, 0.0, 0.0])]
    failing = [*clean, TrialSpec("t1", 3, None, infra_failure=True), TrialSpec("t1", 4, 0.0, grade_infra_error=True)]
    as_zero = [*clean, TrialSpec("t1", 3, 0.0)]
    runs = {name: make_run(tmp_path / name, tiny_model, specs)
            for name, specs in (("clean", clean), ("failing", failing), ("as_zero", as_zero))}
    config = TrainConfig(learning_rate=1e-3)

    advantages = {}
    for name, run in runs.items():
        data = load_step(run)
        prepare(data, config)
        advantages[name] = {t.trial_id: t.advantage for t in data.trials}
        if name == "failing":
            assert data.dropped == {"rollout_infra_failure": 1, "grade_infra_error": 1}
    assert advantages["failing"] == advantages["clean"]
    assert advantages["as_zero"] != advantages["clean"]  # scoring it as reward 0 would have moved the baseline

    ckpt = {name: run_train(run.root, tiny_model, None, config).checkpoint for name, run in runs.items()}
    w_clean, w_failing, w_zero, w_init = (_weights(ckpt["clean"]), _weights(ckpt["failing"]),
                                          _weights(ckpt["as_zero"]), _weights(tiny_model))
    assert all(torch.equal(w_clean[k], w_failing[k]) for k in w_clean)
    assert any(not torch.equal(w_clean[k], w_init[k]) for k in w_clean)  # the step did train
    assert any(not torch.equal(w_clean[k], w_zero[k]) for k in w_clean)


def _metrics(run: RunDir, step: int = 0) -> dict[tuple[str, str | None], float]:
    rows = shards.read_rows(run.metrics, Kind.METRICS)
    return {(r.key, r.harness): r.value for r in rows if r.step == step}


def test_fidelity_on_fp32_rollouts_and_stage_outputs(exact_run: RunDir, tiny_model: Path) -> None:
    result = run_train(exact_run.root, tiny_model, None, TrainConfig(learning_rate=1e-4))
    m = _metrics(exact_run)
    print(f"\nfp32 rollouts: pearson={m[mk.LOGPROB_PEARSON, None]:.7f} "
          f"mismatch_kl={m[mk.MISMATCH_KL, None]:.2e} max|d|={m[mk.LOGPROB_ABS_DIFF_MAX, None]:.2e}")
    assert m[mk.LOGPROB_PEARSON, None] >= 0.9999
    assert m[mk.MISMATCH_KL, None] < 1e-6
    assert m[mk.IS_ESS, None] == pytest.approx(1.0, abs=1e-5)
    for key in (mk.REWARD_MEAN, mk.SOLVE_RATE, mk.ZERO_VARIANCE_SHARE, mk.LOSS, mk.ENTROPY, mk.GRAD_NORM,
                mk.CLIP_FRACTION, mk.IS_WEIGHT_MEAN, mk.PERF_TOKENS_PER_S, mk.MISMATCH_KL_K1):
        assert (key, None) in m, key
    assert m[mk.REWARD_MEAN, None] == pytest.approx(sum(s.reward or 0 for s in SPECS) / len(SPECS))
    assert m[mk.TRIALS_COUNT, None] == len(SPECS)
    assert m[mk.SEGMENTS_COUNT, None] == len(SPECS) + 1
    ckpt = result.checkpoint
    assert ckpt == exact_run.checkpoints / "step-0"
    assert Checkpoints(exact_run.checkpoints).latest() == ckpt
    for name in ("config.json", "model.safetensors", "tokenizer.json", "optimizer.pt", "scheduler.pt",
                 "trainer_state.json", "legorl_train.json"):
        assert (ckpt / name).exists(), name
    assert not (exact_run.checkpoints / "step-0.partial").exists()
    with pytest.raises(LegorlError, match="trained already"):
        run_train(exact_run.root, tiny_model, 0, TrainConfig())
    assert run_train(exact_run.root, tiny_model, 0, TrainConfig(), resume=True).already_done


def test_per_harness_metrics(tiny_model: Path, tmp_path: Path) -> None:
    specs = [TrialSpec("t1", i, r, harness="mini") for i, r in enumerate([1.0, 0.0])]
    specs += [TrialSpec("t1", 2 + i, r, harness="openhands") for i, r in enumerate([1.0, 1.0])]
    run = make_run(tmp_path / "run", tiny_model, specs)
    run_train(run.root, tiny_model, None, TrainConfig())
    m = _metrics(run)
    assert m[mk.REWARD_MEAN, "mini"] == 0.5
    assert m[mk.REWARD_MEAN, "openhands"] == 1.0
    assert (mk.LOGPROB_PEARSON, "openhands") in m
    assert (mk.LOGPROB_PEARSON, None) in m


def test_resume_continues_exactly(tiny_model: Path, tmp_path: Path) -> None:
    from transformers import TrainerCallback

    class StopAfterFirstUpdate(TrainerCallback):  # stands in for a killed process
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                control.should_training_stop = True
            return control

    config = TrainConfig(learning_rate=1e-3, groups_per_batch=1)  # 2 groups -> 2 updates
    ref = make_run(tmp_path / "ref", tiny_model, SPECS)
    cut = make_run(tmp_path / "cut", tiny_model, SPECS)
    full = run_train(ref.root, tiny_model, None, config)
    assert full.updates == 2
    with pytest.raises(LegorlError, match="stopped after 1 of 2"):
        run_train(cut.root, tiny_model, None, config, callbacks=[StopAfterFirstUpdate()])
    assert list((cut.checkpoints / "step-0.partial").glob("checkpoint-1"))
    resumed = run_train(cut.root, tiny_model, None, config, resume=True)
    a, b = _weights(full.checkpoint), _weights(resumed.checkpoint)
    assert all(torch.equal(a[k], b[k]) for k in a)

    # The next step starts from `latest` and carries the optimizer: Adam's step count keeps growing.
    make_run(tmp_path / "cut2", tiny_model, SPECS, step=1)
    step1 = tmp_path / "cut2"
    for part in (step1 / "rollouts").iterdir():
        (cut.rollouts / part.name).write_bytes(part.read_bytes())
    for part in (step1 / "grades").iterdir():
        (cut.grades / part.name).write_bytes(part.read_bytes())
    nxt = run_train(cut.root, tiny_model, 1, config, resume=True)
    assert nxt.started_from == str(resumed.checkpoint)
    state = torch.load(nxt.checkpoint / "optimizer.pt", weights_only=False)["state"]
    assert {int(s["step"]) for s in state.values()} == {4}
    assert math.isfinite(nxt.metrics[mk.LOSS])


def test_cli_train_json_and_one_line_errors(exact_run: RunDir, tiny_model: Path, tmp_path: Path) -> None:
    import json

    from typer.testing import CliRunner

    from legorl.cli.app import app

    runner = CliRunner()
    out = tmp_path / "ckpts"
    result = runner.invoke(app, ["train", "--run", str(exact_run.root), "--model", str(tiny_model), "--out", str(out),
                                 "--loss", "dapo", "--is", "sequence", "--is-cap", "3", "--lr", "1e-5", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["checkpoint"] == str(out / "step-0") and report["updates"] == 1
    assert (out / "latest").read_text().strip() == "step-0"
    bad = runner.invoke(app, ["train", "--run", str(tmp_path / "empty"), "--model", str(tiny_model)])
    assert bad.exit_code != 0
    assert isinstance(bad.exception, LegorlError) and "no rollouts" in str(bad.exception)
    bad = runner.invoke(app, ["train", "--run", str(exact_run.root), "--model", str(tiny_model), "--loss", "ppo"])
    assert bad.exit_code == 2 and "--loss" in bad.output and "'ppo' is not one of" in bad.output
    bad = runner.invoke(app, ["train", "--run", str(exact_run.root), "--model", str(tiny_model), "--is-cap", "0"])
    assert isinstance(bad.exception, LegorlError) and "--is-cap must be > 0" in str(bad.exception)


def test_a_steps_metrics_are_published_from_its_checkpoint_once(tmp_path: Path) -> None:
    """The metrics rows are committed inside the checkpoint and added to RUN/train/metrics once,
    whether the stage was killed before or after the commit (a rerun publishes what is missing)."""
    from legorl.core import shards
    from legorl.core.paths import Checkpoints
    from legorl.core.schemas import Kind, MetricRow
    from legorl.stages.train import publish_metrics

    checkpoint, metrics = tmp_path / "step-3", tmp_path / "metrics"
    rows = [MetricRow(step=3, key="loss", value=0.5), MetricRow(step=3, key="entropy", value=1.5)]
    shards.write(checkpoint / Checkpoints.METRICS_DIR, Kind.METRICS, rows)
    shards.write(metrics, Kind.METRICS, [MetricRow(step=2, key="loss", value=0.9)])
    for _ in range(3):  # the commit's publish, then two reruns finding the step trained
        publish_metrics(checkpoint, metrics, 3)
    dataset = shards.read(metrics, Kind.METRICS)
    assert dataset.duplicates == 0
    assert sorted((r["step"], r["key"]) for r in dataset.table.to_pylist()) == [(2, "loss"), (3, "entropy"), (3, "loss")]
    publish_metrics(tmp_path / "step-1-from-an-older-legorl", metrics, 1)  # nothing committed with it: no-op
    assert shards.read(metrics, Kind.METRICS).table.num_rows == 3
