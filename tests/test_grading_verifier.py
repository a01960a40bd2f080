"""A reward plug-in (``--verifier``) beside the hidden tests, in its own real podman container.

The verifiers are written here into a module of their own (a plug-in the user would ship), put on
the path, and graded against a shipped task's gold patch and a copy of it with a marker line: the
verifier's reward replaces the tests' (kept in ``tests_reward``); a verifier failing on a patch
scores it 0 unless it fails on the gold patch too (infrastructure); it never sees the log, never
reaches the network or the host, and never changes a verdict the tests did not reach.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from grading_support import SHIPPED, shipped_tasks

from legorl.core import shards
from legorl.core.errors import ConfigError
from legorl.core.schemas import GradeRow, GradeStatus, Kind, TaskRow
from legorl.grading.grader import GradeOptions, Grader

pytestmark = pytest.mark.podman

LEGORL = str(Path(sys.executable).parent / "legorl")
TASK = "parse__constant-919546bc"
MARK = "# verifier-marker"

PLUGIN = textwrap.dedent('''
    import json, os, socket, time

    def concise(task, patch, report):
        """The tests' reward, less 0.25 for a patch that adds the marker line; its reasons say what it saw."""
        added = [ln for ln in patch.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
        penalty = 0.25 if any("MARK" in ln for ln in added) else 0.0
        print("a verifier's own print is not its verdict")
        return report["reward"] - penalty, [f"keys={sorted(report)}", f"added={len(added)}",
                                            f"task={task['instance_id']}", f"uid={os.getuid()}"]

    def as_dict(task, patch, report):
        return {"reward": 0.5, "reasons": "one reason"}

    def trips_on_marker(task, patch, report):
        if "MARK" in patch:
            raise ValueError("cannot parse this patch")
        return 1.0

    def always_fails(task, patch, report):
        raise RuntimeError("broken verifier")

    def sleeps(task, patch, report):
        time.sleep(3600)

    def not_a_number(task, patch, report):
        return float("nan")

    def escapes(task, patch, report):
        """What the sandbox lets it reach: the network, the host's files, the testbed."""
        seen = []
        try:
            socket.create_connection(("1.1.1.1", 53), timeout=3)
            seen.append("network")
        except OSError:
            pass
        for path in ("/root", "/testbed", "/work", "HOST_FILE"):
            try:
                if os.listdir(path) if os.path.isdir(path) else os.path.exists(path):
                    seen.append(path)
            except OSError:
                pass
        return 1.0, seen
''').replace("MARK", MARK)


@pytest.fixture(scope="module")
def plugin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("plugin")
    (folder / "my_rewards.py").write_text(PLUGIN.replace("HOST_FILE", str(folder / "my_rewards.py")))
    sys.path.insert(0, str(folder))
    yield str(folder)
    sys.path.remove(str(folder))
    sys.modules.pop("my_rewards", None)


@pytest.fixture(scope="module")
def task() -> TaskRow:
    return shipped_tasks()[TASK]


def marked(task: TaskRow) -> str:
    """The gold patch plus one added comment line carrying the marker (still a fix: the tests pass)."""
    lines = (task.patch or "").splitlines(keepends=True)
    hunk = next(i for i, ln in enumerate(lines) if ln.startswith("@@"))
    _old, new = lines[hunk].split("@@")[1].split()
    start, _, count = new.partition(",")
    lines[hunk] = lines[hunk].replace(new, f"{start},{int(count or 1) + 1}", 1)
    lines.insert(hunk + 1, f"+{MARK}\n")
    return "".join(lines)


def grader(spec: str, timeout: float = 60.0) -> Grader:
    return Grader(GradeOptions(verifier=spec, verifier_timeout=timeout, canaries=False))


def test_the_verifier_reward_replaces_the_tests_and_sees_only_the_verdict(plugin: str, task: TaskRow) -> None:
    g = grader("my_rewards:concise")
    gold = g.grade(task, task.patch)
    assert (gold.status, gold.tests_reward, gold.reward, gold.verifier) == ("graded", 1.0, 1.0, "my_rewards:concise")
    assert gold.resolved is True  # the tests' facts stay the tests'
    assert gold.verifier_reasons[0] == "keys=['resolution', 'resolved', 'reward', 'status', 'tests']"  # no log
    assert gold.verifier_reasons[2:] == [f"task={TASK}", "uid=65534"]
    penalised = g.grade(task, marked(task))
    assert (penalised.status, penalised.tests_reward, penalised.reward) == ("graded", 1.0, 0.75)

    # a grade the tests did not judge keeps its verdict, the verifier is not asked
    empty = g.grade(task, "")
    assert (empty.status, empty.reward, empty.verifier, empty.tests_reward) == ("empty_patch", 0.0, None, None)
    half = grader("my_rewards:as_dict").grade(task, task.patch)
    assert (half.reward, half.verifier_reasons) == (0.5, ["one reason"])


def test_a_verifier_failing_on_a_patch_scores_it_zero_and_on_gold_too_is_infrastructure(
        plugin: str, task: TaskRow) -> None:
    tripped = grader("my_rewards:trips_on_marker").grade(task, marked(task))
    assert (tripped.status, tripped.reward, tripped.infra_failure) == (GradeStatus.VERIFIER_FAILED, 0.0, False)
    assert tripped.tests_reward == 1.0 and "cannot parse this patch" in (tripped.error or "")

    broken = grader("my_rewards:always_fails").grade(task, task.patch)
    assert (broken.status, broken.reward, broken.infra_failure) == ("infra_error", None, True)
    assert "broken verifier" in (broken.error or "")

    nan = grader("my_rewards:not_a_number").grade(task, task.patch)
    assert nan.infra_failure and "finite number" in (nan.error or "")

    start = time.monotonic()
    slow = grader("my_rewards:sleeps", timeout=3).grade(task, task.patch)
    assert slow.infra_failure and "ran past 3 s" in (slow.error or "")
    assert time.monotonic() - start < 120  # the grade, plus the verifier twice (patch, gold), each bounded


def test_the_verifier_sandbox_reaches_nothing(plugin: str, task: TaskRow) -> None:
    row = grader("my_rewards:escapes").grade(task, task.patch)
    assert (row.reward, row.verifier_reasons) == (1.0, [])


def test_a_bad_verifier_spec_is_a_clear_error(plugin: str) -> None:
    with pytest.raises(ConfigError, match="no module named 'no_such_rewards'"):
        grader("no_such_rewards:verify")
    with pytest.raises(ConfigError, match="has no attribute 'nothing'"):
        grader("my_rewards:nothing")
    with pytest.raises(ConfigError, match="not callable"):
        grader("my_rewards:json")  # the module it imports


def test_through_legorl_grade(plugin: str, tmp_path: Path) -> None:
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": plugin}
    assert subprocess.run([LEGORL, "tasks", "import", str(SHIPPED), "--run", str(run), "--id", TASK],
                          capture_output=True, env=env).returncode == 0
    out = subprocess.run([LEGORL, "grade", "--run", str(run), "--gold", "--verifier", "my_rewards:concise",
                          "--json"], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    [grade] = json.loads(out.stdout)["grades"]
    assert (grade["reward"], grade["status"]) == (1.0, "graded")
    [row] = shards.read_rows(run / "grades", Kind.GRADES)
    assert isinstance(row, GradeRow)
    assert (row.verifier, row.tests_reward, row.reward) == ("my_rewards:concise", 1.0, 1.0)
    assert row.verifier_reasons and row.verifier_reasons[-1] == "uid=65534"

    missing = subprocess.run([LEGORL, "grade", "--run", str(run), "--gold", "--verifier",
                              "nope_rewards:verify"], capture_output=True, text=True, env=env, timeout=120)
    assert missing.returncode == 1 and "no module named 'nope_rewards'" in missing.stdout + missing.stderr
