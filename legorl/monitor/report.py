"""The eval report: pass@k per harness and repository, outcomes, behaviour, baseline comparison.

:func:`build_report` turns a run directory into a plain dict; :func:`write_report` writes it as
``eval/report.json`` and ``eval/report.md``; :func:`render` makes the rich table the CLI prints;
:func:`export_predictions` writes ``eval/predictions.jsonl`` in the official SWE-bench format.
The report holds no timestamps or absolute paths and is serialised with sorted keys, so the same
run gives the same bytes.
"""

from __future__ import annotations

import json
import os
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table

from legorl.core.errors import LegorlError
from legorl.monitor import behaviour, behaviour_summary, passk, stats
from legorl.monitor.loading import RunReader, Snapshot
from legorl.trials import costs

REPORT_VERSION = 1


def select_steps(snap: Snapshot, steps: Sequence[int] | None) -> list[int]:
    """The steps a report covers: those asked for, else the latest step with trials."""
    present = sorted({t.step for t in snap.trials.values()})
    if not present:
        raise LegorlError(f"{snap.root}: no rollouts to report on (rollouts/ is empty)")
    if steps is None:
        return [present[-1]]
    missing = sorted(set(steps) - set(present))
    if missing:
        raise LegorlError(f"{snap.root}: no rollouts at step {missing[0]} (steps present: {present})")
    return sorted(set(steps))


def build_report(
    run: str | os.PathLike[str] | Snapshot,
    steps: Sequence[int] | None = None,
    ks: Sequence[int] | None = None,
    baseline: str | os.PathLike[str] | Snapshot | None = None,
) -> dict[str, Any]:
    """The report of ``run`` over ``steps`` (default: its latest step), optionally beside a baseline."""
    snap = run if isinstance(run, Snapshot) else RunReader(run).snapshot()
    chosen = select_steps(snap, steps)
    problems = stats.problems(snap, chosen)
    ks = sorted(set(ks)) if ks else passk.default_ks(problems)
    trials = [t for t in snap.trials.values() if t.step in chosen]
    outcomes: dict[str, Counter[str]] = defaultdict(Counter)
    for t in trials:
        outcomes[t.harness][stats.category(t, snap.grades.get(t.trial_id))] += 1
    beh = {row["harness"]: {k: v for k, v in row.items() if k not in ("step", "harness")}
           for row in behaviour_summary.aggregate(_restep(t.behaviour) for t in trials)}
    models = sorted({t.model for t in trials if t.model})
    report: dict[str, Any] = {
        "report_version": REPORT_VERSION,
        "run": snap.name,
        "models": models,
        "steps": chosen,
        "harnesses": sorted({t.harness for t in trials}),
        "trials": len(trials),
        "infra_failures": sum(1 for t in trials if snap.is_infra(t)),
        "pending": sum(p.pending for p in problems),
        **passk.tables(problems, ks),
        "outcomes": {h: {c: outcomes[h][c] for c in stats.sort_categories(outcomes[h])} for h in sorted(outcomes)},
        "behaviour": beh,
    }
    if baseline is not None:
        base = build_report(baseline, None, ks)
        base.pop("baseline", None)
        report["baseline"] = base
    return report


def _restep(b: behaviour.TrialBehaviour) -> behaviour.TrialBehaviour:
    """The report pools its steps: aggregate everything under one step."""
    return replace(b, step=0)


def to_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2, sort_keys=True) + "\n"


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{100 * v:.1f}%"


def _num(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def _passk_rows(report: dict[str, Any]) -> list[tuple[str, str, dict[str, Any], dict[str, Any] | None]]:
    """(section, name, row, baseline row or None) for the overall, harness and repo tables."""
    base = report.get("baseline")
    rows: list[tuple[str, str, dict[str, Any], dict[str, Any] | None]] = [
        ("overall", "all", report["overall"], base["overall"] if base else None)
    ]
    for section in ("by_harness", "by_repo"):
        label = section.removeprefix("by_")
        for name, row in report[section].items():
            rows.append((label, name, row, base[section].get(name) if base else None))
    return rows


def _cell(row: dict[str, Any], k: int) -> str:
    return _pct(row["pass_at"].get(str(k)))


def _delta(row: dict[str, Any], base: dict[str, Any] | None, k: int) -> str:
    if base is None:
        return "—"
    a, b = row["pass_at"].get(str(k)), base["pass_at"].get(str(k))
    if a is None or b is None:
        return "—"
    return f"{100 * (a - b):+.1f}"


def to_markdown(report: dict[str, Any]) -> str:
    ks = report["ks"]
    base = report.get("baseline")
    lines = [f"# Eval report: {report['run']}", ""]
    lines.append(f"- models: {', '.join(report['models']) or 'unknown'}")
    lines.append(f"- steps: {', '.join(map(str, report['steps']))}")
    lines.append(f"- harnesses: {', '.join(report['harnesses'])}")
    lines.append(f"- trials: {report['trials']} (unrecovered infrastructure failures, counted as failed "
                 f"attempts: {report['infra_failures']}; not graded yet: {report['pending']})")
    if base:
        lines.append(f"- baseline: {base['run']} (steps {', '.join(map(str, base['steps']))})")
    lines += ["", "## pass@k", ""]
    header = ["", "name", "tasks", "attempts", "infra"] + [f"pass@{k}" for k in ks]
    if base:
        header += [f"baseline pass@{k}" for k in ks] + [f"Δ pass@{k} (pts)" for k in ks]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * len(header))
    for section, name, row, brow in _passk_rows(report):
        cells = [section, name, str(row["tasks"]), str(row["attempts"]), str(row["infra_failures"])]
        cells += [_cell(row, k) for k in ks]
        if base:
            cells += [_cell(brow, k) if brow else "—" for k in ks] + [_delta(row, brow, k) for k in ks]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Outcomes", ""]
    cats = stats.sort_categories(c for h in report["outcomes"].values() for c in h)
    lines.append("| harness | " + " | ".join(cats) + " |")
    lines.append("|" + "---|" * (len(cats) + 1))
    for harness, counts in report["outcomes"].items():
        lines.append(f"| {harness} | " + " | ".join(str(counts.get(c, 0)) for c in cats) + " |")
    lines += ["", "## Behaviour", ""]
    names = list(report["behaviour"])
    lines.append("| metric | " + " | ".join(names) + " |")
    lines.append("|" + "---|" * (len(names) + 1))
    for metric in ["trials", *behaviour_summary.METRICS]:
        lines.append(f"| {metric} | " + " | ".join(_num(report["behaviour"][n].get(metric)) for n in names) + " |")
    lines += costs.to_markdown(report.get("cost") or [])  # legorl eval's (legorl.flows.evaluation)
    return "\n".join(lines) + "\n"


def render(report: dict[str, Any]) -> RenderableType:
    """Rich tables: pass@k (with the baseline beside it when there is one) and outcomes."""
    ks = report["ks"]
    base = report.get("baseline")
    title = f"eval {report['run']} · steps {', '.join(map(str, report['steps']))}"
    if base:
        title += f" vs {base['run']}"
    table = Table(title=title, title_justify="left")
    for col in ("", "name", "tasks", "attempts", "infra"):
        table.add_column(col, justify="right" if col in ("tasks", "attempts", "infra") else "left")
    for k in ks:
        table.add_column(f"pass@{k}", justify="right")
    if base:
        for k in ks:
            table.add_column(f"base pass@{k}", justify="right", style="dim")
        for k in ks:
            table.add_column(f"Δ@{k}", justify="right")
    for section, name, row, brow in _passk_rows(report):
        cells = [section, name, str(row["tasks"]), str(row["attempts"]), str(row["infra_failures"])]
        cells += [_cell(row, k) for k in ks]
        if base:
            cells += [_cell(brow, k) if brow else "—" for k in ks] + [_delta(row, brow, k) for k in ks]
        table.add_row(*cells)
    cats = stats.sort_categories(c for h in report["outcomes"].values() for c in h)
    outcomes = Table(title="outcomes", title_justify="left")
    outcomes.add_column("harness")
    for c in cats:
        outcomes.add_column(c, justify="right")
    for harness, counts in report["outcomes"].items():
        outcomes.add_row(harness, *(str(counts.get(c, 0)) for c in cats))
    return Group(table, outcomes)


def write_report(run: str | os.PathLike[str], report: dict[str, Any]) -> tuple[Path, Path]:
    """Write ``eval/report.json`` and ``eval/report.md`` atomically."""
    folder = Path(run) / "eval"
    folder.mkdir(parents=True, exist_ok=True)
    paths = (folder / "report.json", folder / "report.md")
    for path, text in zip(paths, (to_json(report), to_markdown(report)), strict=True):
        _atomic_write(path, text)
    return paths


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def predictions(snap: Snapshot, steps: Sequence[int], harness: str | None = None,
                model_name: str | None = None) -> list[dict[str, str]]:
    """One SWE-bench prediction per task: the lowest-index non-infrastructure sample of ``harness``.

    ``harness`` defaults to the only harness in the selection; with several, one must be named
    (the official harness keys predictions by ``instance_id`` alone).
    """
    trials = [t for t in snap.trials.values() if t.step in steps and not snap.is_infra(t)]
    harnesses = sorted({t.harness for t in trials})
    if harness is None:
        if len(harnesses) > 1:
            raise LegorlError(f"{snap.root}: several harnesses ({', '.join(harnesses)}); name one for predictions")
        harness = harnesses[0] if harnesses else None
    chosen: dict[str, Any] = {}
    for t in sorted(trials, key=lambda t: (t.task_id, t.step, t.sample_index)):
        if t.harness == harness and t.task_id not in chosen:
            chosen[t.task_id] = t
    out = []
    for task_id in sorted(chosen):
        t = chosen[task_id]
        name = model_name or t.model or snap.name
        out.append({"instance_id": task_id, "model_name_or_path": name, "model_patch": t.patch or ""})
    return out


def export_predictions(run: str | os.PathLike[str], steps: Sequence[int] | None = None,
                       harness: str | None = None, model_name: str | None = None,
                       path: str | os.PathLike[str] | None = None) -> Path:
    """Write ``eval/predictions.jsonl`` (``instance_id, model_name_or_path, model_patch``).

    With several harnesses, call once per harness with its own ``path``
    (e.g. ``eval/predictions-<harness>.jsonl``).
    """
    snap = RunReader(run).snapshot()
    rows = predictions(snap, select_steps(snap, steps), harness, model_name)
    path = Path(path) if path is not None else Path(run) / "eval" / "predictions.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    return path
