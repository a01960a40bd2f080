"""With num_iterations = 1 the old logprobs come from each micro-batch's own training forward
(score_in_training_forward, issue #17): the same loss, gradients and health figures as a separate
no-grad scoring pass, one forward fewer per generation batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from train_support import TrialSpec, first_batch_trainer, run_fixture

from legorl.core import metric_keys as mk
from legorl.core.paths import RunDir
from legorl.stages.train import _build_trainer, prepare
from legorl.training.batching import make_batches
from legorl.training.config import TrainConfig
from legorl.training.data import load_step

SPECS = [
    TrialSpec("t1", 0, 1.0, segments=2),
    TrialSpec("t1", 1, 0.0),
    TrialSpec("t1", 2, 0.5, harness="openhands"),
    TrialSpec("t2", 0, 0.0, harness="openhands"),
    TrialSpec("t2", 1, 1.0),
    TrialSpec("t2", 2, 1.0),
]
noisy_run = run_fixture(SPECS, logprob_noise=0.3)


def _one_update(run: RunDir, model: Path, out: Path, **options: Any) -> dict[str, Any]:
    config = TrainConfig(learning_rate=1e-4, micro_batches=2, is_cap=1.5, **options)
    trainer, _, batch = first_batch_trainer(run, model, out, config)
    forwards = [0]
    trainer.model.base_model.register_forward_hook(lambda *args: forwards.__setitem__(0, forwards[0] + 1))
    trainer.current_gradient_accumulation_steps = trainer.steps_per_generation
    rows = [{"seq": i} for i in batch]
    losses = [float(trainer.training_step(trainer.model, rows)) for _ in range(trainer.steps_per_generation)]
    return {
        "in_forward": trainer.scores_in_training_forward,
        "forwards": forwards[0],
        "loss": sum(losses),
        "grads": {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None},
        "figures": trainer.recorder.summary(),
        "entropy": sum(trainer._metrics["train"]["entropy"]),
    }


@pytest.mark.parametrize(("loss", "level"), [("grpo", "token"), ("dapo", "sequence"), ("gspo", "token")])
def test_old_logprobs_from_the_training_forward_equal_a_separate_pass(
    noisy_run: RunDir, tiny_model: Path, tmp_path: Path, loss: str, level: str
) -> None:
    options = {"loss": loss, "importance_sampling": level}
    separate = _one_update(noisy_run, tiny_model, tmp_path / "a", score_in_training_forward=False, **options)
    fused = _one_update(noisy_run, tiny_model, tmp_path / "b", **options)
    assert fused["in_forward"] and not separate["in_forward"]
    assert (separate["forwards"], fused["forwards"]) == (1 + 2, 2)  # the scoring pass is gone
    assert fused["loss"] == pytest.approx(separate["loss"], rel=1e-5, abs=1e-7) and fused["loss"] != 0.0
    assert fused["entropy"] == pytest.approx(separate["entropy"], rel=1e-6)
    assert fused["grads"].keys() == separate["grads"].keys() and len(fused["grads"]) > 10
    for name, grad in separate["grads"].items():
        scale = float(grad.abs().max()) + 1e-12
        assert float((fused["grads"][name] - grad).abs().max()) / scale < 1e-4, name
    a, b = separate["figures"], fused["figures"]
    assert a.keys() == b.keys()
    for key in (mk.LOGPROB_PEARSON, mk.MISMATCH_KL, mk.IS_WEIGHT_MEAN, mk.IS_WEIGHT_MIN, mk.IS_ESS,
                mk.IS_TRUNCATED_FRAC, f"{mk.MISMATCH_KL}@openhands", mk.BATCH_SEQUENCES):
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    assert a[mk.IS_TRUNCATED_FRAC] > 0 or level == "sequence"


def test_more_iterations_keep_the_separate_pass(noisy_run: RunDir, tiny_model: Path, tmp_path: Path) -> None:
    config = TrainConfig(num_iterations=2)
    data = load_step(noisy_run)
    prepare(data, config)
    trainer = _build_trainer(tiny_model, tmp_path / "a", data, make_batches(data, None, seed=0), config, None, [])
    assert not trainer.scores_in_training_forward
