"""Faults other than a killed stage: the engine (or the proxy in front of it) dies while a call is
in flight, podman's API service dies during a rollout, the disk fills under a stage, a harness
hangs holding its output. Each must end as infrastructure (retried by a rerun) or as the agent's
timeout, never as a reward 0 for the policy, and leave no container and no broken shard behind.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from chaos_support import (
    Figures,
    assert_clean,
    containers,
    import_tasks,
    inspect,
    kill_group,
    legorl,
    parts,
    start,
    stderr_of,
)

from legorl.core import shards
from legorl.core.schemas import Kind, Outcome, TrialRow, trial_key
from legorl.trials.lifecycle import HARNESS_GRACE_S

FAKE_VLLM = Path(__file__).with_name("fake_vllm.py")


def _run_dir(parent: Path, stage: str) -> Path:
    return parent / f"chaos-{stage}-{uuid.uuid4().hex[:10]}"


def _wait(predicate: object, limit_s: float, what: str) -> None:
    deadline = time.monotonic() + limit_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------- the engine dies


def _final_answer_tokens(tiny_model: Path) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    ids = [*tok.encode("DONE", add_special_tokens=False), tok.convert_tokens_to_ids("<|im_end|>")]
    return ",".join(str(i) for i in ids)


class _FakeEngine:
    """fake_vllm.py on a fixed port: killed, and started again, by the test."""

    def __init__(self, state: Path, tokens: str):
        self.state, self.tokens, self.port = state, tokens, _free_port()
        self.proc: subprocess.Popen[str] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(FAKE_VLLM), str(self.port), str(self.state), self.tokens],
                                     start_new_session=True, text=True)

        def up() -> bool:
            try:
                return httpx.get(self.url + "/v1/models", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        _wait(up, 30, "the fake engine")

    def kill(self) -> None:
        if self.proc is not None:
            kill_group(self.proc)


def _serve_vllm(tiny_model: Path, engine: _FakeEngine) -> tuple[subprocess.Popen[str], str]:
    proc = start("serve-proxy", "--engine", "vllm", "--upstream", engine.url, "--model", str(tiny_model),
                 "--port", "0", stdout=subprocess.PIPE)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, stderr_of(proc)
    return proc, json.loads(line)["base_url"]


@pytest.mark.podman
@pytest.mark.parametrize(("victim", "sampled"), [("engine", 0), ("engine", 2), ("proxy", 2)],
                         ids=["engine-before-first-token", "engine-mid-stream", "proxy-mid-stream"])
def test_engine_dies_mid_generation_is_infra_then_retried(victim: str, sampled: int, tiny_model: Path,
                                                          base_image: str, tmp_path: Path, figures: Figures) -> None:
    """``sampled``: tokens the engine has streamed of the call in flight when it (or the proxy) dies."""
    run = _run_dir(tmp_path, "engine")
    [task] = import_tasks(run, 1)
    key = trial_key(task, "simple", 0, 0)
    state = tmp_path / "engine-state"
    state.mkdir()
    (state / "hang").write_text(str(sampled))
    engine = _FakeEngine(state, _final_answer_tokens(tiny_model))
    engine.start()
    proxy, url = _serve_vllm(tiny_model, engine)
    args = ["rollout", "--run", str(run), "--harness", "simple", "--retries", "0", "--max-turns", "2",
            "--timeout", "90", "--json"]
    try:
        with figures.stage(f"engine-death ({victim}, {sampled} token(s) sampled)") as fig:
            rollout = start(*args, "--proxy", url, stdout=subprocess.PIPE)
            _wait(lambda: (state / "inflight").exists(), 120, "a call in flight")
            kill_group(proxy if victim == "proxy" else engine.proc)  # type: ignore[arg-type]
            fig.faults_injected += 1
            rollout.communicate(timeout=240)
            assert rollout.returncode == 0, stderr_of(rollout)
            [row] = shards.read_rows(run / "rollouts", Kind.ROLLOUTS)
            assert row.trial_id == key
            assert row.outcome == Outcome.INFRA_ERROR and row.infra_failure, (row.outcome, row.error)
            assert row.segments == [] and row.messages is None  # no tokens of a broken call are training data
            graded = json.loads(legorl("grade", "--run", str(run), "--json").stdout)
            assert graded["graded"] == 0 and graded["infra_rollouts_skipped"] == 1  # never a reward 0

            # the fault is gone: a working engine (and proxy); the rerun retries the infra row
            (state / "hang").unlink()
            if victim == "engine":
                engine.start()
            else:
                proxy, url = _serve_vllm(tiny_model, engine)
            fig.resumes += 1
            result = json.loads(legorl(*args, "--proxy", url).stdout)
            assert result["ran"] == 1, result
            [row] = shards.read_rows(run / "rollouts", Kind.ROLLOUTS)  # the newer row wins
            assert not row.infra_failure and row.calls and row.segments, (row.outcome, row.error)
            assert row.attempts == 1
            graded = json.loads(legorl("grade", "--run", str(run), "--json").stdout)
            assert graded["graded"] == 1
            fig.rows_expected += 1
            leaked = containers(run.name)
            fig.containers_leaked += len(leaked)
            assert leaked == []
    finally:
        kill_group(proxy)
        engine.kill()


# --------------------------------------------------------------------------- podman's API service


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
    return found


def _api_service(owner: int) -> int | None:
    """The pid of the `podman system service` that legorl process ``owner`` runs (legorl.sandbox.service)."""
    for watchdog in _children(owner):
        for pid in _children(watchdog):
            with contextlib.suppress(OSError):
                if b"system\0service" in (Path("/proc") / str(pid) / "cmdline").read_bytes():
                    return pid
    return None


@pytest.mark.podman
def test_podman_api_service_dies_during_rollout(tiny_model: Path, base_image: str, tmp_path: Path,
                                                figures: Figures) -> None:
    run = _run_dir(tmp_path, "service")
    tasks = import_tasks(run, 3)
    expected = {trial_key(t, "simple", 0, k) for t in tasks for k in range(2)}
    args = ["rollout", "--run", str(run), "--model", str(tiny_model), "--harness", "simple", "--samples", "2",
            "--limit", "3", "--concurrency", "2", "--max-turns", "2", "--timeout", "60", "--retries", "1", "--json"]
    with figures.stage("podman-api-service") as fig:
        fig.rows_expected += len(expected)
        proc = start(*args, stdout=subprocess.PIPE)
        for after_rows in (0, 2):  # as the first trials start, and again mid-run
            _wait(lambda n=after_rows: parts(run / "rollouts") >= n and (
                proc.poll() is not None or _api_service(proc.pid) is not None), 180, "the API service")
            pid = _api_service(proc.pid)
            if pid is None:
                break
            time.sleep(0.5)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            fig.faults_injected += 1
        proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr_of(proc)
        leaked = containers(run.name)  # the stage itself removed every container
        fig.containers_leaked += len(leaked)
        rows = shards.read_rows(run / "rollouts", Kind.ROLLOUTS)
        assert {r.trial_id for r in rows} == expected
        for row in rows:  # recovered, or infrastructure: never an agent outcome made of the fault
            assert row.infra_failure or (row.calls and row.segments), (row.trial_id, row.outcome, row.error)
        infra = sum(r.infra_failure for r in rows)
        fig.notes.append(f"{infra} trial(s) recorded as infrastructure, {sum(r.attempts > 1 for r in rows)} retried")
        fig.resumes += 1
        legorl(*args)
        rows = shards.read_rows(run / "rollouts", Kind.ROLLOUTS)
        fig.rows_lost += len(expected - {r.trial_id for r in rows if not r.infra_failure})
    assert leaked == []
    assert all(not r.infra_failure for r in rows), [(r.trial_id, r.error) for r in rows if r.infra_failure]
    assert containers(run.name) == []


# --------------------------------------------------------------------------- the disk fills


@contextlib.contextmanager
def _small_disk(path: Path, size: str = "24m") -> Iterator[Path]:
    path.mkdir(parents=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(path: Path) -> None:
    """Write ``path`` until the file system it is on has no space left."""
    chunk = b"\0" * (1 << 20)
    with open(path, "wb") as out:
        try:
            while True:
                out.write(chunk)
                out.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    with contextlib.suppress(OSError), open(path, "ab") as out:  # the last partial chunk
        while True:
            out.write(b"\0" * 4096)
            out.flush()


@pytest.mark.podman
@pytest.mark.parametrize("stage", ["grade", "rollout"])
def test_disk_fills_under_a_stage(stage: str, tiny_model: Path, base_image: str, tmp_path: Path,
                                  figures: Figures) -> None:
    with _small_disk(tmp_path / "small") as disk, figures.stage(f"disk-full ({stage})") as fig:
        run = _run_dir(disk, "disk")
        tasks = import_tasks(run, 4)
        if stage == "grade":
            args = ["grade", "--run", str(run), "--gold", "--concurrency", "1", "--json"]
            folder, kind, expected = run / "grades", Kind.GRADES, {trial_key(t, "gold", 0, 0) for t in tasks}
        else:
            args = ["rollout", "--run", str(run), "--model", str(tiny_model), "--harness", "simple", "--limit", "4",
                    "--concurrency", "1", "--max-turns", "2", "--timeout", "60", "--retries", "0", "--json"]
            folder, kind, expected = run / "rollouts", Kind.ROLLOUTS, {trial_key(t, "simple", 0, 0) for t in tasks}
        fig.rows_expected += len(expected)
        proc = start(*args)
        _wait(lambda: parts(folder) >= 1 or proc.poll() is not None, 180, "a first committed row")
        committed = {p.name: shards.read_file(p, kind).to_pylist() for p in shards.part_files(folder)}
        _fill(disk / "filler")
        fig.faults_injected += 1
        proc.wait(timeout=300)
        err = stderr_of(proc)
        report = inspect(run)
        for name, rows in committed.items():  # what was committed before the disk filled is intact
            assert shards.read_file(folder / name, kind).to_pylist() == rows, name
        (disk / "filler").unlink()
        fig.resumes += 1
        legorl(*args)
        keys = shards.read(folder, kind, columns=["trial_id"]).table.column("trial_id").to_pylist()
        fig.rows_lost += len(expected - set(keys))
        leaked = containers(run.name, str(run))
        fig.containers_leaked += len(leaked)
        assert set(keys) == expected
        assert leaked == []
        assert_clean(report)
        assert_clean(inspect(run))
        if len(committed) < len(expected):  # the disk filled while the stage still had rows to write
            assert proc.returncode != 0
            assert "No space left on device" in err, err[-2000:]
            assert "Traceback" not in err, err[-3000:]  # one clear line, not a crash


# --------------------------------------------------------------------------- a harness hangs


def _survivors(marker: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@dataclass
class Hang:
    """What a rollout of a hanging plug-in harness left: did it finish, its rows, what outlived it."""

    finished: bool
    stderr: str
    rows: list[TrialRow]
    leaked: list[str]
    survivors: list[int]


_HANG_TIMEOUT_S = 6


def _hang(plugin: str, tasks: int, run: Path, model: Path, figures: Figures) -> Hang:
    marker = f"chaos-hang-{uuid.uuid4().hex[:10]}"
    import_tasks(run, tasks)
    args = ["rollout", "--run", str(run), "--model", str(model), "--harness", f"chaos_harnesses:{plugin}",
            "--limit", str(tasks), "--concurrency", "1", "--max-turns", "2", "--timeout", str(_HANG_TIMEOUT_S),
            "--retries", "0", "--json"]
    with figures.stage(f"harness-hang ({plugin})") as fig:
        fig.rows_expected += tasks
        fig.faults_injected += tasks
        proc = start(*args, stdout=subprocess.PIPE, env={"CHAOS_MARKER": marker})
        try:  # enough for the model to load and each trial to reach its timeout
            proc.communicate(timeout=tasks * (_HANG_TIMEOUT_S + HARNESS_GRACE_S) + 35)
        except subprocess.TimeoutExpired:
            kill_group(proc)
        finally:
            survivors = _survivors(marker)
            for pid in survivors:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        rows = shards.read_rows(run / "rollouts", Kind.ROLLOUTS)
        fig.rows_lost += tasks - len(rows)
        leaked = containers(run.name)
        fig.containers_leaked += len(leaked)
        fig.notes.append(f"{len(survivors)} host process(es) of the hung harness outlived the stage")
        if leaked:  # a stage we had to kill leaves its trial's container to the reaper: run it now
            from legorl.sandbox.reaper import reap

            reap()
    return Hang(proc.returncode == 0, stderr_of(proc), rows, leaked, survivors)


@pytest.fixture(scope="module")
def child_holds_log(tiny_model: Path, base_image: str, tmp_path_factory: pytest.TempPathFactory,
                    figures: Figures) -> Hang:
    """Two trials of a host harness that hangs after starting a setsid child holding its log."""
    return _hang("ChildHoldsLog", 2, _run_dir(tmp_path_factory.mktemp("hang"), "hang"), tiny_model,
                 figures)


@pytest.mark.podman
def test_hung_harness_times_out_and_the_stage_goes_on(child_holds_log: Hang) -> None:
    hang = child_holds_log
    assert hang.finished, f"the stage did not go on past a hung harness: {hang.stderr[-2000:]}"
    assert [r.outcome for r in hang.rows] == [Outcome.TIMEOUT] * 2, [(r.outcome, r.error) for r in hang.rows]
    assert not any(r.infra_failure for r in hang.rows)
    assert hang.leaked == []


@pytest.mark.podman
def test_hung_harness_leaves_no_host_process(child_holds_log: Hang) -> None:
    assert child_holds_log.survivors == [], "a child of the hung harness outlived its trial"


@pytest.fixture(scope="module")
def pipe_held_open(tiny_model: Path, base_image: str, tmp_path_factory: pytest.TempPathFactory,
                   figures: Figures) -> Hang:
    """A Python plug-in blocked on a pipe its helper's child holds open."""
    return _hang("PipeHeldOpen", 1, _run_dir(tmp_path_factory.mktemp("pipe"), "pipe"), tiny_model, figures)


@pytest.mark.podman
def test_plugin_blocked_on_a_held_pipe_times_out(pipe_held_open: Hang) -> None:
    hang = pipe_held_open
    assert hang.finished, f"the stage did not go on past a hung harness: {hang.stderr[-2000:]}"
    assert [r.outcome for r in hang.rows] == [Outcome.TIMEOUT], [(r.outcome, r.error) for r in hang.rows]
    assert hang.leaked == []


@pytest.mark.podman
@pytest.mark.xfail(strict=True, reason=(
    "a Python plug-in harness runs in the rollout process: the children it starts carry no per-trial mark "
    "(legorl/harnesses/processes.py kill_marked covers host-run harness processes only), so its blocked helper's "
    "child outlives the trial"))
def test_plugin_blocked_on_a_held_pipe_leaves_no_host_process(pipe_held_open: Hang) -> None:
    assert pipe_held_open.survivors == []
