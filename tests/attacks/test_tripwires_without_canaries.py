"""Forgeries on tasks without canaries, where the runner's in-process tripwires decide a pass (red teams,
told to assume arbitrary code in the test process).

- ``plugin_named_json``: registers a pytest plugin through ``pytestPDB._pluginmanager`` (a class
  attribute, no audit event) whose class body says ``__module__ = "json"``, and turns failed reports
  into passes; the plugin check looked the module up by that name. Hooks are now judged by their code's
  file (``guard.foreign_plugins``).
- ``recorder_rewrite``: ``import __main__`` reaches the runner itself; replacing ``Recorder._check``
  (which ran the checks) with one that marks every status passed scored 1 on nine tasks of four
  repositories. The runner is now in its own identity snapshot, and its hooks call the checks through
  arguments bound when its class was made.

These are tripwires: code that knows them can still forge a pass on a task without canaries
(docs/threat-model.md, residual risks). What is asserted here is that these attacks score 0.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from grading_support import Tree, describe, shipped_tasks

from legorl.grading.grader import GradeOptions, Grader

pytestmark = pytest.mark.podman

PAYLOADS = Path(__file__).parent / "payloads"
INIT = {"parse": "parse/__init__.py", "webcolors": "src/webcolors/__init__.py"}
ATTACKS = [(p, t) for p in ("plugin_named_json", "recorder_rewrite")
           for t in ("parse__constant-b440166a", "webcolors__constant-ace7d9fa")]


@pytest.mark.parametrize(("payload", "task_id"), ATTACKS, ids=[f"{p}-{t.split('__')[0]}" for p, t in ATTACKS])
def test_a_forgery_the_tripwires_see_scores_0(payload: str, task_id: str, base_image: str, tmp_path: Path) -> None:
    task = shipped_tasks()[task_id]
    grader = Grader(GradeOptions(test_timeout=120))
    assert not grader.canaries.of(task, grader.canaries.seed(task)), f"{task_id} has canaries now: pick a task without"
    tree = Tree(task, tmp_path / "repo")
    row = grader.grade(task, tree.diff(tree.append(INIT[task_id.split("__")[0]], (PAYLOADS / f"{payload}.txt").read_text())))
    assert (row.reward, row.infra_failure) == (0.0, False), describe(row)
    # the plugin forges and is caught; the recorder's checks now run whatever the rewrite did, so its
    # statuses are the real ones (a plain 0) and the rewrite is on the row
    assert any(s.startswith("runner: ") for s in row.suspicious), describe(row)
