"""mini-swe-agent: its own agent class and SWE-bench config, on the host, actions exec'd in the container.

The harness runs in its own venv (``legorl harness install mini-swe-agent``) through a small runner
script; each of its bash actions is a ``podman exec`` into the trial container, which therefore
needs no network. Its batch runner shares one API base across instances, so legorl drives the agent
class per trial to give each trial its own session URL.

Trials are forked from a warm interpreter that has already imported litellm (most of a cold start's
~15 s on two cores; :mod:`legorl.harnesses.warm`); each runs the same runner script with the same
config file as a cold start would. ``warm_start = False`` or ``LEGORL_WARM_START=0`` starts them cold.
"""

from __future__ import annotations

import json
from pathlib import Path

from legorl.harnesses import warm
from legorl.harnesses.base import End, Launch, ProcessHarness, ProcResult, TrialPaths, TrialSpec, json_file
from legorl.sandbox.base import Sandbox
from legorl.sandbox.host import podman_env, podman_path

RUNNER = Path(__file__).with_name("_mini_swe_agent_runner.py")
# What a cold start spends its time importing. minisweagent itself (~0.1 s after litellm) is imported
# by each trial under its own environment: it reads its config dir, .env and MSWEA_* at import.
WARM_MODULES = ("litellm",)

_EXIT_STATUS = {
    "Submitted": End.SUBMITTED,
    "LimitsExceeded": End.MAX_TURNS,
    "TimeExceeded": End.TIME_LIMIT,
    "RepeatedFormatError": End.GAVE_UP,
}
# litellm exceptions meaning the model API (proxy or engine) failed rather than the agent.
_API_ERRORS = ("APIConnectionError", "InternalServerError", "ServiceUnavailableError", "APIError",
               "Timeout", "BadGatewayError", "RateLimitError", "BadRequestError", "NotFoundError")


class MiniSweAgent(ProcessHarness):
    name = "mini-swe-agent"
    in_container = False

    config = "swebench"  # the config mini-swe-agent ships for SWE-bench-style tasks (--harness-config: another)
    takes_config_file = True
    command_timeout_s = 60
    warm_start = True  # fork each trial from a warm interpreter (LEGORL_WARM_START=0 also turns it off)

    def launch(self, trial: TrialSpec, paths: TrialPaths, sandbox: Sandbox) -> Launch:
        model_kwargs: dict[str, object] = {}
        if trial.temperature is not None:
            model_kwargs["temperature"] = trial.temperature
        cfg = {
            "container": sandbox.name,
            "podman": podman_path(),
            "workdir": trial.workdir,
            "api_base": trial.openai_base_url,
            "model": trial.model,
            "model_kwargs": model_kwargs,
            "task": trial.problem_statement,
            "max_turns": trial.max_turns,
            "config": trial.harness_config or self.config,
            "command_timeout": self.command_timeout_s,
        }
        config = paths.host / "mini-swe-agent.json"
        config.write_text(json.dumps(cfg, indent=2))
        env = self.base_env(paths) | {
            "CONTAINERS_CONF": podman_env()["CONTAINERS_CONF"],
            "MSWEA_CONFIG_DIR": paths.at("home", "mini-swe-agent"),
            "MSWEA_GLOBAL_CONFIG_DIR": paths.at("home", "mini-swe-agent"),
            "MSWEA_SILENT_STARTUP": "1",
            "MSWEA_COST_TRACKING": "ignore_errors",
            # a generic 400 is otherwise retried 10 times over ~250 s
            "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1",
            # else ~6 s of failed cost-map fetches at import on a machine without internet
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "PYTHONUNBUFFERED": "1",
        }
        modules = WARM_MODULES if self.warm_start and warm.enabled() else ()
        return Launch([self.install.python or "python", str(RUNNER), str(config)], env, modules)

    def read_end(self, paths: TrialPaths, proc: ProcResult) -> tuple[End, str | None]:
        result = json_file(paths.host / "result.json")
        if result is None:
            return End.UNKNOWN if proc.timed_out else End.CRASHED, _last_line(proc.log_tail)
        status = str(result.get("exit_status") or "")
        message = None if result.get("message") is None else str(result["message"])
        if status in _EXIT_STATUS:
            return _EXIT_STATUS[status], status
        if "ContextWindowExceeded" in status:
            return End.CONTEXT_OVERFLOW, message
        if status in _API_ERRORS:
            return End.API_ERROR, f"{status}: {message}"
        return End.CRASHED, f"{status}: {message}"


def _last_line(text: str) -> str | None:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][-500:] if lines else None
