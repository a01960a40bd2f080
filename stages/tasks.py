"""The tasks stage: import SWE-bench-style rows, or build tasks offline, into a run's ``tasks/``."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from legorl.core import shards
from legorl.core.schemas import Kind, TaskRow
from legorl.tasks.importer import ImportResult, import_tasks

if TYPE_CHECKING:
    from legorl.grading.coverage import TaskCanaries
    from legorl.grading.grader import GradeOptions


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
    from legorl.tasks.build_options import BuildOptions
    from legorl.tasks.builder import build

    assert isinstance(options, BuildOptions)
    tasks = build(specs, out_dir, options)
    if tasks_dir is not None and tasks:
        import_tasks(str(out_dir / "tasks.parquet"), tasks_dir)
    return tasks


def list_tasks(tasks_dir: str | os.PathLike[str]) -> list[TaskRow]:
    rows: list[TaskRow] = shards.read_rows(tasks_dir, Kind.TASKS)
    return rows


def canaries_stage(
    tasks_dir: str | os.PathLike[str], options: GradeOptions, instance_ids: Iterable[str] | None = None,
    into: str | os.PathLike[str] | None = None, on_done: Callable[[TaskCanaries], None] | None = None,
) -> list[TaskCanaries]:
    """Each task's canaries by form (:mod:`legorl.grading.coverage`); with ``into``, the tasks whose
    passes are checked from outside the test process are added to that tasks folder."""
    from legorl.core.errors import LegorlError
    from legorl.grading.coverage import survey
    from legorl.grading.grader import Grader
    from legorl.tasks.importer import add_tasks

    tasks = sorted(list_tasks(tasks_dir), key=lambda t: t.instance_id)
    if instance_ids is not None:
        wanted = set(instance_ids)
        unknown = sorted(wanted - {t.instance_id for t in tasks})
        if unknown:
            raise LegorlError(f"{tasks_dir}: no task {unknown[0]!r}")
        tasks = [t for t in tasks if t.instance_id in wanted]
    if into is not None and Path(into).resolve() == Path(tasks_dir).resolve():
        raise LegorlError(f"--into {into}: the tasks' own folder (give another run's)")
    found = survey(Grader(options), tasks, options.concurrency, on_done)
    if into is not None:
        checked = {c.instance_id for c in found if c.checked}
        add_tasks([t for t in tasks if t.instance_id in checked], into, str(tasks_dir))
    return found
