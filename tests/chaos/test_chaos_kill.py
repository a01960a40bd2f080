"""SIGKILL every stage at seeded random points, rerun it to completion, check what survives.

Each test drives the real `legorl` command in its own process group and kills the whole group
(the way an OOM killer or a lost node ends it: no handler runs), ``KILLS`` times at points drawn
from ``random.Random(f"{stage}:{seed}")``, then reruns it until it exits 0. Afterwards: every
expected row exactly once, nothing a reader could trip on (`legorl inspect --json`: no errors,
no duplicate keys, no temp files), no container left with the run's label, and each trial's
captured conversation is its own task's.
"""

from __future__ import annotations

import functools
import json
import random
import shutil
import subprocess
import threading
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from chaos_support import (
    Figures,
    assert_clean,
    assert_own_task,
    containers,
    datasets,
    has_parts,
    import_tasks,
    inspect,
    kill_at,
    legorl,
    parts,
    rng,
    start,
    stderr_of,
)

from legorl.core import shards
from legorl.core.schemas import Kind, trial_key

KILLS = 2  # kills per seed before the run that must finish


def _run_dir(tmp_path: Path, stage: str) -> Path:
    """A run directory whose name (the containers' run label) no concurrent test shares."""
    return tmp_path / f"chaos-{stage}-{uuid.uuid4().hex[:10]}"


def _keys(folder: Path, kind: Kind) -> list[str]:
    """Every key committed under ``folder``, duplicates included (no dedupe)."""
    keys: list[str] = []
    for path in shards.part_files(folder):
        keys += shards.read_file(path, kind, columns=["trial_id"]).column("trial_id").to_pylist()
    return keys


def _tally(fig: object, expected: set[str], keys: list[str]) -> None:
    fig.rows_lost += len(expected - set(keys))  # type: ignore[attr-defined]
    fig.duplicates += len(keys) - len(set(keys))  # type: ignore[attr-defined]


def _tallied(fig: object, expected: set[str], folder: Path, kind: Kind) -> list[str]:
    """The keys committed under ``folder`` (:func:`_keys`), their lost and duplicate rows counted."""
    keys = _keys(folder, kind)
    _tally(fig, expected, keys)
    return keys


def _leaked(fig: object, *labels: str) -> list[str]:
    """The containers left with any of the run ``labels``, counted."""
    leaked = containers(*labels)
    fig.containers_leaked += len(leaked)  # type: ignore[attr-defined]
    return leaked


def _kill_after_new_parts(fig: object, draw: random.Random, args: list[str], folder: Path, most: int,
                          max_delay: float) -> None:
    """Start `legorl *args` and SIGKILL it once ``folder`` holds 0 to ``most`` (drawn) more committed
    parts than now, after a drawn delay of up to ``max_delay`` seconds."""
    before = parts(folder)
    target = draw.randint(0, most)
    landed = kill_at(start(*args), has_parts(folder, before + target), draw.uniform(0.0, max_delay))
    fig.faults_injected += landed  # type: ignore[attr-defined]
    fig.resumes += landed  # type: ignore[attr-defined]


def _assert_each_once(keys: list[str], expected: set[str]) -> None:
    assert set(keys) == expected and len(keys) == len(expected), sorted(keys)


def _seeded_run(tmp_path: Path, stage: str, chaos_seed: int, tasks: int) -> tuple[random.Random, Path, list[str]]:
    """A stage test's kill points, and its run directory holding the first ``tasks`` tasks."""
    run = _run_dir(tmp_path, stage)
    return rng(stage, chaos_seed), run, import_tasks(run, tasks)


def _harness_args(stage: str, run: Path, model: Path, *options: str) -> list[str]:
    """`legorl STAGE` on ``run`` with the simple harness: two turns, a minute a trial, JSON out."""
    return [stage, "--run", str(run), "--model", str(model), "--harness", "simple", *options,
            "--max-turns", "2", "--timeout", "60", "--json"]


# --------------------------------------------------------------------------- rollout


@pytest.mark.podman
def test_rollout_sigkill_then_rerun(tiny_model: Path, base_image: str, tmp_path: Path, chaos_seed: int,
                                    figures: Figures) -> None:
    draw, run, tasks = _seeded_run(tmp_path, "rollout", chaos_seed, tasks=3)
    args = _harness_args("rollout", run, tiny_model, "--samples", "2", "--limit", "3", "--concurrency", "2")
    expected = {trial_key(t, "simple", 0, k) for t in tasks for k in range(2)}
    with figures.stage("rollout", chaos_seed) as fig:
        fig.rows_expected += len(expected)
        committed: set[str] = set()
        for _ in range(KILLS):
            _kill_after_new_parts(fig, draw, args, run / "rollouts", most=2, max_delay=2.5)
            now = set(_keys(run / "rollouts", Kind.ROLLOUTS))
            assert committed <= now, "a committed row disappeared after a kill"
            committed = now
        result = json.loads(legorl(*args).stdout)
        keys = _tallied(fig, expected, run / "rollouts", Kind.ROLLOUTS)
        leaked = _leaked(fig, run.name)
    _assert_each_once(keys, expected)
    assert result["skipped"] == len(committed) and result["ran"] == len(expected) - len(committed)
    assert_clean(inspect(run))
    assert leaked == []
    assert_own_task(run)


# --------------------------------------------------------------------------- grade


@pytest.mark.podman
def test_grade_sigkill_then_rerun(base_image: str, tmp_path: Path, chaos_seed: int, figures: Figures) -> None:
    draw, run, tasks = _seeded_run(tmp_path, "grade", chaos_seed, tasks=6)
    args = ["grade", "--run", str(run), "--gold", "--concurrency", "1", "--json"]
    expected = {trial_key(t, "gold", 0, 0) for t in tasks}
    with figures.stage("grade", chaos_seed) as fig:
        fig.rows_expected += len(expected)
        for _ in range(KILLS):
            _kill_after_new_parts(fig, draw, args, run / "grades", most=3, max_delay=1.0)
        legorl(*args)
        keys = _tallied(fig, expected, run / "grades", Kind.GRADES)
        leaked = _leaked(fig, str(run), run.name)
    _assert_each_once(keys, expected)
    grades = shards.read_rows(run / "grades", Kind.GRADES)
    assert {g.trial_id: g.reward for g in grades} == dict.fromkeys(expected, 1.0), [
        (g.trial_id, g.status, g.error) for g in grades]
    assert_clean(inspect(run))
    assert leaked == []


# --------------------------------------------------------------------------- train

def _torn_saves(checkpoints: Path) -> list[Path]:
    """TRL saves a kill cut short: a checkpoint-N folder without its trainer_state.json."""
    return [p for p in checkpoints.glob("step-*.partial/checkpoint-*") if not (p / "trainer_state.json").exists()]


def _train_run(tiny_model: Path, root: Path) -> Path:
    from train_support import TrialSpec, make_run

    specs = [TrialSpec(f"t{g}", i, float((i + g) % 2)) for g in range(4) for i in range(2)]
    return make_run(root, tiny_model, specs).root


def _state(checkpoint: Path) -> tuple[dict[str, Any], dict[int, dict[str, Any]], int]:
    import torch
    from safetensors.torch import load_file

    optimizer = torch.load(checkpoint / "optimizer.pt", weights_only=False)["state"]
    step = json.loads((checkpoint / "trainer_state.json").read_text())["global_step"]
    return load_file(str(checkpoint / "model.safetensors")), optimizer, int(step)


def test_train_sigkill_then_resume_matches_unkilled(tiny_model: Path, tmp_path: Path, chaos_seed: int,
                                                    figures: Figures) -> None:
    import torch

    draw = rng("train", chaos_seed)
    ref = _train_run(tiny_model, tmp_path / "ref")
    run = tmp_path / "killed"
    shutil.copytree(ref, run)
    args = ["--model", str(tiny_model), "--groups-per-batch", "1", "--lr", "1e-3", "--json"]  # 4 updates
    legorl("train", "--run", str(ref), *args)
    partial = run / "train" / "checkpoints" / "step-0.partial"
    with figures.stage("train", chaos_seed) as fig:
        fig.rows_expected += 1  # the step's checkpoint
        for _ in range(KILLS):
            # after the n-th of 4 saved updates (4: while the step's checkpoint is being written)
            target = draw.randint(1, 4)
            landed = kill_at(start("train", "--run", str(run), "--resume", *args),
                             functools.partial(_saved_update_reaches, partial, target), draw.uniform(0.0, 0.8))
            fig.faults_injected += landed
            fig.resumes += landed
        result = json.loads(legorl("train", "--run", str(run), "--resume", *args).stdout)
        final = run / "train" / "checkpoints" / "step-0"
        fig.rows_lost += not (final / "config.json").exists()
        report = inspect(run)
        fig.duplicates += sum(d["duplicate_keys"] for d in report["datasets"])
    assert result["checkpoint"] == str(final)
    want_w, want_opt, want_step = _state(ref / "train" / "checkpoints" / "step-0")
    got_w, got_opt, got_step = _state(final)
    assert got_step == want_step == 4
    for name, tensor in want_w.items():
        assert torch.allclose(got_w[name], tensor, rtol=0, atol=1e-6), name
    for index, entry in want_opt.items():
        for key, value in entry.items():
            assert torch.allclose(got_opt[index][key], value, rtol=0, atol=1e-6), (index, key)
    # a kill anywhere writes the step's metrics once (they are committed with its checkpoint)
    assert_clean(report)


def test_train_killed_after_its_metrics_writes_them_once(tiny_model: Path, tmp_path: Path,
                                                         figures: Figures) -> None:
    run = _train_run(tiny_model, tmp_path / "run")
    args = ["train", "--run", str(run), "--model", str(tiny_model), "--groups-per-batch", "1", "--resume", "--json"]
    final = run / "train" / "checkpoints" / "step-0"
    with figures.stage("train (kill after metrics)") as fig:
        # the checkpoint's temp folder exists from after the metrics are written until it is renamed
        landed = kill_at(start(*args), lambda: (final.parent / ".step-0.tmp").exists(), 0.0)
        if not landed or (final / "config.json").exists():
            pytest.skip("the kill missed the window between the metrics and the checkpoint")
        fig.faults_injected += 1
        fig.resumes += 1
        legorl(*args)
        report = inspect(run)
        fig.duplicates += datasets(report)["train/metrics"]["duplicate_keys"]
    assert datasets(report)["train/metrics"]["duplicate_keys"] == 0


def test_train_resumes_after_a_kill_inside_a_checkpoint_save(tiny_model: Path, tmp_path: Path,
                                                             figures: Figures) -> None:
    run = _train_run(tiny_model, tmp_path / "run")
    args = ["train", "--run", str(run), "--model", str(tiny_model), "--groups-per-batch", "1", "--resume", "--json"]
    checkpoints = run / "train" / "checkpoints"
    with figures.stage("train (kill inside a TRL save)") as fig:
        landed = kill_at(start(*args), lambda: (checkpoints / "step-0.partial" / "checkpoint-1").exists(), 0.0)
        if not landed or not _torn_saves(checkpoints):
            pytest.skip("the kill missed the save")
        fig.faults_injected += 1
        fig.resumes += 1
        done = legorl(*args, check=False)
        fig.rows_lost += done.returncode != 0
    assert done.returncode == 0, done.stderr[-1500:]
    assert (checkpoints / "step-0" / "config.json").exists()


def _saved_update_reaches(partial: Path, update: int) -> bool:
    """Whether TRL has saved update ``update`` (or a later one) under ``step-S.partial``."""
    numbers = [int(p.name.rsplit("-", 1)[1]) for p in partial.glob("checkpoint-*")]
    return max(numbers, default=0) >= update


# --------------------------------------------------------------------------- loop


@pytest.mark.podman
def test_loop_sigkill_then_rerun(tiny_model: Path, base_image: str, tmp_path: Path, chaos_seed: int,
                                 figures: Figures) -> None:
    draw, run, tasks = _seeded_run(tmp_path, "loop", chaos_seed, tasks=2)
    args = _harness_args("loop", run, tiny_model, "--steps", "2", "--samples", "2", "--limit", "2")
    expected = {trial_key(t, "simple", s, k) for t in tasks for s in range(2) for k in range(2)}
    checkpoints = run / "train" / "checkpoints"
    with figures.stage("loop", chaos_seed) as fig:
        fig.rows_expected += len(expected)
        for _ in range(KILLS):
            # a point anywhere in the ~25 s of two steps: by rows written, then a random delay
            target = draw.randint(0, len(expected) - 1)
            landed = kill_at(start(*args), has_parts(run / "rollouts", target), draw.uniform(0.0, 6.0))
            fig.faults_injected += landed
            fig.resumes += landed
        legorl(*args)
        keys = _tallied(fig, expected, run / "rollouts", Kind.ROLLOUTS)
        graded = _tallied(fig, expected, run / "grades", Kind.GRADES)
        leaked = _leaked(fig, run.name)
    _assert_each_once(keys, expected)
    _assert_each_once(graded, expected)
    assert (checkpoints / "latest").read_text().strip() == "step-1"
    assert all((checkpoints / f"step-{s}" / "config.json").exists() for s in range(2))
    assert not list(checkpoints.glob("*.partial")) and not list(checkpoints.glob(".*tmp"))
    assert_clean(inspect(run))
    assert leaked == []
    assert_own_task(run)


# --------------------------------------------------------------------------- serve-proxy --run


class _Client:
    """Drives sessions against a running `legorl serve-proxy`: create, one call, finish."""

    def __init__(self, base_url: str):
        self.http = httpx.Client(base_url=base_url, timeout=60)
        self.finished: list[str] = []  # sessions whose /finish answered 200
        self.tried: list[str] = []

    def one(self, finish: bool = True) -> str:
        sid = self.http.post("/sessions", json={}).raise_for_status().json()["session_id"]
        self.tried.append(sid)
        self.http.post(f"/sess/{sid}/v1/chat/completions", json={
            "model": "policy", "messages": [{"role": "user", "content": f"session {sid}"}], "max_tokens": 4,
        }).raise_for_status()
        if finish:
            self.http.post(f"/sess/{sid}/finish").raise_for_status()
            self.finished.append(sid)
        return sid

    def finished_at_least(self, n: int) -> bool:
        return len(self.finished) >= n

    def until_error(self) -> None:
        try:
            while True:
                self.one()
        except httpx.HTTPError:
            return


def _serve(tiny_model: Path, run: Path) -> tuple[subprocess.Popen[str], str]:
    proc = start("serve-proxy", "--model", str(tiny_model), "--port", "0", "--run", str(run),
                 stdout=subprocess.PIPE)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, stderr_of(proc)
    return proc, json.loads(line)["base_url"]


def _proxy_keys(run: Path) -> list[str]:
    return _keys(run / "proxy", Kind.ROLLOUTS)


def _session_key(sid: str) -> str:
    return trial_key(f"proxy/{sid}", "external", 0, 0)


def test_serve_proxy_sigkill_keeps_finished_sessions_once(tiny_model: Path, tmp_path: Path, chaos_seed: int,
                                                          figures: Figures) -> None:
    draw = rng("serve-proxy", chaos_seed)
    run = tmp_path / "proxy-run"
    finished: list[str] = []
    tried: list[str] = []
    with figures.stage("serve-proxy", chaos_seed) as fig:
        for _ in range(KILLS):
            proc, url = _serve(tiny_model, run)
            client = _Client(url)
            worker = threading.Thread(target=client.until_error, daemon=True)
            worker.start()
            target = draw.randint(1, 6)
            kill_at(proc, functools.partial(client.finished_at_least, target), draw.uniform(0.0, 0.5))
            fig.faults_injected += 1
            fig.resumes += 1
            worker.join(timeout=60)
            finished += client.finished
            tried += client.tried
        # the last server: sessions finished by hand, two left open for the shutdown (SIGTERM) to write
        proc, url = _serve(tiny_model, run)
        client = _Client(url)
        for _ in range(3):
            client.one()
        still_open = [client.one(finish=False) for _ in range(2)]
        proc.terminate()
        assert proc.wait(timeout=60) == 0, stderr_of(proc)
        finished += client.finished + still_open
        tried += client.tried
        keys = _proxy_keys(run)
        expected = {_session_key(s) for s in finished}
        fig.rows_expected += len(expected)
        _tally(fig, expected, keys)
    assert expected <= set(keys), "a session finished before the kill is missing"
    assert len(keys) == len(set(keys)), "a session was written twice"
    assert set(keys) <= {_session_key(s) for s in tried}
    report = inspect(run)
    assert_clean(report)  # a temp file a kill left mid-write is swept by the next server's first write
    for row in shards.read_rows(run / "proxy", Kind.ROLLOUTS):  # each capture is its own session's
        sid = row.task_id.removeprefix("proxy/")
        assert f"session {sid}" in (row.messages or ""), row.trial_id


def test_serve_proxy_rerun_sweeps_a_killed_writers_temp_file(tiny_model: Path, tmp_path: Path,
                                                             figures: Figures) -> None:
    run = tmp_path / "proxy-run"
    (run / "proxy").mkdir(parents=True)
    # what a serve-proxy SIGKILLed inside a shard write leaves (the random kills above hit it often)
    (run / "proxy" / ".part-00000000000000000000-999999-deadbeef.parquet.tmp").write_bytes(b"PAR1 torn")
    with figures.stage("serve-proxy (a killed writer's temp file)") as fig:
        fig.faults_injected += 1
        fig.resumes += 1
        proc, url = _serve(tiny_model, run)
        _Client(url).one()
        proc.terminate()
        assert proc.wait(timeout=60) == 0, stderr_of(proc)
        report = inspect(run)
    assert len(_proxy_keys(run)) == 1
    assert datasets(report)["proxy"]["temp_files"] == 0
