"""An example reward plug-in: the hidden tests' reward, less a little for a sprawling patch.

    PYTHONPATH=examples/verifiers legorl grade --run RUN --verifier concise:verify
    PYTHONPATH=examples/verifiers legorl loop ... --grade-verifier concise:verify

It runs in its own sandbox on the grading image's Python (the standard library and this file only),
on every grade the hidden tests judged, and gets the task row, the patch and the grader's report
(``status``, ``reward``, ``resolved``, ``resolution``, ``tests``) — never the test log, which the code
under test writes. See ``legorl.grading.verifier``.
"""

from __future__ import annotations

from typing import Any

FREE_LINES = 40  # lines a patch may add or remove before it costs anything
PENALTY_PER_LINE = 0.002
MAX_PENALTY = 0.2


def changed_lines(patch: str) -> int:
    """Lines the patch adds or removes (its file headers not counted)."""
    return sum(1 for line in patch.splitlines()
               if line[:1] in "+-" and not line.startswith(("+++ ", "--- ")))


def verify(task: dict[str, Any], patch: str, report: dict[str, Any]) -> tuple[float, list[str]]:
    reward = float(report["reward"])
    lines = changed_lines(patch)
    if reward <= 0:
        return 0.0, [f"the hidden tests did not pass ({report['resolution']})"]
    penalty = min(MAX_PENALTY, PENALTY_PER_LINE * max(0, lines - FREE_LINES))
    return reward - penalty, [f"{lines} changed lines: -{penalty:.3f}"]
