"""Build SWE-smith-style tasks offline from real Python libraries whose sdists ship their tests.

The recipe, per library (``NAME==VERSION``):

1. ``pip download --no-binary :all: --no-deps NAME==VERSION``; unpack it as the clean tree.
2. In network-less mining containers (``concurrency`` of them, each with its own copy): run the
   suite once for the baseline, then for each sampled one-span mutation (:mod:`.mutate`) write the
   mutated file, run the suite with a timeout, restore the file. Keep mutations that break 1–10
   baseline-passing tests (test-level ids only: a collection error hides a whole file).
3. For each kept mutation: the *visible* repository = clean code + the bug − the failing test
   functions, committed as one parentless commit with a fixed date; ``test_patch`` restores the
   removed tests, the gold ``patch`` reverts the bug; the problem statement is written from the
   failures (test names and assertion messages — never the diff).
4. FAIL_TO_PASS / PASS_TO_PASS come from fresh grading containers (the real grader): a run
   without the fix and a run with it; then the gold patch must score 1 and the empty patch 0.
5. Every task's commit goes into one git bundle per library (``bundles/NAME.bundle``) and the
   rows into ``tasks.parquet`` with ``repo_source`` relative to it. ``/testbed`` is built from a
   ``git archive`` of the one commit (:mod:`legorl.sandbox.testbed`), so other tasks' objects in
   the bundle never reach a sandbox.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import queue
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from legorl.errors import LegorlError
from legorl.grading.grader import GradeOptions, Grader
from legorl.grading.logparse import parse_pytest
from legorl.sandbox.base import Sandbox, SandboxSpec
from legorl.schemas import TaskRow
from legorl.tasks.mutate import Mutation, find_mutations, sample

FIXED_DATE = "2024-01-01T00:00:00+0000"
MIN_BROKEN, MAX_BROKEN = 1, 10
PYTEST_FLAGS = "-o addopts= --no-header -rA --tb=no -p no:cacheprovider"
_GIT_ENV = {
    "GIT_AUTHOR_NAME": "legorl", "GIT_AUTHOR_EMAIL": "legorl@localhost", "GIT_AUTHOR_DATE": FIXED_DATE,
    "GIT_COMMITTER_NAME": "legorl", "GIT_COMMITTER_EMAIL": "legorl@localhost", "GIT_COMMITTER_DATE": FIXED_DATE,
    "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null",
}
_PASSING = ("PASSED", "XFAIL")


class BuildError(LegorlError):
    pass


@dataclass
class BuildOptions:
    per_library: int = 8  # tasks to keep per library
    attempts: int = 60  # mutations to try per library at most
    concurrency: int = 2
    timeout: float = 60.0  # per test-suite run while mining
    seed: int = 0
    image: str | None = None
    log: Callable[[str], None] = field(default=lambda s: None)


@dataclass
class Library:
    name: str
    version: str
    root: Path  # the unpacked clean tree
    source_files: list[str]
    test_files: list[str]
    pythonpath: str | None  # "src" for src layouts

    @property
    def test_command(self) -> str:
        prefix = f"PYTHONPATH={self.pythonpath} " if self.pythonpath else ""
        return f"{prefix}python3 -m pytest {PYTEST_FLAGS} {{test_files}}"


# --------------------------------------------------------------------------- the library


def fetch_sdist(spec: str, dest: Path) -> Library:
    """Download and unpack ``NAME==VERSION``'s sdist into ``dest``."""
    name, _, version = spec.partition("==")
    if not name or not version:
        raise BuildError(f"{spec!r}: give NAME==VERSION")
    download = dest / "sdist"
    download.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-q", "-d", str(download), spec], capture_output=True, text=True,
    )
    archives = sorted(download.glob("*.tar.gz"))
    if proc.returncode != 0 or not archives:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
        raise BuildError(f"pip download {spec} failed: {tail[0]}")
    root = dest / "clean"
    shutil.rmtree(root, ignore_errors=True)
    with tarfile.open(archives[0]) as tar:
        tar.extractall(dest / "unpacked", filter="data")
    (top,) = [p for p in (dest / "unpacked").iterdir() if p.is_dir()]
    top.rename(root)
    return describe(name, version, root)


def describe(name: str, version: str, root: Path) -> Library:
    """Find the library's source and test files in an unpacked tree."""
    for junk in list(root.glob("*.egg-info")) + list(root.glob("src/*.egg-info")):
        shutil.rmtree(junk)
    tests, sources = [], []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        parts = rel.split("/")
        if parts[0] in ("docs", "doc", "examples", "benchmarks", "tools", "scripts") or path.name in (
            "setup.py", "noxfile.py", "conftest.py", "fabfile.py"
        ):
            continue
        if "tests" in parts[:-1] or "test" in parts[:-1]:
            if path.name.startswith("test_") or path.name.endswith("_test.py"):
                tests.append(rel)
        elif not path.name.startswith("test_") and path.name != "__main__.py":
            sources.append(rel)
    if not tests:
        raise BuildError(f"{name} {version}: its sdist ships no tests")
    if not sources:
        raise BuildError(f"{name} {version}: no library source found")
    pythonpath = "src" if (root / "src").is_dir() and any(s.startswith("src/") for s in sources) else None
    return Library(name, version, root, sources, tests, pythonpath)


# --------------------------------------------------------------------------- git


def _git(repo: Path, *args: str, input: bytes | None = None, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(["git", *args], cwd=repo, capture_output=True, input=input,
                          env={**os.environ, **_GIT_ENV, **(env or {})})
    if proc.returncode != 0:
        raise BuildError(f"git {args[0]} in {repo}: {proc.stderr.decode(errors='replace').strip()[-300:]}")
    return proc.stdout.decode(errors="replace")


def _tree_of(repo: Path, tree_dir: Path) -> str:
    """Write ``tree_dir``'s files as a tree object in ``repo`` (a throwaway index, nothing staged)."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {"GIT_INDEX_FILE": f"{tmp}/index", "GIT_WORK_TREE": str(tree_dir)}
        _git(repo, "add", "-A", "-f", ".", env=env)
        return _git(repo, "write-tree", env=env).strip()


def _commit(repo: Path, tree: str, message: str) -> str:
    return _git(repo, "commit-tree", tree, "-m", message).strip()


# --------------------------------------------------------------------------- hiding tests


def _test_target(test_id: str) -> tuple[str, str | None, str]:
    """``path::Class::func[param]`` -> (path, Class, func)."""
    parts = test_id.split("[", 1)[0].split("::")
    if len(parts) == 2:
        return parts[0], None, parts[1]
    return parts[0], parts[-2], parts[-1]


def _function_spans(text: str, cls: str | None, func: str, anywhere: bool) -> list[tuple[int, int, ast.AST]]:
    """Line spans (1-based, inclusive, decorators included) of ``func`` defined in ``cls``."""
    tree = ast.parse(text)
    spans: list[tuple[int, int, ast.AST]] = []

    def visit(body: list[ast.stmt], owner: ast.ClassDef | None) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                visit(node.body, node)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == func:
                owner_name = owner.name if owner else None
                if anywhere or owner_name == cls:
                    start = min([node.lineno, *[d.lineno for d in node.decorator_list]])
                    spans.append((start, node.end_lineno or node.lineno, owner or tree))

    visit(tree.body, None)
    return spans


def remove_tests(root: Path, test_ids: Iterable[str], helper_files: list[str]) -> list[str]:
    """Delete the functions behind ``test_ids`` from the files under ``root``; the files changed.

    A test inherited from a mixin defined elsewhere (say ``tests/__init__.py``) is removed where it
    is defined. Raises :class:`BuildError` when a test's definition cannot be found.
    """
    removals: dict[str, set[tuple[str | None, str, bool]]] = {}
    for test_id in test_ids:
        path, cls, func = _test_target(test_id)
        text = (root / path).read_text()
        if _function_spans(text, cls, func, anywhere=False):
            removals.setdefault(path, set()).add((cls, func, False))
            continue
        found = [h for h in helper_files if _function_spans((root / h).read_text(), None, func, anywhere=True)]
        if not found:
            raise BuildError(f"cannot find the definition of {test_id}")
        for h in found:
            removals.setdefault(h, set()).add((None, func, True))
    for path, items in removals.items():
        text = (root / path).read_text()
        lines = text.splitlines(keepends=True)
        spans: list[tuple[int, int, ast.AST]] = []
        for cls, func, anywhere in items:
            spans += _function_spans(text, cls, func, anywhere)
        drop: set[int] = set()
        for start, end, _owner in spans:
            drop.update(range(start, end + 1))
        out = []
        for number, line in enumerate(lines, 1):
            if number not in drop:
                out.append(line)
        new_text = "".join(out)
        # A class left without a body gets `pass`.
        try:
            ast.parse(new_text)
        except SyntaxError:
            new_text = _fill_empty_classes(text, spans, lines)
        (root / path).write_text(new_text)
    return sorted(removals)


def _fill_empty_classes(text: str, spans: list[tuple[int, int, ast.AST]], lines: list[str]) -> str:
    drop: dict[int, str] = {}
    for start, end, owner in spans:
        for n in range(start, end + 1):
            drop[n] = ""
        if isinstance(owner, ast.ClassDef):
            remaining = [s for s in owner.body if not any(
                s.lineno >= a and (s.end_lineno or s.lineno) <= b for a, b, _ in spans)]
            if not remaining:
                indent = lines[start - 1][: len(lines[start - 1]) - len(lines[start - 1].lstrip())]
                drop[start] = f"{indent}pass\n"
    return "".join(drop.get(n, line) for n, line in enumerate(lines, 1))


# --------------------------------------------------------------------------- mining


@dataclass
class Mined:
    mutation: Mutation
    broken: dict[str, str]  # test id -> failure message


def _run_suite(box: Sandbox, lib: Library, timeout: float) -> tuple[dict[str, str], dict[str, str], bool]:
    """(statuses, failure messages, timed out) of the whole suite in a mining container."""
    files = " ".join(shlex.quote(f) for f in lib.test_files)
    command = lib.test_command.replace("--tb=no", "--tb=line").replace("{test_files}", files)
    res = box.exec(f"cd /testbed && timeout -k 2 {timeout:g} bash -c {shlex.quote(command)}", timeout=timeout + 30)
    if res.timed_out or res.exit_code in (124, 137):
        return {}, {}, True
    statuses = parse_pytest(res.output).full
    messages: dict[str, str] = {}
    for line in res.output.splitlines():
        if line.startswith("FAILED ") and " - " in line:
            test_id, _, message = line[len("FAILED ") :].partition(" - ")
            messages[test_id.strip()] = message.strip()
    return statuses, messages, False


def mine(lib: Library, create: Callable[[SandboxSpec], Sandbox], image: str, opts: BuildOptions) -> list[Mined]:
    """Try sampled mutations in ``opts.concurrency`` containers; keep those breaking 1–10 tests."""
    candidates = [m for path in lib.source_files for m in find_mutations(path, (lib.root / path).read_text())]
    work: queue.Queue[Mutation] = queue.Queue()
    for m in sample(candidates, opts.attempts, opts.seed):
        work.put(m)
    kept: list[Mined] = []
    lock = threading.Lock()
    baseline: dict[str, str] = {}
    opts.log(f"{lib.name}: {len(candidates)} candidate mutations, trying up to {work.qsize()}")

    def worker(index: int) -> None:
        spec = SandboxSpec(image=image, labels={"role": "task-build", "trial": f"{lib.name}-{index}"},
                           network=False, deadline_s=3600)
        box = create(spec)
        try:
            box.put_dir(str(lib.root), "/testbed")
            statuses, _, timed_out = _run_suite(box, lib, opts.timeout)
            passing = {t for t, s in statuses.items() if s in _PASSING}
            if timed_out or not passing:
                raise BuildError(f"{lib.name}: the clean test suite does not pass in {image}")
            with lock:
                baseline.update(statuses)
            while True:
                with lock:
                    if len(kept) >= opts.per_library:
                        return
                try:
                    m = work.get_nowait()
                except queue.Empty:
                    return
                original = (lib.root / m.path).read_text()
                box.put_file(f"/testbed/{m.path}", m.apply(original).encode())
                after, messages, timed_out = _run_suite(box, lib, opts.timeout)
                box.put_file(f"/testbed/{m.path}", original.encode())
                if timed_out:
                    continue
                broken = {t: messages.get(t, "") for t in passing if after.get(t) not in _PASSING}
                file_level = any("::" not in t for t, s in after.items() if s in ("ERROR", "FAILED"))
                if (MIN_BROKEN <= len(broken) <= MAX_BROKEN and not file_level
                        and not any(any(c.isspace() for c in t) for t in broken)):
                    with lock:
                        if len(kept) < opts.per_library:
                            kept.append(Mined(m, broken))
                            opts.log(f"{lib.name}: kept {m.describe()} ({len(broken)} failing)")
        finally:
            box.remove()

    with ThreadPoolExecutor(max_workers=opts.concurrency) as pool:
        for future in [pool.submit(worker, i) for i in range(opts.concurrency)]:
            future.result()
    return kept


# --------------------------------------------------------------------------- tasks


def problem_statement(lib: Library, broken: dict[str, str]) -> str:
    lines = [
        f"{lib.name}: {len(broken)} test{'s' if len(broken) != 1 else ''} of the maintainers' suite fail",
        "",
        f"Running the test suite of `{lib.name}` ({lib.version}) shows failures that should not happen:",
        "",
    ]
    for test_id, message in sorted(broken.items()):
        lines.append(f"- `{test_id}`" + (f" fails with: `{message}`" if message else " fails"))
    lines += [
        "",
        "The tests are right; the library's behaviour is wrong. Fix the library so these tests pass "
        "again, without breaking any other test.",
    ]
    return "\n".join(lines) + "\n"


def task_id(lib: Library, m: Mutation) -> str:
    digest = hashlib.sha256(m.describe().encode()).hexdigest()[:8]
    return f"{lib.name}__{m.kind}-{digest}"


def make_task(lib: Library, repo: Path, mined: Mined, work: Path) -> tuple[TaskRow, str]:
    """The task row (lists still provisional) and the ref of its visible commit in ``repo``."""
    m = mined.mutation
    iid = task_id(lib, m)
    visible = work / iid
    shutil.rmtree(visible, ignore_errors=True)
    shutil.copytree(lib.root, visible)
    original = (lib.root / m.path).read_text()
    (visible / m.path).write_text(m.apply(original))
    helpers = [p.relative_to(lib.root).as_posix() for p in lib.root.rglob("*.py")
               if p.relative_to(lib.root).as_posix().split("/")[0] in ("tests", "test")]
    changed_tests = remove_tests(visible, mined.broken, helpers)
    visible_tree = _tree_of(repo, visible)
    commit = _commit(repo, visible_tree, f"{lib.name} {lib.version}")
    # gold: the visible tree with the bug reverted; full: with the hidden tests restored
    (visible / m.path).write_text(original)
    fixed_tree = _tree_of(repo, visible)
    (visible / m.path).write_text(m.apply(original))
    for path in changed_tests:
        shutil.copy2(lib.root / path, visible / path)
    full_tree = _tree_of(repo, visible)
    shutil.rmtree(visible)
    gold = _git(repo, "diff", "--no-color", "--no-ext-diff", visible_tree, fixed_tree)
    test_patch = _git(repo, "diff", "--no-color", "--no-ext-diff", visible_tree, full_tree)
    ref = f"refs/tasks/{iid}"
    _git(repo, "update-ref", ref, commit)
    # Run the files the failing tests live in (a test inherited from a mixin in tests/__init__.py
    # changes only that file), plus every test file the test_patch touches.
    from legorl.grading.grader import hidden_test_files

    files = dict.fromkeys([*(t.split("::", 1)[0] for t in sorted(mined.broken)), *hidden_test_files(test_patch)])
    run = [f for f in files if f in lib.test_files]
    task = TaskRow(
        instance_id=iid, repo=f"pypi/{lib.name}", base_commit=commit, patch=gold, test_patch=test_patch,
        problem_statement=problem_statement(lib, mined.broken), hints_text="", created_at=FIXED_DATE,
        version=lib.version, FAIL_TO_PASS=sorted(mined.broken), PASS_TO_PASS=[],
        test_command=lib.test_command.replace("{test_files}", " ".join(shlex.quote(f) for f in run)),
        log_parser="pytest",
    )
    return task, ref


def validate(task: TaskRow, grader: Grader) -> TaskRow | str:
    """Fix FAIL_TO_PASS / PASS_TO_PASS (and the gold statuses they are judged against) from fresh
    runs without and with the gold patch, then check gold -> 1 and empty -> 0. Returns the final
    row, or why the task was rejected."""
    try:
        b = grader.statuses_for(task, "", "unpatched testbed")
        a = grader.statuses_for(task, task.patch or "", "gold patch")
    except LegorlError as exc:
        return f"grading failed: {exc}"
    f2p = sorted(t for t, s in a.items() if s == "PASSED" and b.get(t) != "PASSED")
    p2p = sorted(t for t, s in a.items() if s == "PASSED" and b.get(t) == "PASSED")
    if not f2p:
        return "no test fails before and passes after the gold patch"
    if any(any(c.isspace() for c in t) for t in f2p + p2p):
        p2p = [t for t in p2p if not any(c.isspace() for c in t)]
        if any(any(c.isspace() for c in t) for t in f2p):
            return "a FAIL_TO_PASS id holds whitespace (SWE-bench's parser would truncate it)"
    task.FAIL_TO_PASS, task.PASS_TO_PASS = f2p, p2p
    task.gold_statuses = json.dumps({t: a[t] for t in f2p + p2p}, sort_keys=True)
    gold, empty = grader.grade(task, task.patch), grader.grade(task, "")
    if gold.reward != 1.0:
        return f"gold patch scored {gold.reward} on a fresh run ({gold.status}: {gold.error})"
    if empty.reward != 0.0:
        return f"empty patch scored {empty.reward} on a fresh run"
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
    _git(repo, "init", "-q", "--bare")
    bundle = out_dir / "bundles" / f"{lib.name}.bundle"
    drafts = [make_task(lib, repo, m, work / "visible") for m in mined]
    grader = Grader(GradeOptions(test_timeout=opts.timeout, default_image=image, run_empty=True), create)
    # the grader builds /testbed from repo_source: point drafts at the bare repo while validating
    for task, _ref in drafts:
        task.repo_source = str(repo)

    def check(item: tuple[TaskRow, str]) -> tuple[TaskRow | str, str]:
        return validate(item[0], grader), item[1]

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
    _git(repo, "bundle", "create", str(bundle.resolve()), *refs)
    for task in tasks:
        task.repo_source = os.path.relpath(bundle, out_dir)
    opts.log(f"{lib.name}: {len(tasks)} tasks, bundle {bundle.stat().st_size / 1024:.0f} KiB")
    return tasks


def build(specs: list[str], out_dir: Path, opts: BuildOptions, work: Path | None = None) -> list[TaskRow]:
    """Build tasks from several libraries; writes ``out_dir/tasks.parquet`` and the bundles."""
    import pyarrow.parquet as pq

    from legorl.schemas import Kind
    from legorl.shards import to_table

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
