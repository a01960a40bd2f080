"""The trainer's config: legorl's :class:`~legorl.training.options.TrainOptions` on top of TRL's ``GRPOConfig``.

:class:`TrainConfig` *is* the ``GRPOConfig`` the trainer runs with, so every TRL and Trainer
setting keeps its meaning, default and help; legorl's own fields, and the TRL fields whose default
or meaning it changes, are declared (and documented) once, in ``TrainOptions``.

The settings the segment trainer relies on are not options: ``__post_init__`` sets them whatever
was passed (:data:`FIXED_TRL_SETTINGS`, plus the few derived from legorl's fields).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import Enum
from typing import Any

import torch
from trl import GRPOConfig

from legorl.core.errors import ConfigError
from legorl.training.options import TrainOptions

# TRL / Trainer settings the segment trainer needs; __post_init__ sets them whatever was passed.
FIXED_TRL_SETTINGS: dict[str, Any] = {
    # TRL's per-prompt batch shape is unused (a batch is whole groups of any size, batching.py);
    # these two only pass its divisibility checks.
    "per_device_train_batch_size": 2,
    "num_generations": 2,
    # Derived by TRL from steps_per_generation; cleared so that dataclasses.replace (which passes
    # both back in) does not trip its "not both" check.
    "generation_batch_size": None,
    "num_train_epochs": 1,  # one pass over the step's generation batches (batching.py repeats them)
    "logging_steps": 1,  # every update is a metrics row
    "save_strategy": "steps",  # with save_steps = num_iterations: at generation-batch boundaries
    "save_total_limit": 1,
    "remove_unused_columns": False,  # the dataset is one column of sequence indices
    "shuffle_dataset": False,  # the batch sampler orders the groups (seeded, batching.py)
    "disable_dropout": True,  # the recomputed old logprobs must be the ones the loss sees
    "dataloader_num_workers": 0,
    "log_completions": False,  # nothing is generated
    "disable_tqdm": True,  # stdout stays clean for --json
}

# TRL fields that shape the update: recorded with legorl's own in a checkpoint's info file.
_UPDATE_FIELDS: tuple[str, ...] = (
    "learning_rate", "lr_scheduler_type", "warmup_steps", "weight_decay", "max_grad_norm", "num_iterations",
    "epsilon", "epsilon_high", "beta", "scale_rewards", "loss_type", "importance_sampling_level",
    "max_completion_length", "temperature", "seed", "bf16", "gradient_checkpointing", "report_to",
)


@dataclass
class TrainConfig(TrainOptions, GRPOConfig):  # type: ignore[misc]  # legorl's types widen TRL's (None = per step)
    """One policy-gradient step's settings (``legorl train``), as the ``GRPOConfig`` TRL trains with:
    :class:`TrainOptions` (legorl's choices, which win over TRL's fields of the same name) plus
    every TRL and Trainer setting, plus :data:`FIXED_TRL_SETTINGS`."""

    def __post_init__(self) -> None:
        self.validate()
        if self.beta != 0.0:
            # TRL's KL term needs ref_per_token_logps, which the segment trainer never computes.
            raise ConfigError(
                f"beta = {self.beta}: a KL penalty to a reference model is not supported (legorl's trainer computes "
                "no reference logprobs); use beta = 0 and bound the update with epsilon / is_cap"
            )
        for name, value in FIXED_TRL_SETTINGS.items():
            setattr(self, name, value)
        self.gradient_accumulation_steps = self.steps_per_generation = self.micro_batches
        self.save_steps = self.num_iterations  # generation-batch boundaries: resuming there is exact
        self.loss_type, self.importance_sampling_level = self.trl_loss_type, self.trl_is_level
        self.use_cpu = self.use_cpu or not torch.cuda.is_available()
        if hasattr(self, "activation_checkpointing"):
            # transformers 5's new name for it, which wins over the old one (and warns when unset):
            # legorl's name is the one its callers set, also through dataclasses.replace.
            self.activation_checkpointing = self.gradient_checkpointing
        GRPOConfig.__post_init__(self)

    def to_dict(self) -> dict[str, Any]:
        """legorl's fields and the TRL fields that shape the update, JSON-safe: a checkpoint's record of
        its step's settings (and what TRL's reporters log as the run's hyperparameters), not
        ``TrainingArguments``' every field."""
        own = [f.name for f in fields(self) if f.name in _OWN_FIELDS]
        out = {name: getattr(self, name) for name in (*own, *_UPDATE_FIELDS)}
        out["reasons"] = [str(r) for r in self.reasons]
        out["report_to"] = list(self.report_to)
        return {k: v.value if isinstance(v, Enum) else v for k, v in out.items()}


# legorl's own fields: the ones TrainOptions declares that GRPOConfig does not have.
_OWN_FIELDS: frozenset[str] = frozenset(f.name for f in fields(TrainOptions)) - {f.name for f in fields(GRPOConfig)}
