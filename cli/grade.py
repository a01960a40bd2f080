"""`legorl grade`."""

from __future__ import annotations

import typer

from legorl.cli.common import not_implemented


def register(app: typer.Typer) -> None:
    @app.command("grade", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def grade_command() -> None:
        """Not implemented yet."""
        not_implemented("grade")
