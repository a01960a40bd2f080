"""Warm starts: host-run trials forked from an interpreter that has already imported the harness's
heavy modules (legorl/harnesses/warm.py, _forkserver.py).

A real mini-swe-agent trial through the warm path ends as the cold one does and reaches the model
sooner; concurrent forked trials share no state; a timeout kills the forked trial and everything it
started (a ``setsid`` child too), and so does closing its connection or killing the server under
it; the server dies with its parent, takes requests from its parent only, kills what it forked
when it stops, and a server that cannot start leaves its trials to the cold path with the reason
logged.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from rollout_support import import_one, scripted, solving_script

from legorl.core import shards
from legorl.core.paths import RunDir
from legorl.core.schemas import Kind, Outcome, TrialRow
from legorl.engines.scripted import ScriptedEngine
from legorl.harnesses import warm
from legorl.harnesses.processes import RUN_MARKER, Launch, kill_host_processes, run_on_host
from legorl.proxy.clients import InProcessProxy
from legorl.stages.rollout import RolloutConfig, rollout_stage

PY = sys.executable  # any interpreter serves; the mini-swe-agent test uses the harness's own


@pytest.fixture(autouse=True)
def _no_servers_left() -> Iterator[None]:
    warm.stop_servers()  # servers earlier test files in this process left (mini-swe-agent trials start them)
    yield
    warm.stop_servers()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _gone_within(pids: list[int], seconds: float = 30.0) -> list[int]:
    """The pids still alive after waiting up to ``seconds`` for them to die."""
    deadline = time.monotonic() + seconds
    while (alive := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def _script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {"PATH": os.environ["PATH"], "HOME": str(tmp_path / "home"), **extra}


def _read_pids(path: Path, count: int, timeout_s: float = 60.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines = path.read_text().split() if path.exists() else []
        if len(lines) >= count:
            return [int(x) for x in lines[:count]]
        time.sleep(0.05)
    raise AssertionError(f"{path} never listed {count} pids")


# --------------------------------------------------------------------------- the process mechanics


_SPAWNER = """
    import os, subprocess, sys, time
    out = sys.argv[1]
    group = subprocess.Popen(["sleep", "300"])
    # `setsid` as a program: a new session, out of the trial's process group
    escaped = subprocess.Popen(["setsid", "sleep", "300"])
    time.sleep(0.2)
    with open(out + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {group.pid} {escaped.pid}\\n")
    os.rename(out + ".tmp", out)
    print("spawned", flush=True)
    time.sleep(300)
"""

# A trial that starts a child and writes both pids to the file named by its argument, then sleeps.
_SLEEPER = """
    import os, subprocess, sys, time
    child = subprocess.Popen(["sleep", "300"])
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {child.pid}\\n")
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(300)
"""


@pytest.mark.heavy
def test_timeout_kills_the_forked_trial_and_all_its_descendants(tmp_path: Path) -> None:
    script = _script(tmp_path, "spawner.py", _SPAWNER)
    pids_file = tmp_path / "pids"
    log = tmp_path / "harness.log"
    res = run_on_host(Launch([PY, str(script), str(pids_file)], _env(tmp_path), warm=("json",)), 15.0, log, tmp_path)
    assert res.timed_out, res
    assert res.exit_code is not None and res.exit_code < 0  # killed by a signal, reported by the server
    trial, group, escaped = _read_pids(pids_file, 3)
    assert trial not in (os.getpid(), os.getppid())
    assert "spawned" in log.read_text()
    assert _gone_within([trial, group, escaped]) == []
    [server] = warm._servers.values()
    assert server.proc.poll() is None  # the server outlives its trial, ready for the next


def test_a_forked_trial_dies_with_its_connection(tmp_path: Path) -> None:
    script = _script(tmp_path, "sleeper.py", _SLEEPER)
    pids_file = tmp_path / "pids"
    env = _env(tmp_path)
    server = warm.server_for(PY, ("json",), env, tmp_path, RUN_MARKER, wait_s=60.0)
    assert server is not None
    with open(tmp_path / "log", "ab") as out:
        proc = server.spawn([PY, str(script), str(pids_file)], env, tmp_path, out.fileno())
    trial, child = _read_pids(pids_file, 2)
    assert proc.pid == trial
    proc.close()  # what a dead client leaves: the server kills the trial's group
    assert _gone_within([trial, child]) == []


def test_a_server_killed_under_a_trial_is_legorls_failure_and_takes_the_trial(tmp_path: Path) -> None:
    script = _script(tmp_path, "sleeper.py", _SLEEPER)
    pids_file = tmp_path / "pids"
    failed: list[BaseException] = []

    def trial() -> None:
        try:
            run_on_host(Launch([PY, str(script), str(pids_file)], _env(tmp_path), warm=("json",)), 300.0,
                        tmp_path / "log", tmp_path)
        except BaseException as exc:
            failed.append(exc)

    worker = threading.Thread(target=trial)
    worker.start()
    pids = _read_pids(pids_file, 2)
    [server] = warm._servers.values()
    os.kill(server.proc.pid, signal.SIGKILL)
    worker.join(60)
    assert not worker.is_alive()
    # not the agent's doing: a plain exception, which the trial runner records as infrastructure
    assert len(failed) == 1 and isinstance(failed[0], warm.WarmStartError), failed
    assert _gone_within(pids) == []


def test_trial_output_status_and_environment_are_the_cold_starts(tmp_path: Path) -> None:
    script = _script(tmp_path, "probe.py", """
        import json, os, sys
        print("to stdout")
        print("to stderr", file=sys.stderr)
        info = {"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "stdin": sys.stdin.read(),
                "env": dict(os.environ), "sid_is_pid": os.getsid(0) == os.getpid(),
                "fds": sorted(int(f) for f in os.listdir("/proc/self/fd"))}
        print(json.dumps(info))
        raise SystemExit(int(sys.argv[1]))
    """)
    seen = {}
    for mode, modules in (("cold", ()), ("warm", ("json",))):
        cwd = tmp_path / mode
        cwd.mkdir()
        log = cwd / "harness.log"
        res = run_on_host(Launch([PY, str(script), "7"], _env(tmp_path, MODE=mode), warm=modules), 60.0, log, cwd)
        assert (res.exit_code, res.timed_out) == (7, False), log.read_text()
        lines = log.read_text().splitlines()
        assert "to stdout" in lines and "to stderr" in lines
        seen[mode] = json.loads(lines[-1])
        assert warm._servers if mode == "warm" else not warm._servers
    cold, hot = seen["cold"], seen["warm"]
    for info, mode in ((cold, "cold"), (hot, "warm")):
        assert info["env"].pop(RUN_MARKER) and info["env"].pop("MODE") == mode
        assert info.pop("cwd") == str(tmp_path / mode)
    # the trial's environment (with what the interpreter's start adds to it), nothing of the server's;
    # argv, sys.path[0], stdin (/dev/null), its own session, the same open descriptors
    assert hot == cold


@pytest.mark.heavy
def test_concurrent_forked_trials_share_no_state(tmp_path: Path) -> None:
    script = _script(tmp_path, "state.py", """
        import json, os, random, sys, time
        mine = os.environ["TRIAL"]
        before = getattr(json, "_claimed_by", None)  # a preloaded module: the server's copy, untouched
        json._claimed_by = mine
        time.sleep(1.5)  # both trials are alive together
        with open("state.json", "w") as f:
            json.dump({"before": before, "after": json._claimed_by, "random": random.random(),
                       "urandom": os.urandom(8).hex(), "home": os.environ["HOME"], "pid": os.getpid()}, f)
    """)
    results: dict[str, dict[str, object]] = {}
    errors: list[BaseException] = []

    def one(name: str) -> None:
        try:
            cwd = tmp_path / name
            cwd.mkdir()
            env = _env(cwd, TRIAL=name)
            res = run_on_host(Launch([PY, str(script)], env, warm=("json",)), 60.0, cwd / "log", cwd)
            assert res.exit_code == 0, (cwd / "log").read_text()
            results[name] = json.loads((cwd / "state.json").read_text())
        except BaseException as exc:
            errors.append(exc)

    one("first")  # the server is started (and warm) before the two race
    threads = [threading.Thread(target=one, args=(name,)) for name in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert [r["before"] for r in results.values()] == [None, None, None]
    assert {name: r["after"] for name, r in results.items()} == {"first": "first", "a": "a", "b": "b"}
    assert {name: r["home"] for name, r in results.items()} == {n: str(tmp_path / n / "home") for n in results}
    for key in ("random", "urandom", "pid"):
        assert len({r[key] for r in results.values()}) == 3, key  # re-seeded, separate processes


def test_the_server_dies_with_its_parent(tmp_path: Path) -> None:
    script = _script(tmp_path, "sleeper.py", _SLEEPER)
    pids_file = tmp_path / "pids"
    parent = _script(tmp_path, "parent.py", f"""
        import os, sys, threading, time
        from pathlib import Path
        from legorl.harnesses import warm
        from legorl.harnesses.processes import Launch, run_on_host
        tmp = Path({str(tmp_path)!r})
        launch = Launch([sys.executable, {str(script)!r}, {str(pids_file)!r}], {{"PATH": os.environ["PATH"]}}, ("json",))
        threading.Thread(target=run_on_host, args=(launch, 300.0, tmp / "log", tmp), daemon=True).start()
        while not warm._servers:
            time.sleep(0.05)
        [server] = warm._servers.values()
        print(server.proc.pid, server.folder, flush=True)
        time.sleep(300)
    """)
    proc = subprocess.Popen([PY, str(parent)], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        assert proc.stdout is not None
        pid, where = proc.stdout.readline().split()
        server, folder = int(pid), Path(where)
        trial, grandchild = _read_pids(pids_file, 2)
        assert all(_alive(p) for p in (server, trial, grandchild))
        proc.kill()  # no cleanup runs in the parent
        proc.wait(30)
        assert _gone_within([server, trial, grandchild]) == []
        assert not folder.exists()  # the server removed its own folder
    finally:
        proc.kill()
        proc.wait(30)


def test_the_server_takes_requests_from_its_parent_only(tmp_path: Path) -> None:
    script = _script(tmp_path, "hello.py", "open('ran', 'w').write('yes')\n")
    res = run_on_host(Launch([PY, str(script)], _env(tmp_path), warm=("json",)), 60.0, tmp_path / "log", tmp_path)
    assert res.exit_code == 0 and (tmp_path / "ran").exists()
    (tmp_path / "ran").unlink()
    [server] = warm._servers.values()
    assert (server.folder.stat().st_mode & 0o777) == 0o700
    stranger = textwrap.dedent(f"""
        import json, os, socket, struct
        body = json.dumps({{"argv": [{PY!r}, {str(script)!r}], "env": {{}}, "cwd": {str(tmp_path)!r}}}).encode()
        conn = socket.socket(socket.AF_UNIX)
        conn.connect({str(server.socket_path)!r})
        fd = os.open(os.devnull, os.O_WRONLY)
        try:
            socket.send_fds(conn, [struct.pack(">I", len(body)) + body], [fd])
        except OSError as exc:  # refused before the request was read
            print("refused", type(exc).__name__)
        print(conn.makefile().readline().strip())
    """)
    out = subprocess.run([PY, "-c", stranger], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "from process" in out.stdout or "refused" in out.stdout, out.stdout
    assert '"pid"' not in out.stdout
    time.sleep(0.5)
    assert not (tmp_path / "ran").exists()
    assert server.proc.poll() is None  # still serving its parent
    res = run_on_host(Launch([PY, str(script)], _env(tmp_path), warm=("json",)), 60.0, tmp_path / "log", tmp_path)
    assert res.exit_code == 0 and (tmp_path / "ran").exists()


@pytest.mark.parametrize("stop", ["at exit", "stage stopped"])
def test_what_the_server_forked_dies_when_it_stops(stop: str, tmp_path: Path) -> None:
    """A process the trial forks without exec'ing and moves to its own session carries the server's
    environment, not the trial's marker: it goes when the server stops (the documented gap)."""
    script = _script(tmp_path, "daemon.py", """
        import os, sys, time
        if os.fork() == 0:
            os.setsid()
            with open(sys.argv[1] + ".tmp", "w") as f:
                f.write(f"{os.getpid()}\\n")
            os.rename(sys.argv[1] + ".tmp", sys.argv[1])
            time.sleep(300)
            os._exit(0)
        while not os.path.exists(sys.argv[1]):  # out of our group before we end (our group is killed then)
            time.sleep(0.05)
    """)
    pids_file = tmp_path / "pids"
    res = run_on_host(Launch([PY, str(script), str(pids_file)], _env(tmp_path), warm=("json",)), 60.0,
                      tmp_path / "log", tmp_path)
    assert res.exit_code == 0
    [daemon] = _read_pids(pids_file, 1)
    assert _alive(daemon)
    if stop == "at exit":
        warm.stop_servers()  # legorl's atexit: each server stops itself, killing what carries its marker
    else:
        kill_host_processes()  # what a stopped stage does: every host harness and every warm server
    assert _gone_within([daemon]) == []
    assert not warm._servers


@pytest.mark.heavy
def test_a_server_that_cannot_start_leaves_trials_cold(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "threaded.py").write_text("import threading, time\nthreading.Thread(target=time.sleep, args=(60,), "
                                          "daemon=True).start()\n")
    (tmp_path / "hangs.py").write_text("import time\ntime.sleep(300)\n")
    monkeypatch.setattr(warm, "START_LIMIT_S", 3.0)  # a server still importing after it is taken as hung
    script = _script(tmp_path, "hello.py", "import os; print('hello', os.getppid())\n")
    env = _env(tmp_path, PYTHONPATH=str(tmp_path))  # outside the trial folder: the server gets it as it is
    trial = tmp_path / "trial"
    trial.mkdir()
    for module, reason in (("no_such_module_for_legorl", "ModuleNotFoundError"), ("threaded", "threads after"),
                           ("hangs", "not ready within 3 s")):
        caplog.clear()
        log = tmp_path / f"{module}.log"
        with caplog.at_level(logging.WARNING, logger="legorl.harnesses"):
            res = run_on_host(Launch([PY, str(script)], env, warm=(module,)), 60.0, log, trial)
        assert res.exit_code == 0 and "hello" in log.read_text()
        assert f"hello {os.getpid()}" in log.read_text()  # started cold, by this process
        assert reason in caplog.text and "start cold" in caplog.text
        caplog.clear()  # the failure is remembered: no second attempt, no second warning
        with caplog.at_level(logging.WARNING, logger="legorl.harnesses"):
            assert run_on_host(Launch([PY, str(script)], env, warm=(module,)), 60.0, log, trial).exit_code == 0
        assert caplog.text == ""
    assert not warm._servers  # each was stopped (the hung one killed)


def test_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    assert warm.enabled()
    for off in ("0", "false", "off"):
        monkeypatch.setenv(warm.SWITCH, off)
        assert not warm.enabled()


# --------------------------------------------------------------------------- a real mini-swe-agent trial


def _rollout(model: Path, run: Path, step: int, samples: int, first_calls: list[float]) -> list[TrialRow]:
    """One rollout step of mini-swe-agent fixing the task; the wall-clock time of each trial's first call."""
    solve = scripted(solving_script("mini-swe-agent", shards.read_rows(run / "tasks", Kind.TASKS)[0]))

    def complete(call: object) -> str:
        if str(getattr(call, "prompt_text", "")).count("<|im_start|>assistant") == 1:
            first_calls.append(time.time())
        return solve(call)

    engine = ScriptedEngine(str(model), complete, max_context=32768)
    cfg = RolloutConfig(run=run, harnesses=["mini-swe-agent"], timeout_s=240.0, max_turns=4, retries=0, step=step,
                        samples=samples, concurrency=samples)
    with InProcessProxy(engine, str(model)) as proxy:
        rollout_stage(cfg, proxy)
    return sorted((r for r in shards.read_rows(run / "rollouts", Kind.ROLLOUTS) if r.step == step),
                  key=lambda r: r.trial_id)


@pytest.mark.podman
@pytest.mark.harness
@pytest.mark.slow
def test_a_real_mini_swe_agent_trial_warm_matches_cold_and_starts_sooner(
        tiny_model: Path, base_image: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / f"run-{uuid.uuid4().hex[:12]}"
    import_one(run, tmp_path)
    logs = RunDir.at(run).rollout_logs

    def launched() -> set[str]:
        return set(os.listdir(logs)) if logs.exists() else set()

    def one_step(step: int, samples: int) -> tuple[list[TrialRow], float]:
        """The step's rows and its slowest start → first model call, seconds."""
        before, calls = launched(), []
        rows = _rollout(tiny_model, run, step, samples, calls)
        starts = [(logs / name / "command.txt").stat().st_mtime for name in launched() - before]
        assert len(starts) == samples and len(calls) == samples
        return rows, max(calls) - min(starts)

    monkeypatch.setenv(warm.SWITCH, "0")
    [cold], cold_s = one_step(0, 1)
    assert not warm._servers  # the switch: started cold
    monkeypatch.delenv(warm.SWITCH)
    [first], _ = one_step(1, 1)  # starts the server (its imports are this trial's time, as a cold start's)
    [server] = warm._servers.values()
    pair, warm_s = one_step(2, 2)  # two concurrent trials forked from it
    print(f"\nstart -> first model call: cold {cold_s:.1f} s, warm {warm_s:.1f} s (2 concurrent trials)")
    assert warm_s < cold_s
    assert server.proc.poll() is None and list(warm._servers.values()) == [server]

    for row in [cold, first, *pair]:
        detail = f"{row.trial_id}: {row.outcome} {row.error}"
        assert row.outcome == Outcome.SUBMITTED and not row.infra_failure, detail
        assert row.patch == cold.patch and row.exit_code == cold.exit_code == 0, detail
        assert len(row.calls) == len(cold.calls) and row.segments, detail
    # each concurrent trial has its own session, trial folder and mini-swe-agent outputs
    assert len({r.trial_id for r in pair}) == 2
    folders = sorted(launched())
    assert len(folders) == 4
    for name in folders:
        files = {p.name for p in (logs / name).iterdir()}
        assert {"mini-swe-agent.json", "result.json", "trajectory.json", "command.txt", "harness.log"} <= files
        result = json.loads((logs / name / "result.json").read_text())
        assert result["exit_status"] == "Submitted" and result["n_calls"] == len(cold.calls)
        config = json.loads((logs / name / "mini-swe-agent.json").read_text())
        assert (logs / name / "command.txt").read_text().split()[-1] == str(logs / name / "mini-swe-agent.json")
        assert config["api_base"].endswith("/v1") and config["container"]
    bases = {json.loads((logs / n / "mini-swe-agent.json").read_text())["api_base"] for n in folders}
    assert len(bases) == 4  # one session URL per trial
