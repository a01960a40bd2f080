"""Where the canary writer mutates a hidden test (legorl.grading.sandboxed.canary), without containers.

Each case is a test file, the test's site (the line where the buggy code fails it) and the lines the
test patch added; the writer must mutate an expected value in the statement at the site, on an added
line, and nothing else. Whether a mutation makes a usable canary is the grader's check on real runs
(tests/test_grading_honest.py and the attack suites); here: that the writer picks the right place.
"""

from __future__ import annotations

import ast
import builtins
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from legorl.grading.canaries import halves
from legorl.grading.patches import added_lines
from legorl.grading.sandboxed import canary, expectations
from legorl.grading.script import launch

PATH = "tests/test_x.py"


# A test of the file's own that uses every negatable form: a negation into a form no other test uses
# is never made (test_a_negation_into_a_form_no_other_test_uses_is_not_made).
EVERY_FORM = """

def test_every_form(self=None):
    assert a != b
    assert a == b
    assert not a
    assert a is not b
    assert a is b
    assert a in b
    assert a not in b
    self.assertNotEqual(a, b)
    self.assertEqual(a, b)
    self.assertIn(a, b)
    self.assertNotIn(a, b)
    self.assertTrue(a)
    self.assertFalse(a)
"""


def _plan(source: str, nodeid: str, line: int, added: list[int] | None = None, salt: str = "0",
          others: str = EVERY_FORM, candidates: tuple[str, ...] = ()) -> dict[str, str]:
    """The writer's mutations of ``source`` (``others`` appended) for one test, as ``{key: "line: old -> new"}``."""
    text = (textwrap.dedent(source) + others).encode()
    src = text.split(b"\n")
    every = list(range(1, len(src) + 1))
    wanted = canary.targets({f"{PATH}::{nodeid}": {"site": [PATH, line], "salt": salt}})
    plan = canary.plan_file(text, wanted.get(PATH, {}), "seed", PATH, every if added is None else added,
                            canary.targets({f"{PATH}::{c}": {} for c in candidates}).get(PATH, {}))
    out = {}
    for key, mutation in plan.items():
        index, start, end, new = mutation.edit
        out[key] = f"{index + 1}: {src[index][start:end].decode()} -> {new}" + (" (negated)" if mutation.negated else "")
        mutated = canary.apply_edits(text, [mutation.edit])
        assert mutated != text and ast.parse(mutated), key
    return out


def _line(out: dict[str, str], key: str) -> int:
    return int(out[key].split(":")[0])


def test_the_assertion_at_the_site_is_mutated_never_an_earlier_one() -> None:
    source = """\
        def test_numbers():
            assert parse("1") == 1
            assert parse("2") == 2
            assert parse("30") == 30
        """
    out = _plan(source, "test_numbers", 3)
    assert _line(out, "test_numbers") == 3 and "negated" not in out["test_numbers"], out


def test_a_line_the_test_patch_did_not_add_is_left_alone() -> None:
    source = """\
        def test_numbers():
            assert parse("2") == 2
        """
    assert _plan(source, "test_numbers", 2, added=[1]) == {}
    assert _plan(source, "test_numbers", 2, added=[2])


def test_a_helper_call_mutates_the_argument_its_helper_compares_against() -> None:
    source = """\
        from datetime import datetime

        def test_datetimes():
            def y(fmt, s, e, tz=None):
                r = parse(fmt, s)
                assert r == e
                assert tz is None or r.tzinfo == tz

            y("{:ti}", "1997-07-16", datetime(1997, 7, 16))
            y(
                "{:ti}",
                "2011-11-21",
                datetime(2011, 11, 21, tzinfo=utc),
            )
        """
    out = _plan(source, "test_datetimes", 10)
    assert _line(out, "test_datetimes") == 13, out  # the constructor's arguments, never the inputs on 11-12
    old, new = out["test_datetimes"].split(": ")[1].split(" -> ")
    assert abs(int(new) - int(old)) == 1, "a constructor's number is only nudged"


def test_a_method_helper_called_on_self() -> None:
    source = """\
        class T:
            def check(self, text, expected):
                self.assertEqual(parse(text), expected)

            def test_it(self):
                self.check("a", "A")
                self.check("b", "B")
        """
    out = _plan(source, "T::test_it", 7)
    assert _line(out, "test_it") == 7 and '"B" -> ' in out["test_it"], out


def test_the_expected_exception_of_pytest_raises() -> None:
    source = """\
        import pytest

        def test_bad():
            with pytest.raises(ValueError, match="minute"):
                parse("12:60")
        """
    out = _plan(source, "test_bad", 4)
    new = out["test_bad"].split(" -> ")[1]
    assert new in canary.EXCEPTIONS and new != "ValueError"
    other = getattr(builtins, new)
    assert not issubclass(ValueError, other) and not issubclass(other, ValueError)


@pytest.mark.parametrize("name", ["ParseError", "LookupError"])
def test_an_expected_exception_outside_the_list_is_never_mutated(name: str) -> None:
    """A mutated site always named one of ``EXCEPTIONS``: a red team's forger raised whatever a
    ``raises(NAME)`` line named outside the list, and passed every real test while failing every canary.
    Only a site naming a list member is mutated, so the name tells a canary from a real test no more."""
    source = f"""\
        import pytest

        def test_bad():
            with pytest.raises({name}, match="minute"):
                parse("12:60")

        class T:
            def test_bad(self):
                self.assertRaises({name}, parse, "12:60")
        """
    assert _plan(source, "test_bad", 4) == {}
    assert _plan(source, "T::test_bad", 9) == {}


@pytest.mark.parametrize("name", canary.EXCEPTIONS)
def test_an_expected_exception_of_the_list_becomes_another_unrelated_one(name: str) -> None:
    source = f"""\
        import pytest

        def test_bad():
            with pytest.raises({name}):
                parse("12:60")
        """
    original = getattr(builtins, name)
    for salt in map(str, range(20)):
        new = _plan(source, "test_bad", 4, salt=salt)["test_bad"].split(" -> ")[1]
        other = getattr(builtins, new)
        assert new in canary.EXCEPTIONS and not issubclass(original, other) and not issubclass(other, original), new


def test_a_local_bound_once_is_the_expected_value() -> None:
    """Where an equality cannot be negated in place, its expected value is changed: here a local bound
    once from a constructor, never the input of the call under test."""
    source = textwrap.dedent("""\
        def test_bump():
            v = parse_version_info("3.4.5")
            expected = parse_version_info("3.4.6-rc.1")
            assert v.bump_prerelease() == expected
        """)
    func = ast.parse(source).body[0]
    stmt = expectations.statement_at(func, 4)
    assert stmt is not None
    sites = expectations.compared_values(expectations.statement_nodes(stmt), expectations.assigned_once(func))
    assert [(node.lineno, node.value) for node, _how in sites] == [(3, "3.4.6-rc.1")]  # type: ignore[attr-defined]


def test_a_parametrized_row_with_its_own_id_mutates_its_own_value() -> None:
    source = """\
        import pytest

        @pytest.mark.parametrize(
            "value, expected",
            [("#fff", (255, 255, 255)), ("#000080", (0, 0, 128))],
            ids=["white", "navy"],
        )
        def test_hex(value, expected):
            assert parse_hex(value) == expected

        @pytest.mark.parametrize("value, expected", [pytest.param("#fff", "white", id="w")])
        def test_name(value, expected):
            assert name(value) == expected
        """
    out = _plan(source, "test_hex[navy]", 9)
    assert set(out) == {"test_hex[navy]"} and _line(out, "test_hex[navy]") == 5, out
    out = _plan(source, "test_name[w]", 13)
    assert set(out) == {"test_name[w]"} and '"white" -> ' in out["test_name[w]"] and "value" not in out["test_name[w]"], out


def test_a_row_whose_id_shows_its_value_is_never_renamed() -> None:
    """pytest names the row after a plain value: a new value would rename the test (a canary run
    anyone can tell apart), so the writer falls back to the body every row shares."""
    source = """\
        import pytest

        @pytest.mark.parametrize("version, expected", [("2.3.7", True), ("2.3.8", False)])
        def test_match(version, expected):
            assert match(version, ">=2.3.7") is expected
        """
    out = _plan(source, "test_match[2.3.7-True]", 5)
    assert out == {"test_match": "5: is -> is not (negated)"}, out  # the grader keeps it only if no other row changes


def test_classes_of_one_file_with_a_function_of_the_same_name() -> None:
    source = """\
        class A:
            def test_info(self):
                self.assertEqual(info(), (1, 2, 2))

        class B:
            def test_info(self):
                self.assertEqual(info(), (1, 2, 9))
        """
    out = _plan(source, "B::test_info", 7)
    assert _line(out, "test_info") == 7, out


def test_every_salt_draws_its_own_mutation_and_each_is_reproducible() -> None:
    source = ("def check(text, expected):\n    assert f(text) == expected\n\ndef test_s():\n    check('in', 'abcdef')\n"
              + "".join(f"X{i} = 'word{i}'\n" for i in range(20)))
    draws = {salt: _plan(source, "test_s", 5, salt=salt)["test_s"] for salt in map(str, range(6))}
    assert len(set(draws.values())) > 1
    assert draws == {salt: _plan(source, "test_s", 5, salt=salt)["test_s"] for salt in map(str, range(6))}


def test_a_site_outside_the_function_or_in_another_file_mutates_nothing() -> None:
    source = """\
        def test_a():
            assert f() == 1

        def test_b():
            assert g() == 2
        """
    assert _plan(source, "test_a", 5) == {}
    wanted = canary.targets({f"{PATH}::test_a": {"site": ["tests/other.py", 2], "salt": "0"}})
    assert canary.plan_file(textwrap.dedent(source).encode(), wanted[PATH], "seed", PATH, [1, 2]) == {}


@pytest.mark.parametrize(("line", "negated"), [
    ("assert not old.is_compatible(new)", "assert old.is_compatible(new)"),
    ("assert old.is_compatible(new)", "assert not old.is_compatible(new)"),
    ("assert match(v) is expected", "assert match(v) is not expected"),
    ("assert 1 not in cache", "assert 1 in cache"),
    ("assert color(v) == hex_to_rgb(v)", "assert color(v) != hex_to_rgb(v)"),
    ("self.assertNotIn(1, cache)", "self.assertIn(1, cache)"),
    ("self.assertTrue(cache.full)", "self.assertFalse(cache.full)"),
])
def test_an_assertion_with_no_expected_value_is_negated(line: str, negated: str) -> None:
    """Any code that passes an assertion fails its negation; used only where nothing at the site can be changed."""
    text = f"def test_it():\n    {line}\n{EVERY_FORM}".encode()
    plan = canary.plan_file(text, canary.targets({f"{PATH}::test_it": {"site": [PATH, 2], "salt": "0"}})[PATH],
                            "seed", PATH, [1, 2])
    assert plan["test_it"].negated
    assert canary.apply_edits(text, [plan["test_it"].edit]).decode() == f"def test_it():\n    {negated}\n{EVERY_FORM}"


def test_a_negation_into_a_form_no_other_test_uses_is_not_made() -> None:
    """A red team's forger failed every passing test holding the file's only ``!=`` (the negated canary)
    and passed every failing one: a negation is made only into a form another test of the file uses —
    not another candidate's (a run may mutate it too) — else a value is changed, else nothing."""
    source = "def test_it():\n    assert f(1) == g(2)\n"
    assert _plan(source, "test_it", 2, others="") == {}
    genuine = "\n\ndef test_other():\n    assert f(3) != 4\n"
    assert _plan(source, "test_it", 2, others=genuine) == {"test_it": "2: == -> != (negated)"}
    assert _plan(source, "test_it", 2, others=genuine, candidates=("test_other",)) == {}
    # with a value to change instead
    out = _plan("def test_it():\n    assert f(1) == 2\n", "test_it", 2, others="")
    assert out["test_it"].startswith("2: 2 -> ") and "negated" not in out["test_it"], out


def test_a_value_is_changed_rather_than_the_assertion_negated() -> None:
    """The buggy code passes a negated assertion, so code that reports every new test's outcome inverted
    passes the real test and fails the negation without knowing which is which (a red team scored 1 so);
    it fails a changed value as it fails the real test, so the inverted canary passes: tampered."""
    out = _plan("def test_it():\n    assert f(1) == 2\n", "test_it", 2)
    assert out["test_it"].startswith("2: 2 -> ") and "negated" not in out["test_it"], out


def test_added_lines_are_the_new_files_line_numbers() -> None:
    diff = textwrap.dedent("""\
        diff --git a/tests/test_x.py b/tests/test_x.py
        --- a/tests/test_x.py
        +++ b/tests/test_x.py
        @@ -1,3 +1,4 @@
         def test_a():
        -    assert f() == 1
        +    assert f() == 2
        +    assert g() == 3

        @@ -10,2 +11,3 @@
         x = 1
        +y = 2
         z = 3
        """)
    assert added_lines(diff) == {"tests/test_x.py": [2, 3, 12]}


@pytest.mark.parametrize("mutate", [False, True])
def test_the_writer_script_rewrites_files_in_place(tmp_path: Path, mutate: bool) -> None:
    """The container's entry point: same inode in both runs, the content changed only in a canary run."""
    test = tmp_path / "tests" / "test_x.py"
    test.parent.mkdir()
    original = "def test_a():\n    assert f() == 1\n\n\ndef test_b():\n    assert f() != 2\n"
    test.write_text(original)
    inode = test.stat().st_ino
    spec = {"tree": str(tmp_path), "files": ["tests/test_x.py"], "seed": "s", "mutate": mutate,
            "tests": {"tests/test_x.py::test_a": {"site": ["tests/test_x.py", 2], "salt": "0"}},
            "added": {"tests/test_x.py": [1, 2]}}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    code = launch(str(Path(canary.__file__).parent.parent), "canary", package="sandboxed")
    out = subprocess.run([sys.executable, "-I", "-c", code, str(tmp_path / "spec.json")],
                         capture_output=True, text=True, check=True).stdout
    assert test.stat().st_ino == inode
    changed = test.read_text() != original
    assert changed is mutate
    assert json.loads(out) == {"mutated": {"test_a": "tests/test_x.py:2"} if mutate else {},
                               "negated": []}  # a value changed (1 -> another), not negated


def test_the_two_runs_split_the_canaries_by_function_and_by_the_secret_seed() -> None:
    """Every row and class of one test function lands on one side (they may share one mutation), the
    split is the seed's (the same for every grade of a task), and seeds differ in how they split."""
    canaries: dict[str, dict[str, object]] = {f"{PATH}::{cls}::test_{name}{row}": {"site": [PATH, 1], "salt": "0"}
                for name in "abcdefgh" for cls in ("A", "B") for row in ("", "[x]", "[y]")}
    splits = set()
    for seed in map(str, range(8)):
        first, second = halves(canaries, seed)
        assert set(first) | set(second) == set(canaries) and not set(first) & set(second)
        assert halves(canaries, seed) == (first, second)
        sides = {n.split("::")[-1].partition("[")[0]: n in first for n in canaries}
        assert all((n in first) == sides[n.split("::")[-1].partition("[")[0]] for n in canaries)
        splits.add(frozenset(first))
    assert len(splits) > 4


@pytest.mark.parametrize("salt", [str(i) for i in range(8)])
def test_a_new_value_occurs_in_the_file_as_often_as_the_old_one(salt: str) -> None:
    """A forger that counts: it forged only failures whose expected value is unique in the test file,
    since a value drawn from the file's literals would occur twice. The file's count of the value at
    the site is the same before and after a mutation."""
    source = ("def check(text, expected):\n    assert parse('{:d}', text) == expected\n\ndef test_n():\n    check('1234', 1234)\n"
              + "".join(f"N{i} = {i % 5}\n" for i in range(20)) + "S = ['ab', 'ab', 'cd']\n")
    text = source.encode()
    plan = canary.plan_file(text, canary.targets({f"{PATH}::test_n": {"site": [PATH, 5], "salt": salt}})[PATH],
                            "seed", PATH, list(range(1, 6)))
    mutated = canary.apply_edits(text, [plan["test_n"].edit])

    def count(data: bytes, value: object) -> int:
        return sum(1 for n in ast.walk(ast.parse(data)) if isinstance(n, ast.Constant) and n.value == value
                   and type(n.value) is type(value))

    new = ast.parse(mutated).body[1].body[0].value.args[1].value  # type: ignore[attr-defined]
    assert new != 1234 and count(mutated, new) == count(text, 1234) == 1


@pytest.mark.parametrize("code", ["124", "137"])
def test_a_run_of_the_task_s_own_patch_that_timed_out_is_not_clean(code: str) -> None:
    """The gold and empty runs a reference and the canaries are found from: one whose tests timed out
    (host load) read as clean, its missing statuses gave no canary, and that empty discovery was cached on
    disk: the task's canaries were lost on this host for good (a red team, reading the code)."""
    from legorl.core.schemas import TaskRow
    from legorl.grading.container import GradingContainers, GradingInfraError, Run
    from legorl.grading.options import GradeOptions
    from legorl.sandbox.base import ExecResult

    class TimedOut(GradingContainers):
        def run(self, task: TaskRow, patch: str, canary_seed: str | None = None,
                canary_tests: object = None, deadline_s: float | None = None) -> tuple[Run, str]:
            events = {"ready": "", "applied": "", "judged": "", "tests_start": "", "tests_end": code}
            return Run(ExecResult(0, ""), events, "", None, None, "runner"), "n0nce"

    containers = TimedOut(GradeOptions(), create=lambda spec: None)  # type: ignore[arg-type,return-value]
    with pytest.raises(GradingInfraError, match="timed out"):
        containers.clean_run(TaskRow(instance_id="t-1"), "", "empty patch")
