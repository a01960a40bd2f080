"""SIGKILL the overlapped loop (`legorl loop --max-staleness 1`) at seeded random points, rerun it
to completion, and check what survives: every trial and grade exactly once, every step trained
once (its checkpoint, one set of trainer metrics and one of staleness figures, its trials counted
once), each call versioned with the step's version or the one before it.

The kill lands anywhere in the run: while step 0 rolls out, while step 1 rolls out in the
background as step 0 trains, or while step 1 trains. Training does its work even on groups without
signal (``--no-skip-zero-advantage``: the random tiny model scores 0 everywhere), so it takes the
time that lets step 1's trials start on version 0 and finish on version 1.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
from chaos_support import (
    Figures,
    _stderr,
    assert_clean,
    assert_own_task,
    command_env,
    containers,
    has_parts,
    import_tasks,
    inspect,
    kill_at,
    legorl,
    rng,
    start,
)

from legorl.core import metric_keys as mk
from legorl.core import shards
from legorl.core.schemas import Kind, trial_key
from legorl.trials import provenance

KILLS = 2  # kills per seed before the run that must finish
STEPS, SAMPLES, TASKS = 2, 2, 2

# `legorl loop` as cli/loop.py builds it, for a checkout whose command does not take --max-staleness yet
# (the option comes from OnlineConfig's field once cli/loop.py exposes it): the same configs, same flow.
_DRIVER = """
import json, sys
from pathlib import Path
from legorl.flows.online import OnlineConfig, run_online
from legorl.grading.grader import GradeOptions
from legorl.stages.rollout import RolloutConfig
from legorl.training.config import TrainConfig
a = json.loads(sys.argv[1])
rollout = RolloutConfig(run=Path(a["run"]), harnesses=["simple"], samples=a["samples"], limit=a["limit"],
                        max_turns=2, timeout_s=60)
train = TrainConfig(temperature=rollout.temperature, skip_zero_advantage=False)
cfg = OnlineConfig(rollout=rollout, grade=GradeOptions(), train=train,
                   model=Path(a["model"]), steps=a["steps"], max_staleness=a["max_staleness"])
run_online(cfg)
"""


def _cli_takes_max_staleness() -> bool:
    return "--max-staleness" in legorl("loop", "--help", env={"COLUMNS": "200"}).stdout


def _loop(run: Path, model: Path) -> list[str]:
    """The loop's command line: the real `legorl loop` when it takes --max-staleness, else the driver."""
    if _cli_takes_max_staleness():
        return ["loop", "--run", str(run), "--model", str(model), "--harness", "simple", "--steps", str(STEPS),
                "--samples", str(SAMPLES), "--limit", str(TASKS), "--max-turns", "2", "--timeout", "60",
                "--no-skip-zero-advantage", "--max-staleness", "1"]
    spec = {"run": str(run), "model": str(model), "steps": STEPS, "samples": SAMPLES, "limit": TASKS,
            "max_staleness": 1}
    return ["<driver>", json.dumps(spec)]


def _start(args: list[str]) -> subprocess.Popen[str]:
    if args[0] != "<driver>":
        return start(*args)
    err = tempfile.TemporaryFile()  # noqa: SIM115 (read by chaos_support.stderr_of)
    proc = subprocess.Popen([sys.executable, "-c", _DRIVER, args[1]], stdout=subprocess.DEVNULL, stderr=err,
                            text=True, start_new_session=True, env=command_env())
    _stderr[proc.pid] = err
    return proc


def _finish(args: list[str]) -> None:
    if args[0] != "<driver>":
        legorl(*args, timeout=900)
        return
    done = subprocess.run([sys.executable, "-c", _DRIVER, args[1]], capture_output=True, text=True, timeout=900,
                          env=command_env())
    assert done.returncode == 0, done.stderr[-3000:]


def _keys(folder: Path) -> list[str]:
    keys: list[str] = []
    for path in shards.part_files(folder):
        keys += shards.read_file(path, Kind.ROLLOUTS if folder.name == "rollouts" else Kind.GRADES,
                                 columns=["trial_id"]).column("trial_id").to_pylist()
    return keys


@pytest.mark.podman
def test_async_loop_sigkill_then_rerun(tiny_model: Path, base_image: str, tmp_path: Path, chaos_seed: int,
                                       figures: Figures) -> None:
    draw = rng("async-loop", chaos_seed)
    run = tmp_path / f"chaos-async-loop-{uuid.uuid4().hex[:10]}"
    tasks = import_tasks(run, TASKS)
    args = _loop(run, tiny_model)
    expected = {trial_key(t, "simple", s, k) for t in tasks for s in range(STEPS) for k in range(SAMPLES)}
    checkpoints = run / "train" / "checkpoints"
    with figures.stage("async-loop", chaos_seed) as fig:
        fig.rows_expected += len(expected)
        for _ in range(KILLS):
            # a point anywhere in the run: by rollout rows written (step 1's come in while step 0 trains),
            # then a random delay
            target = draw.randint(0, len(expected) - 1)
            landed = kill_at(_start(args), has_parts(run / "rollouts", target), draw.uniform(0.0, 8.0))
            fig.faults_injected += landed
            fig.resumes += landed
        _finish(args)
        found = {folder.name: _keys(folder) for folder in (run / "rollouts", run / "grades")}
        for keys in found.values():
            fig.rows_lost += len(expected - set(keys))
            fig.duplicates += len(keys) - len(set(keys))
        leaked = containers(run.name)
        fig.containers_leaked += len(leaked)

    for name, keys in found.items():
        assert set(keys) == expected and len(keys) == len(expected), (name, sorted(keys))
    assert (checkpoints / "latest").read_text().strip() == f"step-{STEPS - 1}"
    assert not list(checkpoints.glob("*.partial")) and not list(checkpoints.glob(".*tmp"))
    assert_clean(inspect(run))  # no duplicate key in any dataset, metrics included
    assert leaked == []
    assert_own_task(run)

    trials = shards.read_rows(run / "rollouts", Kind.ROLLOUTS)
    metrics = shards.read_rows(run / "train" / "metrics", Kind.METRICS)
    for step in range(STEPS):
        info = json.loads((checkpoints / f"step-{step}" / "legorl_train.json").read_text())
        mine = [t for t in trials if t.step == step and not t.infra_failure]
        assert info["trials"] == len(mine)  # each of the step's trials trained in it, once
        counted = [m.value for m in metrics if m.step == step and m.key == mk.TRIALS_COUNT and m.harness is None]
        assert counted == [len(mine)]
        figures = {m.key: m.value for m in metrics if m.step == step and m.stage == provenance.METRICS_STAGE}
        assert figures[provenance.TRIALS_STALE] == 0.0 and figures[provenance.MAX_LAG] <= 1.0
        assert figures[provenance.TRIALS_UNVERSIONED] == 0.0
        for trial in mine:
            versions = provenance.call_versions(trial)
            assert versions and None not in versions, trial.trial_id
            # sampled by the policy the step trains (version S) or the one before it, never a later one:
            # a rerun's engine serves the latest checkpoint under that checkpoint's version
            assert all(step - 1 <= v <= step for v in versions), (trial.trial_id, versions)
