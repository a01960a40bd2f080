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
    """The :data:`METRICS` over a set of trials (infrastructure failures left out and counted), in one pass."""
    n = editing = verifying = tests = cutoffs = talking = text_only_trials = 0
    turns = model = env = forks = parse = text_only = asst = reasoning = response = 0
    per_turn: list[float] = []
    for t in trials:
        if t.infra_failure:
            continue
        n += 1
        turns += t.turns
        model += t.model_tokens
        env += t.env_tokens
        forks += t.forks
        parse += t.parse_errors
        text_only += t.text_only_turns
        asst += t.assistant_turns
        reasoning += t.reasoning_chars
        response += t.response_chars
        if t.assistant_turns:
            per_turn.append(t.tool_calls / t.assistant_turns)
            talking += 1
            text_only_trials += not t.tool_calls
        if t.edits > 0:
            editing += 1
            verifying += t.self_verifying
        tests += t.test_runs > 0
        cutoffs += bool(t.budget_stops)
    out: dict[str, Any] = {
        "trials": n,
        "infra_excluded": len(trials) - n,
        "turns_per_trial": _ratio(turns, n),
        "model_tokens_per_trial": _ratio(model, n),
        "env_tokens_per_trial": _ratio(env, n),
        "tool_calls_per_turn": _mean(per_turn),
        "text_only_turn_share": _ratio(text_only, asst),
        "text_only_trial_share": _ratio(text_only_trials, talking),
        "reasoning_share": _ratio(reasoning, response),
        "edit_rate": _ratio(editing, n),
        "self_verification_rate": _ratio(verifying, editing),
        "test_run_rate": _ratio(tests, n),
        "forks_per_trial": _ratio(forks, n),
        "parse_errors_per_trial": _ratio(parse, n),
        "budget_cutoff_rate": _ratio(cutoffs, n),
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
