"""`legorl dashboard RUN [--port N] [--host H] [--compare RUN2 ...] [--export DIR]`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from legorl.cli.common import console, fail
from legorl.cli.options import with_configs


def register(app: typer.Typer) -> None:
    @app.command("dashboard")
    @with_configs()
    def dashboard_command(
        run: Annotated[Path, typer.Argument(help="Run directory to show.")],
        port: Annotated[int, typer.Option("--port", help="Port to serve on.")] = 8765,
        host: Annotated[str, typer.Option("--host", help="Address to bind (keep 127.0.0.1 unless you mean to share).")] = "127.0.0.1",
        compare: Annotated[
            list[Path] | None, typer.Option("--compare", help="Another run to compare with (repeatable).")
        ] = None,
        export: Annotated[
            Path | None, typer.Option("--export", help="Write a static copy (HTML + JSON + JS) to this folder and exit.")
        ] = None,
        poll_ms: Annotated[int, typer.Option("--poll-ms", help="How often the page checks for new shards.")] = 2000,
    ) -> None:
        """A live web dashboard of a run, read from its shards: learning, fidelity, behaviour, trajectories."""
        roots = [run, *(compare or [])]
        for root in roots:
            if not root.is_dir():
                fail(f"{root}: run directory does not exist")
        if export is not None:
            from legorl.monitor.dashboard.export import export as export_dashboard

            counts = export_dashboard(roots, export)
            console.print(f"wrote a static dashboard of {counts['runs']} run(s), {counts['trials']} trials to "
                          f"{export / 'index.html'}")
            return
        from legorl.monitor.dashboard.server import serve

        console.print(f"legorl dashboard on [bold]http://{host}:{port}/[/] (Ctrl-C to stop)")
        serve(roots, host=host, port=port, poll_ms=max(250, poll_ms))
