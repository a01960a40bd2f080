"""`legorl grade`: grade rollouts (or gold patches, or SWE-bench predictions) against hidden tests."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Annotated

import typer

from legorl.cli.common import JsonOption, OptionalRunOption, console, fail, print_json
from legorl.cli.options import ConfigOptions, with_configs
from legorl.grading.grader import GradeOptions
from legorl.trials.executors import ExecutorOptions


def register(app: typer.Typer) -> None:
    @app.command("grade")
    @with_configs(options=ConfigOptions(GradeOptions), placement=ConfigOptions(ExecutorOptions))
    def grade_command(
        options: GradeOptions,
        placement: ExecutorOptions,
        run: OptionalRunOption = None,
        gold: Annotated[bool, typer.Option("--gold", help="Grade each task's own patch (checks the task set).")] = False,
        predictions: Annotated[Path | None, typer.Option(
            "--predictions", help="SWE-bench predictions file: JSON/JSONL of {instance_id, model_patch}.")] = None,
        tasks: Annotated[Path | None, typer.Option("--tasks", help="Tasks dataset (default: RUN/tasks).")] = None,
        rollouts: Annotated[Path | None, typer.Option("--rollouts", help="Rollouts dataset (default: RUN/rollouts).")] = None,
        out: Annotated[Path | None, typer.Option("--out", help="Grades dataset (default: RUN/grades).")] = None,
        json_out: JsonOption = False,
    ) -> None:
        """Grade patches in fresh containers: hidden tests, SWE-bench's rules; resumable."""
        from legorl.cli.progress import StageBar, graded
        from legorl.core.paths import RunDir
        from legorl.stages import grade as stage

        if gold and predictions is not None:
            fail("--gold and --predictions exclude each other")
        if run is None and (tasks is None or out is None or (rollouts is None and not gold and predictions is None)):
            fail("give --run, or --tasks and --out (and --rollouts unless --gold/--predictions)")
        rd = RunDir.at(run) if run is not None else None
        tasks_dir = tasks or (rd.tasks if rd else Path())
        out_dir = out or (rd.grades if rd else Path())
        from legorl.core import shards
        from legorl.core.schemas import Kind

        task_map = {t.instance_id: t for t in shards.read_rows(tasks_dir, Kind.TASKS)}
        if not task_map:
            fail(f"{tasks_dir}: no tasks (run `legorl tasks import` first)")
        infra_rollouts = 0
        if gold:
            jobs = stage.gold_jobs(task_map)
        elif predictions is not None:
            jobs = stage.prediction_jobs(predictions, task_map)
        else:
            jobs, infra_rollouts = stage.rollout_jobs(rollouts or (rd.rollouts if rd else Path()))

        skipped = None if json_out else (lambda n: f"{n} trial(s) already graded: skipped")
        # stdout is for the answer: Ray's driver prints cluster events (a node died) to it
        with StageBar("grading", graded, transient=json_out, skipped=skipped) as bar, \
                contextlib.redirect_stdout(sys.stderr):
            summary = stage.grade_stage(tasks_dir, out_dir, jobs, options, run_label=str(run) if run else None,
                                        placement=placement, on_start=bar.on_start, on_done=bar.on_done)
        result = summary.as_dict()
        result["infra_rollouts_skipped"] = infra_rollouts
        if json_out:
            print_json(result)
            return
        if not summary.graded:
            console.print(f"nothing to grade ({summary.skipped} already graded) -> {out_dir}", highlight=False)
            return
        statuses = ", ".join(f"{k} {v}" for k, v in sorted(summary.by_status.items()))
        per_grade = f"{summary.mean_seconds} s per grade; " if summary.mean_seconds is not None else ""
        lost = f"{len(summary.lost)} lost with their Ray worker (run again); " if summary.lost else ""
        unconfirmed = (f"{summary.unconfirmed} pass(es) a fresh rerun did not reproduce (scored 0); "
                       if summary.unconfirmed else "")
        console.print(
            f"graded {summary.graded} ({statuses}); resolved {summary.resolved}; mean reward {summary.mean_reward}; "
            f"{per_grade}{lost}{unconfirmed}wall {summary.wall_s:.1f} s -> {out_dir}", highlight=False)
