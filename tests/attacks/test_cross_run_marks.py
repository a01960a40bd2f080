"""A forger that carries a mark from one grading run into the next (red team, final canary design).

The patch leaves the bug and rewrites pytest's reports of failed tests into passes. To dodge the
canaries it remembers, across containers, the source of each test it forged: in a later run it forges
only tests whose source it has seen, so a mutated test fails honestly. The mark goes through state the
kernel shares between containers of one host: a named keyring of the test uid (``keyctl``), or the
page cache of a file in the image layer every grading container reads (pages loaded, then timed).
Both scored 1 on four tasks of four repositories against the grader whose canaries all sat in the
second run. Now the keyring calls are denied (``podman_run.seccomp_profile``), every page of the image
is cached before each grading container (``sandbox/pagecache.py``), and the canaries are split
between the two runs (``canaries.halves``).

Each attack is graded twice: as the grader splits the canaries, and in the forger's best case (every
canary in the second run), where only the closed channels stop it. The payloads are the red team's,
plus one that marks by evicting pages rather than loading them.
"""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
from grading_support import Tree, describe, shipped_tasks

from legorl.grading import hidden_tests
from legorl.grading.grader import GradeOptions, Grader

pytestmark = pytest.mark.podman

PAYLOADS = Path(__file__).parent / "payloads"
INIT = {"parse": "parse/__init__.py", "webcolors": "src/webcolors/__init__.py"}
ATTACKS = [("keyring_marks", "parse__constant-919546bc"), ("pagecache_marks", "parse__constant-919546bc"),
           ("eviction_marks", "webcolors__constant-0d6cda0f"), ("pagecache_marks", "webcolors__constant-0d6cda0f"),
           ("blanket_forgery", "webcolors__constant-0d6cda0f")]


def _patch(payload: str, task_id: str, root: Path) -> str:
    task = shipped_tasks()[task_id]
    tree = Tree(task, root)
    code = (PAYLOADS / f"{payload}.txt").read_text().replace("TOKEN", secrets.token_hex(4))
    return tree.diff(tree.append(INIT[task_id.split("__")[0]], code))


@pytest.fixture
def forgers_best_case(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every canary in the second run, the first with none: the forger forges everything in the first
    run and, if its mark reaches the second, only what it saw there."""
    monkeypatch.setattr(hidden_tests, "halves", lambda canaries, seed: ({}, dict(canaries)))


@pytest.mark.parametrize(("payload", "task_id"), ATTACKS, ids=[f"{p}-{t.split('__')[0]}" for p, t in ATTACKS])
def test_a_mark_carried_between_runs_never_scores(payload: str, task_id: str, base_image: str, tmp_path: Path) -> None:
    task = shipped_tasks()[task_id]
    grader = Grader(GradeOptions(test_timeout=120))
    grader.canaries.of(task, grader.canaries.seed(task))  # found before the clock of any run below
    row = grader.grade(task, _patch(payload, task_id, tmp_path / "repo"))
    assert (row.reward, row.infra_failure) == (0.0, False), describe(row)


@pytest.mark.parametrize(("payload", "task_id"), ATTACKS[:4], ids=[f"{p}-{t.split('__')[0]}" for p, t in ATTACKS[:4]])
def test_a_mark_carried_between_runs_never_scores_in_the_forgers_best_case(
        payload: str, task_id: str, base_image: str, tmp_path: Path, forgers_best_case: None) -> None:
    task = shipped_tasks()[task_id]
    grader = Grader(GradeOptions(test_timeout=120))
    grader.canaries.of(task, grader.canaries.seed(task))
    assert grader.canaries.of(task, grader.canaries.seed(task)), f"{task_id} has no canary"
    row = grader.grade(task, _patch(payload, task_id, tmp_path / "repo"))
    assert (row.reward, row.infra_failure) == (0.0, False), describe(row)
    assert row.status == "tampered", describe(row)
