"""`legorl model init|warmup`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from legorl.cli.common import JsonOption, console, fail, print_json

sub = typer.Typer(help="Offline models: build a tiny model, warm it up.", no_args_is_help=True)


@sub.command("init")
def init_command(
    out: Annotated[Path, typer.Argument(help="Directory to write the model into.")],
    moe: Annotated[bool, typer.Option("--moe", help="Qwen3-MoE (8 experts, top-2) instead of dense Qwen3.")] = False,
    size: Annotated[str, typer.Option(help="tiny (~5 M parameters) or small (~26 M).")] = "tiny",
    seed: Annotated[int, typer.Option(help="Seed of the random weights.")] = 0,
    force: Annotated[bool, typer.Option("--force", help="Overwrite a model already in OUT.")] = False,
    json_out: JsonOption = False,
) -> None:
    """Build a byte-level BPE tokenizer, Qwen chat template and random-weight model (seconds, offline)."""
    from legorl.models import init_model, model_info

    if (out / "config.json").exists() and not force:
        fail(f"{out} already holds a model (config.json); pass --force to overwrite")
    t0 = time.perf_counter()
    with console.status(f"building {'MoE' if moe else 'dense'} {size} model in {out} ..."):
        init_model(out, moe=moe, size=size, seed=seed)
    info = model_info(out) | {"path": str(out), "seconds": round(time.perf_counter() - t0, 2)}
    if json_out:
        print_json(info)
        return
    console.print(
        f"[green]built[/] {out}: {'Qwen3-MoE' if moe else 'Qwen3'} {size}, "
        f"{info['parameters'] / 1e6:.1f} M parameters, random weights, in {info['seconds']:.1f} s",
        highlight=False,
    )
    console.print(f"warm it up with: legorl model warmup {out}", highlight=False)


@sub.command("warmup")
def warmup_command(
    model_dir: Annotated[Path, typer.Argument(help="A model directory built by `legorl model init`.")],
    steps: Annotated[int, typer.Option(help="Training steps.")] = 200,
    batch_size: Annotated[int, typer.Option(help="Sequences per step.")] = 8,
    seq_len: Annotated[int, typer.Option(help="Tokens per sequence.")] = 256,
    lr: Annotated[float, typer.Option(help="Peak learning rate.")] = 1e-3,
    seed: Annotated[int, typer.Option(help="Data-order seed.")] = 0,
    minutes: Annotated[float | None, typer.Option(help="Stop after this many minutes even if steps remain.")] = None,
    json_out: JsonOption = False,
) -> None:
    """Train the model briefly on local code and tool-call chats so its distributions are not uniform.

    Costs steps x batch-size x seq-len tokens of training: the tiny model does about 0.5-3 k tokens/s on
    two free CPU cores, so the default 200 steps (410 k tokens) take 2-14 minutes there, and far longer
    on cores other work shares (there, OMP_NUM_THREADS=1 keeps torch's threads from waiting on each
    other); progress lines give the time left as it goes, and --minutes caps it.
    """
    from legorl.cli.progress import StageBar
    from legorl.models import model_info, warmup

    if not (model_dir / "config.json").exists():
        fail(f"{model_dir}: not a model directory (no config.json); build one with `legorl model init`")
    tokens = steps * batch_size * seq_len
    params = model_info(model_dir).get("parameters")
    size = f" ({params / 1e6:.1f} M parameters)" if params else ""
    cap = f", stopping after {minutes:g} min" if minutes else ""
    if not json_out:
        console.print(f"warming up {model_dir}{size}: {steps} steps of {batch_size} x {seq_len} tokens "
                      f"({tokens / 1e3:.0f} k tokens) of local code and tool-call chats{cap}", highlight=False)
    bar: StageBar[float] = StageBar("warmup", lambda loss: f"loss {loss:.3f}", transient=json_out,
                                    status=f"loading the model and {tokens / 1e3:.0f} k tokens of local code")
    with bar:
        bar.on_start(steps, 0)
        stats = warmup(model_dir, steps=steps, batch_size=batch_size, seq_len=seq_len, lr=lr, seed=seed,
                       max_seconds=minutes * 60 if minutes else None, progress=lambda _, loss: bar.on_done(loss))
    if json_out:
        print_json(stats | {"path": str(model_dir)})
        return
    console.print(
        f"[green]warmed up[/] {model_dir}: loss {stats['first_loss']:.3f} -> {stats['last_loss']:.3f} "
        f"over {int(stats['steps'])} steps, {int(stats['tokens'])} tokens in {stats['seconds']:.0f} s "
        f"({stats['tokens'] / stats['seconds']:.0f} tokens/s)",
        highlight=False,
    )


def register(app: typer.Typer) -> None:
    app.add_typer(sub, name="model")
