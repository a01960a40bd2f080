"""Test-log parsing with SWE-bench's pytest rules.

A graded run's log holds the test command's output between two markers, and its exit status after
them (the same markers SWE-bench's eval scripts print, so its tools can read legorl's logs)::

    >>>>> Start Test Output
    ... pytest -rA output ...
    >>>>> End Test Output
    >>>>> Test Exit Code: 1

The statuses come from pytest's ``-rA`` short summary: lines ``STATUS test-id`` (``FAILED`` and
``ERROR`` lines add `` - message``).

**The truncation quirk.** SWE-bench's ``parse_log_pytest`` keeps only the first whitespace-separated
word after the status as the test id, so parametrized ids holding spaces (``test_f[a b]``) are cut
at the space and distinct tests collide (last one wins). legorl parses the *full* id instead (up to
the `` - message`` of FAILED/ERROR/XFAIL lines, found bracket-aware), because a truncated id can
hide a failing parametrization behind a passing one. Expected-test lists produced by SWE-bench's
own tooling hold the truncated ids, so a listed name that is not a full id is looked up under
SWE-bench's truncated keys next, then by SWE-bench 5's prefix rule for ids cut mid-bracket
(:meth:`TestStatuses.status`): grading agrees with SWE-bench wherever SWE-bench's answer is
well-defined.

**Duplicates.** A test can be reported twice (``PASSED`` for its call, then ``ERROR`` for its
teardown; or a patch printing fake ``PASSED`` lines after pytest's own). SWE-bench keeps the last
line; legorl keeps the worst status, so an appended fake ``PASSED`` never overrides a real
``FAILED``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

START_MARKER = ">>>>> Start Test Output"
END_MARKER = ">>>>> End Test Output"
EXIT_CODE_MARKER = ">>>>> Test Exit Code"

STATUSES = ("PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL", "XPASS")
# Worse statuses win when a test is reported more than once.
SEVERITY = {"PASSED": 0, "XPASS": 1, "XFAIL": 1, "SKIPPED": 2, "FAILED": 3, "ERROR": 4}

_EXIT_RE = re.compile(rf"^{re.escape(EXIT_CODE_MARKER)}:\s*(-?\d+)\s*$", re.M)
_SKIP_COUNT = re.compile(r"^\[\d+\]$")


@dataclass
class TestStatuses:
    """What a log says about each test, keyed both ways (full ids and SWE-bench's truncated ids)."""

    __test__ = False  # not a pytest test class

    full: dict[str, str] = field(default_factory=dict)
    truncated: dict[str, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.full)

    @classmethod
    def from_map(cls, statuses: dict[str, str]) -> TestStatuses:
        """From full test ids (a runner report), with SWE-bench's truncated keys beside them."""
        out = cls(full=dict(statuses))
        for name, status in statuses.items():
            words = name.split()
            if words:
                out.truncated.setdefault(words[0], status)
        return out

    def status(self, name: str) -> str | None:
        """The status of a listed test name, or None when the log does not mention it."""
        if name in self.full:
            return self.full[name]
        if name in self.truncated:
            return self.truncated[name]
        # SWE-bench 5's rule for ids truncated mid-parameter: prefix match when all agree.
        if name.count("[") > name.count("]"):
            matches = [v for k, v in self.full.items() if k.startswith(name)]
            if matches and len({v in ("PASSED", "XFAIL") for v in matches}) == 1:
                return max(matches, key=SEVERITY.__getitem__)
        return None


def _split_message(rest: str) -> str:
    """The test id of ``rest`` (the summary line after its status): everything before the first
    `` - `` that is not inside a parametrization's brackets."""
    start = 0
    while True:
        i = rest.find(" - ", start)
        if i < 0:
            return rest.strip()
        head = rest[:i]
        if head.count("[") <= head.count("]"):
            return head.strip()
        start = i + 1


def parse_pytest(text: str) -> TestStatuses:
    """Parse pytest ``-rA`` summary lines into full and SWE-bench-truncated status maps."""
    out = TestStatuses()
    for line in text.split("\n"):
        line = line.rstrip("\r")
        status = next((s for s in STATUSES if line.startswith(s)), None)
        if status is None:
            continue
        # SWE-bench's key: the second whitespace word (FAILED lines drop " - " first).
        words = (line.replace(" - ", " ") if status == "FAILED" else line).split()
        if len(words) <= 1 or (words[0] == "SKIPPED" and _SKIP_COUNT.match(words[1])):
            continue
        if words[0] in STATUSES:
            out.truncated[words[1]] = words[0]
        if not line.startswith(status + " "):
            continue
        test_id = _split_message(line[len(status) + 1 :])
        if not test_id:
            continue
        previous = out.full.get(test_id)
        if previous is None or SEVERITY[status] >= SEVERITY[previous]:
            out.full[test_id] = status
    return out


PARSERS: dict[str, Callable[[str], TestStatuses]] = {"pytest": parse_pytest}


def get_parser(name: str | None) -> Callable[[str], TestStatuses]:
    from legorl.core.errors import LegorlError

    key = name or "pytest"
    if key not in PARSERS:
        raise LegorlError(f"unknown log_parser {key!r} (known: {', '.join(sorted(PARSERS))})")
    return PARSERS[key]


@dataclass
class TestLog:
    """The parts of a graded run's log that grading needs."""

    __test__ = False

    output: str  # between the markers (the whole log when the markers are missing)
    exit_code: int | None
    complete: bool  # both markers present


def split_log(log: str) -> TestLog:
    """The test output between the markers, and the recorded exit code.

    The output starts after the *first* start marker and ends at the *last* end marker, and the
    exit code is the *last* one recorded: the grading script prints those after the test command
    has ended, so markers the code under test prints itself cannot cut the real output short.
    (SWE-bench splits at the first end marker; on logs without forged markers the two agree.)
    """
    codes = _EXIT_RE.findall(log)
    exit_code = int(codes[-1]) if codes else None
    if START_MARKER in log:
        body = log.split(START_MARKER, 1)[1]
        if END_MARKER in body:
            return TestLog(body.rsplit(END_MARKER, 1)[0], exit_code, True)
    return TestLog(log, exit_code, False)


def contradicts_exit_code(statuses: TestStatuses, exit_code: int | None) -> bool:
    """SWE-bench 5's forgery check: the command failed, yet the log reports no failing test."""
    if exit_code in (None, 0) or not statuses:
        return False
    return not any(s in ("FAILED", "ERROR") for s in statuses.full.values())
