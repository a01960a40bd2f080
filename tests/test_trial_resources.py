"""What one trial can make the host spend, and what a host-side error in one trial costs: a
host-run harness reads the agent's output under a memory limit, and a host error in one trial (the
fds run out, a folder cannot be removed) is that trial's trouble — the rollout stage still writes a
row for every trial, and a trial whose harness had finished keeps the outcome it earned."""

from __future__ import annotations

import errno
import json
import uuid
from pathlib import Path

import pytest
from rollout_support import fix_command, import_one, scripted, tool_call

from legorl.core import shards
from legorl.core.schemas import Kind, Outcome, TrialRow
from legorl.engines.scripted import ScriptedEngine
from legorl.harnesses.host_limits import HOST_MEMORY_BYTES
from legorl.proxy.clients import InProcessProxy
from legorl.sandbox.base import SandboxSpec
from legorl.sandbox.podman import PodmanBackend
from legorl.sandbox.podman_container import PodmanSandbox
from legorl.stages.rollout import RolloutConfig, rollout_stage

pytestmark = [pytest.mark.podman]


class Failing:
    """PodmanBackend.create, where the first sandbox's removal (after it really went) raises EMFILE,
    and the third sandbox cannot be created at all."""

    def __init__(self) -> None:
        self.backend = PodmanBackend()
        self.made = 0

    def __call__(self, spec: SandboxSpec) -> PodmanSandbox:
        self.made += 1
        if self.made == 3:
            raise OSError(errno.EMFILE, "Too many open files")
        box = self.backend.create(spec)
        if self.made == 1:
            remove = box.remove

            def broken() -> None:
                remove()
                raise OSError(errno.EMFILE, "Too many open files")

            box.remove = broken  # type: ignore[method-assign]
        return box


def _rows(run: Path) -> list[TrialRow]:
    return sorted(shards.read_rows(run / "rollouts", Kind.ROLLOUTS), key=lambda r: r.sample_index)


def test_host_errors_in_one_trial_never_stop_the_stage(tiny_model: Path, base_image: str, tmp_path: Path) -> None:
    run = tmp_path / f"run-{uuid.uuid4().hex[:12]}"
    import_one(run, tmp_path)
    engine = ScriptedEngine(str(tiny_model), lambda call: "Nothing to change.", max_context=32768)
    cfg = RolloutConfig(run=run, harnesses=["simple"], samples=3, concurrency=1, max_turns=2, retries=0,
                        timeout_s=120.0)
    create = Failing()
    with InProcessProxy(engine, str(tiny_model)) as proxy:
        rollout_stage(cfg, proxy, create=create)
    rows = _rows(run)
    assert [r.sample_index for r in rows] == [0, 1, 2], rows
    # the trial whose cleanup failed had finished: its outcome is what the agent did
    finished = [r for r in rows if not r.infra_failure]
    assert len(finished) == 2 and all(r.outcome == Outcome.NO_SUBMISSION for r in finished), rows
    # the one whose sandbox could not be made is infrastructure (nothing of the agent ran), and says why
    (broken,) = [r for r in rows if r.infra_failure]
    assert broken.outcome == Outcome.INFRA_ERROR and "Too many open files" in (broken.error or ""), broken


@pytest.mark.harness
def test_a_host_run_harness_holds_no_more_than_its_limit_of_the_agents_output(
        tiny_model: Path, base_image: str, tmp_path: Path) -> None:
    """mini-swe-agent (on the host) reads each action's whole output into one string: an action that
    prints more than its memory limit gets a MemoryError there, the agent goes on, and the trial is
    the agent's (submitted, graded as usual)."""
    run = tmp_path / f"run-{uuid.uuid4().hex[:12]}"
    task = import_one(run, tmp_path)
    flood = f"head -c {HOST_MEMORY_BYTES * 3 // 4} /dev/zero; echo"  # held twice over while it is read
    turns = [tool_call("bash", {"command": flood}), tool_call("bash", {"command": fix_command(task)}),
             tool_call("bash", {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"})]
    engine = ScriptedEngine(str(tiny_model), scripted(turns), max_context=32768)
    cfg = RolloutConfig(run=run, harnesses=["mini-swe-agent"], max_turns=5, retries=0, timeout_s=300.0)
    with InProcessProxy(engine, str(tiny_model)) as proxy:
        rollout_stage(cfg, proxy)
    (row,) = _rows(run)
    assert (row.outcome, row.infra_failure) == (Outcome.SUBMITTED, False), row.error
    assert row.patch and "+" in row.patch
    (trajectory,) = (run / "logs" / "rollout").glob("*/trajectory.json")
    # the flood's observation is the harness's own account of the MemoryError, not the output
    assert "MemoryError" in json.dumps(json.loads(trajectory.read_text())["messages"][2:4]), trajectory
