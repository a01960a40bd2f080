"""`legorl inspect PATH`: a summary of a run directory or a dataset folder."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Annotated, Any

import typer

from legorl.cli.common import JsonOption, console, print_json
from legorl.cli.options import with_configs


def _value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_value(v)}" for k, v in value.items()) or "-"
    if isinstance(value, list):
        return "; ".join(_value(v) for v in value) or "-"
    return str(value)


def _breakdown(d: dict[str, Any]) -> str:
    """One dataset's breakdown as short "key: value" parts (a metrics dataset: its headline figures)."""
    from legorl.core import metric_keys as mk

    breakdown = dict(d["breakdown"])
    last = breakdown.pop("last", None)
    parts = [f"{key.replace('_', ' ')}: {_value(value)}" for key, value in breakdown.items()]
    if isinstance(last, dict):
        parts += [f"{key} {_value(last[key])}" for key in mk.HEADLINE if key in last]
    return " · ".join(parts)


def _render(summary: dict[str, Any]) -> None:
    """A narrow table (one row per dataset), then each dataset's breakdown wrapped between words at the
    console's width: it reads the same in an 80-column terminal, a pipe and a CI log, no word cut."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    console.print(f"[bold]legorl inspect[/] {summary['path']}", highlight=False, soft_wrap=True)
    if not summary["datasets"]:
        console.print(f"no datasets under {summary['path']}", highlight=False, soft_wrap=True)
    else:
        table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
        for column in ("dataset", "kind", "files", "rows", "dup keys", "schema"):
            table.add_column(column, justify="right" if column in ("files", "rows", "dup keys") else "left")
        for d in summary["datasets"]:
            dup = f"[yellow]{d['duplicate_keys']}[/]" if d["duplicate_keys"] else "0"
            schema = ",".join(f"v{v}" for v in d["schema_versions"])
            table.add_row(d["name"], d["kind"], str(d["files"]), str(d["rows"]), dup, schema)
        console.print(table)
        for d in summary["datasets"]:
            if d["breakdown"]:
                console.print(f"[bold]{d['name']}[/]", highlight=False)
                # Wrapped here between words, at the console's width: rich would cut a padded block where it
                # does not wrap (a log), or break a word. A word longer than the width (a test id) stays whole.
                # Escaped: a parametrized test id (test_x[a]) is text, not rich markup.
                for line in _breakdown(d).splitlines():
                    wrapped = textwrap.fill(line, max(40, console.width - 2), initial_indent="  ",
                                            subsequent_indent="    ", break_long_words=False, break_on_hyphens=False)
                    console.print(escape(wrapped), highlight=False, soft_wrap=True)
    for error in summary["errors"]:
        console.print(f"[bold red]error:[/] {error}", highlight=False, soft_wrap=True)


def _health(path: Path, summary: dict[str, Any]) -> dict[str, Any] | None:
    """The run's health figures, for a run directory with trials (not for one dataset folder)."""
    if summary["errors"] or not any(d["name"] in ("rollouts", "grades") for d in summary["datasets"]):
        return None
    from legorl.monitor.health import health_summary
    from legorl.monitor.inspect import run_mixes

    return health_summary(path, mixes=run_mixes(summary))  # the fingerprints inspect_path has read


def register(app: typer.Typer) -> None:
    @app.command("inspect")
    @with_configs()
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
