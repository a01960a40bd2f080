"""``legorl rollout --executor ray`` on a real local Ray cluster (a head and two worker nodes on this
machine): a worker node SIGKILLed mid-run loses its trial, which is retried as an infrastructure
failure on the node left, and every trial ends in ``rollouts/`` exactly once; ``legorl grade`` then
grades a shard of them on the same cluster."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from rollout_support import import_one, scripted, tool_call
from test_sharded_stages import edit_command

from legorl.core import shards
from legorl.core.errors import LegorlError
from legorl.core.schemas import Kind, Outcome, TaskRow
from legorl.engines.base import Generation, SamplingParams, TokenChunk
from legorl.engines.scripted import ScriptedEngine
from legorl.grading.grader import GradeOptions
from legorl.proxy.server import ProxyServer
from legorl.stages.grade import Grading, Job
from legorl.stages.rollout import RemoteTrials, RolloutConfig
from legorl.trials.executors import RAY_MISSING, ExecutorOptions, RayExecutor, Shard
from legorl.trials.lifecycle import TrialJob

LEGORL = str(Path(sys.executable).parent / "legorl")
SAMPLES = 3  # two held on the nodes (one lost and retried), one more


def test_missing_ray_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(LegorlError, match=r"pip install 'legorl\[ray\]'") as err:
        next(RayExecutor("auto").map(None, [1], 1))  # type: ignore[arg-type]
    assert str(err.value) == RAY_MISSING
    assert isinstance(ExecutorOptions(executor="ray").make_executor(), RayExecutor)


def test_a_lost_job_runs_again_within_its_retries_then_is_infra(tmp_path: Path) -> None:
    """What the driver does with a job whose worker was lost (no cluster needed): the trial runs
    again while its retries last (the attempt numbering goes on), then is an infrastructure row."""
    cfg = RolloutConfig(run=tmp_path / "run", harnesses=["simple"], retries=1, backoff_s=0.5, executor="ray")
    trials = RemoteTrials(cfg, "policy", "http://127.0.0.1:9", None)
    assert trials.cfg.run.is_absolute()
    job = TrialJob(TaskRow(instance_id="t-1"), "simple", 3)
    assert trials.lost(job, "ray worker lost (NodeDiedError: gone)", 1) is None
    assert trials.backoff_s(1) == 0.5 and trials.backoff_s(2) == 1.0
    row = trials.lost(job, "ray worker lost (NodeDiedError: gone)", 2)
    assert row is not None and row.trial_id == "t-1/simple/step0/sample3"
    assert row.infra_failure and row.outcome == Outcome.INFRA_ERROR and row.attempts == 2 and not row.segments
    assert row.error == "ray worker lost (NodeDiedError: gone)" and row.model == "policy" and len(trials.lost_log) == 2

    grading = Grading(GradeOptions())
    item = (TaskRow(instance_id="t-1"), Job("t-1/simple/step0/sample3", "t-1", "diff", "simple", 0))
    assert [grading.lost(item, "lost", n) for n in (1, 2)] == [None, None]
    grade = grading.lost(item, "lost", 3)
    assert grade is not None and grade.infra_failure and grade.status == "infra_error" and grade.reward is None


class HeldEngine(ScriptedEngine):
    """Holds every call (off the proxy's event loop) until ``release`` is set: the test kills a node
    while a trial on each node is waiting for its model."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.held = threading.Semaphore(0)
        self.release = threading.Event()

    async def _hold(self) -> None:
        if not self.release.is_set():
            self.held.release()
            await asyncio.to_thread(self.release.wait, 240)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        await self._hold()
        return await super().generate(prompt_ids, params)

    async def stream(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[TokenChunk]:
        await self._hold()
        async for chunk in super().stream(prompt_ids, params):
            yield chunk


def _ray() -> Any:
    try:
        import ray.cluster_utils
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("ray is not installed (it is in the dev extra)")
        pytest.skip("ray is not installed: pip install 'legorl[ray]'")
    return ray


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A head with no CPUs (trials never run there) and two one-CPU worker nodes, in a short temp dir
    (Ray's unix socket paths must stay short), every port picked free by Ray, dashboard off; node
    deaths are noticed within a few seconds."""
    ray = _ray()
    temp = tempfile.mkdtemp(prefix="lray-", dir="/tmp")
    monkeypatch.setenv("RAY_TMPDIR", temp)  # Ray's files (its address file too) stay out of /tmp/ray
    # Loopback only: otherwise Ray turns 127.0.0.1 in an address into this host's outward IP
    # (services.resolve_ip_for_localhost), where a loopback cluster does not listen.
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.mkdir(f"{temp}/ray")
    head = ray.cluster_utils.Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False, "temp_dir": f"{temp}/ray", "node_ip_address": "127.0.0.1",
        "_system_config": {"health_check_initial_delay_ms": 1000, "health_check_period_ms": 1000,
                           "health_check_failure_threshold": 3}})
    try:
        for _ in range(2):
            head.add_node(num_cpus=1, node_ip_address="127.0.0.1")
        head.wait_for_nodes(timeout=120)
        yield head
    finally:
        head.shutdown()
        subprocess.run(["rm", "-rf", temp], check=False)


def _kill_node(node: Any) -> list[int]:
    """SIGKILL a worker node's raylet and everything under it (its Ray workers, their children)."""
    import psutil

    raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
    victims = [*raylet.children(recursive=True), raylet]
    for proc in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
    return [p.pid for p in victims]


def _remove_containers(run: Path) -> list[str]:
    from legorl.sandbox.host import run_podman

    names = run_podman(["ps", "-a", "--filter", f"label=legorl.run={run.name}", "--format", "{{.Names}}"]
                       ).stdout.decode().split()
    for name in names:
        run_podman(["rm", "-f", "-t", "0", name])
    return names


@pytest.mark.podman
@pytest.mark.slow
def test_ray_rollout_survives_a_killed_worker_node(cluster: Any, tiny_model: Path, base_image: str,
                                                  tmp_path: Path) -> None:
    run = tmp_path / f"run-{uuid.uuid4().hex[:12]}"
    task = import_one(run, tmp_path)
    engine = HeldEngine(str(tiny_model), scripted([tool_call("bash", {"command": edit_command(task)})]),
                        max_context=32768)
    held, release = engine.held, engine.release
    args = [LEGORL, "rollout", "--run", str(run), "--harness", "simple", "--samples", str(SAMPLES),
            "--concurrency", "2", "--max-turns", "3", "--timeout", "180", "--retries", "2",
            "--executor", "ray", "--address", cluster.address, "--json"]
    with ProxyServer(engine, str(tiny_model)) as server:
        proc = subprocess.Popen([*args, "--proxy", server.base_url], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 180
            for _ in range(2):  # one trial in a model call on each worker node
                while not held.acquire(timeout=1.0):
                    assert proc.poll() is None, proc.communicate()[1][-3000:]
                    assert time.monotonic() < deadline, "no trial reached the proxy on both nodes"
            victim = sorted(cluster.worker_nodes, key=lambda n: n.unique_id)[0]
            assert _kill_node(victim)
            time.sleep(1.0)
            release.set()
            out, err = proc.communicate(timeout=300)
        finally:
            release.set()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            left = _remove_containers(run)
    assert proc.returncode == 0, err[-3000:]
    result = json.loads(out)
    assert result["workers_lost"] >= 1 and all("ray worker lost" in line for line in result["lost"]), result
    data = shards.read(run / "rollouts", Kind.ROLLOUTS)
    assert data.duplicates == 0 and data.table.num_rows == SAMPLES  # every trial exactly once
    rows = {r.trial_id: r for r in shards.read_rows(run / "rollouts", Kind.ROLLOUTS)}
    assert sorted(rows) == sorted(f"{task.instance_id}/simple/step0/sample{k}" for k in range(SAMPLES))
    for row in rows.values():  # the lost trials were retried and solved: a lost worker is never a reward
        assert row.outcome == Outcome.SUBMITTED and not row.infra_failure, (row.trial_id, row.outcome, row.error)
    lost = {line.split(": attempt ")[0] for line in result["lost"]}
    assert lost <= rows.keys() and all(rows[k].attempts >= 2 for k in lost), [rows[k].attempts for k in lost]
    assert len(left) <= len(lost)  # only the killed node's sandbox was left behind (its owner died)

    # grading runs on the same executor (on the node left), here one shard of it
    graded = subprocess.run([LEGORL, "grade", "--run", str(run), "--executor", "ray", "--address", cluster.address,
                             "--shard", "0/2", "--json"], capture_output=True, text=True, timeout=300)
    assert graded.returncode == 0, graded.stderr[-3000:]
    owned = sorted(k for k in rows if Shard(0, 2).owns(k))
    assert owned and json.loads(graded.stdout)["graded"] == len(owned)
    grades = shards.read(run / "grades", Kind.GRADES)
    assert grades.duplicates == 0 and sorted(grades.table.column("trial_id").to_pylist()) == owned
    assert {g.status for g in shards.read_rows(run / "grades", Kind.GRADES)} == {"graded"}
