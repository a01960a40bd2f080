"""Drive mini-swe-agent's own agent class for one trial. Runs in mini-swe-agent's venv, not legorl's.

Usage: ``python _mini_swe_agent_runner.py CONFIG.json``. The config names the trial container, the
session's base URL, the task and the limits. Every action is a ``podman exec`` into the existing
trial container (mini-swe-agent's own docker environment, told not to start or stop containers),
so the container needs no network. Writes ``result.json`` (exit status, error) and
``trajectory.json`` (mini-swe-agent's own format) next to the config.

This file must not import legorl: it is executed by another interpreter.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Any


def main(config_path: str) -> int:
    cfg = json.loads(Path(config_path).read_text())
    out_dir = Path(config_path).parent
    result: dict[str, Any] = {"exit_status": None, "exception": None, "message": None}
    try:
        from minisweagent.agents.default import DefaultAgent
        from minisweagent.config import get_config_from_spec
        from minisweagent.environments.docker import DockerEnvironment
        from minisweagent.models.litellm_model import LitellmModel

        class TrialContainer(DockerEnvironment):
            """mini-swe-agent's docker environment on a container legorl owns."""

            def _start_container(self) -> None:
                self.container_id = cfg["container"]

            def cleanup(self) -> None:
                pass

        mswea = get_config_from_spec(cfg["config"])
        env_cfg = {k: v for k, v in mswea.get("environment", {}).items() if k != "environment_class"}
        env_cfg |= {"image": "unused", "executable": cfg["podman"], "cwd": cfg["workdir"]}
        env_cfg["timeout"] = cfg.get("command_timeout", env_cfg.get("timeout", 60))
        env = TrialContainer(**env_cfg)

        model_kwargs = {"api_base": cfg["api_base"], "api_key": "legorl", **cfg.get("model_kwargs", {})}
        model_cfg = mswea.get("model", {}) | {
            "model_name": f"openai/{cfg['model']}", "model_kwargs": model_kwargs, "cost_tracking": "ignore_errors",
        }
        model = LitellmModel(**model_cfg)

        agent_cfg = mswea.get("agent", {}) | {
            "step_limit": cfg["max_turns"], "cost_limit": 0, "output_path": out_dir / "trajectory.json",
        }
        agent = DefaultAgent(model, env, **agent_cfg)
        info = agent.run(cfg["task"])
        result["exit_status"] = info.get("exit_status")
        result["message"] = (info.get("exception_str") or "")[:2000] or None
        result["submission_chars"] = len(info.get("submission") or "")
        result["n_calls"] = agent.n_calls
        code = 0
    except Exception as exc:
        result["exit_status"] = result["exit_status"] or type(exc).__name__
        result["exception"] = f"{type(exc).__module__}.{type(exc).__name__}"
        result["message"] = str(exc)[:2000]
        traceback.print_exc()
        code = 1
    (out_dir / "result.json").write_text(json.dumps(result, indent=2))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
