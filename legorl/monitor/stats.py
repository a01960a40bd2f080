"""Run statistics from a :class:`~legorl.monitor.loading.Snapshot`: rewards, outcomes, groups.

Shared by the eval report, the health summary and the dashboard so all three agree. A trial is an
infrastructure failure when its rollout or its grade says so; such trials are left out of rewards,
solve rates and group statistics, and counted in the outcome breakdown.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from legorl.core.schemas import GradeStatus, grade_is_infra
from legorl.monitor.loading import GradeInfo, Snapshot, TrialInfo
from legorl.monitor.passk import Problem

ALL = "all"

INFRA_ROLLOUT = "infra: rollout"
INFRA_GRADE = "infra: grade"
PENDING = "not graded yet"
RESOLVED = "resolved"

# Display order of outcome categories (others follow alphabetically).
CATEGORY_ORDER = [
    RESOLVED, "unresolved: submitted", "unresolved: no_submission", "unresolved: max_turns", "unresolved: budget",
    "unresolved: context_overflow", "unresolved: timeout", "unresolved: harness_crash",
    "grade: empty_patch", "grade: patch_apply_failed", "grade: test_timeout", PENDING, INFRA_ROLLOUT, INFRA_GRADE,
]


def category(trial: TrialInfo, grade: GradeInfo | None) -> str:
    """One label per trial combining how the rollout ended and how grading went."""
    if trial.infra_failure:
        return INFRA_ROLLOUT
    if grade is None:
        return PENDING
    if grade_is_infra(grade.infra_failure, grade.status, grade.reward):
        return INFRA_GRADE
    if grade.resolved:
        return RESOLVED
    if grade.status != GradeStatus.GRADED:
        return f"grade: {grade.status}"
    return f"unresolved: {trial.outcome}"


def sort_categories(names: Iterable[str]) -> list[str]:
    rank = {c: i for i, c in enumerate(CATEGORY_ORDER)}
    return sorted(set(names), key=lambda c: (rank.get(c, len(rank)), c))


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 6)


_T = TypeVar("_T")


def _once(snap: Snapshot, name: str, compute: Callable[[Snapshot], _T]) -> _T:
    """``compute(snap)``, computed once per snapshot (a snapshot never changes; the overview and the
    health summary ask for the same figures): callers must not change what it returns."""
    if name not in snap.derived:
        snap.derived[name] = compute(snap)
    found: _T = snap.derived[name]
    return found


def scored(snap: Snapshot) -> list[tuple[TrialInfo, GradeInfo]]:
    """Trials with a usable grade (graded, not an infrastructure failure), sorted by trial id."""
    return list(_once(snap, "scored", _scored))


def _scored(snap: Snapshot) -> list[tuple[TrialInfo, GradeInfo]]:
    found = []
    for tid in sorted(snap.trials):
        trial = snap.trials[tid]
        grade = snap.grades.get(tid)
        if grade is not None and not snap.is_infra(trial):
            found.append((trial, grade))
    return found


def categories(snap: Snapshot) -> dict[str, str]:
    """:func:`category` of each trial of the snapshot, by trial id."""
    return _once(snap, "categories", _categories)


def _categories(snap: Snapshot) -> dict[str, str]:
    grades = snap.grades
    return {tid: category(trial, grades.get(tid)) for tid, trial in snap.trials.items()}


def reward_by_step(snap: Snapshot) -> dict[str, dict[str, list[Any]]]:
    """Per harness (and ``all``): steps, mean reward, solve rate and trial count."""
    return _once(snap, "reward_by_step", _reward_by_step)


def _reward_by_step(snap: Snapshot) -> dict[str, dict[str, list[Any]]]:
    acc: dict[tuple[str, int], list[float]] = {}  # (harness, step) -> [reward sum, solved, trials], in trial order
    for trial, grade in scored(snap):
        reward, solved = grade.reward or 0.0, bool(grade.resolved)
        for key in ((trial.harness, trial.step), (ALL, trial.step)):
            sums = acc.get(key)
            if sums is None:
                sums = acc[key] = [0, 0, 0]
            sums[0] += reward
            sums[1] += solved
            sums[2] += 1
    out: dict[str, dict[str, list[Any]]] = {}
    for (harness, step) in sorted(acc):
        total, solved_n, n = acc[(harness, step)]
        series = out.setdefault(harness, {"steps": [], "reward_mean": [], "solve_rate": [], "n": []})
        series["steps"].append(step)
        series["reward_mean"].append(_r(total / n))
        series["solve_rate"].append(_r(solved_n / n))
        series["n"].append(int(n))
    return out


def outcomes_by_step(snap: Snapshot) -> dict[str, Any]:
    """Counts of each outcome category per step (every trial, infrastructure failures included)."""
    return _once(snap, "outcomes_by_step", _outcomes_by_step)


def _outcomes_by_step(snap: Snapshot) -> dict[str, Any]:
    counts: dict[int, Counter[str]] = defaultdict(Counter)
    by_trial = categories(snap)
    for trial in snap.trials.values():
        counts[trial.step][by_trial[trial.trial_id]] += 1
    steps = sorted(counts)
    names = sort_categories(c for cnt in counts.values() for c in cnt)
    return {"steps": steps, "categories": {n: [counts[s][n] for s in steps] for n in names}}


def groups_by_step(snap: Snapshot) -> dict[str, list[Any]]:
    """Per step: groups (same task, same step) that are all solved, all failed, or mixed.

    A group with the same reward on every attempt has zero advantage everywhere: no gradient.
    Groups with fewer than two scored attempts are not counted.
    """
    return _once(snap, "groups_by_step", _groups_by_step)


def _groups_by_step(snap: Snapshot) -> dict[str, list[Any]]:
    groups: dict[str, list[float]] = defaultdict(list)
    step_of: dict[str, int] = {}
    for trial, grade in scored(snap):
        groups[trial.group_id].append(grade.reward or 0.0)
        step_of[trial.group_id] = trial.step
    per_step: dict[int, Counter[str]] = defaultdict(Counter)
    for gid, rewards in groups.items():
        if len(rewards) < 2:
            continue
        if max(rewards) != min(rewards):
            kind = "mixed"
        elif rewards[0] > 0:
            kind = "all_solved"
        else:
            kind = "all_failed"
        per_step[step_of[gid]][kind] += 1
    steps = sorted(per_step)
    out: dict[str, list[Any]] = {"steps": steps, "all_solved": [], "all_failed": [], "mixed": [],
                                 "zero_variance_share": []}
    for s in steps:
        c = per_step[s]
        for kind in ("all_solved", "all_failed", "mixed"):
            out[kind].append(c[kind])
        total = sum(c.values())
        out["zero_variance_share"].append(_r((c["all_solved"] + c["all_failed"]) / total))
    return out


def token_lags_by_step(snap: Snapshot) -> dict[str, Any]:
    """Per step: its sampled tokens of known policy version and the share of them that lag each number
    of versions behind the step (:func:`legorl.trials.provenance.token_lags`), over the trials training takes
    (not rollout infrastructure failures), as the loop's ``staleness/tokens_lag/`` figures. Steps
    without a versioned token are left out; lags are sorted."""
    counts: dict[int, Counter[int]] = defaultdict(Counter)
    for trial in snap.trials.values():
        if trial.token_lags and not trial.infra_failure:
            counts[trial.step].update(trial.token_lags)
    steps = sorted(counts)
    totals = [sum(counts[s].values()) for s in steps]
    lags = sorted({lag for c in counts.values() for lag in c})
    return {"steps": steps, "tokens": totals,
            "shares": {str(lag): [_r(counts[s][lag] / n) for s, n in zip(steps, totals, strict=True)] for lag in lags}}


def task_step_grid(snap: Snapshot) -> dict[str, Any]:
    """Solve rate per (task, step) where the task was attempted: ``tasks`` (sorted) and ``steps``
    (sorted), and one cell ``[task index, step index, solve rate, attempts]`` per attempted pair.
    Sparse: a run attempts each task at a few of its steps (the dense grid of a 10^5-trial run held
    2.4 M cells, nearly all empty)."""
    acc: dict[tuple[str, int], list[int]] = {}  # (task, step) -> [solved, attempts]
    for trial, grade in scored(snap):
        cell = acc.setdefault((trial.task_id, trial.step), [0, 0])
        cell[0] += bool(grade.resolved)
        cell[1] += 1
    tasks = sorted({t for t, _ in acc})
    steps = sorted({s for _, s in acc})
    row = {t: i for i, t in enumerate(tasks)}
    column = {s: i for i, s in enumerate(steps)}
    cells = [[row[t], column[s], _r(c[0] / c[1]), c[1]] for (t, s), c in sorted(acc.items())]
    return {"tasks": tasks, "steps": steps, "cells": cells}


def problems(snap: Snapshot, steps: Iterable[int] | None = None) -> list[Problem]:
    """One pass@k problem per (task, harness) over trials of ``steps`` (all steps when None)."""
    wanted = None if steps is None else set(steps)
    acc: dict[tuple[str, str], Problem] = {}
    for tid in sorted(snap.trials):
        trial = snap.trials[tid]
        if wanted is not None and trial.step not in wanted:
            continue
        p = acc.setdefault(
            (trial.task_id, trial.harness), Problem(trial.task_id, trial.harness, snap.repo_of(trial.task_id))
        )
        grade = snap.grades.get(tid)
        if snap.is_infra(trial):
            p.infra += 1
            p.n += 1  # an incorrect attempt (passk's docstring says why)
        elif grade is None:
            p.pending += 1
        else:
            p.n += 1
            p.c += int(bool(grade.resolved))
    return [acc[k] for k in sorted(acc)]


def metric_series(snap: Snapshot) -> dict[str, dict[str, dict[str, list[Any]]]]:
    """Metric rows as series: key -> harness (``all`` when none) -> steps and values, sorted by step."""
    latest: dict[tuple[str, str, int], float | None] = {}
    for m in snap.metrics:
        latest[(m.key, m.harness or ALL, m.step)] = m.value
    out: dict[str, dict[str, dict[str, list[Any]]]] = {}
    for key, harness, step in sorted(latest):
        series = out.setdefault(key, {}).setdefault(harness, {"steps": [], "values": []})
        series["steps"].append(step)
        series["values"].append(latest[(key, harness, step)])
    return out
