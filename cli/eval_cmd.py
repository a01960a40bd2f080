"""`legorl eval`: rollout + grade with eval settings into RUN/eval, then the pass@k report.

The command composes stage functions the way a Makefile would — the rollout stage, then the
grade stage, both pointed at ``RUN/eval`` (laid out like a run directory) — and then the
monitor's report. Stages never import each other; only this command knows the order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from legorl.cli.common import JsonOption, RunOption, console, fail, print_json


def register(app: typer.Typer) -> None:
    @app.command("eval")
    def eval_command(
        run: RunOption,
        harness: Annotated[str, typer.Option(
            "--harness", help="Harness name(s), comma-separated: mini-swe-agent, openhands, opencode, claude-code.")],
        model: Annotated[Path | None, typer.Option("--model", help="Model directory for the embedded engine.")] = None,
        proxy: Annotated[str | None, typer.Option("--proxy", help="URL of a running `legorl serve-proxy`.")] = None,
        samples: Annotated[int, typer.Option(help="Attempts per task and harness (pass@k needs k <= samples).")] = 1,
        temperature: Annotated[float | None, typer.Option(
            help="Sampling temperature (default: 0 = greedy for one sample, 1.0 for several).")] = None,
        step: Annotated[int, typer.Option(help="Policy step of the evaluated model (part of every trial key).")] = 0,
        limit: Annotated[int | None, typer.Option(help="Only the first N tasks (by instance id).")] = None,
        concurrency: Annotated[int, typer.Option(help="Trials at once; also grading containers at once.")] = 2,
        baseline: Annotated[Path | None, typer.Option(
            "--baseline", help="Another run directory whose eval results are shown side by side.")] = None,
        baseline_step: Annotated[int | None, typer.Option(
            "--baseline-step", help="The baseline's step (default: its latest eval step).")] = None,
        ks: Annotated[str | None, typer.Option("--ks", help="pass@k columns, e.g. 1,5 (default: 1 … samples).")] = None,
        tasks: Annotated[Path | None, typer.Option(
            "--tasks", help="Task set to evaluate (default: RUN/tasks); copied to RUN/eval/tasks.")] = None,
        timeout: Annotated[float, typer.Option(help="Hard wall-clock limit of one harness run, seconds.")] = 1800.0,
        max_turns: Annotated[int, typer.Option("--max-turns", help="Model calls per trial.")] = 30,
        max_tokens: Annotated[int | None, typer.Option("--max-tokens", help="Cap on one call's sampled tokens.")] = None,
        retries: Annotated[int, typer.Option(help="Extra attempts after an infrastructure error.")] = 2,
        grade_timeout: Annotated[float, typer.Option("--grade-timeout", help="Seconds the hidden tests may run.")] = 600.0,
        api_key: Annotated[str | None, typer.Option("--api-key", help="API key of the --proxy.")] = None,
        json_out: JsonOption = False,
    ) -> None:
        """Evaluate a model: rollouts and grades in RUN/eval, then pass@k per harness and repository.

        Writes RUN/eval/report.json, RUN/eval/report.md and RUN/eval/predictions.jsonl (SWE-bench
        format). Resumable: a rerun skips trials and grades already done, and the same data gives
        a byte-identical report.
        """
        from legorl import evaluation
        from legorl.harnesses import parse_names

        if (model is None) == (proxy is None):
            fail("give exactly one of --model DIR (embedded engine) or --proxy URL")
        if model is not None and not (model / "config.json").exists():
            fail(f"--model {model}: not a model directory (no config.json)")
        settings = evaluation.EvalSettings(
            run=run, harnesses=parse_names(harness), samples=samples, temperature=temperature, step=step,
            limit=limit, concurrency=concurrency, timeout_s=timeout, max_turns=max_turns, max_tokens=max_tokens,
            retries=retries, grade_timeout_s=grade_timeout, ks=evaluation.parse_ks(ks), tasks=tasks,
            baseline=baseline, baseline_step=baseline_step,
        )
        settings.validate()
        if baseline is not None and not evaluation.eval_dir(baseline).rollouts.is_dir():
            fail(f"--baseline {baseline}: no eval rollouts (run `legorl eval --run {baseline}` first)")
        view = evaluation.eval_dir(run)
        evaluation.mirror_tasks(tasks or (run / "tasks"), view.tasks)

        rolled = _rollout(settings, view.root, model, proxy, api_key, quiet=json_out)
        graded = _grade(settings, view, quiet=json_out)

        from legorl.monitor import report as monitor_report

        report, snap = evaluation.build_eval_report(settings)
        json_path, md_path = monitor_report.write_report(run, report)
        predictions = evaluation.write_predictions(run, snap, step, settings.harnesses)
        files = {"report_json": str(json_path), "report_md": str(md_path),
                 "predictions": [str(p) for p in predictions]}
        if json_out:
            print_json({"report": report, "files": files, "rollout": rolled, "grade": graded})
            return
        console.print(monitor_report.render(report))
        console.print(
            f"rollouts: {rolled['ran']} run, {rolled['skipped']} already done; grades: {graded['graded']} run, "
            f"{graded['skipped']} already done -> {json_path}, {md_path}, "
            + ", ".join(files["predictions"]), highlight=False, soft_wrap=True)


def _rollout(settings: Any, eval_root: Path, model: Path | None, proxy: str | None, api_key: str | None,
             quiet: bool) -> dict[str, Any]:
    """The rollout stage on RUN/eval with the eval settings; returns its summary."""
    import asyncio
    import contextlib

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from legorl.schemas import TrialRow
    from legorl.stages import rollout as stage

    cfg = stage.RolloutConfig(
        run=eval_root, harnesses=settings.harnesses, samples=settings.samples, concurrency=settings.concurrency,
        limit=settings.limit, step=settings.step, timeout_s=settings.timeout_s, max_turns=settings.max_turns,
        max_tokens=settings.max_tokens, temperature=settings.effective_temperature, retries=settings.retries,
    )
    jobs, skipped = stage.plan(cfg)
    if not jobs:  # all done: no engine to load, no proxy to start
        return stage.RolloutSummary(planned=skipped, skipped=skipped).as_dict()
    handle: stage.InProcessProxy | stage.RemoteProxy
    if proxy is not None:
        handle = stage.RemoteProxy(proxy, api_key)
    else:
        assert model is not None
        from legorl.engines.embedded import EmbeddedEngine

        with console.status(f"loading {model} …"):
            engine = EmbeddedEngine(model)
        handle = stage.InProcessProxy(engine, str(model), temperature=settings.effective_temperature)
    outcomes: dict[str, int] = {}
    progress = Progress(TextColumn("eval rollout"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("{task.fields[status]}"), console=console, transient=quiet)
    bar = progress.add_task("rollout", total=0, status="")

    def on_start(todo: int, skipped: int) -> None:
        progress.update(bar, total=todo)

    def on_done(row: TrialRow) -> None:
        outcomes[str(row.outcome)] = outcomes.get(str(row.outcome), 0) + 1
        progress.update(bar, advance=1, status=" ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))

    with handle, progress:
        summary = stage.rollout_stage(cfg, handle, on_start=on_start, on_done=on_done)
    watched = getattr(handle, "engine", None)
    if watched is not None:
        with contextlib.suppress(Exception):
            asyncio.run(watched.close())
    return summary.as_dict()


def _grade(settings: Any, view: Any, quiet: bool) -> dict[str, Any]:
    """The grade stage on RUN/eval's rollouts; infrastructure-failed trials are never graded."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from legorl import evaluation, shards
    from legorl.schemas import GradeRow, Kind
    from legorl.stages import grade as stage

    planned = evaluation.planned_trials(settings, evaluation.selected_task_ids(view.tasks, settings.limit))
    jobs, _ = stage.rollout_jobs(view.rollouts)  # infrastructure failures: counted by the report
    jobs = [j for j in jobs if j.trial_id in planned]
    done = shards.already_done(view.grades, Kind.GRADES)
    if all(j.trial_id in done for j in jobs):  # all graded: no containers, no reaper
        return {"graded": 0, "skipped": len(jobs), "by_status": {}, "resolved": 0, "infra_errors": 0,
                "mean_reward": None, "mean_seconds": None, "wall_s": 0.0}
    progress = Progress(TextColumn("eval grade"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("{task.fields[last]}"), console=console, transient=quiet)
    bar = progress.add_task("grade", total=0, last="")

    def on_start(todo: int, skipped: int) -> None:
        progress.update(bar, total=todo)

    def on_done(row: GradeRow) -> None:
        progress.update(bar, advance=1, last=f"{row.task_id}: {row.status} {row.reward}")

    with progress:
        summary = stage.grade_stage(
            view.tasks, view.grades, jobs, concurrency=settings.concurrency, timeout=settings.grade_timeout_s,
            run_label=f"{Path(settings.run).name}-eval", on_start=on_start, on_done=on_done,
        )
    result = summary.as_dict()
    result.pop("grades", None)
    return result
