"""OpenHands (software-agent SDK): the SDK's default agent, inside the trial container.

The SDK needs Python >= 3.12; its venv and the interpreter it was made from are bind-mounted
read-only into the container at their host paths, and the agent runs there with the ``subprocess``
terminal (task images have no tmux), reaching the proxy through the trial's relay on the
container's own loopback (:mod:`legorl.harnesses.channel`). Its
DockerWorkspace is not an option here: it needs a registry image and hard-codes ulimits.
"""

from __future__ import annotations

from pathlib import Path

from legorl.harnesses.base import (
    End,
    Launch,
    ProcessHarness,
    ProcResult,
    TrialPaths,
    TrialSpec,
    json_file,
    no_account,
)
from legorl.sandbox.base import Sandbox

RUNNER = Path(__file__).with_name("_openhands_runner.py")

_API_ERROR_MARKERS = ("APIConnection", "ServiceUnavailable", "InternalServer", "BadRequest", "LLMError",
                      "Timeout", "RateLimit", "NoResponse", "BadGateway", "APIError")


class OpenHands(ProcessHarness):
    name = "openhands"
    in_container = True

    def launch(self, trial: TrialSpec, paths: TrialPaths, sandbox: Sandbox) -> Launch:
        return self.python_runner(RUNNER, "openhands.json", trial, paths, {}, {"OPENHANDS_SUPPRESS_BANNER": "1"})

    def read_end(self, paths: TrialPaths, proc: ProcResult) -> tuple[End, str | None]:
        result = json_file(paths.host / "result.json")
        if result is None:
            return no_account(proc)
        status, code = result.get("status"), str(result.get("error_code") or "")
        detail = f"{code}: {result.get('message')}" if code else _text(result.get("exception"))
        if status == "finished":
            return (End.SUBMITTED if result.get("finish_called") else End.FINISHED), detail
        if code == "MaxIterationsReached":
            return End.MAX_TURNS, detail
        if "ContextWindow" in code:
            return End.CONTEXT_OVERFLOW, detail
        if status == "stuck":
            return End.GAVE_UP, "stuck detector stopped the agent"
        if any(marker in code for marker in _API_ERROR_MARKERS):
            return End.API_ERROR, detail
        return End.CRASHED, detail


def _text(value: object) -> str | None:
    return None if value is None else str(value)
