"""From shards to training sequences: join rollouts with grades, drop infrastructure failures.

One *trial* (a row of ``rollouts/``) becomes one or more *sequences*, one per segment, each with
its own loss mask, rollout logprobs, routing and the policy version of each sampled token (when its
calls record one: :mod:`legorl.trials.provenance`). What is left out, and why:

- trials marked ``infra_failure`` by the rollout stage, and trials whose grading failed for
  infrastructure reasons (``infra_failure`` / status ``infra_error`` / no reward): they leave their
  group entirely, so they neither enter the baseline as reward 0 nor get gradient;
- segments whose reason is not trained on (auxiliary calls by default) or that hold no sampled token.

Each trial keeps the sampling its trained segments' calls record (:attr:`Trial.sampling`); the
step's sampling is decided from them in :mod:`legorl.training.sampling`.

A segment whose rollout logprobs are not finite on a sampled (loss-masked) token is never dropped:
the proxy and the engines refuse to record such a call, so one in a shard means the shard is
corrupt, and :func:`load_step` refuses the step with an error naming the trial and segment (a
dropped trial would leave its group like an infrastructure failure, a way out of a 0).

Advantages are then set per trial (:mod:`legorl.training.advantages`) and shared by its segments.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow.compute as pc

from legorl.core import shards
from legorl.core.errors import LegorlError
from legorl.core.paths import RunDir
from legorl.core.schemas import Kind, SegmentReason, grade_is_infra
from legorl.core.shards.reading import latest_step
from legorl.training.sampling import CallSampling
from legorl.trials import provenance

_ROLLOUT_COLUMNS = ["task_id", "harness", "step", "group_id", "infra_failure", "segments", "calls"]


@dataclass
class TrainSequence:
    """One segment, ready to be padded into a batch."""

    trial_id: str
    group_id: str
    harness: str
    segment_index: int
    reason: str
    token_ids: np.ndarray  # int64 [T]
    loss_mask: np.ndarray  # float32 [T], 1 on sampled tokens
    logprobs: np.ndarray  # float32 [T], rollout logprobs (0 where the mask is 0)
    routed_experts: np.ndarray | None  # int16 [T, moe_layers, top_k]
    reward: float
    versions: np.ndarray | None = None  # int64 [T], the policy version that sampled each token (-1: unknown
    # or not sampled; legorl.trials.provenance); None when no call of the trial records one
    advantage: float = 0.0
    scale: float = 1.0  # per-token weight factor of this segment (see weighting.py)

    @property
    def n_sampled(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def first_sampled(self) -> int:
        return int(np.argmax(self.loss_mask > 0))

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])


@dataclass
class Trial:
    trial_id: str
    group_id: str
    harness: str
    reward: float
    resolved: bool
    sequences: list[int] = field(default_factory=list)  # indices into StepData.sequences
    advantage: float = 0.0
    sampling: list[CallSampling] = field(default_factory=list)  # of the calls that built trained segments

    def n_sampled(self, data: StepData) -> int:
        return sum(data.sequences[i].n_sampled for i in self.sequences)


@dataclass
class StepData:
    step: int
    trials: list[Trial]
    sequences: list[TrainSequence]
    dropped: Counter[str] = field(default_factory=Counter)

    @property
    def harnesses(self) -> list[str]:
        return sorted({t.harness for t in self.trials})

    def groups(self) -> dict[str, list[int]]:
        """group_id -> trial indices, in first-seen order."""
        out: dict[str, list[int]] = {}
        for i, t in enumerate(self.trials):
            out.setdefault(t.group_id, []).append(i)
        return out


def available_steps(run: RunDir) -> list[int]:
    table = shards.read(run.rollouts, Kind.ROLLOUTS, columns=["step"]).table
    return sorted({int(s) for s in table.column("step").to_pylist()})


def load_step(
    run: RunDir,
    step: int | None = None,
    reasons: tuple[str, ...] = (SegmentReason.MAIN, SegmentReason.REWRITE, SegmentReason.SUBAGENT),
    staleness: provenance.Staleness | None = None,
) -> StepData:
    """The trials of policy step ``step`` (default: the latest) joined with their grades.

    ``staleness`` (the overlapped loop's bound): a trial with calls more than ``max_staleness``
    policy versions behind ``step`` is left out (``drop_trial``) or trained without loss on its
    stale tokens (``mask``), or trained as it is (``keep``); without it every trial is taken as it is."""
    if step is None:  # the latest: from the parts' row-group statistics, not their rows
        step = latest_step(run.rollouts, Kind.ROLLOUTS, "step")
        if step is None:
            raise LegorlError(f"{run.rollouts}: no rollouts to train on (run `legorl rollout --run {run.root}` first)")
    # Only the step's rows, pushed down to the row groups (the cost does not grow with the run); a
    # full read of them validates them (segment arrays aligned, enums known) before we use them.
    at_step = pc.field("step") == step
    table = shards.read(run.rollouts, Kind.ROLLOUTS, where=at_step).table.select(["trial_id", *_ROLLOUT_COLUMNS])
    if not table.num_rows:  # the steps present are read only to say so
        steps = available_steps(run)
        if not steps:
            raise LegorlError(f"{run.rollouts}: no rollouts to train on (run `legorl rollout --run {run.root}` first)")
        raise LegorlError(f"{run.rollouts}: no rollouts for step {step} (steps present: {steps})")

    grades = {
        g["trial_id"]: g
        for g in shards.read(
            run.grades, Kind.GRADES, columns=["reward", "resolved", "status", "infra_failure"],
            where=at_step | pc.field("step").is_null(),  # grades written without their trial's step
        ).table.to_pylist()
    }
    rows = table.to_pylist()
    ungraded = [r["trial_id"] for r in rows if r["trial_id"] not in grades and not r["infra_failure"]]
    if ungraded:
        raise LegorlError(
            f"{run.grades}: {len(ungraded)} trial(s) of step {step} have no grade (first: {ungraded[0]}); "
            f"run `legorl grade --run {run.root}` first"
        )

    data = StepData(step=step, trials=[], sequences=[])
    for row in rows:
        if row["infra_failure"]:
            data.dropped["rollout_infra_failure"] += 1
            continue
        grade = grades[row["trial_id"]]
        if grade_is_infra(grade["infra_failure"], grade["status"], grade["reward"]):
            data.dropped["grade_infra_error"] += 1
            continue
        masks = None
        if staleness is not None and provenance.is_stale(row, step, staleness.max_staleness):
            if staleness.stale_tokens == "drop_trial":
                data.dropped["stale_trial"] += 1
                continue
            if staleness.stale_tokens == "mask":
                masks = provenance.segment_loss_masks(row, step, staleness.max_staleness)
        trial = Trial(
            trial_id=row["trial_id"], group_id=row["group_id"], harness=row["harness"],
            reward=float(grade["reward"]), resolved=bool(grade["resolved"]),
        )
        versions = _token_versions(row)
        for index, seg in enumerate(row["segments"] or []):
            sequence = _sequence(row, trial, index, seg)
            if versions is not None:
                sequence.versions = versions[index]
            if masks is not None:
                sequence.loss_mask = np.asarray(masks[index], dtype=sequence.loss_mask.dtype)
            if sequence.reason not in reasons:
                data.dropped[f"segment_{sequence.reason}"] += 1
                continue
            if sequence.n_sampled == 0 or sequence.first_sampled == 0:
                # Nothing sampled, or a first token with no context to score it from.
                data.dropped["segment_without_sampled_tokens"] += 1
                continue
            bad = np.flatnonzero((sequence.loss_mask > 0) & ~np.isfinite(sequence.logprobs))
            if bad.size:
                raise LegorlError(
                    f"{run.rollouts}: trial {row['trial_id']} segment {index}: {bad.size} sampled token(s) have "
                    f"non-finite rollout logprobs (first at position {int(bad[0])}: {sequence.logprobs[bad[0]]}); "
                    "refusing to train on a corrupt rollout"
                )
            trial.sequences.append(len(data.sequences))
            data.sequences.append(sequence)
        if not trial.sequences:
            data.dropped["trial_without_sampled_tokens"] += 1
            continue
        trained = {data.sequences[i].segment_index for i in trial.sequences}
        trial.sampling = [CallSampling.from_call(c) for c in row["calls"] or []
                          if c.get("segment") in trained and not c.get("budget_stop")]
        data.trials.append(trial)
    if not data.trials:
        raise LegorlError(f"{run.root}: step {step} has no trainable trials (dropped: {dict(data.dropped)})")
    return data


def _token_versions(row: dict[str, Any]) -> list[np.ndarray] | None:
    """Per segment, the version of each token (-1: unknown), or None when no call records one (old
    shards: nothing to check, nothing to split by)."""
    if all(v is None for v in provenance.call_versions(row)):
        return None
    return [np.array([provenance.UNKNOWN_VERSION if v is None else v for v in versions], dtype=np.int64)
            for versions in provenance.token_versions(row)]


def _sequence(row: dict[str, Any], trial: Trial, index: int, seg: dict[str, Any]) -> TrainSequence:
    token_ids = np.asarray(seg["token_ids"], dtype=np.int64)
    routed = seg.get("routed_experts")
    routing = None
    if routed is not None:
        layers, top_k = int(seg["routing_layers"]), int(seg["routing_top_k"])
        routing = np.asarray(routed, dtype=np.int16).reshape(len(token_ids), layers, top_k)
    return TrainSequence(
        trial_id=row["trial_id"],
        group_id=row["group_id"],
        harness=row["harness"],
        segment_index=index,
        reason=seg["reason"],
        token_ids=token_ids,
        loss_mask=np.asarray(seg["loss_mask"], dtype=np.float32),
        logprobs=np.asarray(seg["logprobs"], dtype=np.float32),
        routed_experts=routing,
        reward=trial.reward,
    )
