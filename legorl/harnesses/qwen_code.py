"""Qwen Code: the npm package's JavaScript CLI, headless (``qwen -p --output-format stream-json``), in the container.

Qwen Code (a Gemini CLI fork, the natural harness for Qwen models) speaks OpenAI chat completions
(streamed), pointed at the session's OpenAI base URL through the trial's relay on the container's
own loopback. It runs its tools in its own process, so it runs inside the sandbox.

Task images have no Node, and the host's node (if any) need not be the >= 22 that Qwen Code asks
for: the install carries a pinned official Node build from the npm registry
(:data:`legorl.harnesses.install.NODE_RUNTIME`), bind-mounted read-only with the CLI. That build
needs only glibc and libstdc++, which Debian-based task images have (apt depends on libstdc++).

Its settings are given as *system* settings (``QWEN_CODE_SYSTEM_SETTINGS_PATH``, a file in the
trial folder), which it merges over user and workspace settings, so a task repository's own
``.qwen/settings.json`` cannot turn them back: no auto-update, usage statistics, telemetry, IDE or
feedback prompts, follow-up suggestions, speculation or managed memory, and no retries in its
OpenAI client (Qwen Code itself still retries a 5xx up to 7 times, about two minutes: an engine
failure, which the proxy records). Approvals are off (``--yolo``: the container is the sandbox).
``--max-session-turns`` is its own turn limit; the proxy's budgets are the authority. The npm
tarball ships its vendored ripgrep without the exec bit, so it uses its built-in grep, as every
npm install of this version does.
"""

from __future__ import annotations

import json

from legorl.harnesses.base import (
    End,
    Launch,
    ProcessHarness,
    ProcResult,
    TrialPaths,
    TrialSpec,
    json_lines,
    no_account,
)
from legorl.sandbox.base import Sandbox

SETTINGS = "qwen-settings.json"

# Its exit codes for a fatal end with no result event (FatalTurnLimitedError, FatalBudgetExceededError).
_EXIT_ENDS = {53: End.MAX_TURNS, 55: End.TIME_LIMIT}
_CONTEXT_MARKERS = ("context length", "context window", "maximum context", "too many tokens", "context_length")
_API_MARKERS = ("api error", "status code", "connection", "econn", "fetch failed", "timed out", "timeout")


class QwenCode(ProcessHarness):
    name = "qwen-code"
    in_container = True

    def settings(self, trial: TrialSpec) -> dict[str, object]:
        generation: dict[str, object] = {"timeout": 600_000, "maxRetries": 0}
        if trial.temperature is not None:
            generation["samplingParams"] = {"temperature": trial.temperature}
        if trial.context_tokens:
            generation["contextWindowSize"] = trial.context_tokens
        return {
            "general": {"enableAutoUpdate": False, "chatRecording": False},
            "privacy": {"usageStatisticsEnabled": False},
            "telemetry": {"enabled": False},
            "ide": {"enabled": False, "hasSeenNudge": True},
            "ui": {"enableUserFeedback": False, "enableFollowupSuggestions": False, "enableSpeculation": False},
            "memory": {"enableManagedAutoMemory": False, "enableManagedAutoDream": False, "enableAutoSkill": False},
            "model": {"name": trial.model, "maxSessionTurns": trial.max_turns, "generationConfig": generation},
            "security": {"auth": {"selectedType": "openai"}},
        }

    def launch(self, trial: TrialSpec, paths: TrialPaths, sandbox: Sandbox) -> Launch:
        (paths.host / SETTINGS).write_text(json.dumps(self.settings(trial), indent=2))
        env = self.base_env(paths) | {
            "QWEN_CODE_SYSTEM_SETTINGS_PATH": paths.at(SETTINGS),
            "OPENAI_API_KEY": "legorl",
            "OPENAI_BASE_URL": trial.openai_base_url,
            "OPENAI_MODEL": trial.model,
            "QWEN_CODE_NO_RELAUNCH": "1",  # no child node process with a bigger heap: the container's limits hold
        }
        argv = [self.install.binary or "node", self.install.extra.get("entry", "qwen"),
                "--yolo", "--auth-type", "openai", "--model", trial.model,
                "--openai-base-url", trial.openai_base_url, "--openai-api-key", "legorl",
                "--max-session-turns", str(trial.max_turns), "--output-format", "stream-json",
                f"--prompt={trial.problem_statement}"]  # one argument, even when the task starts with '-'
        return Launch(argv, env)

    def read_end(self, paths: TrialPaths, proc: ProcResult) -> tuple[End, str | None]:
        return end_of(json_lines(paths.host / "harness.log"), proc)


def end_of(events: list[dict[str, object]], proc: ProcResult) -> tuple[End, str | None]:
    """How ``qwen --output-format stream-json`` ended: its ``result`` event, else its exit code."""
    results = [e for e in events if e.get("type") == "result"]
    if not results:
        if proc.exit_code in _EXIT_ENDS:
            return _EXIT_ENDS[proc.exit_code], proc.log_tail.strip()[-500:] or None
        return no_account(proc)
    result = results[-1]
    if not result.get("is_error"):
        return End.FINISHED, str(result.get("result") or "")[:1000] or None
    error = result.get("error")
    detail = str(error.get("message", error) if isinstance(error, dict) else error)[:1000]
    lowered = detail.lower()
    if any(m in lowered for m in _CONTEXT_MARKERS):
        return End.CONTEXT_OVERFLOW, detail
    if any(m in lowered for m in _API_MARKERS):
        return End.API_ERROR, detail
    return End.CRASHED, detail
