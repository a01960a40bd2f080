"""The rollout stage with real podman, real harnesses and a scripted engine behind the real proxy:
the success path grades to 1, and each fault lands in the right outcome."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from rollout_support import import_one, scripted, solving_script, tool_call

from legorl.core import shards
from legorl.core.schemas import Kind, Outcome, TrialRow
from legorl.engines.scripted import ScriptedEngine
from legorl.grading.grader import GradeOptions
from legorl.proxy.clients import InProcessProxy
from legorl.stages.grade import grade_stage, rollout_jobs
from legorl.stages.rollout import RolloutConfig, rollout_stage

pytestmark = [pytest.mark.podman, pytest.mark.harness]
LEGORL = str(Path(sys.executable).parent / "legorl")


def _rollout(tiny_model: Path, run: Path, complete: Callable[[object], str], **kw: object) -> list[TrialRow]:
    engine = ScriptedEngine(str(tiny_model), complete, max_context=32768)
    opts: dict[str, object] = {"timeout_s": 180.0, "max_turns": 4, "retries": 1, "backoff_s": 0.1} | kw
    cfg = RolloutConfig(run=run, **opts)
    with InProcessProxy(engine, str(tiny_model)) as proxy:
        rollout_stage(cfg, proxy)
    return sorted(shards.read_rows(run / "rollouts", Kind.ROLLOUTS), key=lambda r: r.trial_id)


def _run_dir(tmp_path: Path) -> Path:
    """A run directory whose name (the containers' run label) no concurrent test run shares."""
    return tmp_path / f"run-{uuid.uuid4().hex[:12]}"


def _containers(run: Path) -> list[str]:
    from legorl.sandbox.host import run_podman

    out = run_podman(["ps", "-a", "--filter", f"label=legorl.run={run.name}", "--format", "{{.Names}}"]).stdout
    return out.decode().split()


@pytest.mark.slow
def test_scripted_fix_is_submitted_and_grades_to_one(tiny_model: Path, base_image: str, tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    task = import_one(run, tmp_path)
    names = ["mini-swe-agent", "openhands", "opencode"]
    scripts = {n: solving_script(n, task) for n in names}

    def complete(call: object) -> str:
        text = str(getattr(call, "prompt_text", ""))
        # each harness announces itself in its own system prompt / tools
        name = ("openhands" if '"name": "finish"' in text else "mini-swe-agent"
                if "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" in text else "opencode")
        return scripted(scripts[name])(call)

    rows = _rollout(tiny_model, run, complete, harnesses=names, concurrency=3)
    assert [r.harness for r in rows] == sorted(names)
    for row in rows:
        assert row.outcome == Outcome.SUBMITTED, (row.harness, row.outcome, row.error)
        assert row.patch and "+" in row.patch
        assert row.segments and row.calls and row.attempts == 1
    jobs, infra = rollout_jobs(run / "rollouts")
    grades = grade_stage(run / "tasks", run / "grades", jobs, GradeOptions(concurrency=2))
    assert infra == 0
    assert {g.trial_id: g.reward for g in grades.rows} == {r.trial_id: 1.0 for r in rows}
    assert _containers(run) == []


def test_container_killed_mid_trial_is_the_agents_outcome(tiny_model: Path, base_image: str, tmp_path: Path) -> None:
    """The agent can kill its own container, so a container that dies after the policy has spoken is
    the agent's outcome (a harness crash), never infrastructure, and not retried."""
    run = _run_dir(tmp_path)
    task = import_one(run, tmp_path)
    solve = scripted(solving_script("mini-swe-agent", task))
    killed = threading.Event()

    def complete(call: object) -> str:
        if not killed.is_set():  # first call of the first attempt: the container dies under the agent
            killed.set()
            from legorl.sandbox.host import run_podman

            for name in _containers(run):
                run_podman(["rm", "-f", "-t", "0", name])
        return solve(call)

    [row] = _rollout(tiny_model, run, complete, harnesses=["mini-swe-agent"])
    assert killed.is_set()
    assert row.attempts == 1 and row.outcome == Outcome.HARNESS_CRASH and not row.infra_failure, row.error
    assert "container died" in (row.error or "") and row.patch is None
    attempt1 = next((run / "logs" / "rollout").glob("*attempt1"))
    assert (attempt1 / "harness.log").exists()
    assert _containers(run) == []


def test_engine_failure_is_infra_error(tiny_model: Path, base_image: str, tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    import_one(run, tmp_path)

    def complete(call: object) -> str:
        raise RuntimeError("the engine is down")

    [row] = _rollout(tiny_model, run, complete, harnesses=["mini-swe-agent"], retries=1)
    assert row.outcome == Outcome.INFRA_ERROR and row.infra_failure, row.error
    assert "engine" in (row.error or "")
    assert row.attempts == 2  # retried once, in a fresh sandbox and session
    assert row.segments == [] and row.messages is None
    assert shards.already_done(run / "rollouts", Kind.ROLLOUTS) == set()  # a rerun tries it again
    assert _containers(run) == []


@pytest.mark.slow
def test_hanging_harness_times_out_and_is_killed(tiny_model: Path, base_image: str, tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    import_one(run, tmp_path)
    hang = {"mini-swe-agent": [tool_call("bash", {"command": "sleep 600"})],
            "opencode": [tool_call("bash", {"command": "sleep 600", "description": "wait"})]}

    def complete(call: object) -> str:
        text = str(getattr(call, "prompt_text", ""))
        return scripted(hang["mini-swe-agent" if "COMPLETE_TASK" in text else "opencode"])(call)

    # 60 s: a harness's own start (opencode, or a fork server's first import) must fit inside the
    # limit on a loaded 2-core machine, or the trial never reaches its hanging call.
    start = time.monotonic()
    rows = _rollout(tiny_model, run, complete, harnesses=["mini-swe-agent", "opencode"], concurrency=2,
                    timeout_s=60.0)
    for row in rows:
        assert row.outcome == Outcome.TIMEOUT and not row.infra_failure, (row.harness, row.outcome, row.error)
        assert row.timings.agent_s is not None and row.timings.agent_s < 60.0 + 15.0
    assert time.monotonic() - start < 240
    assert _containers(run) == []
    # nothing of the host-side harness survives its kill
    left = subprocess.run(["pgrep", "-f", str(run / "logs")], capture_output=True, text=True).stdout
    assert left.strip() == ""


def test_garbage_tool_calls_are_the_harness_business(tiny_model: Path, base_image: str, tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    import_one(run, tmp_path)
    garbage = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"\n</tool_call>'

    def complete(call: object) -> str:
        return garbage if "# Tools" in str(getattr(call, "prompt_text", "")) else "title"

    rows = _rollout(tiny_model, run, complete, harnesses=["mini-swe-agent", "opencode"], concurrency=2)
    for row in rows:
        assert row.outcome in (Outcome.NO_SUBMISSION, Outcome.MAX_TURNS), (row.harness, row.outcome, row.error)
        assert not row.infra_failure
        assert any(c.parse_error for c in row.calls), row.harness
    mini = next(r for r in rows if r.harness == "mini-swe-agent")
    assert "RepeatedFormatError" in (mini.error or "")  # mini-swe-agent's own handling


@pytest.mark.slow
def test_sigkill_then_rerun_runs_only_missing_trials(tiny_model: Path, base_image: str, tmp_path: Path) -> None:
    run = tmp_path / "killed-run"
    import_one(run, tmp_path)
    samples = 5
    args = [LEGORL, "rollout", "--run", str(run), "--harness", "mini-swe-agent", "--model", str(tiny_model),
            "--samples", str(samples), "--concurrency", "1", "--max-turns", "1", "--max-tokens", "4",
            "--timeout", "120", "--json"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while not shards.part_files(run / "rollouts"):
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        assert time.monotonic() < deadline
        time.sleep(0.1)
    # Kill as soon as the next trial's container exists (a trial here takes about a second, so a fixed
    # sleep let every trial finish on a fast machine); a few samples more than can finish meanwhile.
    container_deadline = time.monotonic() + 10
    while not _containers(run) and time.monotonic() < container_deadline and proc.poll() is None:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    first = {r.trial_id for r in shards.read_rows(run / "rollouts", Kind.ROLLOUTS)}
    assert 1 <= len(first) < samples

    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["skipped"] == len(first) and result["ran"] == samples - len(first)
    data = shards.read(run / "rollouts", Kind.ROLLOUTS)
    assert data.table.num_rows == samples and data.duplicates == 0
    assert _containers(run) == []


def test_external_proxy_url(tiny_model: Path, base_image: str, tmp_path: Path) -> None:
    """`--proxy URL`: sessions are made and read over a running proxy's HTTP API."""
    from legorl.proxy.clients import RemoteProxy
    from legorl.proxy.server import ProxyServer

    run = _run_dir(tmp_path)
    task = import_one(run, tmp_path)
    engine = ScriptedEngine(str(tiny_model), scripted(solving_script("mini-swe-agent", task)), max_context=32768)
    cfg = RolloutConfig(run=run, harnesses=["mini-swe-agent"], timeout_s=180, max_turns=4)
    with ProxyServer(engine, str(tiny_model)) as server, RemoteProxy(server.base_url) as remote:
        summary = rollout_stage(cfg, remote)
    [row] = summary.rows
    assert row.outcome == Outcome.SUBMITTED and row.model == "scripted"
    assert len(row.calls) == 2 and row.segments and sum(row.segments[0].loss_mask) > 0
    assert shards.read_rows(run / "rollouts", Kind.ROLLOUTS)[0].segments == row.segments


def test_claude_code_scripted_fix_grades_to_one(tiny_model: Path, base_image: str, tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    task = import_one(run, tmp_path)
    [row] = _rollout(tiny_model, run, scripted(solving_script("claude-code", task)), harnesses=["claude-code"],
                     retries=0)
    assert row.outcome == Outcome.SUBMITTED, row.error
    jobs, _ = rollout_jobs(run / "rollouts")
    assert [g.reward for g in grade_stage(run / "tasks", run / "grades", jobs).rows] == [1.0]
