"""`legorl rollout`: run harnesses on the run's tasks against the proxy; one trial row each."""

from __future__ import annotations

import typer

from legorl.cli.common import JsonOption, console, print_json
from legorl.cli.options import ConfigOptions, with_configs
from legorl.flows.policy import POLICY_FIELDS, PolicySpec
from legorl.proxy.limits import ProxyLimits
from legorl.stages.rollout import RolloutConfig


def register(app: typer.Typer) -> None:
    @app.command("rollout")
    @with_configs(cfg=ConfigOptions(RolloutConfig), policy=ConfigOptions(PolicySpec, only=POLICY_FIELDS),
                  limits=ConfigOptions(ProxyLimits))
    def rollout_command(cfg: RolloutConfig, policy: PolicySpec, limits: ProxyLimits, json_out: JsonOption = False,
                        ) -> None:
        """Roll out: sandbox → proxy session → harness → patch → one trial row; resumable."""
        import contextlib
        import dataclasses
        import sys
        import time

        from legorl.cli.progress import Outcomes, StageBar, loading
        from legorl.core.schemas import TrialRow
        from legorl.flows.policy import open_policy, require_model_dir
        from legorl.stages.rollout import rollout_stage

        policy.validate()
        if policy.model is not None:
            require_model_dir(policy.model)
        run = cfg.run
        policy = dataclasses.replace(policy, temperature=cfg.temperature, limits=limits)
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
            # stdout is for the answer: Ray's driver prints cluster events (a node died) to it
            with StageBar("rollout", describe, transient=json_out, skipped=skipped, tick=status) as bar, \
                    contextlib.redirect_stdout(sys.stderr):
                summary = rollout_stage(cfg, served.proxy, on_start=bar.on_start, on_done=bar.on_done)
        result = summary.as_dict()
        if json_out:
            print_json(result)
            return
        out = ", ".join(f"{k} {v}" for k, v in sorted(result["outcomes"].items())) or "nothing new"
        t = result["mean_timings"]
        lost = f" ({result['workers_lost']} attempt(s) lost with their Ray worker)" if result["workers_lost"] else ""
        console.print(
            f"{result['ran']} trial(s): {out}; {result['infra_failures']} infra failure(s), "
            f"{result['retried']} retried{lost}; {result['tokens_per_s']} tok/s; engine utilisation "
            f"{result['engine_utilisation']}; mean s: sandbox {t['sandbox_s']}, agent {t['agent_s']}, "
            f"model {t['model_s']} -> {run}/rollouts", highlight=False)
