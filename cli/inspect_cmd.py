"""`legorl inspect PATH`: a summary of a run directory or a dataset folder."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from legorl.cli.common import JsonOption, console, print_json


def _render(summary: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title=f"legorl inspect {summary['path']}", title_justify="left")
    for column in ("dataset", "kind", "files", "rows", "dup keys", "schema", "breakdown"):
        table.add_column(column, overflow="fold")
    for d in summary["datasets"]:
        parts = []
        for key, value in d["breakdown"].items():
            if isinstance(value, dict):
                value = ", ".join(f"{k}={v}" for k, v in value.items()) or "-"
            elif isinstance(value, float):
                value = f"{value:.3f}"
            parts.append(f"[bold]{key}[/]: {value}")
        dup = f"[yellow]{d['duplicate_keys']}[/]" if d["duplicate_keys"] else "0"
        schema = ",".join(f"v{v}" for v in d["schema_versions"])
        table.add_row(d["name"], d["kind"], str(d["files"]), str(d["rows"]), dup, schema, "\n".join(parts))
    if summary["datasets"]:
        console.print(table)
    else:
        console.print(f"no datasets under {summary['path']}")
    for error in summary["errors"]:
        console.print(f"[bold red]error:[/] {error}", highlight=False, soft_wrap=True)


def _health(path: Path, summary: dict[str, Any]) -> dict[str, Any] | None:
    """The run's health figures, for a run directory with trials (not for one dataset folder)."""
    if summary["errors"] or not any(d["name"] in ("rollouts", "grades") for d in summary["datasets"]):
        return None
    from legorl.monitor.health import health_summary

    return health_summary(path)


def register(app: typer.Typer) -> None:
    @app.command("inspect")
    def inspect_command(
        path: Annotated[Path, typer.Argument(help="A run directory or one dataset folder.")],
        json_output: JsonOption = False,
    ) -> None:
        """Summarise what a run directory holds: rows, files, schema, duplicates, outcomes, rewards."""
        from legorl.monitor.inspect import inspect_path

        summary = inspect_path(path)
        health = _health(path, summary)
        if health is not None:
            summary["health"] = health
        if json_output:
            print_json(summary)
        else:
            _render(summary)
            if health is not None:
                from legorl.monitor.health import health_renderable

                console.print(health_renderable(health))
        if summary["errors"]:
            raise typer.Exit(1)
