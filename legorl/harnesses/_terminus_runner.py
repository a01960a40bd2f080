"""Run Harbor's Terminus-2 agent for one trial, inside the trial container.

Executed by the Terminus-2 venv's Python 3.12 (bind-mounted read-only into the container), not by
legorl. Usage: ``python _terminus_runner.py CONFIG.json``. Terminus-2 is constructed through its
public constructor and driven as Harbor's own trial does (``setup``, then ``run``); the only thing
supplied here is the environment it acts on: :class:`ContainerEnvironment`, whose ``exec`` runs a
command with ``bash -c`` in this container (where the agent already is), so its tmux session is
this container's. Writes ``result.json`` next to the config: how the agent ended (``end``), the
episodes it ran, and the exception that ended it, if any.

This file must not import legorl.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

CONFIRM_QUESTION = "Are you sure you want to mark the task as complete?"  # Terminus-2's first-completion prompt
SESSION = "terminus-2"  # Terminus-2's tmux session name (its agent name)


def build_environment(workdir: str, out_dir: Path) -> Any:
    """A Harbor environment for the container the agent runs in (imported late: harbor is slow to import)."""
    from harbor.environments.base import BaseEnvironment, ExecResult
    from harbor.models.task.config import EnvironmentConfig
    from harbor.models.trial.paths import TrialPaths

    class ContainerEnvironment(BaseEnvironment):
        """This container, as a Harbor environment. The agent process and its commands share it, as
        Harbor's own in-container agents do; ``user`` is ignored (there is one user here)."""

        @staticmethod
        def type() -> str:
            return "legorl-container"

        def _validate_definition(self) -> None:
            pass

        async def start(self, force_build: bool) -> None:
            pass

        async def stop(self, delete: bool) -> None:
            pass

        async def exec(self, command: str, cwd: str | None = None, env: dict[str, str] | None = None,
                       timeout_sec: int | None = None, user: str | int | None = None) -> ExecResult:
            proc = await asyncio.create_subprocess_exec(
                "bash", "-c", command, cwd=cwd or workdir, env={**os.environ, **(env or {})},
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
            try:
                out, err = await asyncio.wait_for(proc.communicate(), timeout=timeout_sec)
            except TimeoutError:
                os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
                raise RuntimeError(f"Command timed out after {timeout_sec} seconds") from None
            return ExecResult(stdout=out.decode(errors="replace"), stderr=err.decode(errors="replace"),
                              return_code=proc.returncode if proc.returncode is not None else -1)

        async def upload_file(self, source_path: Path | str, target_path: str) -> None:
            shutil.copy(source_path, target_path)

        async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
            shutil.copytree(source_dir, target_dir, dirs_exist_ok=True)

        async def download_file(self, source_path: str, target_path: Path | str) -> None:
            shutil.copy(source_path, target_path)

        async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
            shutil.copytree(source_dir, target_dir, dirs_exist_ok=True)

    return ContainerEnvironment(environment_dir=out_dir, environment_name="legorl", session_id=SESSION,
                                trial_paths=TrialPaths(out_dir), task_env_config=EnvironmentConfig(workdir=workdir))


def make_agent_logs_dir() -> None:
    """Terminus-2 pipes its pane to ``/logs/agent`` (where Harbor mounts the trial's agent folder). Here
    the folder is the container's own: the whole terminal output, unbounded, has no business on the host
    (what the agent saw is in its trajectory, in the trial folder)."""
    with contextlib.suppress(OSError):  # without it only the pane log is missing
        Path("/logs/agent").mkdir(parents=True, exist_ok=True)


def how_it_ended(trajectory: Path, episodes: int, max_turns: int, session_alive: bool) -> str:
    """How ``run`` returned, from Terminus-2's trajectory (ATIF): a confirmed ``task_complete`` (its last
    step marks the task complete, and is not the first, unconfirmed mark), its episode limit, or its
    terminal gone (the agent exited the shell)."""
    steps = json.loads(trajectory.read_text()).get("steps", []) if trajectory.exists() else []
    agent_steps = [s for s in steps if s.get("source") == "agent"]
    if agent_steps:
        last = agent_steps[-1]
        marked = any(c.get("function_name") == "mark_task_complete" for c in last.get("tool_calls") or [])
        observed = json.dumps((last.get("observation") or {}).get("results") or [])
        if marked and CONFIRM_QUESTION not in observed:
            return "task_complete"
    if episodes >= max_turns:
        return "max_turns"
    return "unknown" if session_alive else "session_ended"


def check_tmux() -> None:
    """Terminus-2 drives a tmux session: fail before it starts (and tries to apt-get one) without it."""
    try:
        proc = subprocess.run(["tmux", "-V"], capture_output=True, text=True)
    except OSError as exc:
        raise RuntimeError(f"no tmux in this container (Terminus-2 drives a tmux session): {exc}") from None
    if proc.returncode != 0:
        raise RuntimeError(f"tmux does not run in this container: {(proc.stderr or proc.stdout).strip()[-300:]}")


def error_kind(exc: BaseException) -> str:
    """The end an exception out of Terminus-2 means: Harbor's context-length error (raised only with
    summarization off or failed), a model API error (LiteLLM's, after Terminus-2's own retries), else a crash."""
    names = {f"{c.__module__}.{c.__name__}" for c in type(exc).__mro__}
    if "harbor.llms.base.ContextLengthExceededError" in names:
        return "context_overflow"
    if type(exc).__module__.split(".")[0] in ("litellm", "openai", "httpx"):
        return "api_error"
    return "error"


async def run(cfg: dict[str, Any], out_dir: Path, result: dict[str, Any]) -> None:
    from harbor.agents.terminus_2 import Terminus2
    from harbor.models.agent.context import AgentContext

    agent_dir = out_dir / "agent"
    agent_dir.mkdir(exist_ok=True)
    make_agent_logs_dir()
    # Told the engine's context (as Harbor asks for self-hosted models), Terminus-2 summarizes its history
    # before it runs out; its stock margin (8000 free tokens) is scaled down for small contexts, where it
    # would summarize on every turn.
    context_kwargs: dict[str, Any] = {}
    if cfg.get("context_tokens"):
        tokens = int(cfg["context_tokens"])
        context_kwargs = {
            "model_info": {"max_input_tokens": tokens, "max_tokens": tokens, "litellm_provider": "openai",
                           "mode": "chat"},
            "proactive_summarization_threshold": min(8000, tokens // 4),
        }
    agent = Terminus2(
        logs_dir=agent_dir, model_name=f"openai/{cfg['model']}", api_base=cfg["api_base"],
        max_turns=cfg["max_turns"], temperature=cfg.get("temperature"), **context_kwargs,
        llm_kwargs={"api_key": "legorl", "timeout": 600},
        record_terminal_session=False,  # asciinema: not in task images, and nothing reads it
        suppress_max_turns_warning=True,
    )
    environment = build_environment(cfg["workdir"], out_dir)
    context = AgentContext()
    try:
        await agent.setup(environment)
        await agent.run(cfg["task"], environment, context)
    finally:
        result["episodes"] = int((context.metadata or {}).get("n_episodes") or 0)
    alive = await environment.exec(f"tmux has-session -t {SESSION}")
    result["end"] = how_it_ended(agent_dir / "trajectory.json", result["episodes"], cfg["max_turns"],
                                 alive.return_code == 0)


def main(config_path: str) -> int:
    cfg = json.loads(Path(config_path).read_text())
    out_dir = Path(config_path).parent
    result: dict[str, Any] = {"end": None, "episodes": 0, "exception": None}
    code = 0
    if cfg.get("tools_path"):  # the install's own tmux, before any the image has
        os.environ["PATH"] = f"{cfg['tools_path']}:{os.environ.get('PATH') or os.defpath}"
    try:
        check_tmux()
        asyncio.run(run(cfg, out_dir, result))
    except BaseException as exc:  # every end is reported, an interrupt's too
        result["end"] = error_kind(exc)
        result["exception"] = f"{type(exc).__module__}.{type(exc).__name__}: {exc}"[:2000]
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(OSError):  # the agent's shell ends with its tmux server
            subprocess.run(["tmux", "kill-server"], capture_output=True)
    (out_dir / "result.json").write_text(json.dumps(result, indent=2))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
