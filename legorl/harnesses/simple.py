"""``simple``: a minimal harness-like driver, for tiny models that cannot carry a real harness's prompt.

It speaks exactly what the real harnesses speak — OpenAI chat completions against the trial's
``/sess/<id>/v1`` with one ``bash`` tool, through the official ``openai`` client — and runs each
command in the trial's sandbox (``bash -lc`` in ``/testbed``), so the proxy captures it like any
other harness. The episode ends when the model answers without a tool call (its submission: the
working tree's diff is the patch), after ``max_turns`` model calls, or at the wall-clock limit.

Its system prompt is one sentence, so a 5–25 M-parameter model trained on this exact conversation
(:mod:`legorl.demo.sft`) can fit it in a few hundred tokens. Runs in-process (no install); the
conversation is written to ``harness.log`` in the trial folder.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from legorl.harnesses.base import LOG_NAME, BaseHarness, End, HarnessRun, TrialSpec
from legorl.sandbox.base import Sandbox

SYSTEM_PROMPT = "Fix the repository in /testbed with the bash tool, then reply DONE."
BASH_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a bash command in /testbed.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    },
}
MAX_OUTPUT_CHARS = 600


def tool_result(exit_code: int, output: str, timed_out: bool = False) -> str:
    """What the model sees after a command (the warm-up data uses the same function)."""
    output = output.strip()
    if len(output) > MAX_OUTPUT_CHARS:
        output = output[:MAX_OUTPUT_CHARS] + " [...]"
    head = "timed out" if timed_out else f"exit code {exit_code}"
    return f"{head}\n{output}" if output else head


class SimpleHarness(BaseHarness):
    """One bash tool, a one-line system prompt, a text reply ends the episode."""

    name = "simple"
    in_container = False
    needs_install = False

    max_tokens = 128  # per model call: a tiny model must not ramble for the whole context
    command_timeout_s = 30.0

    def run(self, trial: TrialSpec, sandbox: Sandbox, trial_dir: Path) -> HarnessRun:
        import openai

        log = trial_dir / LOG_NAME
        start = time.monotonic()
        client = openai.OpenAI(base_url=trial.openai_base_url, api_key="legorl", max_retries=0,
                               timeout=max(1.0, trial.timeout_s))
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": trial.problem_statement},
        ]
        end, detail = End.MAX_TURNS, f"{trial.max_turns} model calls without a final answer"
        try:
            for _ in range(trial.max_turns):
                if time.monotonic() - start > trial.timeout_s:
                    end, detail = End.TIME_LIMIT, f"wall-clock limit ({trial.timeout_s:.0f} s)"
                    break
                kwargs: dict[str, Any] = {}
                if trial.temperature is not None:
                    kwargs["temperature"] = trial.temperature
                response = client.chat.completions.create(
                    model=trial.model, messages=messages,  # type: ignore[arg-type]
                    tools=[BASH_TOOL],  # type: ignore[list-item]
                    max_tokens=self.max_tokens, **kwargs,
                )
                message = response.choices[0].message
                calls = message.tool_calls or []
                turn: dict[str, Any] = {"role": "assistant", "content": message.content or ""}
                if calls:
                    turn["tool_calls"] = [
                        {"id": c.id, "type": "function",
                         "function": {"name": c.function.name, "arguments": c.function.arguments}}
                        for c in calls if c.type == "function"
                    ]
                messages.append(turn)
                if not calls:
                    end, detail = End.FINISHED, (message.content or "")[:200]
                    break
                for call in turn["tool_calls"]:
                    messages.append({"role": "tool", "tool_call_id": call["id"],
                                     "content": self._execute(call["function"], sandbox, trial.workdir)})
        except openai.APIError as exc:
            end, detail = End.API_ERROR, f"{type(exc).__name__}: {exc}"[:500]
        finally:
            log.write_text(json.dumps(messages, indent=1, ensure_ascii=False) + "\n")
        return HarnessRun(end, detail, 0, False, time.monotonic() - start, log)

    def _execute(self, function: dict[str, str], sandbox: Sandbox, workdir: str) -> str:
        if function["name"] != "bash":
            return f"error: unknown tool {function['name']!r} (the only tool is bash)"
        try:
            args = json.loads(function["arguments"] or "{}")
            command = args["command"]
            if not isinstance(command, str):
                raise TypeError("command is not a string")
        except (ValueError, KeyError, TypeError) as exc:
            return f"error: bad arguments for bash ({type(exc).__name__}: {exc})"
        res = sandbox.exec(command, timeout=self.command_timeout_s, workdir=workdir)
        return tool_result(res.exit_code, res.output, res.timed_out)
