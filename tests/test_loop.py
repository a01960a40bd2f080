"""`legorl loop`: rollout → grade → train → reload, with the reloaded policy really sampling."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from legorl.core import metric_keys as mk
from legorl.core import shards
from legorl.core.schemas import Kind

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "examples" / "tasks" / "tasks.parquet"
VERIFIERS = {**os.environ, "PYTHONPATH": str(ROOT / "examples" / "verifiers")}  # the example reward plug-in


def legorl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "legorl.cli", *args], capture_output=True, text=True, timeout=900,
                          env=VERIFIERS)


def sampled_logprobs(model_dir: Path, segment) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([segment.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float()
    recomputed = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
    mask = torch.tensor(segment.loss_mask[1:], dtype=torch.bool)
    return recomputed[mask], torch.tensor(segment.logprobs[1:])[mask]


@pytest.mark.podman
@pytest.mark.slow
def test_loop_trains_and_the_next_step_samples_from_the_new_checkpoint(
    tiny_model: Path, base_image: str, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    assert legorl("tasks", "import", str(TASKS), "--run", str(run)).returncode == 0
    args = ["loop", "--run", str(run), "--model", str(tiny_model), "--harness", "simple", "--steps", "2",
            "--samples", "2", "--limit", "1", "--max-turns", "2", "--max-tokens", "12", "--timeout", "120",
            "--lr", "1e-2", "--grade-verifier", "concise:verify", "--json"]
    result = legorl(*args)
    assert result.returncode == 0, result.stderr[-2000:]
    history = json.loads(result.stdout)["steps"]
    assert [h["step"] for h in history] == [0, 1] and all(h["new_trials"] == 2 for h in history)

    trials = shards.read_rows(run / "rollouts", Kind.ROLLOUTS)
    assert sorted(t.step for t in trials) == [0, 0, 1, 1]
    grades = shards.read_rows(run / "grades", Kind.GRADES)
    assert {g.trial_id for g in grades} == {t.trial_id for t in trials}
    for g in grades:  # the reward plug-in gave every reward the hidden tests judged, and no other
        judged = g.status == "graded"
        assert (g.verifier, g.tests_reward is not None) == (("concise:verify", True) if judged else (None, False))
    metric_steps = set(shards.read(run / "train" / "metrics", Kind.METRICS).table.column("step").to_pylist())
    assert metric_steps == {0, 1}
    checkpoints = run / "train" / "checkpoints"
    assert (checkpoints / "step-0" / "config.json").exists() and (checkpoints / "step-1" / "config.json").exists()

    # Step 1 was sampled by the step-0 checkpoint, not by the initial model.
    segment = next(s for t in trials if t.step == 1 for s in t.segments if sum(s.loss_mask) > 1)
    new, captured = sampled_logprobs(checkpoints / "step-0", segment)
    assert torch.allclose(new, captured, atol=1e-4)
    old, _ = sampled_logprobs(tiny_model, segment)
    if torch.allclose(old, captured, atol=1e-3):
        # Only possible when step 0 had no signal to learn from: every group's rewards were equal
        # (the random tiny model rarely edits anything), so every advantage was 0.
        metrics = shards.read_rows(run / "train" / "metrics", Kind.METRICS)
        assert [m.value for m in metrics if m.step == 0 and m.key == mk.ZERO_VARIANCE_SHARE] == [1.0]

    # A rerun resumes: nothing left to roll out or grade.
    again = json.loads(legorl(*args).stdout)["steps"]
    assert all(h["new_trials"] == 0 and h["new_grades"] == 0 for h in again)


@pytest.mark.heavy
def test_loop_refuses_a_verifier_it_cannot_import_before_any_rollout(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert legorl("tasks", "import", str(TASKS), "--run", str(run), "--limit", "1").returncode == 0
    result = legorl("loop", "--run", str(run), "--model", str(tmp_path), "--harness", "simple", "--steps", "1",
                    "--grade-verifier", "concise:no_such_function")
    assert result.returncode == 1
    assert "verifier 'concise:no_such_function': concise has no attribute 'no_such_function'" in result.stdout + result.stderr
    assert not (run / "rollouts").exists()
