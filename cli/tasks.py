"""`legorl tasks import|build|list`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from legorl.cli.common import JsonOption, OptionalRunOption, RunOption, console, fail, print_json
from legorl.cli.options import ConfigOptions, with_configs
from legorl.grading.grader import GradeOptions
from legorl.tasks.build_options import CHECK_RUNS

sub = typer.Typer(help="Task sets: import SWE-bench-style data, build tasks offline.", no_args_is_help=True)


@sub.command("import")
def import_command(
    source: Annotated[str, typer.Argument(help=(
        "A Hugging Face dataset id, a local .parquet/.jsonl/.json file, or a folder of Harbor task directories "
        "(or one): their images are built with podman, offline."))],
    run: RunOption,
    split: Annotated[str, typer.Option(help="Dataset split (Hub datasets only).")] = "test",
    limit: Annotated[int | None, typer.Option(help="Import at most this many rows.")] = None,
    instance_id: Annotated[list[str] | None, typer.Option("--id", help="Import only these instance ids.")] = None,
    json_out: JsonOption = False,
) -> None:
    """Import SWE-bench-schema task rows into RUN/tasks (rows already there unchanged are skipped)."""
    from legorl.core.paths import RunDir
    from legorl.stages.tasks import import_stage

    result = import_stage(source, RunDir.at(run).tasks, split=split, limit=limit, instance_ids=instance_id,
                          log=lambda s: console.print(s, highlight=False))
    errors: list[str] = getattr(result, "errors", [])  # Harbor task directories that were not imported
    if json_out:
        print_json({"source": source, "written": result.written, "unchanged": result.unchanged, "file": result.path,
                    **({"errors": errors} if errors else {})})
    else:
        console.print(f"imported {len(result.written)} task(s) from {source} into {RunDir.at(run).tasks}"
                      f" ({len(result.unchanged)} already there)", highlight=False)
    if errors:
        fail(f"{len(errors)} task(s) not imported:\n" + "\n".join(errors))


@sub.command("build")
def build_command(
    packages: Annotated[list[str], typer.Argument(help="Libraries as NAME==VERSION (their sdists must ship tests).")],
    out: Annotated[Path, typer.Option("--out", help="Where the bundles and tasks.parquet go.")],
    run: OptionalRunOption = None,
    per_library: Annotated[int, typer.Option(help="Tasks to keep per library.")] = 8,
    attempts: Annotated[int, typer.Option(help="Mutations to try per library at most.")] = 60,
    concurrency: Annotated[int, typer.Option(help="Mining / validation containers at once.")] = 2,
    timeout: Annotated[float, typer.Option(help="Seconds per test-suite run.")] = 60.0,
    seed: Annotated[int, typer.Option(help="Seed of the mutation sampler.")] = 0,
    image: Annotated[str | None, typer.Option(help="Image to mine and validate in (default: the base image).")] = None,
    check_runs: Annotated[int, typer.Option(min=1, help=(
        "Runs of the gold and the empty patch per task in the check: a test whose status varies is "
        "flaky, left out of FAIL_TO_PASS / PASS_TO_PASS and recorded on the task."))] = CHECK_RUNS,
    json_out: JsonOption = False,
) -> None:
    """Build SWE-smith-style tasks from real libraries, offline; with --run, import them too."""
    from legorl.core.paths import RunDir
    from legorl.sandbox.reaper import reap
    from legorl.stages.tasks import build_stage
    from legorl.tasks.build_options import BuildOptions

    reap()
    options = BuildOptions(per_library=per_library, attempts=attempts, concurrency=concurrency, timeout=timeout,
                           seed=seed, image=image, check_runs=check_runs, log=lambda s: console.print(s, highlight=False))
    tasks = build_stage(packages, out, options, RunDir.at(run).tasks if run else None)
    if not tasks:
        fail("no task survived validation")
    if json_out:
        print_json({"out": str(out), "tasks": [t.instance_id for t in tasks]})
        return
    console.print(f"built {len(tasks)} task(s) into {out}", highlight=False)


@sub.command("list")
def list_command(run: RunOption, json_out: JsonOption = False) -> None:
    """List the tasks of RUN/tasks, by instance id: the order `rollout --limit N` takes the first N in."""
    from rich.table import Table

    from legorl.core.paths import RunDir
    from legorl.stages.tasks import list_tasks

    tasks = sorted(list_tasks(RunDir.at(run).tasks), key=lambda t: t.instance_id)
    if json_out:
        print_json([{"instance_id": t.instance_id, "repo": t.repo, "image": t.image, "FAIL_TO_PASS": len(t.FAIL_TO_PASS),
                     "PASS_TO_PASS": len(t.PASS_TO_PASS)} for t in tasks])
        return
    table = Table("#", "instance_id", "repo", "F2P", "P2P", "image")
    for i, t in enumerate(tasks, 1):
        table.add_row(str(i), t.instance_id, t.repo or "", str(len(t.FAIL_TO_PASS)), str(len(t.PASS_TO_PASS)),
                      t.image or "(base)")
    console.print(table)
    console.print(f"{len(tasks)} task(s)")


@sub.command("canaries")
@with_configs(options=ConfigOptions(GradeOptions, only=("concurrency", "test_timeout", "default_image", "memory")))
def canaries_command(
    options: GradeOptions,
    run: RunOption,
    instance_id: Annotated[list[str] | None, typer.Option("--id", help="Only these instance ids.")] = None,
    into: Annotated[Path | None, typer.Option("--into", help=(
        "Add the tasks whose passes canaries check (a changed expected value) to this run's tasks."))] = None,
    json_out: JsonOption = False,
) -> None:
    """Which tasks' passes are checked from outside the test process: each task's canaries, by form.

    A pass is checked only where the grade changes a canary's expected value; a task whose canaries
    are negations only, or that has none, is graded on the runner's tripwires, which code in the test
    process can evade (docs/threat-model.md). Train on the checked ones with --into."""
    from rich.table import Table

    from legorl.core.paths import RunDir
    from legorl.grading.coverage import CHECKED
    from legorl.sandbox.reaper import reap
    from legorl.stages.tasks import canaries_stage

    reap()
    found = canaries_stage(RunDir.at(run).tasks, options, instance_id, RunDir.at(into).tasks if into else None,
                           on_done=None if json_out else lambda c: console.print(
                               f"{c.instance_id}: {c.verdict}", highlight=False))
    if json_out:
        print_json([c.as_dict() for c in found])
        return
    table = Table("instance_id", "F2P", "values", "negations", "checked by")
    for c in found:
        table.add_row(c.instance_id, str(c.tests), str(len(c.values)), str(len(c.negations)),
                      c.verdict if c.error is None else f"{c.verdict}: {c.error[:120]}")
    console.print(table)
    checked = sum(c.verdict == CHECKED for c in found)
    console.print(f"{checked} of {len(found)} task(s) checked by canaries"
                  + (f"; added to {RunDir.at(into).tasks}" if into else ""), highlight=False)


def register(app: typer.Typer) -> None:
    app.add_typer(sub, name="tasks")
