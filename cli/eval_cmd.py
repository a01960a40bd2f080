"""`legorl eval`: rollout + grade with eval settings into RUN/eval, then the pass@k report.

The composition (the rollout stage, then the grade stage, both pointed at ``RUN/eval``, laid out
like a run directory, then the monitor's report) is :mod:`legorl.flows.evaluate`; this command
parses the options, shows progress and prints the result.
"""

from __future__ import annotations

import typer

from legorl.cli.common import JsonOption, console, print_json
from legorl.cli.options import ConfigOptions, with_configs
from legorl.flows.evaluation import EvalSettings
from legorl.flows.policy import POLICY_FIELDS, PolicySpec
from legorl.grading.grader import GRADE_FIELDS, GradeOptions  # taken prefixed --grade-: --grade-timeout, …
from legorl.proxy.limits import ProxyLimits


def register(app: typer.Typer) -> None:
    @app.command("eval")
    @with_configs(settings=ConfigOptions(EvalSettings, exclude=("grade",)),
                  grade=ConfigOptions(GradeOptions, only=GRADE_FIELDS, prefix="grade-"),
                  policy=ConfigOptions(PolicySpec, only=POLICY_FIELDS), limits=ConfigOptions(ProxyLimits))
    def eval_command(settings: EvalSettings, grade: GradeOptions, policy: PolicySpec, limits: ProxyLimits,
                     json_out: JsonOption = False) -> None:
        """Evaluate a model: rollouts and grades in RUN/eval, then pass@k per harness and repository.

        Writes RUN/eval/report.json, RUN/eval/report.md and RUN/eval/predictions.jsonl (SWE-bench
        format). Resumable: a rerun skips trials and grades already done, and the same data gives
        a byte-identical report.
        """
        import dataclasses

        from legorl.cli.progress import Outcomes, StageBar, graded, loading
        from legorl.flows.evaluate import evaluate
        from legorl.flows.policy import require_model_dir

        policy.validate()
        if policy.model is not None:
            require_model_dir(policy.model)
        settings = dataclasses.replace(settings, grade=grade)
        policy = dataclasses.replace(policy, limits=limits)
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
