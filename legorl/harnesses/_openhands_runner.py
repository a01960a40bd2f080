"""Run the OpenHands software-agent SDK's default agent for one trial, inside the trial container.

Executed by the OpenHands venv's Python 3.12 (bind-mounted read-only into the container), not by
legorl. Usage: ``python _openhands_runner.py CONFIG.json``. The agent is the SDK's default preset
(terminal, file editor, task tracker, finish, think), with the ``subprocess`` terminal because task
images have no tmux. Writes ``result.json`` (execution status, whether ``finish`` was called, the
last conversation error) next to the config.

This file must not import legorl.
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
    result: dict[str, Any] = {"status": None, "finish_called": False, "error_code": None, "message": None}
    code = 0
    conversation = None
    try:
        from openhands.sdk import LLM, Conversation
        from openhands.sdk.tool import Tool
        from openhands.tools.preset.default import get_default_agent
        from openhands.tools.terminal import TerminalTool

        llm_kwargs: dict[str, Any] = {}
        if cfg.get("temperature") is not None:
            llm_kwargs["temperature"] = cfg["temperature"]
        llm = LLM(
            model=f"openai/{cfg['model']}", base_url=cfg["api_base"], api_key="legorl",
            num_retries=0, usage_id="agent", timeout=cfg.get("request_timeout", 600), **llm_kwargs,
        )
        agent = get_default_agent(llm, cli_mode=True)
        tools = [
            Tool(name=TerminalTool.name, params={"terminal_type": "subprocess"}) if t.name == TerminalTool.name else t
            for t in agent.tools
        ]
        agent = agent.model_copy(update={"tools": tools})
        conversation = Conversation(
            agent=agent, workspace=cfg["workdir"], persistence_dir=str(out_dir / "openhands-state"),
            max_iteration_per_run=cfg["max_turns"], visualizer=None, delete_on_close=False,
        )
        conversation.send_message(cfg["task"])
        try:
            conversation.run()
        except Exception as exc:  # the conversation records the error as an event; keep going
            result["exception"] = f"{type(exc).__name__}: {exc}"[:2000]
    except Exception as exc:
        result["exception"] = f"{type(exc).__name__}: {exc}"[:2000]
        traceback.print_exc()
        code = 1
    if conversation is not None:
        state = conversation.state
        result["status"] = str(getattr(state.execution_status, "value", state.execution_status))
        for event in state.events:
            kind = type(event).__name__
            if kind == "ActionEvent" and getattr(event, "tool_name", None) == "finish":
                result["finish_called"] = True
            if kind == "ConversationErrorEvent":
                result["error_code"] = getattr(event, "code", None)
                result["message"] = str(getattr(event, "detail", ""))[:2000]
    (out_dir / "result.json").write_text(json.dumps(result, indent=2))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
