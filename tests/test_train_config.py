"""TrainConfig is TRL's GRPOConfig: legorl's defaults, the fixed trainer settings, copies per step, the CLI fields."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import typer
from trl import GRPOConfig

from legorl.cli.options import ConfigOptions
from legorl.core.errors import ConfigError
from legorl.training.config import FIXED_TRL_SETTINGS, TrainConfig
from legorl.training.options import TRAIN_CLI_FIELDS, TrainOptions


def test_is_trls_config_with_legorls_defaults_and_fixed_settings() -> None:
    config = TrainConfig(
        loss="gspo", micro_batches=3, num_iterations=2,
        # fixed settings are not options: whatever is passed, the trainer's values win
        shuffle_dataset=True, logging_steps=50, per_device_train_batch_size=16,
    )
    assert isinstance(config, GRPOConfig)
    for name, value in FIXED_TRL_SETTINGS.items():
        if name != "generation_batch_size":  # TRL derives it (checked below)
            assert getattr(config, name) == value, name
    assert config.gradient_accumulation_steps == config.steps_per_generation == 3
    assert config.generation_batch_size == 2 * 3
    assert config.save_steps == 2  # generation-batch boundaries
    assert (config.loss_type, config.importance_sampling_level) == ("grpo", "sequence")
    default = TrainConfig()
    assert (default.seed, default.bf16, default.gradient_checkpointing, default.learning_rate) == (0, False, False, 1e-6)
    assert default.temperature is None and default.scale_rewards is None and default.max_completion_length is None
    assert default.lr_scheduler_type == "constant_with_warmup"
    assert (default.loss_type, default.importance_sampling_level) == ("grpo", "token")


def test_a_per_step_copy_rederives_and_keeps_legorls_names() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # no deprecated-name warning from our own fields
        config = TrainConfig(loss="dapo", gradient_checkpointing=True, temperature=0.7)
        step = dataclasses.replace(config, output_dir="/tmp/legorl-step", temperature=0.7, max_completion_length=9,
                                   micro_batches=2)
        again = dataclasses.replace(step, gradient_checkpointing=False)
    assert (step.output_dir, step.max_completion_length, step.steps_per_generation) == ("/tmp/legorl-step", 9, 2)
    assert step.gradient_checkpointing and getattr(step, "activation_checkpointing", True)
    assert not again.gradient_checkpointing and not getattr(again, "activation_checkpointing", False)
    assert step.loss_type == "dapo" and config.output_dir != step.output_dir
    with pytest.raises(ConfigError, match="--temperature must be a finite number"):
        dataclasses.replace(config, temperature=float("nan"))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"loss": "ppo"}, "unknown loss 'ppo'"),
    ({"importance_sampling": "word"}, "unknown importance sampling level 'word'"),
    ({"scale_rewards": "max"}, "unknown reward scaling 'max'"),
    ({"trial_weighting": "segment"}, "unknown trial weighting 'segment'"),
    ({"routing_replay": "maybe"}, "unknown routing replay 'maybe'"),
    ({"is_cap": 0.0}, "--is-cap must be > 0"),
    ({"micro_batches": 0}, "micro_batches must be >= 1"),
    ({"groups_per_batch": 0}, "groups_per_batch must be >= 1"),
    ({"learning_rate": 0.0}, "learning rate must be > 0"),
    ({"temperature": -1.0}, "--temperature must be a finite number >= 0"),
])
def test_invalid_values_are_one_line_config_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**kwargs)  # type: ignore[arg-type]


def test_to_dict_is_the_update_settings_json_safe() -> None:
    record = TrainConfig(loss="dr_grpo", report_to=["none"]).to_dict()
    assert json.loads(json.dumps(record)) == record
    assert record["loss"] == "dr_grpo" and record["loss_type"] == "dr_grpo"
    assert record["lr_scheduler_type"] == "constant_with_warmup"
    assert record["reasons"] == ["main", "rewrite", "subagent"]
    assert {"is_cap", "micro_batches", "learning_rate", "num_iterations", "epsilon", "beta", "seed"} <= set(record)
    assert "output_dir" not in record and "per_device_train_batch_size" not in record


def test_cli_fields_are_documented_once_and_are_legorl_trains_options() -> None:
    from legorl.cli.app import app

    spec = ConfigOptions(TrainOptions, only=TRAIN_CLI_FIELDS)
    documented = {f.name: f for f in spec.fields()}
    assert set(documented) == set(TRAIN_CLI_FIELDS)
    assert all(f.metadata["help"].strip() for f in documented.values())
    assert spec.flags(documented["learning_rate"]) == ["--learning-rate", "--lr"]
    # TrainConfig's fields are TrainOptions' (help and default), not TRL's of the same name
    config_fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    for name, f in documented.items():
        assert config_fields[name].metadata is f.metadata, name
        if name != "report_to":  # Trainer normalises ["none"] to []
            assert getattr(TrainConfig(), name) == getattr(TrainOptions(), name), name

    command = typer.main.get_command(app).commands["train"]  # type: ignore[attr-defined]
    options = {p.opts[0]: p.default for p in command.params}
    own = {"--run", "--model", "--out", "--step", "--resume", "--json", "--config", "--print-config", "--print-format"}
    # a bool's first flag is "--x/--no-x"; click's first option name is "--x"
    assert set(options) - own == {spec.flags(f)[0].split("/")[0] for f in spec.fields()}
    assert spec.flags(documented["skip_zero_advantage"])[0] == "--skip-zero-advantage/--no-skip-zero-advantage"
    assert options["--learning-rate"] == 1e-6 and options["--loss"] == "grpo" and options["--report-to"] == "none"


@pytest.mark.heavy
def test_the_command_line_does_not_import_trl() -> None:
    import subprocess
    import sys

    code = "import sys, legorl.cli.app; print(sorted(m for m in ('trl', 'torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
