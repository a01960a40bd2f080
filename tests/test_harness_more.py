"""Qwen Code, Pi and Aider as harnesses: their installs, configs and end states, and a scripted fix
through each harness's own tools (or edit format) and the real proxy, graded by the real grader.

The end-state samples are what the pinned versions printed against a stub server that refused the
prompt as too long (400) or failed (500), and against the tiny model through the proxy. The tiny
model's own trials (sampled tokens in the row) are ``tests/test_harness_e2e.py``'s, per recipe.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rollout_support import fix_command, import_one, local_task, scripted, tool_call, write_tasks

from legorl.core import shards
from legorl.core.errors import LegorlError
from legorl.core.schemas import Kind, Outcome
from legorl.harnesses import HARNESSES, REAL, qwen_code
from legorl.harnesses import aider as aider_mod
from legorl.harnesses import pi as pi_mod
from legorl.harnesses.base import End, TrialPaths, TrialSpec
from legorl.harnesses.install import NODE_RUNTIME, RECIPES, Installation, find_python, installed, node_cli
from legorl.harnesses.processes import ProcResult

NEW = ("qwen-code", "pi", "aider")
URL = "http://127.0.0.1:4180/sess/trial-1/v1"


def _spec(**kw: object) -> TrialSpec:
    base: dict[str, object] = {"trial_id": "t1", "problem_statement": "-fix `add`", "model": "policy",
                               "openai_base_url": URL, "anthropic_base_url": URL[:-3], "max_turns": 7}
    return TrialSpec(**(base | kw))  # type: ignore[arg-type]


def _proc(exit_code: int | None = 0, timed_out: bool = False, log: str = "") -> ProcResult:
    return ProcResult(exit_code, timed_out, 1.0, log)


class _Box:
    """The sandbox as launch sees it: commands are recorded, not run."""

    def __init__(self) -> None:
        self.commands: list[list[str]] = []

    def exec(self, argv: list[str], timeout: float | None = None, workdir: str | None = None,
             env: dict[str, str] | None = None) -> None:
        self.commands.append(argv)


def _node_install(name: str) -> Installation:
    return Installation(name, RECIPES[name].version, "/inst", "npm", [], binary="/inst/node", extra={"entry": "/inst/cli.js"})


# --------------------------------------------------------------------------- registry and installs


def test_registered_pinned_and_in_all() -> None:
    for name in NEW:
        assert name in HARNESSES and HARNESSES[name] in REAL
        assert HARNESSES[name].in_container  # they edit and run in the repo themselves
        r = RECIPES[name]
        assert any(p.endswith(("@" + r.version, "==" + r.version)) for p in r.packages)
    node, version, path = NODE_RUNTIME
    for name in ("qwen-code", "pi"):  # JavaScript CLIs: run by the pinned Node, never the host's
        r = RECIPES[name]
        assert f"{node}@{version}" in r.packages and (r.native_package, r.native_path) == (node, path)
        assert r.entry_package and r.entry_path


def test_node_cli_recipe() -> None:
    r = node_cli("x", "@scope/x-cli", "1.2.3", "dist/cli.js")
    assert r.kind == "npm" and r.packages[0] == "@scope/x-cli@1.2.3"
    assert (r.entry_package, r.entry_path) == ("@scope/x-cli", "dist/cli.js")


def test_find_python_below() -> None:
    exe = find_python((3, 10), below=(3, 13))
    assert exe
    with pytest.raises(LegorlError, match=r"< 3\.10"):
        find_python((3, 9), below=(3, 10), explicit=exe)


@pytest.mark.harness
@pytest.mark.parametrize("name", NEW)
def test_installed_runs_here(name: str) -> None:
    from legorl.harnesses.install import check

    inst = installed(name)
    if inst is None:
        pytest.skip(f"{name} is not installed (legorl harness install {name})")
    ok, detail = check(inst, timeout=120)
    assert ok, detail
    if inst.kind == "npm":
        assert detail == inst.version  # the CLI's own --version, run by the pinned Node
        assert Path(inst.extra["entry"]).is_file() and Path(inst.root) in Path(inst.binary or "").parents
    assert all(p.startswith(inst.root) or p == inst.base_prefix for p, _, _ in inst.mounts())


# --------------------------------------------------------------------------- launch


def test_qwen_code_launch(tmp_path: Path) -> None:
    h = qwen_code.QwenCode(_node_install("qwen-code"))
    paths = TrialPaths(tmp_path, "/legorl")
    launch = h.launch(_spec(temperature=0.5, context_tokens=4096), paths, _Box())  # type: ignore[arg-type]
    argv = launch.argv
    assert argv[:2] == ["/inst/node", "/inst/cli.js"]
    assert argv[argv.index("--openai-base-url") + 1] == URL and argv[argv.index("--max-session-turns") + 1] == "7"
    assert argv[-1] == "--prompt=-fix `add`"  # one argument, though it starts with '-'
    settings = json.loads((tmp_path / qwen_code.SETTINGS).read_text())
    assert launch.env["QWEN_CODE_SYSTEM_SETTINGS_PATH"] == f"/legorl/{qwen_code.SETTINGS}"  # over any repo's settings
    assert settings["general"]["enableAutoUpdate"] is False and settings["telemetry"]["enabled"] is False
    assert settings["privacy"]["usageStatisticsEnabled"] is False
    assert settings["model"]["generationConfig"] == {"timeout": 600_000, "maxRetries": 0, "contextWindowSize": 4096,
                                                     "samplingParams": {"temperature": 0.5}}
    assert launch.env["HOME"] == "/legorl/home" and "PATH" not in launch.env


def test_pi_launch(tmp_path: Path) -> None:
    h = pi_mod.Pi(_node_install("pi"))
    launch = h.launch(_spec(), TrialPaths(tmp_path, "/legorl"), _Box())  # type: ignore[arg-type]
    assert launch.argv[:2] == ["/inst/node", "/inst/cli.js"]
    assert launch.argv[-2:] == ["--", "-fix `add`"]
    assert {"--print", "--no-session", "--offline", "--no-approve", "--no-context-files"} <= set(launch.argv)
    assert launch.env["PI_CODING_AGENT_DIR"] == "/legorl/pi-agent" and launch.env["PI_TELEMETRY"] == "0"
    provider = json.loads((tmp_path / "pi-agent" / "models.json").read_text())["providers"][pi_mod.PROVIDER]
    assert provider["baseUrl"] == URL and provider["api"] == "openai-completions"
    assert provider["models"][0]["id"] == "policy"
    settings = json.loads((tmp_path / "pi-agent" / "settings.json").read_text())
    assert settings["retry"] == {"enabled": False} and settings["enableInstallTelemetry"] is False


def test_aider_launch(tmp_path: Path) -> None:
    inst = Installation("aider", RECIPES["aider"].version, "/inst", "venv", [], python="/inst/venv/bin/python",
                        base_prefix="/py")
    box = _Box()
    launch = aider_mod.Aider(inst).launch(_spec(temperature=0.0), TrialPaths(tmp_path, "/legorl"), box)  # type: ignore[arg-type]
    argv = launch.argv
    assert argv[:3] == ["/inst/venv/bin/python", "-m", "aider"]
    assert argv[argv.index("--openai-api-base") + 1] == URL and argv[argv.index("--model") + 1] == "openai/policy"
    assert argv[-2:] == ["--message", "-fix `add`"]
    assert {"--no-auto-commits", "--no-gitignore", "--analytics-disable", "--no-check-update", "--yes-always"} <= set(argv)
    for flag in ("--chat-history-file", "--input-history-file", "--llm-history-file", "--analytics-log"):
        assert argv[argv.index(flag) + 1].startswith("/legorl/")  # never into the repository
    meta = json.loads((tmp_path / "aider-model.json").read_text())["openai/policy"]
    assert meta["max_input_tokens"] == aider_mod.Aider.context_tokens
    assert json.loads((tmp_path / "aider-settings.json").read_text())[0]["use_temperature"] == 0.0
    assert box.commands and ".aider*" in box.commands[0][-1]  # its caches stay out of the patch


# --------------------------------------------------------------------------- end states

_QWEN_INIT = {"type": "system", "subtype": "init"}


@pytest.mark.parametrize(("events", "proc", "want"), [
    ([_QWEN_INIT, {"type": "result", "subtype": "success", "is_error": False, "result": "Done."}], _proc(0), End.FINISHED),
    ([_QWEN_INIT, {"type": "result", "subtype": "error_during_execution", "is_error": True, "error": {
        "message": "[API Error: 400 This model's maximum context length is 32768 tokens. However, your messages "
                   "resulted in 40000 tokens.]"}}], _proc(1), End.CONTEXT_OVERFLOW),
    ([_QWEN_INIT, {"type": "result", "subtype": "error_during_execution", "is_error": True,
                   "error": {"message": "[API Error: 500 engine failed]"}}], _proc(1), End.API_ERROR),
    ([_QWEN_INIT, {"type": "result", "is_error": True, "error": {"message": "Tool registry exploded"}}], _proc(1),
     End.CRASHED),
    # its turn limit (FatalTurnLimitedError) and run budget (FatalBudgetExceededError) exit with no result event
    ([_QWEN_INIT], _proc(53, log="Reached max session turns for this session."), End.MAX_TURNS),
    ([_QWEN_INIT], _proc(55), End.TIME_LIMIT),
    ([_QWEN_INIT], _proc(1, log="TypeError: boom"), End.CRASHED),
    ([], _proc(None, timed_out=True), End.UNKNOWN),
])
def test_qwen_code_end_states(events: list[dict[str, object]], proc: ProcResult, want: End) -> None:
    assert qwen_code.end_of(events, proc)[0] is want


def _pi_end(stop: str, error: str | None = None) -> list[dict[str, object]]:
    reply: dict[str, object] = {"role": "assistant", "content": [{"type": "text", "text": "ok"}], "stopReason": stop}
    if error:
        reply["errorMessage"] = error
    return [{"type": "agent_start"}, {"type": "agent_end", "messages": [{"role": "user", "content": "x"}, reply]},
            {"type": "agent_settled", "aborted": False}]


@pytest.mark.parametrize(("events", "proc", "want"), [
    (_pi_end("stop"), _proc(0), End.FINISHED),
    (_pi_end("length"), _proc(0), End.FINISHED),  # a reply cut at the cap ends its run like any text reply
    (_pi_end("error", '400: {"message":"This model\'s maximum context length is 32768 tokens."}'), _proc(0),
     End.CONTEXT_OVERFLOW),
    (_pi_end("error", '500: {"message":"engine failed"}'), _proc(0), End.API_ERROR),
    (_pi_end("aborted"), _proc(0), End.CRASHED),
    (_pi_end("stop"), _proc(1, log="Error: out of memory"), End.CRASHED),
    ([{"type": "agent_start"}], _proc(1), End.CRASHED),
    ([{"type": "agent_end", "messages": "garbled"}], _proc(None, timed_out=True), End.UNKNOWN),
])
def test_pi_end_states(events: list[dict[str, object]], proc: ProcResult, want: End) -> None:
    assert pi_mod.end_of(events, proc)[0] is want


_AIDER_EXIT = [{"event": "launched"}, {"event": "message_send_starting"},
               {"event": "exit", "properties": {"reason": "Completed --message"}}]
_LIMIT = "\nModel openai/policy has hit a token limit!\nInput tokens: ~549 of 32,768\nOutput tokens: ~{} of 4,096\n"


@pytest.mark.parametrize(("events", "output", "proc", "want"), [
    (_AIDER_EXIT, "Applied edit to calc.py\n", _proc(0), End.FINISHED),
    (_AIDER_EXIT, _LIMIT.format(9), _proc(0), End.GAVE_UP),  # the reply hit the per-call output cap
    (_AIDER_EXIT, "Tokens: 726 sent, 0 received.\n" + _LIMIT.format(0), _proc(0), End.CONTEXT_OVERFLOW),
    (_AIDER_EXIT, "litellm.BadRequestError: OpenAIException - engine failed\n", _proc(0), End.API_ERROR),
    (_AIDER_EXIT, "litellm.APIConnectionError: Connection error.\nRetrying in 0.2 seconds...\n", _proc(0),
     End.API_ERROR),
    (_AIDER_EXIT, "litellm.ContextWindowExceededError: too long\n", _proc(0), End.CONTEXT_OVERFLOW),
    ([*_AIDER_EXIT[:2], {"event": "message_send_exception", "properties": {"exception": "KeyError: 'x'"}},
      _AIDER_EXIT[2]], "", _proc(0), End.CRASHED),
    (_AIDER_EXIT[:2], "Traceback (most recent call last):\n", _proc(1), End.CRASHED),  # died before its exit event
    (_AIDER_EXIT[:2], "", _proc(None, timed_out=True), End.UNKNOWN),
])
def test_aider_end_states(events: list[dict[str, object]], output: str, proc: ProcResult, want: End) -> None:
    assert aider_mod.end_of(events, output, proc)[0] is want


def test_unreadable_outputs_are_the_harness_crash(tmp_path: Path) -> None:
    (tmp_path / "harness.log").symlink_to("/etc/passwd")  # planted by the agent: never followed
    (tmp_path / aider_mod.EVENTS).write_text("{garbled")
    paths, proc = TrialPaths(tmp_path, str(tmp_path)), _proc(1, log="boom")
    for cls in (qwen_code.QwenCode, pi_mod.Pi, aider_mod.Aider):
        assert cls().read_end(paths, proc)[0] is End.CRASHED


# --------------------------------------------------------------------------- a scripted fix through the proxy


def _whole_file_reply() -> str:
    """Aider's default (``whole``) edit format for an unknown model: the file's path, then all of it."""
    from rollout_support import _BUGGY

    return "calc.py\n```python\n" + _BUGGY.replace("return a - b", "return a + b", 1) + "```\n"


@pytest.mark.podman
@pytest.mark.harness
@pytest.mark.slow
@pytest.mark.parametrize("name", NEW)
def test_scripted_fix_through_the_proxy_grades_to_one(name: str, tiny_model: Path, base_image: str,
                                                       tmp_path: Path) -> None:
    from legorl.engines.scripted import ScriptedEngine
    from legorl.proxy.clients import InProcessProxy
    from legorl.stages.grade import grade_stage, rollout_jobs
    from legorl.stages.rollout import RolloutConfig, rollout_stage

    if installed(name) is None:
        pytest.skip(f"{name} is not installed (legorl harness install {name})")
    run = tmp_path / "run"
    if name == "aider":  # no tools: the policy writes the fixed file in aider's edit format
        write_tasks(run, [local_task(tmp_path)])
        complete = scripted([], aux=_whole_file_reply())
    else:
        task = import_one(run, tmp_path)
        shell = {"qwen-code": "run_shell_command", "pi": "bash"}[name]
        complete = scripted([tool_call(shell, {"command": fix_command(task)}), "Fixed."])
    engine = ScriptedEngine(str(tiny_model), complete, max_context=65536)
    with InProcessProxy(engine, str(tiny_model)) as proxy:
        cfg = RolloutConfig(run=run, harnesses=[name], timeout_s=300.0, max_turns=4, retries=0)
        rollout_stage(cfg, proxy)
    [row] = shards.read_rows(run / "rollouts", Kind.ROLLOUTS)
    assert row.outcome == Outcome.SUBMITTED, (row.outcome, row.error)
    assert row.patch and row.calls and row.segments
    assert ".aider" not in row.patch  # the harness's own caches are not the agent's work
    jobs, _ = rollout_jobs(run / "rollouts")
    assert [g.reward for g in grade_stage(run / "tasks", run / "grades", jobs).rows] == [1.0]
