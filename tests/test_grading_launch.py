"""How the grading container starts its scripts (``script.launch``), on the host's own interpreter: the
entry runs as ``__main__`` with its package importable, and what the tests under it start can find it.

A red team (reading the code only) found that with the package's folder taken off ``sys.path``, a
``spawn`` or ``forkserver`` child could not import ``__main__`` by its name: every worker died, a pool
waited for the grade's timeout, and any task whose tests use such a pool could not be graded at all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from legorl.grading.script import RUNNER_FILES, launch, sandboxed_files

ENTRY = """
import multiprocessing
import sys

from .helper import square  # a sibling, through the package


def main() -> None:
    folder = sys.argv[1]
    assert sys.path[-1] == folder and folder not in sys.path[:-1], sys.path  # shadows nothing
    with multiprocessing.get_context(sys.argv[2]).Pool(1) as pool:
        print(pool.map(square, [3]))


if __name__ == "__main__":
    main()
"""


@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
def test_a_child_of_the_entry_can_import_it_by_name(tmp_path: Path, method: str) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "helper.py").write_text("def square(x: int) -> int:\n    return x * x\n")
    (package / "entry.py").write_text(textwrap.dedent(ENTRY))
    code = launch(str(tmp_path), "entry", package="pkg")
    out = subprocess.run([sys.executable, "-I", "-c", code, str(tmp_path), method],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert (out.returncode, out.stdout.strip()) == (0, "[9]"), out.stderr[-2000:]


def test_the_runner_reports_a_session_whose_test_removed_its_working_folder(tmp_path: Path) -> None:
    """Code that enters a temporary folder and removes it leaves the process without a working folder:
    the runner's checks took the tree from ``os.getcwd()`` after each test, raised, and pytest ended in
    an internal error (exit 3, a 0 for an honest fix). The tree is taken once, at the start."""
    folder = tmp_path / "runner"
    for name, text in sandboxed_files(*RUNNER_FILES).items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "test_cwd.py").write_text(textwrap.dedent("""
        import os, shutil, tempfile

        def test_leaves_its_folder():
            scratch = tempfile.mkdtemp()
            os.chdir(scratch)
            shutil.rmtree(scratch)

        def test_after():
            assert True
        """))
    (tmp_path / "changes.json").write_text("{}")
    report = os.open(tmp_path / "report.json", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        out = subprocess.run(
            [sys.executable, "-I", "-c", launch(str(folder), "runner"), str(report), str(tmp_path / "changes.json"),
             "-q", "-p", "no:cacheprovider", "test_cwd.py"],
            input="n0nce\n", capture_output=True, text=True, timeout=120, cwd=tree, pass_fds=(report,),
        )
    finally:
        os.close(report)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    sent = json.loads((tmp_path / "report.json").read_text())
    assert sent["nonce"] == "n0nce" and sent["exitstatus"] == 0
    assert set(sent["statuses"].values()) == {"PASSED"} and len(sent["statuses"]) == 2
