"""Aider: its own CLI in scripting mode (``aider --message``), inside the trial container.

Aider edits the repository from its own process, so it runs inside the sandbox: its venv and the
interpreter it was made from are bind-mounted read-only at their host paths (as OpenHands'), and it
reaches the session's OpenAI base URL through the trial's relay on the container's loopback, via
LiteLLM (``openai/<model>``). The model's context and output limits come from a model-metadata file
in the trial folder, so aider's own token checks see the engine's context.

Scripting mode sends the one task message, applies the edits of the reply (with its own
reflections on malformed edits or lint errors) and exits; with ``--yes-always`` it accepts file
additions but, by its own rule, runs no suggested shell command. Off: commits (the patch is the
sandbox's diff), ``.gitignore`` edits, update checks, analytics (only written to a local log),
URL scraping, release notes; its history files live in the trial folder. The repository map's
cache (``.aider.tags.cache.*`` at the repository root) is its own state, not the agent's work: the
trial repository's ``info/exclude`` keeps ``.aider*`` out of the patch.

Aider has no structured result: its local analytics log says whether it completed the message or
hit an exception, and its output says what LiteLLM raised (it prints ``litellm.<Error>: …``) or
that the model hit a token limit.
"""

from __future__ import annotations

import json
import re

from legorl.harnesses.base import (
    End,
    Launch,
    ProcessHarness,
    ProcResult,
    TrialPaths,
    TrialSpec,
    json_lines,
    no_account,
    tail,
)
from legorl.sandbox.base import Sandbox

EVENTS = "aider-events.jsonl"
_EXCLUDE = 'printf "%s\\n" ".aider*" >> "$(git rev-parse --git-path info/exclude)"'
_LITELLM_ERROR = re.compile(r"litellm\.(\w+(?:Error|Exception|Timeout))\b[^\n]*")
_CONTEXT_ERRORS = ("ContextWindowExceededError",)
_OUTPUT_TOKENS = re.compile(r"^Output tokens: ~([\d,]+) of", re.MULTILINE)


class Aider(ProcessHarness):
    name = "aider"
    in_container = True

    context_tokens = 32768
    output_tokens = 4096

    def metadata(self, trial: TrialSpec) -> dict[str, object]:
        """LiteLLM model info for the trial's model: aider reads its token limits from it."""
        context = trial.context_tokens or self.context_tokens
        return {f"openai/{trial.model}": {
            "max_input_tokens": context, "max_tokens": min(self.output_tokens, max(1, context // 4)),
            "max_output_tokens": min(self.output_tokens, max(1, context // 4)),
            "input_cost_per_token": 0.0, "output_cost_per_token": 0.0,
            "litellm_provider": "openai", "mode": "chat",
        }}

    def launch(self, trial: TrialSpec, paths: TrialPaths, sandbox: Sandbox) -> Launch:
        (paths.host / "aider-model.json").write_text(json.dumps(self.metadata(trial), indent=2))
        sandbox.exec(["sh", "-c", _EXCLUDE], timeout=30, workdir=trial.workdir)
        env = self.base_env(paths) | {
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # else failed fetches of LiteLLM's cost map at import
            "PYTHONUNBUFFERED": "1",
            "PYTHONDONTWRITEBYTECODE": "1",  # the venv is mounted read-only
        }
        argv = [self.install.python or "python3", "-m", "aider",
                "--model", f"openai/{trial.model}", "--openai-api-base", trial.openai_base_url,
                "--openai-api-key", "legorl", "--model-metadata-file", paths.at("aider-model.json"),
                "--no-show-model-warnings", "--timeout", "600",
                "--yes-always", "--no-auto-commits", "--no-dirty-commits", "--no-gitignore",
                "--no-check-update", "--no-show-release-notes", "--analytics-disable",
                "--analytics-log", paths.at(EVENTS), "--no-detect-urls", "--no-notifications",
                "--no-pretty", "--no-fancy-input",
                "--chat-history-file", paths.at("aider.chat.history.md"),
                "--input-history-file", paths.at("aider.input.history"),
                "--llm-history-file", paths.at("aider.llm.history"),
                "--message", trial.problem_statement]
        if trial.temperature is not None:
            settings = [{"name": f"openai/{trial.model}", "use_temperature": trial.temperature}]
            (paths.host / "aider-settings.json").write_text(json.dumps(settings))
            argv[-2:-2] = ["--model-settings-file", paths.at("aider-settings.json")]
        return Launch(argv, env)

    def read_end(self, paths: TrialPaths, proc: ProcResult) -> tuple[End, str | None]:
        return end_of(json_lines(paths.host / EVENTS), tail(paths.host / "harness.log", 20000), proc)


def end_of(events: list[dict[str, object]], output: str, proc: ProcResult) -> tuple[End, str | None]:
    """How ``aider --message`` ended, from its analytics events and the end of its output."""
    exits = [e for e in events if e.get("event") == "exit"]
    if not exits:
        return no_account(proc)
    failures = [e for e in events if e.get("event") == "message_send_exception"]
    if failures:
        props = failures[-1].get("properties")
        return End.CRASHED, str(props.get("exception") if isinstance(props, dict) else props)[:1000]
    errors = list(_LITELLM_ERROR.finditer(output))
    if errors:
        name, detail = errors[-1].group(1), errors[-1].group(0)[:1000]
        return (End.CONTEXT_OVERFLOW if name in _CONTEXT_ERRORS else End.API_ERROR), detail
    if "has hit a token limit!" in output:
        # Aider gives up on a reply cut at the per-call output cap, and on a prompt the server refused
        # as too long (LiteLLM's ContextWindowExceededError): then it received nothing.
        received = _OUTPUT_TOKENS.findall(output)
        if "possibly exhausted context window" in output or (received and received[-1] == "0"):
            return End.CONTEXT_OVERFLOW, "the prompt exceeded the context window"
        return End.GAVE_UP, "the reply hit the output token limit"
    if proc.exit_code not in (0, None):
        return End.CRASHED, output.strip()[-500:] or f"exit code {proc.exit_code}"
    props = exits[-1].get("properties")
    return End.FINISHED, str(props.get("reason") if isinstance(props, dict) else props)
