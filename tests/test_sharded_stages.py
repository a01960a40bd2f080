"""``--shard i/n``: n processes of the real CLI over one run directory split rollout and grade
between them — every planned trial exactly once, the same keys as one unsharded run — and a shard's
rerun resumes only its own trials."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from rollout_support import import_one, scripted, tool_call

from legorl.core import shards
from legorl.core.errors import ConfigError
from legorl.core.schemas import Kind, Outcome, TaskRow
from legorl.engines.scripted import ScriptedEngine
from legorl.proxy.server import ProxyServer
from legorl.stages.rollout import RolloutConfig, plan
from legorl.trials.executors import Shard

LEGORL = str(Path(sys.executable).parent / "legorl")


def edit_command(task: TaskRow) -> str:
    """A command short enough for the simple harness's per-call cap: a comment appended to the file
    the gold patch fixes (a real patch that grades, to 0)."""
    path = re.search(r"^diff --git a/(\S+)", task.patch or "", re.M)
    assert path is not None, "the task's gold patch names no file"
    return f"echo '# edited' >> /testbed/{path.group(1)}"
SAMPLES = 4
TIMEOUT_S = 420


def test_shard_parse_and_partition() -> None:
    assert Shard.parse(" 1/3 ") == Shard(1, 3) and str(Shard(1, 3)) == "1/3"
    for bad in ("3/3", "1/0", "-1/2", "a/2", "1", "1/2/3", ""):
        with pytest.raises(ConfigError, match="--shard"):
            Shard.parse(bad)
    keys = [f"task-{i}/simple/step0/sample{k}" for i in range(50) for k in range(4)]
    owners = [[s for s in range(4) if Shard(s, 4).owns(key)] for key in keys]
    assert all(len(o) == 1 for o in owners)  # each key in exactly one shard
    sizes = Counter(o[0] for o in owners)
    assert len(sizes) == 4 and min(sizes.values()) >= 25  # and spread over all of them
    assert Shard(0, 1).owns("anything")
    # a stable hash: another process (another hash seed, another host) splits the keys the same way
    code = ("import json, sys; from legorl.trials.executors import Shard; keys = json.load(sys.stdin); "
            "print(json.dumps([next(s for s in range(4) if Shard(s, 4).owns(k)) for k in keys]))")
    other = subprocess.run([sys.executable, "-c", code], input=json.dumps(keys), capture_output=True, text=True,
                           env={"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"}, timeout=120, check=True)
    assert json.loads(other.stdout) == [o[0] for o in owners]


@pytest.fixture
def proxy(tiny_model: Path, tmp_path: Path) -> Iterator[tuple[str, TaskRow, Path]]:
    """A run with one task, and a proxy whose scripted policy edits a file, then answers."""
    run = tmp_path / f"run-{uuid.uuid4().hex[:12]}"
    task = import_one(run, tmp_path)
    engine = ScriptedEngine(str(tiny_model), scripted([tool_call("bash", {"command": edit_command(task)})]),
                            max_context=32768)
    with ProxyServer(engine, str(tiny_model)) as server:
        yield server.base_url, task, run


def _parallel(commands: list[list[str]]) -> list[dict[str, object]]:
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in commands]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=TIMEOUT_S)
            assert proc.returncode == 0, err[-3000:]
            results.append(json.loads(out))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


@pytest.mark.podman
def test_sharded_rollout_and_grade_cover_the_run_once(proxy: tuple[str, TaskRow, Path], base_image: str) -> None:
    url, _, run = proxy
    rollout = [LEGORL, "rollout", "--run", str(run), "--proxy", url, "--harness", "simple",
               "--samples", str(SAMPLES), "--concurrency", "2", "--max-turns", "3", "--timeout", "180",
               "--retries", "1", "--json"]
    unsharded, _ = plan(RolloutConfig(run=run, harnesses=["simple"], samples=SAMPLES))
    everything = {f"{j.task.instance_id}/simple/step0/sample{j.sample_index}" for j in unsharded}
    assert len(everything) == SAMPLES
    owned = [{k for k in everything if Shard(i, 2).owns(k)} for i in range(2)]
    assert all(owned), owned  # both shards have work (true of these keys: the hash is fixed)

    results = _parallel([[*rollout, "--shard", f"{i}/2"] for i in range(2)])
    for i, result in enumerate(results):
        assert result["ran"] == len(owned[i]) and result["skipped"] == 0, result
    data = shards.read(run / "rollouts", Kind.ROLLOUTS)
    assert data.duplicates == 0 and data.table.num_rows == SAMPLES
    rows = shards.read_rows(run / "rollouts", Kind.ROLLOUTS)
    assert {r.trial_id for r in rows} == everything
    for row in rows:
        assert row.outcome == Outcome.SUBMITTED and not row.infra_failure, (row.trial_id, row.outcome, row.error)
        assert row.patch and "+" in row.patch
    # a shard's rerun resumes its own trials only: nothing left to do, nothing of the other shard run
    [again] = _parallel([[*rollout, "--shard", "1/2"]])
    assert again["ran"] == 0 and again["skipped"] == len(owned[1]), again

    grade = [LEGORL, "grade", "--run", str(run), "--concurrency", "2", "--json"]
    graded = _parallel([[*grade, "--shard", f"{i}/2"] for i in range(2)])
    assert [g["graded"] for g in graded] == [len(o) for o in owned]
    [single] = _parallel([[*grade, "--out", str(run / "grades-unsharded")]])
    assert single["graded"] == SAMPLES
    sharded_rows = shards.read_rows(run / "grades", Kind.GRADES)
    single_rows = shards.read_rows(run / "grades-unsharded", Kind.GRADES)
    assert shards.read(run / "grades", Kind.GRADES).duplicates == 0
    assert sorted(g.trial_id for g in sharded_rows) == sorted(g.trial_id for g in single_rows) == sorted(everything)
    assert {g.trial_id: g.reward for g in sharded_rows} == {g.trial_id: g.reward for g in single_rows}
    assert {(g.status, g.reward) for g in sharded_rows} == {("graded", 0.0)}, [g.error for g in sharded_rows]
