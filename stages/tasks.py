"""The tasks stage: import SWE-bench-style rows, or build tasks offline, into a run's ``tasks/``."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

from legorl import shards
from legorl.schemas import Kind, TaskRow
from legorl.tasks.importer import ImportResult, import_tasks


def import_stage(
    source: str, tasks_dir: str | os.PathLike[str], split: str = "test", limit: int | None = None,
    instance_ids: Iterable[str] | None = None, log: Callable[[str], None] = lambda _s: None,
) -> ImportResult:
    """Validate ``source`` and add its new or changed rows to ``tasks_dir``. A folder of Harbor task
    directories (or one) is imported by :mod:`legorl.tasks.harbor`: its result's ``errors`` name the
    tasks that were not."""
    from legorl.tasks.harbor import import_harbor, is_harbor_source

    if is_harbor_source(Path(source).expanduser()):
        return import_harbor(Path(source).expanduser(), tasks_dir, instance_ids=list(instance_ids) if instance_ids
                             is not None else None, limit=limit, log=log)
    return import_tasks(source, tasks_dir, split=split, limit=limit, instance_ids=instance_ids)


def build_stage(specs: list[str], out_dir: Path, options: object, tasks_dir: Path | None = None) -> list[TaskRow]:
    """Build tasks from sdists into ``out_dir`` (bundles + tasks.parquet); import them into
    ``tasks_dir`` too when given."""
    from legorl.tasks.builder import BuildOptions, build

    assert isinstance(options, BuildOptions)
    tasks = build(specs, out_dir, options)
    if tasks_dir is not None and tasks:
        import_tasks(str(out_dir / "tasks.parquet"), tasks_dir)
    return tasks


def list_tasks(tasks_dir: str | os.PathLike[str]) -> list[TaskRow]:
    rows: list[TaskRow] = shards.read_rows(tasks_dir, Kind.TASKS)
    return rows
