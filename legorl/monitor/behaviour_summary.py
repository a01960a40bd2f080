"""Behaviour figures aggregated: the :data:`METRICS` per policy step and harness, from the
per-trial figures of :mod:`legorl.monitor.behaviour` (infrastructure failures left out, and counted)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # behaviour re-exports this module's names, so it is imported for types only
    from legorl.monitor.behaviour import TrialBehaviour

# name -> short description, in display order. Rates are shares of trials (or of editing trials).
METRICS: dict[str, str] = {
    "turns_per_trial": "model turns per trial",
    "model_tokens_per_trial": "sampled tokens per trial (loss_mask 1)",
    "env_tokens_per_trial": "prompt and tool-output tokens per trial (loss_mask 0)",
    "tool_calls_per_turn": "tool calls per assistant turn",
    "text_only_turn_share": "share of assistant turns with no tool call",
    "text_only_trial_share": "share of trials that never call a tool",
    "reasoning_share": "reasoning characters / response characters (tool arguments included)",
    "edit_rate": "share of trials that edit a file",
    "self_verification_rate": "share of editing trials that re-read an edited file or run tests after the last edit",
    "test_run_rate": "share of trials that run tests",
    "forks_per_trial": "segments forked by history rewrites or sub-agents, per trial",
    "parse_errors_per_trial": "tool-call parse errors per trial",
    "budget_cutoff_rate": "share of trials cut off by a budget: turns, tokens, context or wall time",
}


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def summarize(trials: Sequence[TrialBehaviour]) -> dict[str, Any]:
    """The :data:`METRICS` over a set of trials (infrastructure failures left out and counted)."""
    kept = [t for t in trials if not t.infra_failure]
    editing = [t for t in kept if t.edited]
    per_turn = [t.tool_calls / t.assistant_turns for t in kept if t.assistant_turns]
    out: dict[str, Any] = {
        "trials": len(kept),
        "infra_excluded": len(trials) - len(kept),
        "turns_per_trial": _mean([t.turns for t in kept]),
        "model_tokens_per_trial": _mean([t.model_tokens for t in kept]),
        "env_tokens_per_trial": _mean([t.env_tokens for t in kept]),
        "tool_calls_per_turn": _mean(per_turn),
        "text_only_turn_share": _ratio(sum(t.text_only_turns for t in kept), sum(t.assistant_turns for t in kept)),
        "text_only_trial_share": _ratio(sum(1 for t in kept if t.assistant_turns and not t.tool_calls),
                                        sum(1 for t in kept if t.assistant_turns)),
        "reasoning_share": _ratio(sum(t.reasoning_chars for t in kept), sum(t.response_chars for t in kept)),
        "edit_rate": _ratio(len(editing), len(kept)),
        "self_verification_rate": _ratio(sum(t.self_verifying for t in editing), len(editing)),
        "test_run_rate": _ratio(sum(t.ran_tests for t in kept), len(kept)),
        "forks_per_trial": _mean([t.forks for t in kept]),
        "parse_errors_per_trial": _mean([t.parse_errors for t in kept]),
        "budget_cutoff_rate": _ratio(sum(1 for t in kept if t.budget_stops), len(kept)),
    }
    return {k: (round(v, 6) if isinstance(v, float) and math.isfinite(v) else v) for k, v in out.items()}


ALL = "all"


def aggregate(trials: Iterable[TrialBehaviour]) -> list[dict[str, Any]]:
    """One summary per (step, harness), plus one per step over all harnesses (harness ``"all"``).

    Sorted by step, then harness, so the output is deterministic.
    """
    groups: dict[tuple[int, str], list[TrialBehaviour]] = defaultdict(list)
    for t in trials:
        groups[(t.step, t.harness)].append(t)
        groups[(t.step, ALL)].append(t)
    return [{"step": step, "harness": harness, **summarize(groups[(step, harness)])}
            for step, harness in sorted(groups)]
