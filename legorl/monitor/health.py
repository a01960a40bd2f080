"""A one-screen health summary of a run, for ``legorl inspect``.

:func:`health_summary` answers the questions people watching a run ask first — is it learning
(reward, solve rate), does the gradient have signal (zero-variance groups), are the rollouts
faithful (logprob correlation, mismatch KL, ESS), what is the agent doing (behaviour) and is the
infrastructure healthy — and lists warnings where a figure is out of its usual range.
:func:`health_renderable` lays it out with rich.
"""

from __future__ import annotations

import os
from typing import Any

from rich.columns import Columns
from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from legorl.core import metric_keys as mk
from legorl.monitor import behaviour_summary, stats
from legorl.monitor.loading import RunReader, Snapshot
from legorl.trials import fingerprints, provenance

# The trainer's figures the summary shows, by their metric keys.
FIDELITY_KEYS = tuple(mk.FIDELITY_PANEL)

# Behaviour figures the summary shows (all of them are in the dashboard).
_BEHAVIOUR_HEADLINES = ("turns_per_trial", "tool_calls_per_turn", "text_only_turn_share", "self_verification_rate",
                        "test_run_rate", "parse_errors_per_trial", "budget_cutoff_rate")


def _latest_pair(steps: list[int], values: list[Any]) -> tuple[Any, Any]:
    latest = values[-1] if values else None
    previous = values[-2] if len(values) > 1 else None
    return latest, previous


def health_summary(run: str | os.PathLike[str] | Snapshot, mixes: list[str] | None = None) -> dict[str, Any]:
    """The health figures of a run as plain data (JSON-able, deterministic for a given run);
    ``mixes``: the run's :func:`legorl.trials.fingerprints.run_mixes` when the caller has them."""
    snap = run if isinstance(run, Snapshot) else RunReader(run).snapshot()
    trials = list(snap.trials.values())
    steps = sorted({t.step for t in trials})
    latest_step = steps[-1] if steps else None
    infra = sum(1 for t in trials if snap.is_infra(t))
    graded = sum(1 for t in trials if t.trial_id in snap.grades)
    pending = sum(1 for t in trials if t.trial_id not in snap.grades and not t.infra_failure)
    rewards = stats.reward_by_step(snap).get(stats.ALL, {"steps": [], "reward_mean": [], "solve_rate": []})
    groups = stats.groups_by_step(snap)
    outcomes = stats.outcomes_by_step(snap)
    latest_outcomes = (
        {c: v[-1] for c, v in outcomes["categories"].items() if v[-1]} if outcomes["steps"] else {}
    )
    beh_rows = [r for r in behaviour_summary.aggregate(t.behaviour for t in trials if t.step == latest_step)
                if r["harness"] == stats.ALL]
    beh = {k: beh_rows[0].get(k) for k in _BEHAVIOUR_HEADLINES} if beh_rows else {}
    metrics = stats.metric_series(snap)
    fidelity: dict[str, Any] = {}
    for key in FIDELITY_KEYS:
        series = metrics.get(key, {}).get(stats.ALL)
        if series and series["values"]:
            fidelity[key] = {"step": series["steps"][-1], "value": series["values"][-1]}
    reward_latest, reward_prev = _latest_pair(rewards["steps"], rewards["reward_mean"])
    solve_latest, solve_prev = _latest_pair(rewards["steps"], rewards["solve_rate"])
    zv_latest = groups["zero_variance_share"][-1] if groups["steps"] else None
    summary: dict[str, Any] = {
        "run": snap.name,
        "tasks": len(snap.task_ids),
        "trials": len(trials),
        "graded": graded,
        "pending_grades": pending,
        "steps": steps,
        "latest_step": latest_step,
        "harnesses": sorted({t.harness for t in trials}),
        "infra_failures": infra,
        "infra_rate": round(infra / len(trials), 6) if trials else None,
        "reward_mean": {"latest": reward_latest, "previous": reward_prev},
        "solve_rate": {"latest": solve_latest, "previous": solve_prev},
        "zero_variance_share": zv_latest,
        "outcomes_latest_step": latest_outcomes,
        "behaviour_latest_step": beh,
        "fidelity": fidelity,
        "staleness": _staleness(metrics),
        "eval": _eval_headline(snap.eval_report),
        "fingerprint_mixes": fingerprints.run_mixes(snap.root) if mixes is None else mixes,
    }
    summary["warnings"] = warnings(summary)
    return summary


def _staleness(metrics: dict[str, Any]) -> dict[str, Any] | None:
    """The overlapped loop's latest staleness figures (legorl.trials.provenance): step, share of trials per lag,
    trials stale and dropped; None when the loop wrote none (a synchronous run)."""
    lags = {key.removeprefix(provenance.TRIALS_AT_LAG): s for key, by in metrics.items()
            if key.startswith(provenance.TRIALS_AT_LAG) and (s := by.get(stats.ALL))}
    if not lags:
        return None
    step = max(s["steps"][-1] for s in lags.values())

    def at(series: dict[str, Any] | None) -> float | None:
        found = [v for st, v in zip(series["steps"], series["values"], strict=True) if st == step] if series else []
        return found[-1] if found else None

    return {
        "step": step,
        "trials_by_lag": {lag: v for lag, s in sorted(lags.items(), key=lambda kv: int(kv[0]))
                          if (v := at(s)) is not None},
        "trials_stale": at(metrics.get(provenance.TRIALS_STALE, {}).get(stats.ALL)),
        "trials_dropped": at(metrics.get(provenance.TRIALS_DROPPED, {}).get(stats.ALL)),
    }


def _eval_headline(report: dict[str, Any] | None) -> dict[str, Any] | None:
    if not report:
        return None
    return {"steps": report.get("steps"), "pass_at": report.get("overall", {}).get("pass_at", {})}


def _value(summary: dict[str, Any], *path: str) -> Any:
    node: Any = summary
    for p in path:
        if not isinstance(node, dict):
            return None
        node = node.get(p)
    return node


def warnings(summary: dict[str, Any]) -> list[str]:
    """Plain-language warnings for figures outside their usual range (thresholds are rules of thumb)."""
    out = []
    checks: list[tuple[tuple[str, ...], Any, str]] = [
        (("infra_rate",), lambda v: v > 0.1, "more than 10% of trials are infrastructure failures"),
        (("zero_variance_share",), lambda v: v > 0.8, "over 80% of groups have zero reward variance: little gradient signal"),
        (("behaviour_latest_step", "text_only_turn_share"), lambda v: v > 0.5,
         "most turns call no tool: the policy may be collapsing to text-only answers"),
        (("behaviour_latest_step", "budget_cutoff_rate"), lambda v: v > 0.3, "over 30% of trials hit a budget (turns, tokens, context, wall time)"),
        (("behaviour_latest_step", "parse_errors_per_trial"), lambda v: v > 1, "more than one tool-call parse error per trial"),
    ]
    for path, test, message in checks:
        value = _value(summary, *path)
        if isinstance(value, int | float) and test(value):
            out.append(f"{message} ({'.'.join(path)} = {value:.3g})")
    fidelity_checks: list[tuple[str, Any, str]] = [
        (mk.LOGPROB_PEARSON, lambda v: v < 0.9,
         "rollout and trainer logprobs correlate below 0.9: check the engine/trainer match"),
        (mk.MISMATCH_KL, lambda v: v > 0.01, "mismatch KL above 0.01"),
        (mk.IS_ESS, lambda v: v < 0.5, "effective sample size below 0.5"),
    ]
    for key, test, message in fidelity_checks:
        entry = _value(summary, "fidelity", key) or {}
        value = entry.get("value")
        if isinstance(value, int | float) and test(value):
            out.append(f"{message} ({key} = {value:.3g} at step {entry.get('step')})")
    out += [f"rows mix fingerprints: {line}" for line in summary.get("fingerprint_mixes") or []]
    return out


def _fmt(v: Any, pct: bool = False) -> str:
    if v is None:
        return "—"
    if pct:
        return f"{100 * v:.1f}%"
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def _trend(figure: dict[str, Any], pct: bool) -> Text:
    latest, previous = figure.get("latest"), figure.get("previous")
    text = Text(_fmt(latest, pct))
    if isinstance(latest, float | int) and isinstance(previous, float | int):
        delta = latest - previous
        arrow = "▲" if delta > 0 else "▼" if delta < 0 else "="
        style = "green" if delta > 0 else "red" if delta < 0 else "dim"
        text.append(f" {arrow} {_fmt(abs(delta), pct)}", style=style)
    return text


def health_renderable(summary: dict[str, Any]) -> RenderableType:
    """The summary as one screen: run, learning, signal, fidelity, behaviour, outcomes, warnings."""
    top = Table.grid(padding=(0, 2))
    top.add_column(style="bold")
    top.add_column()
    top.add_row("run", f"{summary['run']} · harnesses {', '.join(summary['harnesses']) or '—'}")
    top.add_row("progress", f"{summary['tasks']} tasks · {summary['trials']} trials · steps "
                f"{summary['steps'][0] if summary['steps'] else '—'}–{summary['latest_step'] if summary['steps'] else '—'}"
                f" · {summary['graded']} graded, {summary['pending_grades']} pending")
    top.add_row("infra failures", f"{summary['infra_failures']} ({_fmt(summary['infra_rate'], pct=True)})")
    top.add_row("reward (latest step)", _trend(summary["reward_mean"], pct=False))
    top.add_row("solve rate", _trend(summary["solve_rate"], pct=True))
    top.add_row("zero-variance groups", _fmt(summary["zero_variance_share"], pct=True))
    if summary.get("staleness"):
        st = summary["staleness"]
        lags = ", ".join(f"lag {lag} {_fmt(v, pct=True)}" for lag, v in st["trials_by_lag"].items())
        top.add_row("staleness", f"step {st['step']}: {lags or '—'} of trials · {_fmt(st['trials_stale'])} stale, "
                    f"{_fmt(st['trials_dropped'])} dropped")
    if summary.get("eval"):
        passes = ", ".join(f"pass@{k} {_fmt(v, pct=True)}" for k, v in summary["eval"]["pass_at"].items())
        top.add_row("eval", passes or "—")

    fid = Table(title="fidelity (latest)", title_justify="left", show_header=False, box=None)
    fid.add_column(style="cyan")
    fid.add_column(justify="right")
    for key in FIDELITY_KEYS:
        entry = summary["fidelity"].get(key)
        fid.add_row(key, _fmt(entry["value"]) if entry else "—")

    beh = Table(title="behaviour (latest step)", title_justify="left", show_header=False, box=None)
    beh.add_column(style="cyan")
    beh.add_column(justify="right")
    for key in _BEHAVIOUR_HEADLINES:
        value = summary["behaviour_latest_step"].get(key)
        beh.add_row(key, _fmt(value, pct=key.endswith(("share", "rate"))))

    out = Table(title="outcomes (latest step)", title_justify="left", show_header=False, box=None)
    out.add_column(style="cyan")
    out.add_column(justify="right")
    for cat, count in summary["outcomes_latest_step"].items():
        out.add_row(cat, str(count))

    # side by side when they fit, one under another in a narrow terminal (never truncated labels)
    columns = Columns([fid, beh, out], padding=(1, 4))
    parts: list[RenderableType] = [top, Text(""), columns]
    if summary["warnings"]:
        parts.append(Text(""))
        parts.extend(Text(f"⚠ {w}", style="yellow") for w in summary["warnings"])
    return Panel(Group(*parts), title=f"legorl health · {summary['run']}", title_align="left")
