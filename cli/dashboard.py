"""`legorl dashboard`."""

from __future__ import annotations

import typer

from legorl.cli.common import not_implemented


def register(app: typer.Typer) -> None:
    @app.command("dashboard", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def dashboard_command() -> None:
        """Not implemented yet."""
        not_implemented("dashboard")
