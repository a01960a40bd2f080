"""`legorl serve-proxy`: the capturing LLM proxy as a standalone server."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path
from typing import Annotated

import typer

from legorl.cli.common import OptionalRunOption, console, fail


def register(app: typer.Typer) -> None:
    @app.command("serve-proxy")
    def serve_proxy_command(
        model: Annotated[Path, typer.Option("--model", help="Model directory (weights + tokenizer + chat template); "
                                            "with --engine vllm only its tokenizer is read.")],
        engine: Annotated[str, typer.Option(help="embedded (in-process transformers) or vllm (an existing server).")] = "embedded",
        upstream: Annotated[str | None, typer.Option(help="vLLM server URL (with --engine vllm).")] = None,
        host: Annotated[str, typer.Option(help="Address to bind; loopback by default.")] = "127.0.0.1",
        port: Annotated[int, typer.Option(help="Port (0 = a free one).")] = 8000,
        run: OptionalRunOption = None,
        api_key: Annotated[str | None, typer.Option("--api-key", envvar="LEGORL_PROXY_API_KEY",
                                                    help="Require this key (Bearer or x-api-key).")] = None,
        max_turns: Annotated[int | None, typer.Option(help="Default budget: model calls per session.")] = None,
        max_total_tokens: Annotated[int | None, typer.Option(help="Default budget: tokens held per session.")] = None,
        max_context: Annotated[int | None, typer.Option(help="Default budget: prompt + completion tokens per call.")] = None,
        max_wall: Annotated[float | None, typer.Option(help="Default budget: seconds per session.")] = None,
        dtype: Annotated[str, typer.Option(help="Embedded engine dtype.")] = "float32",
        device: Annotated[str | None, typer.Option(help="Embedded engine device (default: cuda if present).")] = None,
        parser: Annotated[str | None, typer.Option(help="Tool-call parser (default: from the chat template).")] = None,
        temperature: Annotated[float | None, typer.Option(
            help="Sample every call at this temperature, whatever the harness asks (the trainer's).")] = None,
        top_p: Annotated[float | None, typer.Option(help="Sample every call with this top-p.")] = None,
        single_session: Annotated[bool, typer.Option(
            "--single-session", help="Also serve the un-prefixed /v1 routes, as one shared session "
                                     "'default' (for a single client; off: they answer 404).")] = False,
    ) -> None:
        """Serve OpenAI + Anthropic APIs per session at /sess/<id>/v1/..., capturing exact tokens.

        With --run, every finished session (POST /sess/<id>/finish, or all open ones at shutdown)
        is written to RUN/proxy/ as a rollouts shard (harness "external").
        """
        from legorl.engines import make_engine
        from legorl.errors import LegorlError
        from legorl.proxy.budgets import Budgets
        from legorl.proxy.core import SamplingOverride
        from legorl.proxy.server import ProxyServer, load_tokenizer

        if engine not in ("embedded", "vllm"):
            fail(f"--engine must be embedded or vllm, not {engine!r}")
        if engine == "vllm" and not upstream:
            fail("--engine vllm needs --upstream URL of a running `vllm serve`")
        try:
            budgets = Budgets.from_dict({"max_turns": max_turns, "max_total_tokens": max_total_tokens,
                                         "max_context": max_context, "max_wall_s": max_wall})
            tokenizer = load_tokenizer(model)
            with console.status(f"loading the {engine} engine ..."):
                if engine == "embedded":
                    eng = make_engine("embedded", model_dir=model, dtype=dtype, device=device)
                else:
                    eng = make_engine("vllm", base_url=upstream, served_model_dir=model)
            server = ProxyServer(eng, tokenizer, host=host, port=port, api_key=api_key, budgets=budgets,
                                 run_dir=run, parser=parser,
                                 sampling=(SamplingOverride.policy(temperature, top_p) if temperature is not None
                                           else SamplingOverride(top_p=top_p)),
                                 single_session=single_session).start()
        except LegorlError as exc:
            fail(str(exc))
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        console.print(f"[green]legorl proxy[/] serving {eng.name} at {server.base_url} "
                      f"(per session: {server.base_url}/sess/<id>/v1)", highlight=False)
        typer.echo(json.dumps({"base_url": server.base_url, "model": eng.name}))
        while not stop.wait(0.5):
            pass
        finished = server.close()
        import asyncio

        asyncio.run(eng.close())
        if run is not None:
            console.print(f"wrote {sum(1 for c in finished if c.calls)} open session(s) to {Path(run) / 'proxy'}")
