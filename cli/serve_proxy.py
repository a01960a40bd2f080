"""`legorl serve-proxy`: the capturing LLM proxy as a standalone server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from legorl.cli.common import OptionalRunOption, console, fail, wait_for_stop
from legorl.cli.options import ConfigOptions, with_configs
from legorl.engines.config import EngineConfig, ProxySampling
from legorl.proxy.budgets import Budgets
from legorl.proxy.limits import ProxyLimits

# The budgets `serve-proxy` applies to every session unless its creator sets its own.
BUDGET_FIELDS = ("max_turns", "max_total_tokens", "max_context", "max_wall_s", "max_tokens_per_call")


def _default_budgets(**values: object) -> Budgets:
    return Budgets.from_dict(values, where="default budgets")


def register(app: typer.Typer) -> None:
    @app.command("serve-proxy")
    @with_configs(engine_config=ConfigOptions(EngineConfig),
                  budgets=ConfigOptions(Budgets, only=BUDGET_FIELDS, factory=_default_budgets),
                  limits=ConfigOptions(ProxyLimits), sampling=ConfigOptions(ProxySampling))
    def serve_proxy_command(
        engine_config: EngineConfig,
        budgets: Budgets,
        limits: ProxyLimits,
        sampling: ProxySampling,
        host: Annotated[str, typer.Option(help="Address to bind; loopback by default.")] = "127.0.0.1",
        port: Annotated[int, typer.Option(help="Port (0 = a free one).")] = 8000,
        run: OptionalRunOption = None,
        api_key: Annotated[str | None, typer.Option("--api-key", envvar="LEGORL_PROXY_API_KEY",
                                                    help="Require this key (Bearer or x-api-key).")] = None,
        parser: Annotated[str | None, typer.Option(help="Tool-call parser (default: from the chat template).")] = None,
        single_session: Annotated[bool, typer.Option(
            "--single-session", help="Also serve the un-prefixed /v1 routes, as one shared session "
                                     "'default' (for a single client; off: they answer 404).")] = False,
    ) -> None:
        """Serve OpenAI + Anthropic APIs per session at /sess/<id>/v1/..., capturing exact tokens.

        With --run, every finished session (POST /sess/<id>/finish, or all open ones at shutdown)
        is written to RUN/proxy/ as a rollouts shard (harness "external").
        """
        from legorl.core.errors import LegorlError
        from legorl.proxy.core import SamplingOverride
        from legorl.proxy.server import ProxyServer, load_tokenizer
        from legorl.trials.external import ShardSink

        try:
            tokenizer = load_tokenizer(engine_config.model)
            with console.status(f"loading the {engine_config.engine} engine ..."):
                eng = engine_config.build()
            server = ProxyServer(eng, tokenizer, host=host, port=port, api_key=api_key, budgets=budgets,
                                 on_finish=ShardSink(run) if run is not None else None, parser=parser,
                                 sampling=(SamplingOverride(top_p=sampling.top_p) if sampling.temperature is None
                                           else SamplingOverride.policy(sampling.temperature, sampling.top_p)),
                                 single_session=single_session, limits=limits).start()
        except LegorlError as exc:
            fail(str(exc))
        console.print(f"[green]legorl proxy[/] serving {eng.name} at {server.base_url} "
                      f"(per session: {server.base_url}/sess/<id>/v1)", highlight=False)
        typer.echo(json.dumps({"base_url": server.base_url, "model": eng.name}))
        wait_for_stop()
        finished = server.close()
        import asyncio

        asyncio.run(eng.close())
        if run is not None:
            console.print(f"wrote {sum(1 for c in finished if c.calls)} open session(s) to {Path(run) / 'proxy'}")
