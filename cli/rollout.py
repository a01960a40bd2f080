"""`legorl rollout`: run harnesses on the run's tasks against the proxy; one trial row each."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from legorl.cli.common import JsonOption, RunOption, console, fail, print_json


def register(app: typer.Typer) -> None:
    @app.command("rollout")
    def rollout_command(
        run: RunOption,
        harness: Annotated[str, typer.Option(
            "--harness", help="Harness name(s), comma-separated: mini-swe-agent, openhands, opencode, claude-code.")],
        model: Annotated[Path | None, typer.Option("--model", help="Model directory for the embedded engine.")] = None,
        proxy: Annotated[str | None, typer.Option("--proxy", help="URL of a running `legorl serve-proxy`.")] = None,
        samples: Annotated[int, typer.Option(help="Trials per task and harness (a group).")] = 1,
        concurrency: Annotated[int, typer.Option(help="Trials at once.")] = 2,
        limit: Annotated[int | None, typer.Option(help="Only the first N tasks (by instance id).")] = None,
        step: Annotated[int, typer.Option(help="Policy step these trials belong to.")] = 0,
        timeout: Annotated[float, typer.Option(help="Hard wall-clock limit of one harness run, seconds.")] = 1800.0,
        max_turns: Annotated[int, typer.Option("--max-turns", help="Model calls per trial.")] = 30,
        max_tokens: Annotated[int | None, typer.Option("--max-tokens", help="Cap on one call's sampled tokens.")] = None,
        temperature: Annotated[float, typer.Option(help="Policy sampling temperature: the in-process proxy samples every call at it, whatever the harness asks.")] = 1.0,
        retries: Annotated[int, typer.Option(help="Extra attempts after an infrastructure error.")] = 2,
        api_key: Annotated[str | None, typer.Option("--api-key", help="API key of the --proxy.")] = None,
        json_out: JsonOption = False,
    ) -> None:
        """Roll out: sandbox → proxy session → harness → patch → one trial row; resumable."""
        import time

        from legorl.cli.progress import Outcomes, StageBar, loading
        from legorl.flows.policy import PolicySpec, open_policy, require_model_dir
        from legorl.harnesses import parse_names
        from legorl.schemas import TrialRow
        from legorl.stages.rollout import RolloutConfig, rollout_stage

        if (model is None) == (proxy is None):
            fail("give exactly one of --model DIR (embedded engine) or --proxy URL")
        cfg = RolloutConfig(
            run=run, harnesses=parse_names(harness), samples=samples, concurrency=concurrency, limit=limit,
            step=step, timeout_s=timeout, max_turns=max_turns, max_tokens=max_tokens, temperature=temperature,
            retries=retries,
        )
        if model is not None:
            require_model_dir(model)
        policy = PolicySpec(model=model, proxy_url=proxy, api_key=api_key, temperature=temperature)
        with open_policy(policy, loading=loading) as served:
            outcomes = Outcomes()
            started = time.monotonic()
            sampled = [0]

            def status() -> str:
                parts = [outcomes.text()]
                engine = served.engine
                elapsed = max(time.monotonic() - started, 1e-6)
                if engine is not None:
                    parts.append(f"{engine.tokens / elapsed:.1f} tok/s")
                    parts.append(f"{engine.in_flight} calls in flight")
                    parts.append(f"engine {engine.busy_seconds() / elapsed:.0%} busy")
                else:
                    parts.append(f"{sampled[0] / elapsed:.1f} tok/s")
                return " · ".join(p for p in parts if p)

            def describe(row: TrialRow) -> str:
                outcomes.add(row)
                sampled[0] += sum(c.completion_tokens for c in row.calls)
                return status()

            skipped = None if json_out else (lambda n: f"{n} trial(s) already in {run}/rollouts: skipped")
            with StageBar("rollout", describe, transient=json_out, skipped=skipped, tick=status) as bar:
                summary = rollout_stage(cfg, served.proxy, on_start=bar.on_start, on_done=bar.on_done)
        result = summary.as_dict()
        if json_out:
            print_json(result)
            return
        out = ", ".join(f"{k} {v}" for k, v in sorted(result["outcomes"].items())) or "nothing new"
        t = result["mean_timings"]
        console.print(
            f"{result['ran']} trial(s): {out}; {result['infra_failures']} infra failure(s), "
            f"{result['retried']} retried; {result['tokens_per_s']} tok/s; engine utilisation "
            f"{result['engine_utilisation']}; mean s: sandbox {t['sandbox_s']}, agent {t['agent_s']}, "
            f"model {t['model_s']} -> {run}/rollouts", highlight=False)
