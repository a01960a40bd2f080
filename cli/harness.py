"""`legorl harness install|list`: the real harnesses in isolated, cached, version-pinned installs."""

from __future__ import annotations

from typing import Annotated

import typer

from legorl.cli.common import JsonOption, console, print_json
from legorl.harnesses import REAL

sub = typer.Typer(help="Coding-agent harnesses: install, list.", no_args_is_help=True)


@sub.command("install")
def install_command(
    name: Annotated[str, typer.Argument(help=(
        f"Harness name(s), comma-separated: {', '.join(h.name for h in REAL)}, or all (these {len(REAL)}).")
    )],
    force: Annotated[bool, typer.Option("--force", help="Reinstall even when already installed.")] = False,
    python: Annotated[str | None, typer.Option(
        "--python", help="Interpreter for Python harnesses (OpenHands needs >= 3.12; found automatically).")] = None,
    json_out: JsonOption = False,
) -> None:
    """Install a harness into its own cached environment (a venv or an npm prefix), pinned."""
    import time

    from legorl.harnesses import HARNESSES, parse_names
    from legorl.harnesses.install import check, install, recipe

    results = []
    for harness in parse_names(name):
        if not HARNESSES[harness].needs_install:
            console.print(f"{harness}: runs inside legorl, nothing to install")
            continue
        start = time.monotonic()
        with console.status(f"installing {harness} {recipe(harness).version} …"):
            inst = install(harness, force=force, python=python)
        ok, detail = check(inst)
        results.append({"name": harness, "version": inst.version, "path": inst.root, "works": ok,
                        "detail": detail, "seconds": round(time.monotonic() - start, 1)})
        if not json_out:
            mark = "[green]ok[/]" if ok else f"[red]broken: {detail}[/]"
            console.print(f"{harness} {inst.version}: {mark}  ({inst.root})")
    if json_out:
        print_json(results)
    if not all(r["works"] for r in results):
        raise typer.Exit(1)


@sub.command("list")
def list_command(json_out: JsonOption = False) -> None:
    """Each harness: pinned version, whether it is installed, and whether it works here."""
    from rich.table import Table

    from legorl.harnesses.install import RECIPES, check, harness_root, installed

    rows = []
    for name, r in RECIPES.items():
        inst = installed(name)
        ok, detail = check(inst) if inst else (False, "not installed")
        rows.append({"name": name, "version": r.version, "kind": r.kind, "installed": inst is not None,
                     "works": ok, "detail": detail, "path": str(harness_root(name))})
    if json_out:
        print_json(rows)
        return
    table = Table("harness", "version", "kind", "installed", "works here", "detail")
    for row in rows:
        table.add_row(str(row["name"]), str(row["version"]), str(row["kind"]), "yes" if row["installed"] else "no",
                      "[green]yes[/]" if row["works"] else "[red]no[/]", str(row["detail"]))
    console.print(table)


def register(app: typer.Typer) -> None:
    app.add_typer(sub, name="harness")
