"""``PodmanBackend.run_once``: a whole job as one ``podman run --rm -i`` — the grader's fast path.

Same policy as ``create`` (limits, no network, labels), stdin in, output out, and the container
gone on every exit path: normal exit, a timeout, and a timeout inside a grade.
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from legorl.core.schemas import GradeStatus, TaskRow
from legorl.sandbox.base import SandboxSpec
from legorl.sandbox.host import run_podman
from legorl.sandbox.live import live_sandboxes
from legorl.sandbox.podman import PodmanBackend

pytestmark = pytest.mark.podman

SHIPPED = Path(__file__).resolve().parents[1] / "examples" / "tasks" / "tasks.parquet"


@pytest.fixture(scope="module")
def image() -> str:
    from legorl.sandbox.host import base_image, image_exists

    name = base_image()
    if not image_exists(name):
        pytest.skip(f"base image {name} missing: run `legorl setup`")
    return name


def _mine() -> list[str]:
    proc = run_podman(["ps", "-a", "--filter", f"label=legorl.owner_pid={os.getpid()}", "--format", "{{.Names}}"],
                      timeout=60)
    return proc.stdout.decode().split()


def test_stdin_output_exit_code_and_removal(image: str) -> None:
    backend = PodmanBackend()
    script = "cat > /tmp/in; echo out; echo err >&2; wc -c < /tmp/in; " \
             "python3 -c 'import socket; socket.create_connection((\"1.1.1.1\", 53), timeout=2)' 2>/dev/null " \
             "|| echo no-network; exit 7"
    res = backend.run_once(SandboxSpec(image=image, labels={"run": "pytest", "trial": "once"}),
                           ["sh", "-c", script], stdin=b"x" * 100_000, timeout=60)
    assert res.exit_code == 7 and not res.timed_out
    assert res.output.split() == ["out", "err", "100000", "no-network"]
    assert live_sandboxes() == [] and _mine() == []


def test_timeout_removes_the_container(image: str) -> None:
    res = PodmanBackend().run_once(SandboxSpec(image=image), ["sh", "-c", "echo started; sleep 300"], timeout=3)
    assert res.timed_out and res.exit_code == 137 and res.duration_s < 60
    assert live_sandboxes() == [] and _mine() == []


def test_memory_limit_applies(image: str) -> None:
    hog = "b = bytearray(400 * 1024 * 1024); print('survived')"
    res = PodmanBackend().run_once(SandboxSpec(image=image, memory="128m"), ["python3", "-c", hog], timeout=60)
    assert "survived" not in res.output and res.exit_code != 0
    assert _mine() == []


def test_grade_whose_tests_hang_is_a_timeout_and_leaves_nothing(image: str) -> None:
    from legorl.grading.grader import GradeOptions, Grader

    row = next(r for r in pq.read_table(SHIPPED).to_pylist())
    task = TaskRow.from_dict(row)
    task.repo_source = str((SHIPPED.parent / (task.repo_source or "")).resolve())
    task.test_command = "sleep 120"
    grade = Grader(GradeOptions(test_timeout=3)).grade(task, task.patch)
    assert grade.status == GradeStatus.TEST_TIMEOUT and grade.reward == 0.0 and not grade.infra_failure
    assert grade.apply_method == "git apply"
    assert (grade.duration_s or 0) < 60
    assert live_sandboxes() == [] and _mine() == []
