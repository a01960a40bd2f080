"""What each trial cost, per trial and per step and harness.

:func:`trial_cost` is the one definition of a trial's cost (:class:`~legorl.core.schemas.TrialCost`, on
every trial row): derived from its calls and attempts, plus the one figure nothing else records,
the seconds its sandboxes lived. :func:`cost_table` sums it per step and harness for ``legorl
eval``'s report and the dashboard; rows written before costs were recorded get theirs derived
(without sandbox seconds). :func:`fork_cost` is what a trial's segments cost a trainer against what
the policy sampled: a harness that rewrites its history forks the trial into segments repeating the
same prompt.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from legorl.core.schemas import Call, Segment, TrialCost

ALL = "all"  # the harness of a cost row over every harness (as legorl.monitor.stats.ALL)


def _get(obj: Any, name: str) -> Any:
    if isinstance(obj, dict):  # before the Mapping test, which is slow: called per trial of a run
        return obj.get(name)
    return obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)


def trial_cost(calls: Sequence[Call | Mapping[str, Any]], attempts: int, sandbox_s: float | None) -> TrialCost:
    """A trial's cost from its calls (a row's, or their dicts as shards read them), its attempts and the
    seconds its sandboxes lived (None: not measured)."""
    prompt = sum(_get(c, "prompt_tokens") or 0 for c in calls)
    new = sum(_get(c, "new_prompt_tokens") or 0 for c in calls)
    return TrialCost(
        sandbox_s=None if sandbox_s is None else round(sandbox_s, 3),
        engine_s=round(sum(_get(c, "latency_s") or 0.0 for c in calls), 3),
        prompt_tokens=prompt,
        sampled_tokens=sum(_get(c, "completion_tokens") or 0 for c in calls),
        cached_tokens=max(0, prompt - new),
        retries=max(0, (attempts or 1) - 1),
    )


def cost_of(row: Any) -> TrialCost:
    """A row's recorded cost; derived from its calls for rows written before it was recorded."""
    cost = _get(row, "cost")
    if isinstance(cost, TrialCost):
        return cost
    if isinstance(cost, Mapping):
        return TrialCost.from_dict(dict(cost))
    return trial_cost(_get(row, "calls") or [], _get(row, "attempts") or 1, None)


@dataclass(frozen=True)
class ForkCost:
    """A trial's segment tokens (what a trainer's forward pass reads) against its sampled tokens (what it
    learns from), and how many segment tokens repeat a prefix of an earlier segment of the trial (what
    prefix sharing in packing can save: :mod:`legorl.training.packing`)."""

    segments: int
    segment_tokens: int
    sampled_tokens: int
    shared_tokens: int

    @property
    def tokens_per_sampled(self) -> float | None:
        return round(self.segment_tokens / self.sampled_tokens, 2) if self.sampled_tokens else None

    @property
    def shared_share(self) -> float | None:
        return round(self.shared_tokens / self.segment_tokens, 4) if self.segment_tokens else None

    def to_dict(self) -> dict[str, Any]:
        return {"segments": self.segments, "segment_tokens": self.segment_tokens,
                "sampled_tokens": self.sampled_tokens, "shared_tokens": self.shared_tokens,
                "tokens_per_sampled": self.tokens_per_sampled, "shared_share": self.shared_share}


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differs = np.flatnonzero(a[:n] != b[:n])
    return int(differs[0]) if len(differs) else n


def fork_cost(token_ids: Sequence[Sequence[int] | np.ndarray], sampled_tokens: int) -> ForkCost:
    """The :class:`ForkCost` of a trial whose segments hold ``token_ids`` (in order) and whose policy
    sampled ``sampled_tokens``: a segment's shared tokens are the longest prefix it has in common with
    any earlier segment (a fork of a fork shares with the fork)."""
    arrays = [np.asarray(ids, dtype=np.int64) for ids in token_ids]
    shared = sum(max((_common_prefix(arrays[j], a) for j in range(i)), default=0) for i, a in enumerate(arrays))
    return ForkCost(len(arrays), sum(len(a) for a in arrays), int(sampled_tokens), shared)


def segments_fork_cost(segments: Sequence[Segment]) -> ForkCost:
    """:func:`fork_cost` of a trial row's segments."""
    return fork_cost([s.token_ids for s in segments], sum(sum(s.loss_mask) for s in segments))


COST_FIELDS = ("sandbox_s", "engine_s", "prompt_tokens", "sampled_tokens", "cached_tokens", "retries")
_COUNTED = [(name, f"n_{name}") for name in COST_FIELDS]


def cost_table(trials: Iterable[Any]) -> list[dict[str, Any]]:
    """Cost per (step, harness), and per step over every harness (harness ``all``): trials, the sums
    of :data:`COST_FIELDS` (``sandbox_s`` over the trials that measured it), the mean per trial of
    each, and the share of prompt tokens cached. Rows are trial rows or their dicts."""
    sums: dict[tuple[int, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for row in trials:
        cost = cost_of(row)
        known = [(name, counted, value) for name, counted in _COUNTED if (value := getattr(cost, name)) is not None]
        step = int(_get(row, "step") or 0)
        for harness in (str(_get(row, "harness")), ALL):
            acc = sums[(step, harness)]
            acc["trials"] += 1
            for name, counted, value in known:
                acc[name] += value
                acc[counted] += 1
    out = []
    for (step, harness), acc in sorted(sums.items(), key=lambda kv: (kv[0][0], kv[0][1] == ALL, kv[0][1])):
        n = int(acc["trials"])
        entry: dict[str, Any] = {"step": step, "harness": harness, "trials": n}
        for name in COST_FIELDS:
            measured = int(acc[f"n_{name}"])
            total = round(acc[name], 3) if measured else None
            entry[name] = int(total) if total is not None and name not in ("sandbox_s", "engine_s") else total
            entry[f"{name}_per_trial"] = round(acc[name] / measured, 3) if measured else None
        prompt = acc["prompt_tokens"]
        entry["cached_share"] = round(acc["cached_tokens"] / prompt, 4) if prompt else None
        out.append(entry)
    return out


def run_costs(root: Path, trial_ids: Collection[str] | None = None) -> list[dict[str, Any]]:
    """:func:`cost_table` of a run directory's trials (those of ``trial_ids`` when given); reads only
    the columns it needs."""
    from legorl.core import shards
    from legorl.core.schemas import Kind

    columns = ["trial_id", "harness", "step", "attempts", "calls", "cost"]
    rows = shards.read(Path(root) / "rollouts", Kind.ROLLOUTS, columns=columns).table.to_pylist()
    return cost_table(r for r in rows if trial_ids is None or r["trial_id"] in trial_ids)


# the columns of the cost table as reports show it: (heading, key, decimals)
SHOWN: tuple[tuple[str, str, int], ...] = (
    ("trials", "trials", 0), ("sandbox s/trial", "sandbox_s_per_trial", 1),
    ("engine s/trial", "engine_s_per_trial", 2), ("prompt tok/trial", "prompt_tokens_per_trial", 0),
    ("sampled tok/trial", "sampled_tokens_per_trial", 0), ("cached share", "cached_share", 3),
    ("retries", "retries", 0),
)


def _cell(value: Any, decimals: int) -> str:
    if value is None:
        return "—"
    return f"{value:.{decimals}f}" if decimals else f"{round(value):d}"


def to_markdown(table: Sequence[Mapping[str, Any]]) -> list[str]:
    """The cost table as markdown lines (a "## Cost" section; none for an empty table)."""
    if not table:
        return []
    header = ["step", "harness", *(h for h, _, _ in SHOWN)]
    lines = ["", "## Cost per trial", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in table:
        cells = [str(row["step"]), str(row["harness"]), *(_cell(row.get(k), d) for _, k, d in SHOWN)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines
