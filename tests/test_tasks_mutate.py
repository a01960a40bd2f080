"""AST-located one-span mutations and hiding failing tests (the task builder's pure parts)."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from legorl.core.errors import LegorlError
from legorl.tasks.drafting import problem_statement
from legorl.tasks.hiding import remove_tests
from legorl.tasks.library import describe
from legorl.tasks.mutate import find_mutations, sample

SOURCE = textwrap.dedent(
    """
    def clamp(x: int, lo: int = 0, hi: int = 10) -> int:
        \"\"\"Docstring with 5 < 6 and not this.\"\"\"
        if x < lo or x is None:
            return lo
        if not (x <= hi):
            return hi
        return x + 0x10 - 1

    def member(x, items):
        return x in items and len(items) == 3
    """
)


def test_each_kind_is_found_and_applies_to_one_span() -> None:
    muts = find_mutations("m.py", SOURCE)
    kinds = {(m.kind, m.old, m.new) for m in muts}
    assert ("compare", "<", ">=") in kinds
    assert ("compare", "is", "is not") in kinds
    assert ("compare", "<=", ">") in kinds
    assert ("compare", "in", "not in") in kinds
    assert ("compare", "==", "!=") in kinds
    assert ("boolop", "or", "and") in kinds and ("boolop", "and", "or") in kinds
    assert ("not", "not (x <= hi)", "(x <= hi)") in kinds
    assert ("constant", "1", "2") in kinds and ("constant", "3", "4") in kinds
    # docstrings and hex literals are left alone
    assert not any(m.line == 3 for m in muts)
    assert not any(m.old == "0x10" for m in muts)
    for m in muts:
        new = m.apply(SOURCE)
        ast.parse(new)  # still valid Python
        changed = [(a, b) for a, b in zip(SOURCE.splitlines(), new.splitlines(), strict=True) if a != b]
        assert len(changed) == 1  # exactly one line differs


def test_mutations_change_behaviour_when_run() -> None:
    """Apply a comparison flip and run the code for real: the behaviour changes."""
    (flip,) = [m for m in find_mutations("m.py", SOURCE) if (m.kind, m.old) == ("compare", "<")]
    ns_old: dict[str, object] = {}
    ns_new: dict[str, object] = {}
    exec(SOURCE, ns_old)
    exec(flip.apply(SOURCE), ns_new)
    assert ns_old["clamp"](15) == 10 and ns_new["clamp"](15) == 0  # type: ignore[operator]


def test_sample_is_seeded_and_one_per_line() -> None:
    muts = find_mutations("m.py", SOURCE)
    a = list(sample(muts, 4, seed=1))
    assert a == list(sample(muts, 4, seed=1))
    assert len({m.line for m in a}) == len(a) == 4


def test_stale_span_is_refused() -> None:
    m = find_mutations("m.py", SOURCE)[0]
    with pytest.raises(ValueError, match="no longer reads"):
        m.apply("x = 1\n" + SOURCE)


TESTS = textwrap.dedent(
    """
    import pytest

    class Mixin:
        def test_shared(self):
            assert True

    class TestOnly:
        @pytest.mark.parametrize("v", [1, 2])
        def test_one(self, v):
            assert v

    class TestKeep(Mixin):
        def test_kept(self):
            assert True

    def test_plain():
        assert True

    def test_other():
        assert True
    """
)


@pytest.mark.heavy
def test_remove_tests_hides_functions_and_keeps_files_runnable(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_m.py").write_text(TESTS)
    changed = remove_tests(
        tmp_path,
        ["tests/test_m.py::TestOnly::test_one[1]", "tests/test_m.py::test_plain", "tests/test_m.py::TestKeep::test_shared"],
        ["tests/test_m.py"],
    )
    assert changed == ["tests/test_m.py"]
    text = (tmp_path / "tests" / "test_m.py").read_text()
    assert "test_one" not in text and "test_plain" not in text and "test_shared" not in text
    assert "@pytest.mark.parametrize" not in text  # the decorator went with its function
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_m.py"],
                          cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
    assert "2 passed" in proc.stdout  # test_kept, test_other


def test_remove_tests_unknown_definition(tmp_path: Path) -> None:
    (tmp_path / "test_m.py").write_text(TESTS)
    with pytest.raises(LegorlError, match="cannot find the definition"):
        remove_tests(tmp_path, ["test_m.py::test_nowhere"], ["test_m.py"])


def test_describe_layout_and_problem_statement(tmp_path: Path) -> None:
    for rel in ("src/lib/__init__.py", "src/lib/core.py", "tests/test_core.py", "tests/helpers.py", "docs/conf.py",
                "setup.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    lib = describe("lib", "1.0", tmp_path)
    assert lib.source_files == ["src/lib/__init__.py", "src/lib/core.py"]
    assert lib.test_files == ["tests/test_core.py"]
    assert lib.pythonpath == "src" and lib.test_command.startswith("PYTHONPATH=src python3 -m pytest")
    text = problem_statement(lib, {"tests/test_core.py::test_a": "AssertionError: assert 2 == 1"})
    assert "`tests/test_core.py::test_a` fails with: `AssertionError: assert 2 == 1`" in text
    assert "diff" not in text
