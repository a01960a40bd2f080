"""The training stage's options: TRL's ``GRPOConfig`` plus legorl's fields, each documented once.

:class:`TrainConfig` *is* the ``GRPOConfig`` the trainer runs with, so every TRL and Trainer
setting keeps its meaning, default and help. legorl adds its own fields (the loss by name, the
importance correction against the rollout policy, trial weighting, routing replay, segment
selection, micro-batching) and redeclares a TRL field only where its default or meaning differs;
each such help says why. ``TRAIN_CLI_FIELDS`` names the fields ``legorl train`` exposes (help
text: ``metadata["help"]``; option name: ``metadata["flag"]`` where it is not ``--field-name``).

The settings the segment trainer relies on are not options: ``__post_init__`` sets them whatever
was passed (:data:`FIXED_TRL_SETTINGS`, plus the few derived from legorl's fields).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, Literal

import torch
from transformers.trainer_utils import SchedulerType
from trl import GRPOConfig

from legorl.errors import ConfigError
from legorl.schemas import SegmentReason

LossName = Literal["grpo", "dr_grpo", "dapo", "gspo"]
ISLevel = Literal["token", "sequence", "none"]
RewardScale = Literal["group", "batch", "none"]
TrialWeighting = Literal["trial", "token"]
Replay = Literal["auto", "on", "off"]

LOSSES: tuple[str, ...] = ("grpo", "dr_grpo", "dapo", "gspo")
IS_LEVELS: tuple[str, ...] = ("token", "sequence", "none")

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
class TrainConfig(GRPOConfig):
    """One policy-gradient step's settings (``legorl train``), as the ``GRPOConfig`` TRL trains with."""

    # ------------------------------------------------------------------ legorl's own

    loss: LossName = field(default="grpo", metadata={"help": (
        "Policy loss, all TRL's own: grpo (per-sequence mean), dr_grpo (constant normaliser), dapo "
        "(token-level mean), gspo (TRL's grpo with sequence-level importance ratios). Sets TRL's loss_type "
        "and importance_sampling_level.")})
    importance_sampling: ISLevel = field(default="token", metadata={"flag": "--is", "help": (
        "Correction against the rollout policy's logprobs: token (truncated per-token weights, TIS), "
        "sequence (one truncated weight per segment) or none.")})
    is_cap: float = field(default=2.0, metadata={"help": (
        "Truncation cap C of the importance weights min(pi_old / pi_rollout, C).")})
    trial_weighting: TrialWeighting | None = field(default=None, metadata={"help": (
        "How much a trial weighs in the loss. trial: every trial counts once, whatever its length and "
        "segment count; token: every sampled token counts once. Default: trial for grpo/gspo, token for "
        "dapo/dr_grpo (what each loss means). Either way, splitting a trial into segments never changes its "
        "weight (legorl.training.weighting).")})
    micro_batches: int = field(default=1, metadata={"help": (
        "Gradient-accumulation micro-batches per optimizer update (memory, not maths); sets TRL's "
        "gradient_accumulation_steps and steps_per_generation.")})
    groups_per_batch: int | None = field(default=None, metadata={"help": (
        "Whole groups per generation batch (one batch = num_iterations updates); default: all groups of the "
        "step in one batch.")})
    routing_replay: Replay = field(default="auto", metadata={"help": (
        "Force the experts recorded at generation (MoE models): auto = when the model is MoE and the "
        "segments carry routing.")})
    reasons: tuple[str, ...] = field(
        default=(SegmentReason.MAIN, SegmentReason.REWRITE, SegmentReason.SUBAGENT),
        metadata={"help": "Segment reasons trained on (auxiliary calls such as title generation are left out by "
                          "default)."},
    )
    logprob_batch_size: int = field(default=8, metadata={"help": (
        "Sequences per no-grad forward when recomputing old logprobs.")})

    # ------------------------------------------------------------------ TRL's, redeclared
    # (scale_rewards and temperature add None, "decided per step", to TRL's types: hence the ignores)

    learning_rate: float = field(default=1e-6, metadata={"flag": "--lr", "help": (
        "The initial learning rate for AdamW (TRL's default; redeclared for its option name).")})
    lr_scheduler_type: SchedulerType | str = field(default="constant_with_warmup", metadata={"help": (
        "Learning-rate schedule. Not Trainer's linear decay, which would reach 0 at the end of every step's "
        "few updates: one rate after warmup_steps, counted across steps (the schedule carries over).")})
    scale_rewards: RewardScale | None = field(  # type: ignore[assignment]
        default=None, metadata={"help": (
            "Advantage scaling: group std (GRPO), batch std, or none (Dr.GRPO). Default: none for dr_grpo, "
            "group otherwise (TRL: always group). legorl computes advantages over the whole step before "
            "training (legorl.training.advantages).")})
    temperature: float | None = field(  # type: ignore[assignment]
        default=None, metadata={"help": (
            "Sampling temperature of the rollouts, only for shards that do not record it (then 1.0). The "
            "proxy records the sampling of every call and the trainer takes it from there; a different value "
            "here is refused (legorl.training.sampling). Unset = take it from the shards (TRL: 1.0).")})
    max_completion_length: int | None = field(default=None, metadata={"help": (
        "Only Dr.GRPO's constant normaliser (tokens per sequence): nothing is generated. Default: the "
        "longest segment of the step (TRL: 512).")})
    seed: int = field(default=0, metadata={"help": (
        "Random seed of the trainer, the batch order and the micro-batch cuts (Trainer: 42).")})
    report_to: list[str] = field(default_factory=lambda: ["none"], metadata={"help": (
        "TRL reporters, comma-separated (tensorboard, wandb, ... when installed) or none; metrics always go "
        "to RUN/train/metrics.")})
    bf16: bool = field(default=False, metadata={"help": (
        "Train in bfloat16: the model is loaded in bf16 and mixed precision is on (TRL: on unless fp16; "
        "legorl: off, as the default must run on CPUs).")})
    gradient_checkpointing: bool = field(default=False, metadata={"help": (
        "Recompute activations in the backward pass: less memory, about a fifth slower (TRL: on; legorl: off).")})

    def __post_init__(self) -> None:
        self._validate()
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
        super().__post_init__()

    def _validate(self) -> None:
        if self.loss not in LOSSES:
            raise ConfigError(f"unknown loss {self.loss!r}: choose one of {', '.join(LOSSES)}")
        if self.importance_sampling not in IS_LEVELS:
            raise ConfigError(
                f"unknown importance sampling level {self.importance_sampling!r}: choose one of {', '.join(IS_LEVELS)}"
            )
        if self.scale_rewards not in (None, "group", "batch", "none"):
            raise ConfigError(f"unknown reward scaling {self.scale_rewards!r}: choose group, batch or none")
        if self.trial_weighting not in (None, "trial", "token"):
            raise ConfigError(f"unknown trial weighting {self.trial_weighting!r}: choose trial or token")
        if self.routing_replay not in ("auto", "on", "off"):
            raise ConfigError(f"unknown routing replay {self.routing_replay!r}: choose auto, on or off")
        if self.is_cap <= 0:
            raise ConfigError(f"--is-cap must be > 0 (got {self.is_cap})")
        for name in ("num_iterations", "micro_batches", "logprob_batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.groups_per_batch is not None and self.groups_per_batch < 1:
            raise ConfigError(f"groups_per_batch must be >= 1 (got {self.groups_per_batch})")
        if self.learning_rate <= 0:
            raise ConfigError(f"learning rate must be > 0 (got {self.learning_rate})")
        if self.temperature is not None and not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ConfigError(f"--temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")

    @property
    def reward_scale(self) -> RewardScale:
        if self.scale_rewards is not None:
            return self.scale_rewards
        return "none" if self.loss == "dr_grpo" else "group"

    @property
    def weighting(self) -> TrialWeighting:
        if self.trial_weighting is not None:
            return self.trial_weighting
        return "trial" if self.loss in ("grpo", "gspo") else "token"

    @property
    def trl_loss_type(self) -> str:
        return "grpo" if self.loss == "gspo" else self.loss

    @property
    def trl_is_level(self) -> str:
        """TRL's ``importance_sampling_level`` (of pi_theta / pi_old, not of the rollout correction)."""
        return "sequence" if self.loss == "gspo" else "token"

    def to_dict(self) -> dict[str, Any]:
        """legorl's fields and the TRL fields that shape the update, JSON-safe: a checkpoint's record of
        its step's settings (and what TRL's reporters log as the run's hyperparameters), not
        ``TrainingArguments``' every field."""
        own = [f.name for f in fields(self) if f.name in _OWN_FIELDS]
        out = {name: getattr(self, name) for name in (*own, *_UPDATE_FIELDS)}
        out["reasons"] = [str(r) for r in self.reasons]
        out["report_to"] = list(self.report_to)
        return {k: v.value if isinstance(v, Enum) else v for k, v in out.items()}


# legorl's own fields: the ones TrainConfig declares that GRPOConfig does not have.
_OWN_FIELDS: frozenset[str] = frozenset(f.name for f in fields(TrainConfig)) - {f.name for f in fields(GRPOConfig)}

# The fields `legorl train` exposes as options (cli/options.py reads help, flag, type and default).
TRAIN_CLI_FIELDS: tuple[str, ...] = (
    "loss", "importance_sampling", "is_cap", "learning_rate", "num_iterations", "micro_batches",
    "groups_per_batch", "scale_rewards", "trial_weighting", "routing_replay", "report_to", "temperature",
    "seed", "bf16",
)
