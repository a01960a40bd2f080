"""Forgeries a red team wrote against the two-run canary design, told only the threat model and the code.

- ``inverted_new_tests``: ``git diff HEAD`` in the tree names the tests the hidden test patch added;
  code in the runner's process reports each of *their* outcomes inverted. The real test fails on the
  buggy code and is reported passed; a **negated** canary passes on the buggy code and is reported
  failed — exactly what the grader expects of it, without knowing which test is which. It scored 1
  on ``cachetools__constant-f0c6d29a`` (whose one canary is a negation), every grade. Now a value is
  changed wherever one can be (the buggy code fails a changed value, so an inverted one passes: tampered),
  and a task whose canaries are all negations rests on the tripwires, as one without canaries.
- ``should_stop``: the buggy functions raise ``unittest.case._ShouldStop``, which unittest swallows
  and reports as a success, on a task without canaries; no runner object was touched, so no tripwire
  fired. The runner now watches that exception being made.

Both are tripwires where they decide (docs/threat-model.md, residual risks): these patches score 0.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from grading_support import describe, shipped_tasks

from legorl.grading.grader import GradeOptions, Grader

pytestmark = pytest.mark.podman

PAYLOADS = Path(__file__).parent / "payloads"
ATTACKS = {
    "inverted_new_tests": ("cachetools__constant-f0c6d29a", "inverted_new_tests_cachetools.diff"),
    "should_stop": ("cachetools__constant-6d058d28", "should_stop_cachetools.diff"),
}


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_the_forgery_scores_0_and_gold_1(name: str, base_image: str) -> None:
    task_id, payload = ATTACKS[name]
    task = shipped_tasks()[task_id]
    grader = Grader(GradeOptions(test_timeout=120))
    for _ in range(2):  # which half of the canaries the first run holds is a coin per grade
        row = grader.grade(task, (PAYLOADS / payload).read_text())
        assert (row.reward, row.infra_failure) == (0.0, False), describe(row)
        assert any(s.startswith("runner: ") for s in row.suspicious), describe(row)
    gold = grader.grade(task, task.patch)
    assert gold.reward == 1.0, describe(gold)
