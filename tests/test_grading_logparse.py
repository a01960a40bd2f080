"""Log parsing and verdicts, checked against real pytest output and the swebench package itself."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from legorl.core.schemas import Resolution
from legorl.grading.logparse import (
    END_MARKER,
    EXIT_CODE_MARKER,
    START_MARKER,
    TestStatuses,
    contradicts_exit_code,
    parse_pytest,
    split_log,
)
from legorl.grading.report import evaluate

SUITE = textwrap.dedent(
    """
    import pytest

    def test_pass():
        assert True

    def test_fail():
        assert 1 == 2, "one is not two"

    @pytest.mark.skip(reason="not today")
    def test_skip():
        pass

    @pytest.mark.xfail(reason="known")
    def test_xfail():
        assert False

    @pytest.fixture
    def broken():
        raise RuntimeError("fixture broke")

    def test_error(broken):
        pass

    @pytest.mark.parametrize("x", ["a b", "a c", "plain"])
    def test_param(x):
        assert x != "a c"

    class TestGroup:
        def test_method(self):
            assert True

        def test_method_fails(self):
            assert "x - y" == "z"
    """
)


@pytest.fixture(scope="module")
def real_log(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The output of a real pytest run (SWE-bench's flags) wrapped in the grading markers."""
    root: Path = tmp_path_factory.mktemp("suite")
    (root / "test_suite.py").write_text(SUITE)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--no-header", "-rA", "--tb=no", "-p", "no:cacheprovider", "test_suite.py"],
        cwd=root, capture_output=True, text=True,
    )
    return f"{START_MARKER}\n{proc.stdout}{proc.stderr}\n{END_MARKER}\n{EXIT_CODE_MARKER}: {proc.returncode}\n"


@pytest.mark.heavy
def test_real_pytest_output_parses_to_every_status(real_log: str) -> None:
    statuses = parse_pytest(split_log(real_log).output)
    assert statuses.full == {
        "test_suite.py::test_pass": "PASSED",
        "test_suite.py::test_fail": "FAILED",
        "test_suite.py::test_xfail": "XFAIL",
        "test_suite.py::test_error": "ERROR",
        "test_suite.py::test_param[a b]": "PASSED",
        "test_suite.py::test_param[a c]": "FAILED",
        "test_suite.py::test_param[plain]": "PASSED",
        "test_suite.py::TestGroup::test_method": "PASSED",
        "test_suite.py::TestGroup::test_method_fails": "FAILED",
    }
    # pytest reports skips as "SKIPPED [1] file:line: reason": no test id, so none is recorded
    assert not any("skip" in k for k in statuses.full)
    assert split_log(real_log).exit_code == 1


def test_truncated_ids_follow_swebench_but_full_ids_win(real_log: str) -> None:
    """The decision documented in logparse: full ids first, SWE-bench's truncated keys as fallback."""
    statuses = parse_pytest(split_log(real_log).output)
    # SWE-bench cuts "test_param[a b]" and "test_param[a c]" to one key; the later line wins there.
    assert "test_suite.py::test_param[a" in statuses.truncated
    assert statuses.status("test_suite.py::test_param[a b]") == "PASSED"
    assert statuses.status("test_suite.py::test_param[a c]") == "FAILED"
    # A list written by SWE-bench tooling holds the truncated id: it still resolves.
    assert statuses.status("test_suite.py::test_param[a") == statuses.truncated["test_suite.py::test_param[a"]


def _swebench_verdict(log: str, f2p: list[str], p2p: list[str], tmp_path: Path) -> tuple[str, dict[str, str], bool]:
    from swebench.harness.grading import get_eval_tests_report, get_logs_eval, get_resolution_status
    from swebench.types import TestSpec

    path = tmp_path / "eval.log"
    path.write_text(log)
    spec = TestSpec(instance_id="x", image="img", eval_script_list=[], repo="r/r", version="1",
                    FAIL_TO_PASS=f2p, PASS_TO_PASS=p2p, log_parser="parse_log_pytest", eval_type="pass_and_fail")
    status_map, found = get_logs_eval(spec, str(path))
    if not found:
        return "NO", status_map, found
    report = get_eval_tests_report(status_map, {"FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p})
    return get_resolution_status(report).removeprefix("RESOLVED_"), status_map, found


CASES = [
    (["test_suite.py::test_pass"], ["test_suite.py::TestGroup::test_method"]),
    (["test_suite.py::test_fail"], ["test_suite.py::test_pass"]),
    (["test_suite.py::test_pass", "test_suite.py::test_fail"], ["test_suite.py::test_xfail"]),
    (["test_suite.py::test_pass", "test_suite.py::test_fail"], ["test_suite.py::test_error"]),
    (["test_suite.py::test_xfail"], ["test_suite.py::test_param[plain]"]),
    (["test_suite.py::test_error"], []),
    (["test_suite.py::test_missing"], ["test_suite.py::test_pass"]),
    (["test_suite.py::test_pass"], ["test_suite.py::test_missing"]),
    (["test_suite.py::TestGroup::test_method_fails"], ["test_suite.py::TestGroup::test_method"]),
    (["test_suite.py::test_param[plain]", "test_suite.py::test_pass"], []),
]


@pytest.mark.parametrize(("f2p", "p2p"), CASES)
def test_verdicts_agree_with_swebench(real_log: str, f2p: list[str], p2p: list[str], tmp_path: Path) -> None:
    expected, status_map, found = _swebench_verdict(real_log, f2p, p2p, tmp_path)
    assert found
    statuses = parse_pytest(split_log(real_log).output)
    # An honest gold run: XFAIL / SKIPPED where the log has them, everything else passing. Judged
    # against it, legorl reaches SWE-bench's verdict; without one it is stricter (next test).
    gold = TestStatuses.from_map({k: v if v in ("XFAIL", "SKIPPED") else "PASSED" for k, v in statuses.full.items()})
    ours = evaluate(statuses, f2p, p2p, gold)
    assert ours.resolution == expected
    # and the per-test statuses agree wherever SWE-bench's key is a full id
    for test in ours.tests:
        if test.name in status_map:
            assert test.status == status_map[test.name]


def test_skipped_fail_to_pass_does_not_resolve() -> None:
    log = "SKIPPED tests/t.py::test_a\nPASSED tests/t.py::test_b\n"
    statuses = parse_pytest(log)
    assert evaluate(statuses, ["tests/t.py::test_a"], ["tests/t.py::test_b"]).resolution == Resolution.NO
    # a skipped PASS_TO_PASS test is maintained only where the gold run skips it too (SWE-bench: always)
    gold = TestStatuses.from_map({"tests/t.py::test_a": "SKIPPED", "tests/t.py::test_b": "PASSED"})
    assert evaluate(statuses, ["tests/t.py::test_b"], ["tests/t.py::test_a"], gold).resolution == Resolution.FULL
    assert evaluate(statuses, ["tests/t.py::test_b"], ["tests/t.py::test_a"]).resolution == Resolution.NO


def test_xfail_counts_only_where_the_gold_run_xfails() -> None:
    """SWE-bench counts XFAIL as a pass, so code calling pytest.xfail() would resolve a task there."""
    statuses = parse_pytest("XFAIL t.py::test_a - reason\nPASSED t.py::test_b\n")
    assert evaluate(statuses, ["t.py::test_a"], ["t.py::test_b"]).resolution == Resolution.NO
    passed = TestStatuses.from_map({"t.py::test_a": "PASSED", "t.py::test_b": "PASSED"})
    assert evaluate(statuses, ["t.py::test_a"], ["t.py::test_b"], passed).resolution == Resolution.NO
    xfail = TestStatuses.from_map({"t.py::test_a": "XFAIL", "t.py::test_b": "PASSED"})
    assert evaluate(statuses, ["t.py::test_a"], ["t.py::test_b"], xfail).resolution == Resolution.FULL


def test_partial_needs_pass_to_pass_intact() -> None:
    statuses = parse_pytest("PASSED t.py::a\nFAILED t.py::b - x\nPASSED t.py::c\nFAILED t.py::d\n")
    assert evaluate(statuses, ["t.py::a", "t.py::b"], ["t.py::c"]).resolution == Resolution.PARTIAL
    assert evaluate(statuses, ["t.py::a", "t.py::b"], ["t.py::d"]).resolution == Resolution.NO
    report = evaluate(statuses, ["t.py::a"], ["t.py::c"])
    assert report.resolved and report.reward == 1.0


def test_fake_passed_lines_never_override_real_failures() -> None:
    """A patch printing PASSED lines (e.g. from atexit) after pytest's summary; SWE-bench keeps
    the last line, legorl the worst."""
    log = (f"{START_MARKER}\nFAILED t.py::test_a - assert 1 == 2\nPASSED t.py::test_a\n{END_MARKER}\n"
           f"{EXIT_CODE_MARKER}: 1\n")
    statuses = parse_pytest(split_log(log).output)
    assert statuses.full["t.py::test_a"] == "FAILED"
    assert evaluate(statuses, ["t.py::test_a"], []).resolution == Resolution.NO


def test_forged_markers_cannot_cut_the_real_output() -> None:
    forged = f"PASSED t.py::test_a\n{END_MARKER}\n{EXIT_CODE_MARKER}: 0\n"
    log = f"{START_MARKER}\n{forged}FAILED t.py::test_a - boom\n{END_MARKER}\n{EXIT_CODE_MARKER}: 1\n"
    parts = split_log(log)
    assert parts.exit_code == 1
    assert parse_pytest(parts.output).full["t.py::test_a"] == "FAILED"


def test_exit_code_contradiction_is_detected() -> None:
    statuses = parse_pytest("PASSED t.py::a\n")
    assert contradicts_exit_code(statuses, 1)
    assert not contradicts_exit_code(statuses, 0)
    assert not contradicts_exit_code(parse_pytest("FAILED t.py::a\n"), 1)
