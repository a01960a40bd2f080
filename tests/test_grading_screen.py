"""Which lines a patch added, numbered as the interpreter numbers them (``grading/sandboxed/screen.py``).

The guard in the test process attributes a frame to the patch by its file and line number, so a line
number off by one turns a pristine line into the patch's (its frame read becomes a finding on honest
work) and hides a patch's own line.
"""

from __future__ import annotations

import pytest

from legorl.grading.sandboxed.screen import added_lines

PRISTINE = b"import sys\n\n\ndef caller():\n    return sys._getframe(1)\n"


@pytest.mark.parametrize("separator", ["\x0c", "\x0b", "\x1c", "\x85", "\u2028", "\u2029"])
def test_a_separator_python_does_not_count_moves_no_line_number(separator: str) -> None:
    """An Emacs page break (a form feed) in a new comment, or any separator ``str.splitlines`` splits at
    and Python does not: the pristine frame read stays on the line the interpreter gives it."""
    new = ("# helpers" + separator + "page two\nimport sys\n\n\ndef caller():\n    return sys._getframe(1)\n").encode()
    numbers, lines, _ = added_lines(new, PRISTINE)
    assert numbers == [1]
    code = compile(new.decode(), "mod.py", "exec")
    caller = next(c for c in code.co_consts if hasattr(c, "co_lines"))
    last = max(line for _, _, line in caller.co_lines() if line)  # its return line, as a frame reports it
    assert lines[last - 1].strip() == "return sys._getframe(1)"


def test_lines_end_at_newline_carriage_return_or_both() -> None:
    numbers, lines, _ = added_lines(b"a = 1\r\nb = 2\rc = 3\nd = 4", b"a = 1\n")
    assert (numbers, lines) == ([2, 3, 4], ["a = 1", "b = 2", "c = 3", "d = 4"])
    assert added_lines(b"", None)[:2] == ([], [])
    assert added_lines(b"x\n\n", None)[:2] == ([1, 2], ["x", ""])
