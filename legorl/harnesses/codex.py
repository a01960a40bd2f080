"""Codex CLI: the npm package's static native binary, headless (``codex exec --json``), in the container.

Codex speaks the OpenAI Responses API (always streamed), so it is pointed at the session's OpenAI
base URL (``/sess/<id>/v1``, through the trial's relay) as a custom model provider in a
``config.toml`` under a ``CODEX_HOME`` in the trial folder: no login, no retries, no update check,
analytics, feedback or OpenTelemetry export, no web search, sub-agents, goals, plugins, apps,
hooks, memories or bundled skills, and no AGENTS.md from the task repository (the harness prompt
does not vary with repo files). ``--strict-config`` makes an unknown key (a Codex release that
renamed one) fail before the first model call, which is legorl's infrastructure failure, not the
agent's. Its own sandbox and approvals are off: the podman container is the sandbox.

Codex has no turn limit of its own: the proxy's turn budget ends the episode with a normal reply.
Its JSONL events say how the turn ended (``turn.completed`` / ``turn.failed``); what it claims
about its work is never read, the patch is the sandbox's diff. Unlike the chat harnesses, which
carry on after a reply cut at the per-call token cap, Codex fails its turn on that ``incomplete``
response: the policy's outcome (no submission), not a crash.
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
CODEX_HOME = "codex-home"

# Features of the pinned version that would add tools, prompts or traffic a trial must not have.
_FEATURES_OFF = (
    "goals", "apps", "plugins", "hooks", "memories", "image_generation", "skill_search", "tool_suggest",
    "api_key_model_discovery", "in_app_updates", "view_image", "shell_snapshot",
    "unbounded_connection_retries",  # a dead relay must end the trial, not be retried forever
    "enable_request_compression",  # the proxy reads plain JSON bodies
)

_CONTEXT_MARKERS = ("context window", "context_length_exceeded", "maximum context length")
# Codex fails the turn on a response whose status is ``incomplete`` (a reply cut at max tokens).
_CUT_REPLY = "reason: max_output_tokens"

TomlValue = str | int | bool | float


class Codex(ProcessHarness):
    name = "codex"
    in_container = True

    context_tokens = 32768

    def config(self, trial: TrialSpec) -> dict[str, TomlValue | dict[str, TomlValue]]:
        """The ``config.toml`` for one trial: top-level keys, then one level of tables."""
        return {
            "model": trial.model,
            "model_provider": PROVIDER,
            "approval_policy": "never",
            "sandbox_mode": "danger-full-access",
            "check_for_update_on_startup": False,
            "web_search": "disabled",
            "model_context_window": trial.context_tokens or self.context_tokens,
            "model_reasoning_summary": "none",
            "project_doc_max_bytes": 0,
            f"model_providers.{PROVIDER}": {
                "name": PROVIDER,
                "base_url": trial.openai_base_url,
                "wire_api": "responses",
                "requires_openai_auth": False,
                "request_max_retries": 0,
                "stream_max_retries": 0,
            },
            "features": dict.fromkeys(_FEATURES_OFF, False),
            "agents": {"enabled": False},
            "skills.bundled": {"enabled": False},
            "analytics": {"enabled": False},
            "feedback": {"enabled": False},
            "otel": {"exporter": "none"},
            "history": {"persistence": "none"},
        }

    def launch(self, trial: TrialSpec, paths: TrialPaths, sandbox: Sandbox) -> Launch:
        home = paths.host / CODEX_HOME
        home.mkdir(exist_ok=True)
        (home / "config.toml").write_text(to_toml(self.config(trial)))
        env = self.base_env(paths) | {"CODEX_HOME": paths.at(CODEX_HOME)}
        argv = [self.install.binary or "codex", "exec", "--json", "--ephemeral", "--strict-config",
                "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", "--ignore-rules",
                "-C", trial.workdir, "-m", trial.model, "--", trial.problem_statement]
        return Launch(argv, env)

    def read_end(self, paths: TrialPaths, proc: ProcResult) -> tuple[End, str | None]:
        return end_of(json_lines(paths.host / "harness.log"), proc)


def end_of(events: list[dict[str, object]], proc: ProcResult) -> tuple[End, str | None]:
    """How ``codex exec --json`` ended, from its events (the last turn's end decides)."""
    ends = [e for e in events if e.get("type") in ("turn.completed", "turn.failed")]
    if not ends:
        return no_account(proc)
    last = ends[-1]
    if last["type"] == "turn.failed":
        error = last.get("error")
        detail = str(error.get("message", error) if isinstance(error, dict) else error)[:1000]
        if any(m in detail.lower() for m in _CONTEXT_MARKERS):
            return End.CONTEXT_OVERFLOW, detail
        if _CUT_REPLY in detail:  # the policy's reply hit the per-call token cap: Codex gives up on it
            return End.GAVE_UP, detail
        return End.API_ERROR, detail
    if proc.exit_code not in (0, None):
        return End.CRASHED, proc.log_tail.strip()[-500:] or f"exit code {proc.exit_code}"
    return End.FINISHED, _last_message(events)


def _last_message(events: list[dict[str, object]]) -> str | None:
    for event in reversed(events):
        item = event.get("item")
        if event.get("type") == "item.completed" and isinstance(item, dict) and item.get("type") == "agent_message":
            return str(item.get("text", ""))[:1000] or None
    return None


def to_toml(config: dict[str, TomlValue | dict[str, TomlValue]]) -> str:
    """TOML for a flat config: scalars first, then ``[table]`` sections of scalars (a dotted table
    name is written as is). Strings are JSON strings, which are valid TOML basic strings."""
    def value(v: TomlValue) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, int | float):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)
        raise TypeError(f"config.toml: unsupported value {v!r}")

    top = [f"{k} = {value(v)}" for k, v in config.items() if not isinstance(v, dict)]
    tables = [f"\n[{k}]\n" + "".join(f"{key} = {value(val)}\n" for key, val in v.items())
              for k, v in config.items() if isinstance(v, dict)]
    return "\n".join(top) + "\n" + "".join(tables)
