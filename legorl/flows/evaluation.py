"""Evaluation glue: the eval view of a run directory, its settings, its report and predictions.

``legorl eval`` is the rollout and grade stages run with eval settings, then the monitor's report
(composed by :mod:`legorl.flows.evaluate`). So that eval data never mixes with training data, eval
lives in ``RUN/eval/``, which has the layout of a run directory of its own::

    RUN/eval/tasks/      a byte copy of the task set evaluated (RUN/tasks unless told otherwise)
    RUN/eval/rollouts/   one trial row per (task, harness, step, sample)
    RUN/eval/grades/     one grade row per trial
    RUN/eval/report.json, report.md, predictions.jsonl

The report carries, beside the monitor's figures, ``cost``: what the trials cost per step and
harness (:func:`legorl.trials.costs.cost_table`).

Because ``RUN/eval`` is laid out like a run, the unchanged stage functions (and the plain
``legorl rollout --run RUN/eval`` / ``legorl grade --run RUN/eval`` commands) work on it, and the
monitor's :class:`~legorl.monitor.loading.RunReader` reads it. This module owns only what is
eval-specific: mirroring the task set, choosing the trials a report covers, and writing the
report and the SWE-bench predictions deterministically (same shards -> same bytes).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from legorl.core import shards
from legorl.core.errors import LegorlError
from legorl.core.paths import RunDir
from legorl.core.schemas import Kind, trial_key
from legorl.engines.config import DEFAULT_TEMPERATURE
from legorl.grading.grader import GradeOptions
from legorl.trials.costs import run_costs
from legorl.trials.lifecycle import TrialOptions

PREDICTIONS = "predictions.jsonl"


def parse_ks(text: str | None) -> list[int] | None:
    """``"1,5"`` -> ``[1, 5]``."""
    if text is None or not text.strip():
        return None
    try:
        ks = sorted({int(p) for p in text.split(",") if p.strip()})
    except ValueError:
        raise LegorlError(f"--ks {text!r}: expected comma-separated integers such as 1,5") from None
    if not ks or ks[0] < 1:
        raise LegorlError(f"--ks {text!r}: every k must be at least 1")
    return ks


@dataclass(kw_only=True)
class EvalSettings(TrialOptions):
    """Options of ``legorl eval``: the trials' (:class:`~legorl.trials.lifecycle.TrialOptions`), the grading's and the report's."""

    run: Path = field(metadata={"help": "Run directory; the eval lives in RUN/eval."})
    step: int = field(default=0, metadata={"help": "Policy step of the evaluated model (part of every trial key)."})
    ks: list[int] | None = field(default=None, metadata={"parse": parse_ks, "help": (
        "pass@k columns, e.g. 1,5 (default: 1, powers of two up to samples, samples).")})
    tasks: Path | None = field(default=None, metadata={"help": (
        "Task set to evaluate (default: RUN/tasks); copied to RUN/eval/tasks.")})
    baseline: Path | None = field(default=None, metadata={"help": (
        "Another run directory whose eval results are shown side by side.")})
    baseline_step: int | None = field(default=None, metadata={"help": (
        "The baseline's step (default: its latest eval step).")})
    grade: GradeOptions = field(default_factory=GradeOptions)  # how the eval's trials are graded

    def unset_temperature(self) -> float:
        return 0.0 if self.samples == 1 else DEFAULT_TEMPERATURE  # one sample: greedy

    def validate(self) -> None:
        for k in self.ks or []:
            if k < 1:
                raise LegorlError(f"--ks: k must be at least 1, got {k}")

    def as_report_dict(self) -> dict[str, Any]:
        """The settings that shape the numbers, as recorded in the report (no paths, no times)."""
        return {
            "samples": self.samples, "temperature": self.temperature, "step": self.step,
            "limit": self.limit, "max_turns": self.max_turns, "max_tokens": self.max_tokens,
            "timeout_s": self.timeout_s, "grade_timeout_s": self.grade.test_timeout,
        }


def eval_dir(run: str | os.PathLike[str]) -> RunDir:
    """``RUN/eval`` as a run directory of its own."""
    return RunDir.at(RunDir.at(run).eval)


# --------------------------------------------------------------------------- the task set


def _digest(files: Sequence[Path]) -> list[tuple[str, str]]:
    return [(f.name, hashlib.sha256(f.read_bytes()).hexdigest()) for f in files]


def mirror_tasks(source: Path, dest: Path) -> bool:
    """Make ``dest`` hold byte copies of ``source``'s task part files; returns whether it changed.

    Unchanged when it already matches (names and bytes), so a rerun touches nothing.
    """
    files = shards.part_files(source)
    if not files:
        raise LegorlError(f"{source}: no tasks (run `legorl tasks import` or `legorl tasks build` first)")
    shards.read(source, Kind.TASKS, columns=["repo"])  # validate before copying, naming the bad file
    if _digest(files) == _digest(shards.part_files(dest)):
        return False
    staging = dest.with_name(f".{dest.name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for f in files:
        shutil.copyfile(f, staging / f.name)
    old = dest.with_name(f".{dest.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        os.replace(dest, old)
    os.replace(staging, dest)
    shutil.rmtree(old, ignore_errors=True)
    return True


def selected_task_ids(tasks_dir: Path, limit: int | None) -> list[str]:
    """The tasks an eval covers: sorted by instance id, the first ``limit`` (the rollout stage's rule)."""
    table = shards.read(tasks_dir, Kind.TASKS, columns=[]).table
    ids = sorted(table.column("instance_id").to_pylist())
    return ids[:limit] if limit is not None else ids


def planned_trials(settings: EvalSettings, task_ids: Sequence[str]) -> set[str]:
    """The trial keys this eval is made of (what the report covers)."""
    return {trial_key(t, h, settings.step, k) for t in task_ids for h in settings.harnesses
            for k in range(settings.samples)}


# --------------------------------------------------------------------------- the report


def _snapshot(run: Path) -> Any:
    """The eval data of ``run`` as a monitor snapshot whose name is the run's (not "eval")."""
    from legorl.monitor.loading import RunReader

    view = eval_dir(run)
    if not shards.part_files(view.rollouts):
        raise LegorlError(f"{view.rollouts}: no eval rollouts (run `legorl eval --run {run}` first)")
    snap = RunReader(view.root).snapshot()
    return replace(snap, root=Path(run))


def _restrict(snap: Any, keep: Any) -> Any:
    trials = {tid: t for tid, t in snap.trials.items() if keep(t)}
    return replace(snap, trials=trials, grades={k: g for k, g in snap.grades.items() if k in trials})


def build_eval_report(settings: EvalSettings) -> tuple[dict[str, Any], Any]:
    """The report over exactly this eval's trials (and the baseline over the same tasks and
    harnesses), plus the restricted snapshot it was built from (for the predictions)."""
    from legorl.monitor import report as monitor_report

    run = Path(settings.run)
    view = eval_dir(run)
    planned = planned_trials(settings, selected_task_ids(view.tasks, settings.limit))
    snap = _restrict(_snapshot(run), lambda t: t.trial_id in planned)
    if not snap.trials:
        raise LegorlError(f"{view.rollouts}: none of this eval's {len(planned)} trial(s) are there")
    report = monitor_report.build_report(snap, [settings.step], settings.ks)
    report["settings"] = settings.as_report_dict()
    report["cost"] = run_costs(view.root, set(snap.trials))  # per step and harness (legorl.trials.costs)
    if settings.baseline is not None:
        tasks = {t.task_id for t in snap.trials.values()}
        harnesses = set(settings.harnesses)
        base = _restrict(_snapshot(Path(settings.baseline)),
                         lambda t: t.task_id in tasks and t.harness in harnesses)
        if not base.trials:
            raise LegorlError(f"--baseline {settings.baseline}: no eval trials on these tasks and harnesses")
        steps = None if settings.baseline_step is None else [settings.baseline_step]
        base_report = monitor_report.build_report(base, steps, report["ks"])
        report["baseline"] = base_report
    return report, snap


def write_predictions(run: Path, snap: Any, step: int, harnesses: Sequence[str]) -> list[Path]:
    """SWE-bench predictions (``instance_id, model_name_or_path, model_patch``), one JSON line per
    task: ``eval/predictions.jsonl`` for one harness, ``eval/predictions-<harness>.jsonl`` each for
    several (the official harness keys predictions by instance id alone)."""
    from legorl.monitor.report import predictions

    folder = RunDir.at(run).eval
    present = sorted({t.harness for t in snap.trials.values()})
    out = []
    for name in sorted(harnesses):
        if name not in present:
            continue
        rows = predictions(snap, [step], name)
        path = folder / (PREDICTIONS if len(harnesses) == 1 else f"predictions-{name}.jsonl")
        _atomic_write(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
        out.append(path)
    return out


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
