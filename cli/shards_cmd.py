"""`legorl shards compact RUN`: merge the small part files of a run (or one dataset folder)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from legorl.cli.common import JsonOption, console, fail, print_json


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="Maintain a run's shards (part files).", no_args_is_help=True)
    app.add_typer(group, name="shards")

    @group.command("compact")
    def compact_command(
        path: Annotated[Path, typer.Argument(help="A run directory or one dataset folder.")],
        target_mb: Annotated[int, typer.Option("--target-mb", help="Size of a merged part (MB on disk).")] = 128,
        json_output: JsonOption = False,
    ) -> None:
        """Merge runs of small part files into large ones, keeping each key's last row.

        Safe while stages write and readers read, and after a kill: the next compaction finishes
        the killed one's work."""
        from legorl.core import shards
        from legorl.monitor import summaries
        from legorl.monitor.inspect import detect_kind

        if not path.is_dir():
            fail(f"{path}: no such run directory or dataset folder")
        target = target_mb * 2**20
        if shards.part_files(path):
            kind = detect_kind(path)
            done = [shards.compact(path, kind, target_bytes=target, on_merge=summaries.merge)] if kind is not None else []
        else:
            done = shards.compact_run(path, target_bytes=target, on_merge=summaries.merge)
        result = [{"path": str(c.folder), "merged": len(c.merged), "replaced": c.replaced, "rows": c.rows,
                   "superseded_rows_dropped": c.dropped} for c in done if c.replaced]
        if json_output:
            print_json({"compacted": result})
            return
        for r in result:
            console.print(f"{r['path']}: {r['replaced']} parts -> {r['merged']} ({r['rows']} rows, "
                          f"{r['superseded_rows_dropped']} superseded dropped)", highlight=False, soft_wrap=True)
        if not result:
            console.print(f"{path}: nothing to compact", highlight=False, soft_wrap=True)
