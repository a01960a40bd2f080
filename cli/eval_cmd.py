"""`legorl eval`: rollout + grade with eval settings into RUN/eval, then the pass@k report.

The composition (the rollout stage, then the grade stage, both pointed at ``RUN/eval``, laid out
like a run directory, then the monitor's report) is :mod:`legorl.flows.evaluate`; this command
parses the options, shows progress and prints the result.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

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
        from legorl.cli.progress import Outcomes, StageBar, graded, loading
        from legorl.flows.evaluate import evaluate
        from legorl.flows.policy import PolicySpec, require_model_dir
        from legorl.harnesses import parse_names

        if (model is None) == (proxy is None):
            fail("give exactly one of --model DIR (embedded engine) or --proxy URL")
        if model is not None:
            require_model_dir(model)
        settings = evaluation.EvalSettings(
            run=run, harnesses=parse_names(harness), samples=samples, temperature=temperature, step=step,
            limit=limit, concurrency=concurrency, timeout_s=timeout, max_turns=max_turns, max_tokens=max_tokens,
            retries=retries, grade_timeout_s=grade_timeout, ks=evaluation.parse_ks(ks), tasks=tasks,
            baseline=baseline, baseline_step=baseline_step,
        )
        policy = PolicySpec(model=model, proxy_url=proxy, api_key=api_key)
        with StageBar("eval rollout", Outcomes().add, transient=json_out) as rollout_bar, \
                StageBar("eval grade", graded, transient=json_out) as grade_bar:
            result = evaluate(settings, policy, loading=loading, rollout=rollout_bar, grade=grade_bar)
        files = result.files()
        if json_out:
            print_json({"report": result.report, "files": files, "rollout": result.rollout, "grade": result.grade})
            return
        from legorl.monitor import report as monitor_report

        console.print(monitor_report.render(result.report))
        rolled, done = result.rollout, result.grade
        console.print(
            f"rollouts: {rolled['ran']} run, {rolled['skipped']} already done; grades: {done['graded']} run, "
            f"{done['skipped']} already done -> {result.report_json}, {result.report_md}, "
            + ", ".join(files["predictions"]), highlight=False, soft_wrap=True)
