"""Build the shipped flaky-test task (examples/flaky-task/README.md): ``coin__flaky-1``.

The visible repository is ``library/`` with a bug in ``coin.clamp`` (it stops one short of
``high``) and the two tests that catch it removed; ``test_patch`` puts them back, the gold patch
reverts the bug, and ``half-fix.diff`` is a fix that works only when ``coin.flip()`` lands heads.
``tests/test_coin.py::test_flip_lands_heads`` fails on about half the runs whatever the patch: the
task check (``legorl.tasks.builder.validate``) must find it flaky and leave it out of the lists.

    python examples/flaky-task/build.py [--check-runs N]   # needs podman and the base image

Writes ``bundles/coin.bundle``, ``tasks.parquet`` (the checked row) and ``half-fix.diff`` here.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
INSTANCE_ID = "coin__flaky-1"
REF = f"refs/tasks/{INSTANCE_ID}"
TESTS = "tests/test_coin.py"
HIDDEN = [f"{TESTS}::test_clamp_above", f"{TESTS}::test_clamp_at_high"]
FIX = "return max(low, min(value, high))"
BUG = "return max(low, min(value, high - 1))"
HALF_FIX = "return max(low, min(value, high if flip() else high - 1))"
PROBLEM = """coin: clamp never reaches its upper bound

`coin.clamp(12, 0, 10)` returns 9, and so does `coin.clamp(10, 0, 10)`: a value at or above `high`
should come back as `high`. Fix `clamp` without breaking any other test.
"""


def build(out: Path, check_runs: int) -> None:
    import pyarrow.parquet as pq

    from legorl.core.schemas import Kind, TaskRow
    from legorl.core.shards import to_table
    from legorl.grading.grader import GradeOptions, Grader
    from legorl.tasks.builder import validate
    from legorl.tasks.drafting import FIXED_DATE, _commit, _tree_of, git
    from legorl.tasks.hiding import remove_tests
    from legorl.tasks.library import PYTEST_FLAGS

    with tempfile.TemporaryDirectory(prefix="legorl-flaky-") as tmp:
        repo, tree = Path(tmp) / "coin.git", Path(tmp) / "tree"
        repo.mkdir()
        git(repo, "init", "-q", "--bare")
        shutil.copytree(HERE / "library", tree, ignore=shutil.ignore_patterns("__pycache__"))
        module = tree / "coin" / "__init__.py"
        clean = module.read_text()
        assert FIX in clean, f"{module}: no {FIX!r} to break"

        def snapshot(code: str, full_tests: bool) -> str:
            module.write_text(code)
            shutil.copy2(HERE / "library" / TESTS, tree / TESTS)
            if not full_tests:
                remove_tests(tree, HIDDEN, [])
            return _tree_of(repo, tree)

        visible = snapshot(clean.replace(FIX, BUG), full_tests=False)
        fixed = snapshot(clean, full_tests=False)
        half = snapshot(clean.replace(FIX, HALF_FIX), full_tests=False)
        full = snapshot(clean.replace(FIX, BUG), full_tests=True)
        commit = _commit(repo, visible, "coin 0.1")
        git(repo, "update-ref", REF, commit)

        def diff(to: str) -> str:
            return git(repo, "diff", "--no-color", "--no-ext-diff", visible, to)

        draft = TaskRow(
            instance_id=INSTANCE_ID, repo="examples/coin", base_commit=commit, patch=diff(fixed),
            test_patch=diff(full), problem_statement=PROBLEM, hints_text="", created_at=FIXED_DATE,
            version="0.1", FAIL_TO_PASS=HIDDEN, repo_source=str(repo),
            test_command=f"python3 -m pytest {PYTEST_FLAGS} {TESTS}", log_parser="pytest",
        )
        checked = validate(draft, Grader(GradeOptions(test_timeout=120, run_empty=True)), check_runs)
        if isinstance(checked, str):
            raise SystemExit(f"{INSTANCE_ID}: the task check rejected it: {checked}")
        (out / "bundles").mkdir(parents=True, exist_ok=True)
        git(repo, "bundle", "create", str((out / "bundles" / "coin.bundle").resolve()), REF)
        checked.repo_source = "bundles/coin.bundle"
        table = to_table(Kind.TASKS, [checked]).replace_schema_metadata(None)
        pq.write_table(table, out / "tasks.parquet", compression="zstd")
        (out / "half-fix.diff").write_text(diff(half))
    print(f"{INSTANCE_ID}: FAIL_TO_PASS {checked.FAIL_TO_PASS}, PASS_TO_PASS {len(checked.PASS_TO_PASS)}, "
          f"flaky {checked.flaky_tests}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check-runs", type=int, default=6, help="runs of each patch in the task check")
    args = parser.parse_args()
    build(HERE, args.check_runs)
