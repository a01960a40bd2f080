"""Build SWE-smith-style tasks offline from real Python libraries whose sdists ship their tests.

The recipe, per library (``NAME==VERSION``):

1. ``pip download --no-binary :all: --no-deps NAME==VERSION``; unpack it as the clean tree
   (:mod:`.library`).
2. In network-less mining containers (``concurrency`` of them, each with its own copy): run the
   suite once for the baseline, then for each sampled one-span mutation (:mod:`.mutate`) write the
   mutated file, run the suite with a timeout, restore the file. Keep mutations that break 1–10
   baseline-passing tests (test-level ids only: a collection error hides a whole file;
   :mod:`.mining`).
3. For each kept mutation: the *visible* repository = clean code + the bug − the failing test
   functions, committed as one parentless commit with a fixed date; ``test_patch`` restores the
   removed tests, the gold ``patch`` reverts the bug; the problem statement is written from the
   failures (test names and assertion messages — never the diff; :mod:`.drafting`, :mod:`.hiding`).
4. FAIL_TO_PASS / PASS_TO_PASS come from fresh grading containers (the real grader): runs
   without the fix and with it (``check_runs`` of each; a test whose status varies between runs
   of one patch is flaky, left out and recorded in ``flaky_tests``); then the gold patch must
   score 1 on a fresh grade (the empty patch scored 0 on each of its runs; :func:`validate`, here,
   like step 5).
5. Every task's commit goes into one git bundle per library (``bundles/NAME.bundle``) and the
   rows into ``tasks.parquet`` with ``repo_source`` relative to it. ``/testbed`` is built from a
   ``git archive`` of the one commit (:mod:`legorl.sandbox.testbed`), so other tasks' objects in
   the bundle never reach a sandbox.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Container
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from legorl.core.errors import ConfigError, LegorlError
from legorl.core.schemas import TaskRow
from legorl.grading.grader import GradeOptions, Grader
from legorl.sandbox.base import Sandbox, SandboxSpec
from legorl.tasks.build_options import CHECK_RUNS, BuildOptions
from legorl.tasks.drafting import git, make_task
from legorl.tasks.library import BuildError, fetch_sdist
from legorl.tasks.mining import mine

MISSING = "MISSING"


def flaky_tests(runs: dict[str, list[dict[str, str]]]) -> dict[str, dict[str, list[str]]]:
    """The tests whose status differs between runs of the same patch (absent from a run: MISSING),
    each with its status per run under every patch (``runs``: patch name -> each run's statuses)."""
    names = sorted({t for per_patch in runs.values() for statuses in per_patch for t in statuses})
    seen = {t: {p: [r.get(t, MISSING) for r in per_patch] for p, per_patch in runs.items()} for t in names}
    return {t: by_patch for t, by_patch in seen.items() if any(len(set(s)) > 1 for s in by_patch.values())}


def _test_lists(runs: dict[str, list[dict[str, str]]], flaky: Container[str]) -> tuple[list[str], list[str]]:
    """FAIL_TO_PASS / PASS_TO_PASS from the stable tests: PASSED on every gold run, and not / also
    PASSED on every empty-patch run."""
    gold, empty = runs["gold"][0], runs["empty"][0]
    stable = [t for t, s in gold.items() if s == "PASSED" and t not in flaky]
    return (sorted(t for t in stable if empty.get(t) != "PASSED"), sorted(t for t in stable if empty.get(t) == "PASSED"))


def validate(task: TaskRow, grader: Grader, runs: int = CHECK_RUNS) -> TaskRow | str:
    """Fix FAIL_TO_PASS / PASS_TO_PASS (and the gold statuses they are judged against) from ``runs``
    fresh runs each of the empty and the gold patch (empty -> 0 on each, by construction), then
    check gold -> 1 on a fresh grade. A test whose status varies between runs of one patch is flaky: it is left out of both
    lists and recorded in ``flaky_tests`` (a reward that hangs on it would be noise a policy learns to
    chase). The runs of one patch share the grader's per-task testbed tar, image and test command;
    the check stops early once no test can still be FAIL_TO_PASS. Returns the final row, or why the
    task was rejected."""
    if runs < 1:
        raise ConfigError(f"--check-runs must be at least 1, got {runs}")
    seen: dict[str, list[dict[str, str]]] = {"empty": [], "gold": []}
    try:
        for _ in range(runs):
            seen["empty"].append(grader.statuses_for(task, "", "unpatched testbed", timed_out_ok=True))
            seen["gold"].append(grader.statuses_for(task, task.patch or "", "gold patch", timed_out_ok=True))
            if not _test_lists(seen, flaky_tests(seen))[0]:
                break  # further runs can only take tests away
    except LegorlError as exc:
        return f"grading failed: {exc}"
    flaky = flaky_tests(seen)
    f2p, p2p = _test_lists(seen, flaky)
    if not f2p:
        done = len(seen["gold"])
        why = "no test fails before and passes after the gold patch"
        if flaky:
            return (f"{why} on all of {done} runs of each ({len(flaky)} flaky test(s) left out: "
                    f"{', '.join(sorted(flaky)[:5])})")
        return why
    if any(any(c.isspace() for c in t) for t in f2p + p2p):
        p2p = [t for t in p2p if not any(c.isspace() for c in t)]
        if any(any(c.isspace() for c in t) for t in f2p):
            return "a FAIL_TO_PASS id holds whitespace (SWE-bench's parser would truncate it)"
    a = seen["gold"][0]
    task.FAIL_TO_PASS, task.PASS_TO_PASS = f2p, p2p
    task.gold_statuses = json.dumps({t: a[t] for t in f2p + p2p}, sort_keys=True)
    task.flaky_tests = json.dumps(flaky, sort_keys=True) if flaky else None
    # The empty patch scored 0 on every one of its runs already (each FAIL_TO_PASS test failed in
    # all of them); the gold patch gets a full grade on a fresh run, judged against what was found.
    gold = grader.grade(task, task.patch)
    if gold.reward != 1.0:
        return f"gold patch scored {gold.reward} on a fresh run ({gold.status}: {gold.error})"
    return task


def build_library(spec: str, out_dir: Path, work: Path, opts: BuildOptions,
                  create: Callable[[SandboxSpec], Sandbox] | None = None) -> list[TaskRow]:
    """Build up to ``opts.per_library`` validated tasks from one library into ``out_dir``."""
    from legorl.sandbox.host import base_image

    if create is None:
        from legorl.sandbox.podman import PodmanBackend

        create = PodmanBackend().create
    image = opts.image or base_image()
    lib = fetch_sdist(spec, work / spec.replace("==", "-"))
    opts.log(f"{lib.name} {lib.version}: {len(lib.source_files)} source files, {len(lib.test_files)} test files")
    mined = mine(lib, create, image, opts)
    repo = work / f"{lib.name}.git"
    shutil.rmtree(repo, ignore_errors=True)
    repo.mkdir(parents=True)
    git(repo, "init", "-q", "--bare")
    bundle = out_dir / "bundles" / f"{lib.name}.bundle"
    drafts = [make_task(lib, repo, m, work / "visible") for m in mined]
    grader = Grader(GradeOptions(test_timeout=opts.timeout, default_image=image, run_empty=True), create)
    # the grader builds /testbed from repo_source: point drafts at the bare repo while validating
    for task, _ref in drafts:
        task.repo_source = str(repo)

    def check(item: tuple[TaskRow, str]) -> tuple[TaskRow | str, str]:
        return validate(item[0], grader, opts.check_runs), item[1]

    tasks: list[TaskRow] = []
    refs: list[str] = []
    with ThreadPoolExecutor(max_workers=opts.concurrency) as pool:
        for result, ref in pool.map(check, drafts):
            if isinstance(result, str):
                opts.log(f"{lib.name}: rejected {ref.rsplit('/', 1)[1]}: {result}")
                continue
            tasks.append(result)
            refs.append(ref)
    if not tasks:
        return []
    bundle.parent.mkdir(parents=True, exist_ok=True)
    git(repo, "bundle", "create", str(bundle.resolve()), *refs)
    for task in tasks:
        task.repo_source = os.path.relpath(bundle, out_dir)
    opts.log(f"{lib.name}: {len(tasks)} tasks, bundle {bundle.stat().st_size / 1024:.0f} KiB")
    return tasks


def build(specs: list[str], out_dir: Path, opts: BuildOptions, work: Path | None = None) -> list[TaskRow]:
    """Build tasks from several libraries; writes ``out_dir/tasks.parquet`` and the bundles."""
    import pyarrow.parquet as pq

    from legorl.core.schemas import Kind
    from legorl.core.shards import to_table

    out_dir.mkdir(parents=True, exist_ok=True)
    owned_tmp = work is None
    work = Path(tempfile.mkdtemp(prefix="legorl-build-")) if work is None else work
    try:
        tasks: list[TaskRow] = []
        failed: list[str] = []
        for spec in specs:
            try:
                tasks += build_library(spec, out_dir, work, opts)
            except BuildError as exc:  # one library's failure does not lose the others
                opts.log(f"error: {exc}")
                failed.append(spec)
            # written after every library, so a late failure never loses what was built
            table = to_table(Kind.TASKS, tasks).replace_schema_metadata(None)
            pq.write_table(table, out_dir / "tasks.parquet", compression="zstd")
        if failed and not tasks:
            raise BuildError(f"no library could be built ({', '.join(failed)})")
        return tasks
    finally:
        if owned_tmp:
            shutil.rmtree(work, ignore_errors=True)
