"""An eval: the rollout and grade stages with eval settings in ``RUN/eval``, then the pass@k report
and the SWE-bench predictions (:mod:`legorl.flows.evaluation` holds the settings and the report).

Resumable, like the stages: a rerun skips trials and grades already done (loading no engine when
nothing is left to roll out), and the same shards give a byte-identical report.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

from legorl.core import shards
from legorl.core.errors import LegorlError
from legorl.core.paths import RunDir
from legorl.core.schemas import GradeRow, Kind, TrialRow
from legorl.flows import evaluation
from legorl.flows.policy import Loading, PolicySpec, open_policy
from legorl.stages.grade import GradeSummary, grade_stage, rollout_jobs
from legorl.stages.rollout import RolloutConfig, RolloutSummary, plan, rollout_stage
from legorl.trials.lifecycle import TrialOptions

RowT = TypeVar("RowT", contravariant=True)


class StageProgress(Protocol[RowT]):
    """What a stage reports while it runs: how much it has to do, then each row as it is written."""

    def on_start(self, todo: int, skipped: int) -> None: ...

    def on_done(self, row: RowT) -> None: ...


@dataclass
class EvalResult:
    """What an eval wrote (the report, its files, the predictions) and what each stage did."""

    report: dict[str, Any]
    report_json: Path
    report_md: Path
    predictions: list[Path]
    rollout: dict[str, Any] = field(default_factory=dict)  # the rollout stage's summary
    grade: dict[str, Any] = field(default_factory=dict)  # the grade stage's summary (without the rows)

    def files(self) -> dict[str, Any]:
        return {"report_json": str(self.report_json), "report_md": str(self.report_md),
                "predictions": [str(p) for p in self.predictions]}


def evaluate(settings: evaluation.EvalSettings, policy: PolicySpec, *, loading: Loading | None = None,
             rollout: StageProgress[TrialRow] | None = None,
             grade: StageProgress[GradeRow] | None = None) -> EvalResult:
    """Mirror the task set into ``RUN/eval``, roll out and grade there, then write the report."""
    settings.validate()
    if settings.baseline is not None and not evaluation.eval_dir(settings.baseline).rollouts.is_dir():
        raise LegorlError(f"--baseline {settings.baseline}: no eval rollouts "
                          f"(run `legorl eval --run {settings.baseline}` first)")
    run = Path(settings.run)
    view = evaluation.eval_dir(run)
    evaluation.mirror_tasks(settings.tasks or RunDir.at(run).tasks, view.tasks)
    rolled = _rollout(settings, view, policy, loading, rollout)
    graded = _grade(settings, view, grade)

    from legorl.monitor import report as monitor_report

    report, snap = evaluation.build_eval_report(settings)
    json_path, md_path = monitor_report.write_report(run, report)
    predictions = evaluation.write_predictions(run, snap, settings.step, settings.harnesses)
    return EvalResult(report, json_path, md_path, predictions, rolled, graded)


def _rollout(settings: evaluation.EvalSettings, view: RunDir, policy: PolicySpec, loading: Loading | None,
             progress: StageProgress[TrialRow] | None) -> dict[str, Any]:
    """The rollout stage on RUN/eval with the eval settings; returns its summary."""
    trial_options = {f.name: getattr(settings, f.name) for f in fields(TrialOptions)}
    cfg = RolloutConfig(**trial_options | {"run": view.root, "step": settings.step})
    jobs, skipped = plan(cfg)
    if not jobs:  # all done: no engine to load, no proxy to start
        return RolloutSummary(planned=skipped, skipped=skipped).as_dict()
    policy = replace(policy, temperature=settings.temperature)
    with open_policy(policy, loading=loading) as served:
        summary = rollout_stage(cfg, served.proxy, on_start=progress.on_start if progress else None,
                                on_done=progress.on_done if progress else None)
    return summary.as_dict()


def _grade(settings: evaluation.EvalSettings, view: RunDir, progress: StageProgress[GradeRow] | None) -> dict[str, Any]:
    """The grade stage on this eval's trials in RUN/eval (infrastructure-failed ones are never graded)."""
    planned = evaluation.planned_trials(settings, evaluation.selected_task_ids(view.tasks, settings.limit))
    jobs, _ = rollout_jobs(view.rollouts)  # infrastructure failures: counted by the report
    jobs = [j for j in jobs if j.trial_id in planned]
    done = shards.already_done(view.grades, Kind.GRADES)
    if all(j.trial_id in done for j in jobs):  # all graded: no containers, no reaper
        summary = GradeSummary(skipped=len(jobs))
    else:
        summary = grade_stage(
            view.tasks, view.grades, jobs, settings.grade, run_label=f"{Path(settings.run).name}-eval", on_start=progress.on_start if progress else None,
            on_done=progress.on_done if progress else None,
        )
    result = summary.as_dict()
    result.pop("grades", None)
    return result
