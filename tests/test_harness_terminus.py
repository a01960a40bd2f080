"""Terminus-2 (Harbor's reference agent): how its ends map to outcomes, its install's own tmux, and
real trials in the trial container — a scripted policy that fixes the task and confirms completion,
one that exits its shell, and a container where tmux cannot run.

The end-to-end trial against the tiny model is ``tests/test_harness_e2e.py -k terminus-2``.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
from rollout_support import import_one

from legorl.core import shards
from legorl.core.errors import LegorlError
from legorl.core.schemas import Kind, Outcome, TaskRow, TrialRow
from legorl.engines.scripted import ScriptedEngine
from legorl.harnesses import HARNESSES, parse_names
from legorl.harnesses.base import (
    End,
    HarnessRun,
    Launch,
    ProcResult,
    ProxyView,
    TrialPaths,
    TrialSpec,
    classify,
)
from legorl.harnesses.install import RECIPES, Installation, installed
from legorl.harnesses.terminus import RUNNER, Terminus2
from legorl.proxy.clients import InProcessProxy
from legorl.sandbox.base import Sandbox
from legorl.stages.rollout import RolloutConfig, rollout_stage

NAME = "terminus-2"


def _runner() -> ModuleType:
    """The runner script as a module (it imports harbor only inside its functions)."""
    spec = importlib.util.spec_from_file_location("_terminus_runner", RUNNER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _read_end(tmp_path: Path, result: dict[str, object] | None, timed_out: bool = False) -> tuple[End, str | None]:
    if result is not None:
        (tmp_path / "result.json").write_text(json.dumps(result))
    proc = ProcResult(exit_code=None if timed_out else 0, timed_out=timed_out, duration_s=1.0, log_tail="last words\n")
    return Terminus2(install=_fake_install()).read_end(TrialPaths(tmp_path, "/legorl"), proc)


def _fake_install() -> Installation:
    root = "/opt/terminus-2"
    return Installation(NAME, "0.26.0", root, "venv", ["harbor==0.26.0"], python=f"{root}/venv/bin/python",
                        base_prefix="/opt/py312", extra={"tools_path": f"{root}/debian/usr/bin"})


# --------------------------------------------------------------------------- ends and outcomes


@pytest.mark.parametrize(("end", "expected"), [
    ("task_complete", End.SUBMITTED),
    ("max_turns", End.MAX_TURNS),
    ("context_overflow", End.CONTEXT_OVERFLOW),
    ("api_error", End.API_ERROR),
    ("session_ended", End.FINISHED),
    ("error", End.CRASHED),
    ("unknown", End.CRASHED),
    ("something new", End.CRASHED),
])
def test_each_runner_end_maps_to_an_end(end: str, expected: End, tmp_path: Path) -> None:
    got, detail = _read_end(tmp_path, {"end": end, "episodes": 3, "exception": None})
    assert got is expected
    assert detail == f"{end} after 3 episodes"


def test_an_exception_is_the_detail_and_no_account_is_a_crash(tmp_path: Path) -> None:
    err = "litellm.exceptions.BadRequestError: bad thing"
    assert _read_end(tmp_path, {"end": "api_error", "episodes": 1, "exception": err}) == (End.API_ERROR, err)
    (tmp_path / "result.json").unlink()
    assert _read_end(tmp_path, None) == (End.CRASHED, "last words")
    assert _read_end(tmp_path, None, timed_out=True) == (End.UNKNOWN, "last words")
    (tmp_path / "result.json").write_text("[1, 2")  # the agent can write the trial folder
    assert _read_end(tmp_path, None)[0] is End.CRASHED


@pytest.mark.parametrize(("end", "patch", "outcome"), [
    ("task_complete", "diff", Outcome.SUBMITTED),
    ("task_complete", None, Outcome.SUBMITTED),  # an explicit submit, even of nothing
    ("session_ended", "diff", Outcome.SUBMITTED),
    ("session_ended", None, Outcome.NO_SUBMISSION),
    ("max_turns", "diff", Outcome.MAX_TURNS),
    ("context_overflow", None, Outcome.CONTEXT_OVERFLOW),
    ("api_error", None, Outcome.HARNESS_CRASH),  # a claim the proxy did not record
    ("error", None, Outcome.HARNESS_CRASH),
])
def test_outcome_of_each_end(end: str, patch: str | None, outcome: Outcome, tmp_path: Path) -> None:
    got, detail = _read_end(tmp_path, {"end": end, "episodes": 2, "exception": None})
    run = HarnessRun(got, detail, 0, False, 1.0, tmp_path / "harness.log")
    assert classify(run, ProxyView(calls=2), True, patch)[0] is outcome


def _trajectory(path: Path, *agent_steps: dict[str, object]) -> Path:
    steps = [{"step_id": 1, "source": "user", "message": "task"}]
    steps += [{"step_id": i + 2, "source": "agent", **s} for i, s in enumerate(agent_steps)]
    path.write_text(json.dumps({"schema_version": "ATIF-v1.5", "steps": steps}))
    return path


def _step(marked: bool, observation: str) -> dict[str, object]:
    calls = [{"tool_call_id": "c", "function_name": "mark_task_complete", "arguments": {}}] if marked else []
    return {"tool_calls": calls or None, "observation": {"results": [{"content": observation}]}}


def test_how_the_runner_tells_a_confirmed_completion_from_the_limit(tmp_path: Path) -> None:
    runner = _runner()
    ask = f"Current terminal state:\n$ \n\n{runner.CONFIRM_QUESTION} This will trigger ..."
    confirmed = _trajectory(tmp_path / "a.json", _step(False, "$ ls"), _step(True, ask), _step(True, "$ "))
    first_mark_at_limit = _trajectory(tmp_path / "b.json", _step(False, "$ ls"), _step(True, ask))
    no_mark = _trajectory(tmp_path / "c.json", _step(False, "$ ls"))
    assert runner.how_it_ended(confirmed, 3, 3, True) == "task_complete"
    assert runner.how_it_ended(first_mark_at_limit, 2, 2, True) == "max_turns"
    assert runner.how_it_ended(no_mark, 1, 5, False) == "session_ended"
    assert runner.how_it_ended(no_mark, 5, 5, False) == "max_turns"
    assert runner.how_it_ended(tmp_path / "missing.json", 0, 5, True) == "unknown"


def test_which_exceptions_are_api_errors() -> None:
    runner = _runner()

    def made(module: str, name: str, base: type[Exception] = Exception) -> Exception:
        return type(name, (base,), {"__module__": module})("x")

    context = made("harbor.llms.base", "ContextLengthExceededError")
    assert runner.error_kind(context) == "context_overflow"
    assert runner.error_kind(made("x", "Sub", type(context))) == "context_overflow"
    assert runner.error_kind(made("litellm.exceptions", "BadRequestError")) == "api_error"
    assert runner.error_kind(made("openai", "APIConnectionError")) == "api_error"
    assert runner.error_kind(RuntimeError("Failed to start tmux session")) == "error"


def test_launch_points_terminus_at_its_session_and_its_tmux(tmp_path: Path) -> None:
    harness = Terminus2(install=_fake_install())
    paths = harness.paths(tmp_path)
    trial = TrialSpec("t1", "Fix it", "policy", "http://127.0.0.1:4180/sess/s1/v1", "http://127.0.0.1:4180/sess/s1",
                      max_turns=7, temperature=0.5, context_tokens=4096)
    launch = harness.launch(trial, paths, sandbox=None)  # type: ignore[arg-type]  # not used by launch
    assert launch.argv == ["/opt/terminus-2/venv/bin/python", "/legorl/_terminus_runner.py", "/legorl/terminus.json"]
    assert (tmp_path / RUNNER.name).read_text() == RUNNER.read_text()
    cfg = json.loads((tmp_path / "terminus.json").read_text())
    assert cfg == {"api_base": trial.openai_base_url, "model": "policy", "temperature": 0.5, "task": "Fix it",
                   "max_turns": 7, "workdir": "/testbed", "context_tokens": 4096,
                   "tools_path": "/opt/terminus-2/debian/usr/bin"}
    assert launch.env["HOME"] == "/legorl/home" and "PATH" not in launch.env  # the image's PATH stays
    assert not any(k.endswith(("_API_KEY", "_BASE_URL")) for k in launch.env)


def test_it_is_a_real_harness() -> None:
    assert NAME in RECIPES and HARNESSES[NAME] is Terminus2
    assert NAME in parse_names("all")
    assert RECIPES[NAME].debian_tools == ("tmux",)


# --------------------------------------------------------------------------- the install


def test_installing_debian_tools_needs_apt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from legorl.harnesses.install import _install_debian_tools

    monkeypatch.setenv("PATH", str(tmp_path))  # a host without apt-get
    with pytest.raises(LegorlError, match=r"needs apt-get and dpkg-deb .* tmux"):
        _install_debian_tools(RECIPES[NAME], tmp_path, tmp_path / "install.log")


@pytest.fixture
def terminus_install() -> Installation:
    """Terminus-2's installation; the test skips where it is not installed."""
    inst = installed(NAME)
    if inst is None:
        pytest.skip(f"{NAME} is not installed (legorl harness install {NAME})")
    return inst


@pytest.mark.harness
def test_the_installed_tmux_finds_its_own_libraries(terminus_install: Installation) -> None:
    tmux = Path(terminus_install.extra["tools_path"]) / "tmux"
    assert tmux.resolve().is_relative_to(terminus_install.path)  # mounted with the install
    env = {"PATH": "/usr/bin:/bin"}  # no LD_LIBRARY_PATH: the rpath finds them
    libs = subprocess.run(["ldd", str(tmux)], capture_output=True, text=True, env=env, check=True).stdout
    assert f"libevent_core-2.1.so.7 => {terminus_install.root}" in libs
    assert "libc.so.6 => /" in libs and f"libc.so.6 => {terminus_install.root}" not in libs  # the image's C library
    version = subprocess.run([str(tmux), "-V"], capture_output=True, text=True, env=env, check=True).stdout
    assert version.startswith("tmux 3.")


@pytest.mark.harness
def test_its_container_has_no_network_and_mounts_the_install_read_only(tmp_path: Path,
                                                                       terminus_install: Installation) -> None:
    from legorl.harnesses import get
    from legorl.harnesses.channel import CONTAINER_DIR, ProxyChannel
    from legorl.sandbox.podman import PodmanBackend
    from legorl.trials.lifecycle import TrialJob, TrialRunner

    run = tmp_path / "run"
    import_one(run, tmp_path)
    [task] = shards.read_rows(run / "tasks", Kind.TASKS)
    runner = TrialRunner(RolloutConfig(run=run, harnesses=[NAME]), proxy=None, create=lambda spec: None)  # type: ignore[arg-type, return-value]
    channel = ProxyChannel.create()
    try:
        spec = runner.sandbox_spec(TrialJob(task, NAME, 0), "key", get(NAME), tmp_path, channel)
        args = PodmanBackend().run_args(spec, "x")
    finally:
        channel.close()
    assert args[args.index("--network") + 1] == "none" and args.count("--network") == 1
    assert not any(a.startswith(("--net=", "--network=", "--add-host", "--dns")) or "slirp" in a for a in args)
    assert f"{channel.host_dir}:{CONTAINER_DIR}:ro,nodev,nosuid" in args
    assert args[-len(channel.command):] == list(channel.command)  # the relay is the main process
    for path in (terminus_install.root, terminus_install.base_prefix):
        assert any(a.startswith(f"{path}:{path}:ro") for a in args), path


# --------------------------------------------------------------------------- real trials


def _reply(commands: list[tuple[str, float]], complete: bool = False) -> str:
    return json.dumps({"analysis": "Looking at the repository.", "plan": "Run the commands.",
                       "commands": [{"keystrokes": k, "duration": d} for k, d in commands],
                       "task_complete": complete})


def _trial(tmp_path: Path, tiny_model: Path, replies: Callable[[TaskRow], list[str]],
           max_turns: int = 6) -> tuple[TaskRow, TrialRow, Path]:
    """One rollout of Terminus-2 on the shipped task, the policy replaying ``replies(task)``."""
    run = tmp_path / "run"
    task = import_one(run, tmp_path)
    engine = ScriptedEngine(str(tiny_model), replies(task), name="policy")
    start = time.monotonic()
    with InProcessProxy(engine, str(tiny_model)) as proxy:
        rollout_stage(RolloutConfig(run=run, harnesses=[NAME], timeout_s=300, max_turns=max_turns, max_tokens=2048,
                                    retries=0), proxy)
    [row] = shards.read_rows(run / "rollouts", Kind.ROLLOUTS)
    print(f"{NAME} trial: {row.outcome} in {time.monotonic() - start:.1f} s (agent {row.timings.agent_s} s)")
    [trial_dir] = (run / "logs" / "rollout").iterdir()
    return task, row, trial_dir


@pytest.mark.podman
@pytest.mark.harness
@pytest.mark.slow
def test_terminus_fixes_the_task_in_its_tmux_session_and_confirms(tiny_model: Path, base_image: str,
                                                                  tmp_path: Path,
                                                                  terminus_install: Installation) -> None:
    def replies(task: TaskRow) -> list[str]:
        fix = base64.b64encode((task.patch or "").encode()).decode()
        return [
            _reply([(f"cd /testbed && echo {fix} | base64 -d | git apply - && echo APPLIED-$((40+2))\n", 2.0)]),
            _reply([], complete=True),  # Terminus-2 asks to confirm ...
            _reply([], complete=True),  # ... and stops at the second
        ]

    task, row, trial_dir = _trial(tmp_path, tiny_model, replies)
    assert row.outcome == Outcome.SUBMITTED, row.error
    assert len(row.calls) == 3 and all(c.finish_reason == "stop" for c in row.calls)
    assert row.patch and all(line in row.patch for line in (task.patch or "").splitlines() if line.startswith("+"))
    # the command ran in the container's shell, and the agent saw its screen (its trajectory says so)
    steps = json.loads((trial_dir / "agent" / "trajectory.json").read_text())["steps"]
    assert "APPLIED-42" in json.dumps(steps[1]["observation"])
    assert json.loads((trial_dir / "result.json").read_text()) == {"end": "task_complete", "episodes": 3,
                                                                   "exception": None}


@pytest.mark.podman
@pytest.mark.harness
@pytest.mark.slow
def test_exiting_its_shell_ends_the_trial_without_a_submission(tiny_model: Path, base_image: str,
                                                              tmp_path: Path, terminus_install: Installation) -> None:
    _task, row, trial_dir = _trial(tmp_path, tiny_model, lambda task: [_reply([("exit\n", 1.0)])])
    assert json.loads((trial_dir / "result.json").read_text())["end"] == "session_ended"
    assert row.outcome == Outcome.NO_SUBMISSION and not row.patch, row.error
    assert len(row.calls) == 1


class _NoTmux(Terminus2):
    """Terminus-2 where its install's tmux is not on the PATH (and the base image has none)."""

    def launch(self, trial: TrialSpec, paths: TrialPaths, sandbox: Sandbox) -> Launch:
        launch = super().launch(trial, paths, sandbox)
        cfg = json.loads((paths.host / "terminus.json").read_text())
        (paths.host / "terminus.json").write_text(json.dumps({**cfg, "tools_path": "/nonexistent"}))
        return launch


@pytest.mark.podman
@pytest.mark.harness
@pytest.mark.slow
def test_a_container_without_tmux_is_a_clear_infrastructure_error(tiny_model: Path, base_image: str, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   terminus_install: Installation) -> None:
    monkeypatch.setitem(HARNESSES, NAME, _NoTmux)
    _task, row, _dir = _trial(tmp_path, tiny_model, lambda task: [_reply([])])
    assert row.outcome == Outcome.INFRA_ERROR and row.infra_failure
    assert "no tmux in this container" in (row.error or "")
    assert not row.calls
