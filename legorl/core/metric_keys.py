"""The keys of ``train/metrics/`` rows: the one vocabulary the trainer writes and the monitor reads.

A metrics row is ``(step, key, value, harness)`` (long format). Every key legorl itself writes or
looks up is a constant here; the train stage and :mod:`legorl.training` write them, and
:mod:`legorl.monitor` (health summary, dashboard), the CLI and the examples read them, so a renamed
figure cannot leave a reader looking for a key nobody writes. Besides these, the trainer records
TRL's own log entries under TRL's names (``learning_rate``, ``clip_ratio/low_mean``, ...).

No imports beyond the standard library: the monitor uses this module without torch.
"""

from __future__ import annotations

from typing import Final

# Fidelity of the trainer to the rollout policy (legorl.training.metrics.fidelity; formulas there).
LOGPROB_PEARSON: Final = "fidelity/logprob_pearson"
MISMATCH_KL: Final = "fidelity/mismatch_kl"  # k3 estimator
MISMATCH_KL_K1: Final = "fidelity/mismatch_kl_k1"
LOGPROB_ABS_DIFF_MAX: Final = "fidelity/logprob_abs_diff_max"

# Importance weights against the rollout policy (legorl.training.importance).
IS_WEIGHT_MEAN: Final = "is/weight_mean"
IS_WEIGHT_MIN: Final = "is/weight_min"
IS_WEIGHT_MAX: Final = "is/weight_max"
IS_TRUNCATED_FRAC: Final = "is/truncated_frac"
IS_ESS: Final = "is/ess"
# Under --is-mode mask only (masked IS): the share of the weights set to 0 (tokens at token level,
# segments at sequence / geometric level), and the share of sampled tokens whose weight is 0.
IS_MASKED_FRAC: Final = "is/masked_frac"
IS_MASKED_TOKEN_FRAC: Final = "is/masked_token_frac"
# The same per staleness level, each prefix followed by the lag ("is/ess/lag1"): over the sampled
# tokens that lag that many policy versions behind the trained step (legorl.trials.provenance; at sequence
# level, the segments whose oldest token does). Tokens of unknown version are in the figures above only.
IS_WEIGHT_MEAN_AT_LAG: Final = "is/weight_mean/lag"
IS_TRUNCATED_FRAC_AT_LAG: Final = "is/truncated_frac/lag"
IS_ESS_AT_LAG: Final = "is/ess/lag"
IS_MASKED_FRAC_AT_LAG: Final = "is/masked_frac/lag"  # --is-mode mask only

# TRL's log entries legorl relies on, under TRL's names; CLIP_FRACTION is TRL's region clip ratio.
LOSS: Final = "loss"
ENTROPY: Final = "entropy"
GRAD_NORM: Final = "grad_norm"
TRL_CLIP_RATIO: Final = "clip_ratio/region_mean"
CLIP_FRACTION: Final = "clip_fraction"

# The step's data (stages/train.py: prepare).
GROUPS_COUNT: Final = "groups/count"
ZERO_VARIANCE_SHARE: Final = "groups/zero_variance_share"
TRIALS_COUNT: Final = "trials/count"
TRIALS_DROPPED_INFRA: Final = "trials/dropped_infra"
SEGMENTS_COUNT: Final = "segments/count"
TOKENS_SAMPLED: Final = "tokens/sampled"
TOKENS_TOTAL: Final = "tokens/total"
REWARD_MEAN: Final = "reward/mean"
SOLVE_RATE: Final = "solve_rate"

# Per generation batch (legorl.training.trainer).
BATCH_SEQUENCES: Final = "batch/sequences"
BATCH_PADDING_SHARE: Final = "batch/padding_share"
ROUTING_REPLAY: Final = "routing/replay"
ROUTING_NATURAL_FLIP_RATE: Final = "routing/natural_flip_rate"
ROUTING_EFFECTIVE_FLIP_RATE: Final = "routing/effective_flip_rate"

# Work not done on zero signal (TrainOptions.skip_zero_advantage; stages/train.py: run_train). Every
# step writes SKIPPED: 1.0 when it made no update, then SKIPPED_BECAUSE + the reason (the one reason
# today: SKIP_ZERO_ADVANTAGE, every trial's advantage is 0) is 1.0 too; 0.0 when it trained.
SKIPPED: Final = "skipped"
SKIPPED_BECAUSE: Final = "skipped/"
SKIP_ZERO_ADVANTAGE: Final = "zero_advantage"
SKIP_REASONS: Final = {  # what each reason means, for whoever shows a skipped step
    SKIP_ZERO_ADVANTAGE: "every group's trials scored the same, so every advantage was 0: nothing to learn from",
}
TRIALS_SKIPPED: Final = "trials/skipped_zero_advantage"  # trials neither scored nor trained (advantage 0)

# Throughput of the step (stages/train.py: run_train).
PERF_TOKENS_PER_S: Final = "perf/tokens_per_s"
PERF_PADDING_WASTE: Final = "perf/padding_waste"
PERF_WALL_S: Final = "perf/wall_s"
UPDATES: Final = "updates"

# The figures of the fidelity panel (dashboard) and table (health summary), in display order.
# What a one-line summary of a training step shows (`legorl train`, `legorl inspect`), in this order.
HEADLINE: Final[tuple[str, ...]] = (
    REWARD_MEAN, SOLVE_RATE, ZERO_VARIANCE_SHARE, LOSS, ENTROPY, LOGPROB_PEARSON, MISMATCH_KL, IS_ESS,
    CLIP_FRACTION, GRAD_NORM, PERF_TOKENS_PER_S,
)

FIDELITY_PANEL: Final[dict[str, str]] = {
    LOGPROB_PEARSON: "rollout vs trainer logprob correlation",
    MISMATCH_KL: "KL(rollout ‖ trainer) on sampled tokens",
    IS_ESS: "effective sample size of the importance weights (normalised)",
    CLIP_FRACTION: "share of tokens clipped",
    ENTROPY: "policy entropy",
    GRAD_NORM: "gradient norm",
    LOSS: "training loss",
}
