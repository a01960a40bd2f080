"""Pi: the npm package's JavaScript CLI, headless (``pi --print --mode json``), in the container.

Pi (``@earendil-works/pi-coding-agent``, formerly ``@mariozechner/pi-coding-agent``) is a minimal
coding agent (read, bash, edit, write) that several peer projects run. It is pointed at the
session's OpenAI base URL as a custom ``openai-completions`` provider in a ``models.json`` under a
``PI_CODING_AGENT_DIR`` in the trial folder, and reaches it through the trial's relay on the
container's own loopback. Like Qwen Code it runs on the pinned Node build its install carries
(:data:`legorl.harnesses.install.NODE_RUNTIME`), bind-mounted read-only.

Offline mode, no version check, no telemetry, no agent-level retries, no session file, no MCP and
no project-local files (``--no-approve``) or AGENTS.md: the harness prompt does not vary with repo
files. Pi has no turn limit of its own: the proxy's turn budget ends the episode with a normal reply.
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

PROVIDER = "legorl"
AGENT_DIR = "pi-agent"

_CONTEXT_MARKERS = ("context length", "context window", "maximum context", "context_length", "too long")


class Pi(ProcessHarness):
    name = "pi"
    in_container = True

    context_tokens = 32768
    output_tokens = 4096

    def models(self, trial: TrialSpec) -> dict[str, object]:
        """Its ``models.json``: one provider, the session, with the trial's model."""
        context = trial.context_tokens or self.context_tokens
        model: dict[str, object] = {"id": trial.model, "contextWindow": context,
                                    "maxTokens": min(self.output_tokens, max(1, context // 4))}
        if trial.temperature is not None:
            model["samplingParams"] = {"temperature": trial.temperature}
        return {"providers": {PROVIDER: {
            "baseUrl": trial.openai_base_url, "api": "openai-completions", "apiKey": "legorl",
            "compat": {"supportsStore": False, "supportsDeveloperRole": False, "supportsReasoningEffort": False},
            "models": [model],
        }}}

    def settings(self) -> dict[str, object]:
        return {"enableInstallTelemetry": False, "quietStartup": True, "retry": {"enabled": False}}

    def launch(self, trial: TrialSpec, paths: TrialPaths, sandbox: Sandbox) -> Launch:
        agent_dir = paths.host / AGENT_DIR
        agent_dir.mkdir(exist_ok=True)
        (agent_dir / "models.json").write_text(json.dumps(self.models(trial), indent=2))
        (agent_dir / "settings.json").write_text(json.dumps(self.settings(), indent=2))
        env = self.base_env(paths) | {
            "PI_CODING_AGENT_DIR": paths.at(AGENT_DIR),
            "PI_OFFLINE": "1",
            "PI_SKIP_VERSION_CHECK": "1",
            "PI_TELEMETRY": "0",
        }
        argv = [self.install.binary or "node", self.install.extra.get("entry", "pi"),
                "--print", "--mode", "json", "--no-session", "--offline", "--no-approve", "--no-mcp",
                "--no-context-files", "--provider", PROVIDER, "--model", trial.model,
                "--", trial.problem_statement]
        return Launch(argv, env)

    def read_end(self, paths: TrialPaths, proc: ProcResult) -> tuple[End, str | None]:
        return end_of(json_lines(paths.host / "harness.log"), proc)


def end_of(events: list[dict[str, object]], proc: ProcResult) -> tuple[End, str | None]:
    """How ``pi --mode json`` ended: the stop reason of the last assistant message of its last run."""
    runs = [e for e in events if e.get("type") == "agent_end"]
    messages = runs[-1].get("messages") if runs else None
    replies = [m for m in messages if isinstance(m, dict) and m.get("role") == "assistant"] \
        if isinstance(messages, list) else []
    if not replies:
        return no_account(proc)
    last = replies[-1]
    reason, detail = last.get("stopReason"), str(last.get("errorMessage") or "")[:1000] or None
    if reason == "error":
        if any(m in (detail or "").lower() for m in _CONTEXT_MARKERS):
            return End.CONTEXT_OVERFLOW, detail
        return End.API_ERROR, detail
    if reason == "aborted":
        return End.CRASHED, detail or "aborted"
    if proc.exit_code not in (0, None):
        return End.CRASHED, proc.log_tail.strip()[-500:] or f"exit code {proc.exit_code}"
    return End.FINISHED, _text(last)


def _text(message: dict[str, object]) -> str | None:
    content = message.get("content")
    if isinstance(content, list):
        texts = [str(c.get("text", "")) for c in content if isinstance(c, dict) and c.get("type") == "text"]
        return "".join(texts)[:1000] or None
    return None
