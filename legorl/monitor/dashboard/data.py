"""The dashboard's JSON payloads: one overview per run, one detail per trial.

Both are built only from shards (through :class:`~legorl.monitor.loading.RunReader`) and hold
plain JSON data; the server and the static export serve the same payloads.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from operator import attrgetter
from typing import Any

from legorl.core import metric_keys as mk
from legorl.core.schemas import Call, GradeRow, Segment, TrialRow
from legorl.monitor import behaviour, behaviour_summary, stats
from legorl.monitor.behaviour import classify_call
from legorl.monitor.health import FIDELITY_KEYS, health_summary
from legorl.monitor.loading import RunReader, Snapshot
from legorl.trials import costs

MAX_POINTS = 4000  # logprob points per segment sent to the browser (longer segments are binned)
MAX_LOG_CHARS = 20000


def _behaviour_series(snap: Snapshot) -> dict[str, dict[str, dict[str, list[Any]]]]:
    rows = behaviour_summary.aggregate(t.behaviour for t in snap.trials.values())
    out: dict[str, dict[str, dict[str, list[Any]]]] = {}
    for metric in behaviour_summary.METRICS:
        per_harness: dict[str, dict[str, list[Any]]] = {}
        for row in rows:
            series = per_harness.setdefault(row["harness"], {"steps": [], "values": []})
            series["steps"].append(row["step"])
            series["values"].append(row[metric])
        out[metric] = per_harness
    return out


def _trial_rows(snap: Snapshot) -> list[dict[str, Any]]:
    rows = []
    grades, categories = snap.grades, stats.categories(snap)
    for t in sorted(snap.trials.values(), key=attrgetter("step", "harness", "task_id", "sample_index")):
        grade = grades.get(t.trial_id)
        b = t.behaviour
        rows.append({
            "trial_id": t.trial_id, "key": t.key, "task_id": t.task_id, "harness": t.harness, "step": t.step,
            "sample_index": t.sample_index, "outcome": t.outcome, "category": categories[t.trial_id],
            "reward": grade.reward if grade else None, "resolved": grade.resolved if grade else None,
            "turns": b.turns, "tool_calls": b.tool_calls, "model_tokens": b.model_tokens,
            "env_tokens": b.env_tokens, "self_verifying": b.self_verifying, "ran_tests": b.ran_tests,
            "forks": b.forks, "text_only": bool(b.assistant_turns and not b.tool_calls),
        })
    return rows


def _cost_table(snap: Snapshot) -> list[dict[str, Any]]:
    """:func:`legorl.trials.costs.cost_table` of the trials, from the parts' summaries; each handed over
    as the dict of the three fields it reads (a dict is its fast path)."""
    return costs.cost_table({"step": t.step, "harness": t.harness, "cost": t.cost} for t in snap.trials.values())


def _by_lag(metrics: dict[str, dict[str, dict[str, list[Any]]]], prefix: str) -> dict[str, dict[str, list[Any]]]:
    """The whole-batch series of a per-lag key (``prefix`` + lag), by lag in numeric order."""
    found = {key.removeprefix(prefix): per["all"] for key, per in metrics.items()
             if key.startswith(prefix) and key.removeprefix(prefix).lstrip("-").isdigit() and "all" in per}
    return dict(sorted(found.items(), key=lambda kv: int(kv[0])))


def _skipped_steps(metrics: dict[str, dict[str, dict[str, list[Any]]]]) -> dict[int, list[str]]:
    """Steps the trainer made no update at, with the reasons it wrote (``skipped/<reason>`` = 1)."""
    out: dict[int, list[str]] = {}
    for key, per in metrics.items():
        if not key.startswith(mk.SKIPPED_BECAUSE):
            continue
        for series in per.values():
            for step, value in zip(series["steps"], series["values"], strict=True):
                if value == 1.0 and key.removeprefix(mk.SKIPPED_BECAUSE) not in out.setdefault(step, []):
                    out[step].append(key.removeprefix(mk.SKIPPED_BECAUSE))
    return dict(sorted(out.items()))


def overview(snap: Snapshot) -> dict[str, Any]:
    """Everything the panels plot, for one run."""
    metrics = stats.metric_series(snap)
    fidelity = {k: metrics[k] for k in FIDELITY_KEYS if k in metrics}
    ess_by_lag = _by_lag(metrics, mk.IS_ESS_AT_LAG)
    shown = {*fidelity, *(mk.IS_ESS_AT_LAG + lag for lag in ess_by_lag)}
    others = {k: v for k, v in metrics.items() if k not in shown}
    health = health_summary(snap)
    return {
        "run": {"name": snap.name, "fingerprint": snap.fingerprint},
        "counts": {k: health[k] for k in ("tasks", "trials", "graded", "pending_grades", "infra_failures", "steps")},
        "warnings": health["warnings"],
        "reward": stats.reward_by_step(snap),
        "outcomes": stats.outcomes_by_step(snap),
        "groups": stats.groups_by_step(snap),
        "zero_variance_metric": metrics.get(mk.ZERO_VARIANCE_SHARE),
        "fidelity": fidelity,
        "fidelity_help": {k: mk.FIDELITY_PANEL[k] for k in fidelity},
        "skipped": _skipped_steps(metrics),  # steps with no update, and why (their figures are not fidelity)
        "skip_reasons": mk.SKIP_REASONS,
        "staleness": {**stats.token_lags_by_step(snap), "ess": ess_by_lag},  # token lags from the rollouts
        "other_metrics": others,
        "behaviour": _behaviour_series(snap),
        "behaviour_help": behaviour_summary.METRICS,
        "grid": stats.task_step_grid(snap),
        "trials": _trial_rows(snap),
        "eval": snap.eval_report,
        "cost": _cost_table(snap),  # per step and harness (legorl.trials.costs)
    }


def _runs_of_ones(mask: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) spans of consecutive 1s in a loss mask: one per sampled completion."""
    spans = []
    start = None
    for i, m in enumerate(mask):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    if start is not None:
        spans.append((start, len(mask)))
    return spans


def _bin(xs: list[int], ys: list[float], limit: int) -> tuple[list[int | None], list[float | None]]:
    """At most ``limit`` points; short series get a gap (None) between turns so lines don't join them."""
    if len(xs) <= limit:
        gx: list[int | None] = []
        gy: list[float | None] = []
        for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
            if i and x != xs[i - 1] + 1:
                gx.append(None)
                gy.append(None)
            gx.append(x)
            gy.append(y)
        return gx, gy
    size = math.ceil(len(xs) / limit)
    bx: list[int | None] = []
    by: list[float | None] = []
    for i in range(0, len(xs), size):
        chunk = ys[i : i + size]
        bx.append(xs[i])
        by.append(sum(chunk) / len(chunk))
    return bx, by


def _segments_and_calls(segments: list[Segment], calls: list[Call]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Per-segment token/logprob data and per-call figures, matching each call to its sampled span.

    The proxy appends one sampled completion per call to the call's segment, in call order, so the
    i-th run of loss_mask 1 in a segment belongs to the i-th call of that segment that sampled tokens.
    """
    call_rows = [c.to_dict() for c in sorted(calls, key=lambda c: c.index)]
    by_segment: dict[int, list[dict[str, Any]]] = {}
    for c in call_rows:
        if c.get("completion_tokens"):
            by_segment.setdefault(int(c["segment"]), []).append(c)
    seg_rows = []
    for i, seg in enumerate(segments):
        spans = _runs_of_ones(seg.loss_mask)
        for call, (start, end) in zip(by_segment.get(i, []), spans, strict=False):
            lps = seg.logprobs[start:end]
            call["span"] = [start, end]
            call["mean_logprob"] = round(sum(lps) / len(lps), 4) if lps else None
            call["min_logprob"] = round(min(lps), 4) if lps else None
        xs = [j for j, m in enumerate(seg.loss_mask) if m]
        ys = [round(float(seg.logprobs[j]), 4) for j in xs]
        bx, by = _bin(xs, ys, MAX_POINTS)
        sampled = len(xs)
        seg_rows.append({
            "index": i, "reason": str(seg.reason), "parent": seg.parent, "tokens": len(seg.token_ids),
            "model_tokens": sampled, "env_tokens": len(seg.token_ids) - sampled, "turns": len(spans),
            "mean_logprob": round(sum(ys) / len(ys), 4) if ys else None,
            "logprob_x": bx, "logprob_y": by, "binned": len(xs) > MAX_POINTS, "spans": [list(s) for s in spans],
            "routed": seg.routed_experts is not None,
        })
    return seg_rows, call_rows


def _annotated_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation, each tool call tagged with the actions the behaviour rules see in it."""
    out = []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):
            tagged = []
            for call in message["tool_calls"]:
                fn = call.get("function") or {}
                event = classify_call(str(fn.get("name", "")), fn.get("arguments", ""))
                tagged.append({**call, "legorl_actions": [str(a) for a in event.actions]})
            message["tool_calls"] = tagged
        out.append(message)
    return out


def trial_detail(reader: RunReader, trial_id: str) -> dict[str, Any]:
    """One trial for the trajectory viewer: conversation, segments, calls, patch, grade."""
    row = reader.trial_row(trial_id)
    grade = reader.grade_row(trial_id)
    return _detail(reader.snapshot(), row, grade)


def trial_details(reader: RunReader) -> Iterator[dict[str, Any]]:
    """Every trial's detail (:func:`trial_detail`), step by step: each file read once per step it
    holds, never once per trial (the static export)."""
    snap = reader.snapshot()
    for step in sorted({t.step for t in snap.trials.values()}):
        trials, grades = reader.step_rows(step)
        snap = reader.snapshot()
        for trial_id, row in trials.items():
            if trial_id in snap.trials:
                yield _detail(snap, row, grades.get(trial_id))


def _detail(snap: Snapshot, row: TrialRow, grade: GradeRow | None) -> dict[str, Any]:
    info = snap.trials[row.trial_id]
    segs, calls = _segments_and_calls(row.segments, row.calls)
    try:
        messages = row.conversation()
    except json.JSONDecodeError:
        messages = [{"role": "system", "content": "(messages are not valid JSON)"}]
    grade_data = None
    if grade is not None:
        grade_data = grade.to_dict()
        log = grade_data.get("log") or ""
        grade_data["log"] = log[-MAX_LOG_CHARS:]
        grade_data["log_truncated"] = len(log) > MAX_LOG_CHARS
    return {
        "trial_id": row.trial_id, "key": info.key, "task_id": row.task_id, "harness": row.harness,
        "step": row.step, "sample_index": row.sample_index, "group_id": row.group_id, "model": row.model,
        "outcome": row.outcome, "infra_failure": row.infra_failure, "error": row.error,
        "exit_code": row.exit_code, "attempts": row.attempts, "timings": row.timings.to_dict(),
        "category": stats.category(info, snap.grades.get(row.trial_id)),
        "patch": row.patch, "messages": _annotated_messages(messages), "segments": segs, "calls": calls,
        # its events (every tool call classified) from the row: the overview's summaries do not keep them
        "behaviour": behaviour.behaviour_dict(behaviour.trial_behaviour(row)), "grade": grade_data,
        "cost": costs.cost_of(row).to_dict(), "fork_cost": costs.segments_fork_cost(row.segments).to_dict(),
        "fingerprint": row.fingerprint.to_dict() if row.fingerprint else None,
    }
