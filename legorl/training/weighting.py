"""How much each trial weighs in the loss, whatever the number and length of its segments.

The proxy splits one trial into several segments (a fork after a history rewrite, a sub-agent),
and each segment is one training sequence sharing the trial's advantage. Fed to TRL's losses as
they are, that would change a trial's weight with its segment count: ``grpo`` averages each
*sequence* over its tokens and then averages sequences, so a trial forked into five segments would
count five times. We fix the target per-token weight ``u`` a trial's tokens should have, and
scale each segment's per-token advantages by ``u / v``, where ``v`` is the per-token weight the
TRL loss gives that segment by itself:

=================  =========================  ===================================
loss (TRL)          v (its own token weight)   note
=================  =========================  ===================================
grpo, gspo          1 / T_segment              per-sequence mean, then mean
dapo, dr_grpo       1 / const                  token sum over a batch constant
=================  =========================  ===================================

``trial`` weighting (default for grpo/gspo): ``u = 1 / T_trial`` — every trial counts once, like
one GRPO sequence, however long it ran; a long failing trajectory does not drown the short ones.
``token`` weighting (default for dapo/dr_grpo): ``u = 1 / T_mean`` — every sampled token counts
once, as those losses intend (a trial weighs its token count; the length-bias fix of Dr.GRPO).
``T_trial`` is a trial's sampled tokens over all its segments, ``T_mean`` the mean over the step's
trials (it keeps the overall scale of the loss, so learning rates carry over).

For per-sequence losses the trainer also multiplies a batch's advantages by sequences / trials, so
TRL's mean over sequences becomes a mean over trials. For a batch of single-segment trials under
the loss's own weighting every factor is exactly 1: plain TRL.
Scaling the advantage by a positive factor leaves PPO clipping unchanged (``min(rA, clip(r)A)``
keeps its branch), so this is TRL's loss with re-weighted samples, nothing else.
"""

from __future__ import annotations

from legorl.training.data import StepData

_PER_SEQUENCE_LOSSES = ("grpo", "gspo")


def segment_scales(data: StepData, loss: str, weighting: str) -> list[float]:
    """The factor for each sequence of ``data`` (same order as ``data.sequences``)."""
    trial_tokens = {t.trial_id: t.n_sampled(data) for t in data.trials}
    mean_tokens = sum(trial_tokens.values()) / len(trial_tokens)
    scales = []
    for seq in data.sequences:
        u = 1.0 / trial_tokens[seq.trial_id] if weighting == "trial" else 1.0 / mean_tokens
        v = 1.0 / seq.n_sampled if loss in _PER_SEQUENCE_LOSSES else 1.0 / mean_tokens
        scales.append(u / v)
    return scales
