"""No work on zero signal (issue #13): trials whose advantage is 0 are neither scored nor trained, a
micro-batch of nothing else does not run, a step of nothing else makes no update and says so in
its metrics; the loss normalisers still count them, so the update is the one computed with them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from train_support import TrialSpec, make_run

from legorl.core import metric_keys as mk
from legorl.core import shards
from legorl.core.errors import ConfigError
from legorl.core.paths import INFO_FILE, Checkpoints, RunDir
from legorl.core.schemas import Kind
from legorl.stages import train as train_stage
from legorl.training.config import TrainConfig
from legorl.training.data import load_step


def _metrics(run: RunDir) -> dict[str, float]:
    return {r.key: r.value for r in shards.read_rows(run.metrics, Kind.METRICS) if r.harness is None}


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_a_step_whose_groups_all_have_zero_advantage_does_no_work(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    specs = [TrialSpec("t1", i, 1.0) for i in range(2)] + [TrialSpec("t2", i, 0.0) for i in range(3)]
    run = make_run(tmp_path / "run", tiny_model, specs, turns=(3, 2))
    nxt = make_run(tmp_path / "next", tiny_model, [TrialSpec("t3", i, float(i)) for i in range(2)], step=1,
                   turns=(3, 2))

    def no_model(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a model was loaded (and would have run) for a step with no signal")

    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", no_model)
    result = train_stage.run_train(run.root, tiny_model, None, TrainConfig(learning_rate=1e-3))
    assert result.skipped == mk.SKIP_ZERO_ADVANTAGE and result.updates == 0
    checkpoint = result.checkpoint
    assert Checkpoints(run.checkpoints).latest() == checkpoint
    assert (checkpoint / "model.safetensors").read_bytes() == (tiny_model / "model.safetensors").read_bytes()
    assert (checkpoint / "tokenizer.json").exists() and (checkpoint / "config.json").exists()
    info = json.loads((checkpoint / INFO_FILE).read_text())
    assert info["skipped"] == mk.SKIP_ZERO_ADVANTAGE and info["updates"] == 0

    m = _metrics(run)
    assert m[mk.SKIPPED] == 1.0 and m[mk.SKIPPED_BECAUSE + mk.SKIP_ZERO_ADVANTAGE] == 1.0
    assert m[mk.UPDATES] == 0.0 and m[mk.TRIALS_SKIPPED] == 5 and m[mk.ZERO_VARIANCE_SHARE] == 1.0
    assert m[mk.REWARD_MEAN] == pytest.approx(0.4)
    assert mk.LOSS not in m  # nothing ran

    again = train_stage.run_train(run.root, tiny_model, None, TrainConfig(), resume=True)
    assert again.already_done and again.skipped == mk.SKIP_ZERO_ADVANTAGE
    assert shards.read(run.metrics, Kind.METRICS).duplicates == 0

    # the next step continues from the skipped step's checkpoint as from any other
    for name in ("rollouts", "grades"):
        for part in (nxt.root / name).iterdir():
            (run.root / name / part.name).write_bytes(part.read_bytes())
    monkeypatch.undo()
    trained = train_stage.run_train(run.root, tiny_model, 1, TrainConfig(learning_rate=1e-3), resume=True)
    assert trained.skipped is None and trained.started_from == str(checkpoint) and trained.updates == 1


_BUILD = train_stage._build_trainer


class _Forwards:
    """Counts the forwards of a trainer's model backbone and the tokens they ran."""

    def __init__(self) -> None:
        self.calls = 0
        self.tokens = 0

    def hook(self, module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        self.calls += 1
        self.tokens += int(kwargs["input_ids"].numel())


def _train_counting(run: RunDir, model: Path, config: TrainConfig, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, _Forwards]:
    counter = _Forwards()

    def counting(*args: Any, **kwargs: Any) -> Any:
        trainer = _BUILD(*args, **kwargs)
        trainer.model.base_model.register_forward_hook(counter.hook, with_kwargs=True)
        return trainer

    monkeypatch.setattr(train_stage, "_build_trainer", counting)
    return train_stage.run_train(run.root, model, None, config), counter


def test_a_mixed_batch_runs_only_its_informative_trials_for_the_same_update(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # t1/2 scores the group's mean (advantage 0), t2 is a group of equal rewards: 3 of 5 trials skip
    specs = [TrialSpec("t1", i, r) for i, r in enumerate([1.0, 0.0, 0.5])] + [TrialSpec("t2", i, 0.0) for i in range(2)]
    runs = {skip: make_run(tmp_path / f"skip-{skip}", tiny_model, specs, turns=(3, 2)) for skip in (True, False)}
    data = load_step(runs[True])
    lengths = {s.trial_id: len(s) for s in data.sequences}
    informative = [t.trial_id for t in data.trials[:2]]
    results, counts = {}, {}
    for skip, run in runs.items():
        # three micro-batches for two informative trials: with skipping one of them is empty
        config = TrainConfig(learning_rate=1e-4, micro_batches=3, skip_zero_advantage=skip)
        results[skip], counts[skip] = _train_counting(run, tiny_model, config, monkeypatch)

    on, off = counts[True], counts[False]
    # one training forward per micro-batch that has work (its old logprobs come from it: one iteration)
    assert on.calls == 2 and on.tokens == sum(lengths[t] for t in informative)
    assert off.calls == 3 and off.tokens == sum(lengths.values())

    m = _metrics(runs[True])
    assert m[mk.SKIPPED] == 0.0 and m[mk.TRIALS_SKIPPED] == 3 and m[mk.UPDATES] == 1
    assert mk.TRIALS_SKIPPED not in _metrics(runs[False])
    # the zero-advantage trials still count in the normalisers: the same update either way (Adam moves
    # every weight by about the learning rate, so a wrong normaliser would be far off; float noise in
    # gradients near Adam's eps stays well under the tolerance)
    a, b, init = (_weights(results[True].checkpoint), _weights(results[False].checkpoint), _weights(tiny_model))
    assert max(float((a[k] - init[k]).abs().max()) for k in a) > 5e-5
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("loss", ["grpo", "dapo", "dr_grpo"])
def test_skipping_keeps_each_losses_gradient(tiny_model: Path, tmp_path: Path, loss: str) -> None:
    specs = [TrialSpec("t1", i, r) for i, r in enumerate([1.0, 0.0, 0.5])] + [TrialSpec("t2", i, 1.0) for i in range(2)]
    run = make_run(tmp_path / "run", tiny_model, specs, turns=(3, 2))
    grads = []
    for skip in (True, False):
        config = TrainConfig(loss=loss, learning_rate=1e-3, micro_batches=2, skip_zero_advantage=skip)  # type: ignore[arg-type]
        data = load_step(run)
        train_stage.prepare(data, config)
        batches = train_stage.make_batches(data, None, seed=0)
        trainer = train_stage._build_trainer(tiny_model, tmp_path / f"out-{skip}", data, batches, config, None, [])
        trainer.current_gradient_accumulation_steps = trainer.steps_per_generation
        rows = [{"seq": i} for i in batches[0]]
        for _ in range(trainer.steps_per_generation):
            trainer.training_step(trainer.model, rows)
        grads.append({n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for name, grad in grads[1].items():
        assert float((grads[0][name] - grad).abs().max()) <= 1e-4 * (float(grad.abs().max()) + 1e-12), name


def test_cli_turns_skipping_off_and_a_kl_penalty_is_refused() -> None:
    from legorl.cli.options import ConfigOptions
    from legorl.training.options import TRAIN_CLI_FIELDS, TrainOptions

    options = ConfigOptions(TrainOptions, only=TRAIN_CLI_FIELDS)
    field = next(f for f in options.fields() if f.name == "skip_zero_advantage")
    assert field.default is True
    assert TrainConfig(skip_zero_advantage=False).skip_zero_advantage is False
    with pytest.raises(ConfigError, match="computes no reference logprobs"):
        TrainConfig(beta=0.04)
