"""OpenCode: the npm package's native binary, headless (``opencode run --format json``), in the container.

It runs its tools in its own process, so it must run inside the sandbox: the binary (glibc only)
is bind-mounted read-only and it reaches the proxy through the trial's relay on the container's
own loopback (:mod:`legorl.harnesses.channel`), configured as an ``@ai-sdk/openai-compatible``
provider. Autoupdate, model-catalogue fetches, LSP downloads,
default plugins, sharing and snapshots are off; HOME is private to the trial.

Its step limit is soft, it retries any 400 forever and a context-length 400 starts a compaction
loop: the proxy's budgets end episodes with normal replies and the rollout's wall-clock kill is the
backstop.
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


class OpenCode(ProcessHarness):
    name = "opencode"
    in_container = True

    context_tokens = 32768
    output_tokens = 4096

    def config(self, trial: TrialSpec) -> dict[str, object]:
        agent: dict[str, object] = {"steps": trial.max_turns}
        if trial.temperature is not None:
            agent["temperature"] = trial.temperature
        context = trial.context_tokens or self.context_tokens
        model = {"name": trial.model, "tool_call": True,
                 "limit": {"context": context, "output": min(self.output_tokens, max(1, context // 4))}}
        return {
            "$schema": "https://opencode.ai/config.json",
            "autoupdate": False,
            "share": "disabled",
            "snapshot": False,
            "lsp": False,
            "formatter": False,
            "enabled_providers": [PROVIDER],
            "model": f"{PROVIDER}/{trial.model}",
            "small_model": f"{PROVIDER}/{trial.model}",
            "provider": {PROVIDER: {
                "npm": "@ai-sdk/openai-compatible",
                "name": PROVIDER,
                "options": {"baseURL": trial.openai_base_url, "apiKey": "legorl"},
                "models": {trial.model: model},
            }},
            "permission": {"edit": "allow", "bash": "allow", "webfetch": "deny", "external_directory": "allow"},
            "agent": {"build": agent},
        }

    def launch(self, trial: TrialSpec, paths: TrialPaths, sandbox: Sandbox) -> Launch:
        (paths.host / "opencode.json").write_text(json.dumps(self.config(trial), indent=2))
        env = self.base_env(paths) | {
            "OPENCODE_CONFIG": paths.at("opencode.json"),
            "OPENCODE_DISABLE_AUTOUPDATE": "1",
            "OPENCODE_DISABLE_MODELS_FETCH": "1",
            "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
            "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
            "OPENCODE_DISABLE_SHARE": "1",
            "OPENCODE_DISABLE_CLAUDE_CODE": "1",
            "OPENCODE_DISABLE_EXTERNAL_SKILLS": "1",
            "OPENCODE_DISABLE_PROJECT_CONFIG": "1",  # a task repo's own opencode.json must not steer it
            "OPENCODE_DISABLE_TERMINAL_TITLE": "1",
        }
        argv = [self.install.binary or "opencode", "run", "--format", "json",
                "-m", f"{PROVIDER}/{trial.model}", trial.problem_statement]
        return Launch(argv, env)

    def read_end(self, paths: TrialPaths, proc: ProcResult) -> tuple[End, str | None]:
        events = json_lines(paths.host / "harness.log")
        errors = [e for e in events if e.get("type") == "error"]
        if errors:
            detail = json.dumps(errors[-1].get("error", errors[-1]))[:1000]
            if "ContextOverflow" in detail:
                return End.CONTEXT_OVERFLOW, detail
            if "APIError" in detail or "statusCode" in detail:
                return End.API_ERROR, detail
            return End.CRASHED, detail
        if proc.exit_code == 0 and events:
            return End.FINISHED, None
        return no_account(proc)
