"""How the grading container starts its scripts (``script.launch``), on the host's own interpreter: the
entry runs as ``__main__`` with its package importable, and what the tests under it start can find it.

A red team (reading the code only) found that with the package's folder taken off ``sys.path``, a
``spawn`` or ``forkserver`` child could not import ``__main__`` by its name: every worker died, a pool
waited for the grade's timeout, and any task whose tests use such a pool could not be graded at all.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from legorl.grading.script import launch

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
