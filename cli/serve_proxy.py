"""`legorl serve-proxy`."""

from __future__ import annotations

import typer

from legorl.cli.common import not_implemented


def register(app: typer.Typer) -> None:
    @app.command("serve-proxy", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def serve_proxy_command() -> None:
        """Not implemented yet."""
        not_implemented("serve-proxy")
