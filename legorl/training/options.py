"""The training stage's choices, each documented once: legorl's own fields and the TRL fields it sets differently.

:class:`TrainOptions` is plain data (importing it imports neither torch nor TRL, so the command
line is built from it in milliseconds); :class:`legorl.training.config.TrainConfig` is it *plus*
TRL's ``GRPOConfig``, the object the trainer runs with. ``TRAIN_CLI_FIELDS`` names the fields
``legorl train`` exposes (help text: ``metadata["help"]``; extra option names:
``metadata["aliases"]``, as transformers' ``HfArgumentParser`` reads them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from legorl.core.errors import ConfigError
from legorl.core.schemas import SegmentReason
from legorl.engines.config import SamplingConfig, check_temperature

LossName = Literal["grpo", "dr_grpo", "dapo", "gspo"]
ISLevel = Literal["token", "sequence", "geometric", "none"]
ISMode = Literal["truncate", "mask"]
RewardScale = Literal["group", "batch", "none"]
TrialWeighting = Literal["trial", "token"]
Replay = Literal["auto", "on", "off"]

LOSSES: tuple[str, ...] = ("grpo", "dr_grpo", "dapo", "gspo")
IS_LEVELS: tuple[str, ...] = ("token", "sequence", "geometric", "none")
IS_MODES: tuple[str, ...] = ("truncate", "mask")


@dataclass
class TrainOptions(SamplingConfig):
    """What a user chooses for one policy-gradient step (``legorl train``). Its ``temperature``
    (:class:`SamplingConfig`, TRL's field of that name) is only for shards that do not record their
    sampling: the trainer takes it from the calls (legorl.training.sampling)."""

    # ------------------------------------------------------------------ legorl's own

    loss: LossName = field(default="grpo", metadata={"help": (
        "Policy loss, all TRL's own: grpo (per-sequence mean), dr_grpo (constant normaliser), dapo "
        "(token-level mean), gspo (TRL's grpo with sequence-level importance ratios). Sets TRL's loss_type "
        "and importance_sampling_level.")})
    importance_sampling: ISLevel = field(default="token", metadata={"aliases": ["--is"], "help": (
        "Correction against the rollout policy's logprobs, from the ratios r = pi_old / pi_rollout of the "
        "sampled tokens: token (one weight per token), sequence (prod r, one per segment), geometric "
        "(exp(mean log r), one per segment, free of its length) or none. --is-mode says what becomes of "
        "the ratio (docs/off-policy.md).")})
    is_mode: ISMode = field(default="truncate", metadata={"help": (
        "truncate: weight min(ratio, --is-cap) (TIS). mask: weight ratio inside [--is-lower, --is-cap], 0 "
        "outside (masked IS; at token level IcePop, at geometric level verl's geometric rejection): a "
        "masked token or segment gets no gradient.")})
    is_cap: float = field(default=2.0, metadata={"help": (
        "C: the truncation cap (truncate) or the upper bound of the kept ratios (mask, then > 1).")})
    is_lower: float | None = field(default=None, metadata={"help": (
        "With --is-mode mask: the lower bound of the kept ratios, in (0, 1] (default 1 / --is-cap).")})
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
    padding_free: bool = field(default=True, metadata={"help": (
        "Pack each micro-batch's segments into one padding-free row and run the LM head only where the next "
        "token was sampled (same loss and gradients as TRL's padded path, which computes logprobs at every "
        "position; off = that path).")})
    share_prefixes: bool = field(default=True, metadata={"help": (
        "With padding_free: segments of one trial that start with the same tokens (forks after a history "
        "rewrite) compute their shared prefix once (same loss and gradients as computing it per fork).")})
    max_tokens_per_micro_batch: int | None = field(default=None, metadata={"help": (
        "Cut each generation batch into micro-batches of at most this many tokens (a trial's segments stay "
        "together; one longer than this is a micro-batch of its own) instead of micro_batches equal row "
        "counts: memory bounded by length, not row count. The update is the same either way.")})
    logprob_max_tokens: int = field(default=16384, metadata={"help": (
        "With padding_free: tokens per no-grad forward when recomputing old logprobs (whole segments; one "
        "longer than this is a forward of its own).")})
    score_in_training_forward: bool = field(default=True, metadata={"help": (
        "With num_iterations = 1 (each micro-batch is trained once, by the policy the trainer holds before "
        "the update): take the old logprobs from the training forward itself, detached, "
        "instead of a separate no-grad pass (TRL's on-policy shortcut; same loss and gradients, one forward "
        "fewer). Dense models only: MoE models keep the separate pass, which watches the routing.")})
    skip_zero_advantage: bool = field(default=True, metadata={"help": (
        "Do no work on trials whose advantage is 0 (every trial of a group that scored the same): they are "
        "neither scored nor trained, a micro-batch or generation batch of them only does not run, and a step "
        "with no other trial makes no update (its metrics say skipped, and why). The loss normalisers still "
        "count them, so the update equals the one computed with them (legorl.training.batching).")})

    # ------------------------------------------------------------------ TRL's, with legorl's default or meaning

    learning_rate: float = field(default=1e-6, metadata={"aliases": ["--lr"], "help": (
        "The initial learning rate for AdamW (TRL's default).")})
    num_iterations: int = field(default=1, metadata={"help": (
        "Optimizer passes over each step's batch (PPO epochs; GRPO's mu; TRL's default).")})
    lr_scheduler_type: str = field(default="constant_with_warmup", metadata={"help": (
        "Learning-rate schedule. Not Trainer's linear decay, which would reach 0 at the end of every step's "
        "few updates: one rate after warmup_steps, counted across steps (the schedule carries over).")})
    scale_rewards: RewardScale | None = field(default=None, metadata={"help": (
        "Advantage scaling: group std (GRPO), batch std, or none (Dr.GRPO). Default: none for dr_grpo, "
        "group otherwise (TRL: always group). legorl computes advantages over the whole step before "
        "training (legorl.training.advantages).")})
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
        "Recompute activations in the backward pass, run decoder layers in token tiles and give freed blocks back "
        "to the system: less memory, slower (TRL: on; legorl: off; docs/training-at-scale.md).")})

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
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
        self._validate_correction()
        for name in ("num_iterations", "micro_batches", "logprob_batch_size", "logprob_max_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.max_tokens_per_micro_batch is not None and self.max_tokens_per_micro_batch < 1:
            raise ConfigError(f"max_tokens_per_micro_batch must be >= 1 (got {self.max_tokens_per_micro_batch})")
        if self.groups_per_batch is not None and self.groups_per_batch < 1:
            raise ConfigError(f"groups_per_batch must be >= 1 (got {self.groups_per_batch})")
        if self.learning_rate <= 0:
            raise ConfigError(f"learning rate must be > 0 (got {self.learning_rate})")
        check_temperature(self.temperature)

    def _validate_correction(self) -> None:
        if self.is_mode not in IS_MODES:
            raise ConfigError(f"unknown --is-mode {self.is_mode!r}: choose one of {', '.join(IS_MODES)}")
        if not self.is_cap > 0:  # NaN too
            raise ConfigError(f"--is-cap must be > 0 (got {self.is_cap})")
        if self.is_mode == "truncate":
            if self.is_lower is not None:
                raise ConfigError(f"--is-lower {self.is_lower} applies to --is-mode mask only (truncation has no "
                                  "lower bound)")
            return
        if self.importance_sampling == "none":
            raise ConfigError("--is-mode mask needs an importance sampling level (--is token, sequence or geometric), "
                              "not none")
        if self.is_cap <= 1:
            raise ConfigError(f"--is-cap must be > 1 with --is-mode mask (got {self.is_cap}): the kept ratios "
                              "[--is-lower, --is-cap] must hold 1, the ratio of a token both policies agree on")
        if self.is_lower is not None and not (0 < self.is_lower <= 1):
            raise ConfigError(f"--is-lower must be in (0, 1] (got {self.is_lower}), below --is-cap {self.is_cap}: "
                              "the kept ratios [--is-lower, --is-cap] must hold 1")

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


# The fields `legorl train` exposes as options (cli/options.py reads help, aliases, type and default).
TRAIN_CLI_FIELDS: tuple[str, ...] = (
    "loss", "importance_sampling", "is_mode", "is_cap", "is_lower", "learning_rate", "num_iterations", "micro_batches",
    "groups_per_batch", "scale_rewards", "trial_weighting", "routing_replay", "report_to", "temperature",
    "seed", "bf16", "gradient_checkpointing", "padding_free", "share_prefixes", "max_tokens_per_micro_batch",
    "skip_zero_advantage",
)
