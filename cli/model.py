"""`legorl model ...`."""

from __future__ import annotations

import typer

from legorl.cli.common import not_implemented

sub = typer.Typer(help="Offline models: build a tiny model, warm it up.", no_args_is_help=True)


@sub.callback(invoke_without_command=True, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def _not_yet(ctx: typer.Context) -> None:
    not_implemented("model")


def register(app: typer.Typer) -> None:
    app.add_typer(sub, name="model")
