"""The training stage's options: one dataclass, each field documented once (the CLI mirrors them)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from legorl.errors import ConfigError
from legorl.schemas import SegmentReason

LossName = Literal["grpo", "dr_grpo", "dapo", "gspo"]
ISLevel = Literal["token", "sequence", "none"]
RewardScale = Literal["group", "batch", "none"]
TrialWeighting = Literal["trial", "token"]
Replay = Literal["auto", "on", "off"]

LOSSES: tuple[str, ...] = ("grpo", "dr_grpo", "dapo", "gspo")
IS_LEVELS: tuple[str, ...] = ("token", "sequence", "none")


@dataclass
class TrainConfig:
    loss: LossName = "grpo"
    """Policy loss, all TRL's own: ``grpo`` (per-sequence mean), ``dr_grpo`` (constant normaliser),
    ``dapo`` (token-level mean), ``gspo`` (TRL's ``grpo`` with sequence-level importance ratios)."""

    importance_sampling: ISLevel = "token"
    """Correction against the rollout policy's logprobs: ``token`` (truncated per-token weights, TIS),
    ``sequence`` (one truncated weight per segment) or ``none``."""

    is_cap: float = 2.0
    """Truncation cap C of the importance weights ``min(pi_old / pi_rollout, C)``."""

    scale_rewards: RewardScale | None = None
    """Advantage scaling: ``group`` std (GRPO), ``batch`` std, or ``none`` (Dr.GRPO). Default: ``none``
    for ``dr_grpo``, ``group`` otherwise."""

    trial_weighting: TrialWeighting | None = None
    """How much a trial weighs in the loss. ``trial``: every trial counts once, whatever its length and
    segment count; ``token``: every sampled token counts once. Default: ``trial`` for ``grpo``/``gspo``,
    ``token`` for ``dapo``/``dr_grpo`` (what each loss means). Either way, splitting a trial into
    segments never changes its weight. See :mod:`legorl.training.weighting`."""

    learning_rate: float = 1e-6
    num_iterations: int = 1
    """Optimizer passes over each batch (PPO epochs; GRPO's mu)."""

    micro_batches: int = 1
    """Gradient-accumulation micro-batches per optimizer update (memory, not maths)."""

    groups_per_batch: int | None = None
    """Whole groups per generation batch (one batch = ``num_iterations`` updates); None = all groups
    of the step in one batch."""

    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0
    """KL penalty to the initial model (needs a reference model copy when > 0)."""

    max_grad_norm: float = 1.0
    weight_decay: float = 0.0
    warmup_steps: int = 0
    temperature: float | None = None
    """Sampling temperature of the rollouts, only for shards that do not record it (then default 1.0).
    The proxy records the sampling of every call and the trainer takes it from there; a value given
    here that differs from the recorded one is refused (:mod:`legorl.training.sampling`)."""

    routing_replay: Replay = "auto"
    """Force the experts recorded at generation (MoE): ``auto`` = when the model is MoE and the
    segments carry routing."""

    reasons: tuple[str, ...] = (SegmentReason.MAIN, SegmentReason.REWRITE, SegmentReason.SUBAGENT)
    """Segment reasons trained on (auxiliary calls such as title generation are left out by default)."""

    logprob_batch_size: int = 8
    """Sequences per no-grad forward when recomputing old logprobs."""

    max_length: int | None = None
    """Dr.GRPO's constant normaliser (tokens per sequence); default: the longest segment of the step."""

    seed: int = 0
    report_to: list[str] = field(default_factory=lambda: ["none"])
    """TRL reporters: ``tensorboard``, ``wandb``, ... (when installed)."""

    bf16: bool = False
    gradient_checkpointing: bool = False

    def __post_init__(self) -> None:
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
        out = asdict(self)
        out["reasons"] = [str(r) for r in self.reasons]
        return out
