"""Claude Code: the npm package's native binary, headless (``claude -p``), in the container.

It speaks only the Anthropic Messages API, so it is pointed at the session's Anthropic base URL
(``/sess/<id>``, reached through the trial's relay on the container's own loopback). Proprietary: installed by the user's
own ``legorl harness install claude-code`` from the npm registry, never vendored. It exits at
once on a 400, so an API error is visible as its result event.
"""

from __future__ import annotations

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

_SUBTYPES = {"success": End.FINISHED, "error_max_turns": End.MAX_TURNS}


class ClaudeCode(ProcessHarness):
    name = "claude-code"
    in_container = True

    def launch(self, trial: TrialSpec, paths: TrialPaths, sandbox: Sandbox) -> Launch:
        env = self.base_env(paths) | {
            "ANTHROPIC_BASE_URL": trial.anthropic_base_url,
            "ANTHROPIC_API_KEY": "legorl",
            "IS_SANDBOX": "1",  # allows --dangerously-skip-permissions as root (the container is the sandbox)
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "CLAUDE_CONFIG_DIR": paths.at("home", ".claude"),
        }
        argv = [self.install.binary or "claude", "-p", trial.problem_statement,
                "--output-format", "stream-json", "--verbose", "--dangerously-skip-permissions",
                "--max-turns", str(trial.max_turns), "--model", trial.model]
        return Launch(argv, env)

    def read_end(self, paths: TrialPaths, proc: ProcResult) -> tuple[End, str | None]:
        results = [e for e in json_lines(paths.host / "harness.log") if e.get("type") == "result"]
        if not results:
            return no_account(proc)
        result = results[-1]
        subtype = str(result.get("subtype", ""))
        text = str(result.get("result", ""))[:1000]
        if result.get("is_error") and "API Error" in text:
            if "prompt is too long" in text or "context" in text.lower():
                return End.CONTEXT_OVERFLOW, text
            return End.API_ERROR, text
        if subtype in _SUBTYPES:
            return _SUBTYPES[subtype], text or None
        return End.CRASHED, f"{subtype}: {text}"
